"""Training tokens/s of a quickstart-size MoE language model over its dense equivalent, one device, one process.

    python3 benchmarks/bench_train.py --out train.json              # on a GPU: bf16 autocast (gpu_check.sh)
    .venv/bin/python benchmarks/bench_train.py --smoke              # CPU, tiny, seconds: that it runs

Plain PyTorch and fairseq_moe_layer, no fairseq (the lent GPU machines' Python has no fairseq wheel): a causal
pre-norm transformer LM (--layers blocks of width --d; every second FFN an MoELayer of --experts experts of width
--f, top-2, dropless) against the same model with a dense FFN of width k * f in those blocks (the same active
FLOPs per token). Random tokens (--batch x --seq per step), AdamW, the MoE loss plus 0.01 x the balance loss.
After --warmup steps of each, --steps timed steps alternate between the two models (a CUDA synchronize around
each on a GPU); printed: the median tokens/s of each, the ratio MoE / dense, the layer's kernel backend, the
peak device memory of each on a GPU. Written to --out as JSON.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fairseq_moe_kernels import backend  # noqa: E402
from fairseq_moe_layer import MoEConfig, MoELayer  # noqa: E402


class Block(nn.Module):
    def __init__(self, d, heads, ffn):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ffn = ffn

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        h = self.ln2(x)
        if isinstance(self.ffn, MoELayer):
            y, aux = self.ffn(h)
            return x + y, aux.balance_loss
        return x + self.ffn(h), h.new_zeros(())


def dense_ffn(d, f):
    return nn.Sequential(nn.Linear(d, f), nn.ReLU(), nn.Linear(f, d))


class LM(nn.Module):
    def __init__(self, vocab, d, heads, layers, f, experts, k, kernel_backend):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(
            Block(d, heads, MoELayer(MoEConfig(model_dim=d, ffn_dim=f, num_experts=experts, top_k=k,
                                               capacity_factor=0.0, kernel_backend=kernel_backend))
                  if experts and i % 2 == 1 else dense_ffn(d, f * (k if not experts and i % 2 == 1 else 1)))
            for i in range(layers))
        self.ln = nn.LayerNorm(d)

    def forward(self, tokens):
        T = tokens.shape[1]
        mask = torch.triu(torch.full((T, T), float("-inf"), device=tokens.device), diagonal=1)
        x, balance = self.embed(tokens), 0.0
        for block in self.blocks:
            x, b = block(x, mask)
            balance = balance + b
        logits = self.ln(x) @ self.embed.weight.t()
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
        return loss + 0.01 * balance


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--d", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--f", type=int, default=2048, help="expert width (the dense FFN of an MoE block: k * f)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=20, help="timed steps of each model (median reported)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--backend", choices=backend.BACKENDS, default="auto", help="--moe-kernel-backend of the layers")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, fp32: that it runs")
    p.add_argument("--out", help="write the results here (JSON)")
    args = p.parse_args(argv)
    if args.smoke:
        args.layers, args.d, args.heads, args.f, args.experts, args.vocab = 2, 32, 2, 64, 4, 100
        args.batch, args.seq, args.steps, args.warmup = 2, 16, 3, 1
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return args


def main(argv=None):
    args = parse(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    models = {name: LM(args.vocab, args.d, args.heads, args.layers, args.f, experts, args.k, args.backend).to(device)
              for name, experts in (("moe", args.experts), ("dense", 0))}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step(name):
        sync()
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
            loss = models[name](tokens)
        loss.backward()
        optimizers[name].step()
        optimizers[name].zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - start, float(loss.detach())

    for name in models:
        for _ in range(args.warmup):
            step(name)
    times, losses = {name: [] for name in models}, {}
    peak = {}
    for _ in range(args.steps):
        for name in models:  # (interleaved: both see the same state of the machine)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            seconds, losses[name] = step(name)
            times[name].append(seconds)
            if device.type == "cuda":
                peak[name] = max(peak.get(name, 0), torch.cuda.max_memory_allocated())
    tokens_per_step = args.batch * args.seq
    rate = {name: tokens_per_step / statistics.median(t) for name, t in times.items()}
    resolved = backend.resolve(args.backend, device, dtype)
    result = dict(settings=vars(args), device=str(torch.cuda.get_device_name() if device.type == "cuda" else "cpu"),
                  dtype=str(dtype), kernel_backend=resolved, tokens_per_s=rate, ratio=rate["moe"] / rate["dense"],
                  last_loss=losses, peak_memory_bytes=peak or None,
                  params={name: sum(p.numel() for p in m.parameters()) for name, m in models.items()})
    print(f"{result['device']} {dtype} backend {resolved}: MoE {rate['moe']:.0f} tokens/s, dense {rate['dense']:.0f} "
          f"tokens/s, MoE / dense {result['ratio']:.3f} (median of {args.steps} interleaved steps each; "
          f"{result['params']['moe']:,} vs {result['params']['dense']:,} parameters)")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
