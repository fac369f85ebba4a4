"""Sparse upcycling (Komatsuzaki et al. 2022): an MoE checkpoint made from a trained dense one.

    python -m fairseq_moe.upcycle dense/checkpoint_best.pt moe/upcycled.pt --experts 8
    fairseq-train DATA --user-dir fairseq_moe --task moe_translation --arch moe_transformer \\
        --moe-expert-count 8 ... --finetune-from-model moe/upcycled.pt

DENSE.pt is a checkpoint of fairseq's `transformer` (translation) or `transformer_lm` (language model),
any of their archs. Every chosen FFN (layer i of a side is MoE when (i + 1) % freq == 0, freq being the
side's --encoder/--decoder-moe-freq or else --moe-freq, as for training) becomes E experts, each a copy
of it (with --noise S, each weight of each copy times 1 + S * N(0, 1)); the router is fresh (random, as
a new linear gate starts) or zero; every other weight is the dense model's. With top-k >= 2, or top-1 and
--top1-weight one, and no noise, the weights of a token's experts sum to one and the MoE model computes
exactly what the dense one did (until its first update): OUT.pt generates (or evaluates) like DENSE.pt.

Granular upcycling (--granularity G; Megatron-Core's --moe-upcycling-granularity, He et al. 2024): each FFN of
width f is cut along its hidden units into G slices of width f / G, and E / G copies of the FFN become E experts,
expert e holding slice e % G of copy e // G; the router row of a copy is repeated for its G slices, so those tie,
and --top-k K (a multiple of G) chooses K / G whole copies. Each slice's fc2 is multiplied by G and keeps the whole
fc2 bias: a copy's G slices, each weighted 1 / G of its copy's renormalised weight, then sum to the FFN, whatever the
activation (Megatron scales fc1 and fc2 by roots of G: exact for ReLU, not for GELU or SiLU), so the upcycled model
computes the dense one exactly (with a fresh random router: distinct copies, no ties between them). The experts'
width is f / G: continue with --moe-expert-ffn-dim f/G and --moe-top-k K.

OUT.pt is a moe_transformer / moe_transformer_lm checkpoint of the moe_translation / moe_language_modeling
task, dropless at validation and generation (--moe-eval-capacity-token-fraction 0). It holds no optimizer
state (Adam's moments of one FFN are not those of E experts): continue training with
--finetune-from-model OUT.pt (one process or W ranks, each cutting out its experts), with the flags of the
MoE model (the same --moe-expert-count, --moe-freq, and the dense model's sizes). The data and
dictionaries must be the dense model's; a checkpoint of another dictionary or task is refused when loaded.
OUT is never overwritten and is written whole or not at all.
"""
import math
import os
import re
import sys

import torch

from .checkpoints import sets as shards
from .checkpoints import safe_load
from .errors import CheckpointError, FlagError
from fairseq_moe_layer.config import ACTIVATIONS
from .checkpoints.new_files import write_new
from .checkpoints.command import PROG, new_checkpoint, parser, run, safe_globals
from .checkpoints.fits import expert_counts
from .checkpoints.state import moe_checkpoint, section

# dense model -> (MoE model, its sides) (the tasks and criteria: checkpoints/state.py)
MODELS = {"transformer": ("moe_transformer", ("encoder", "decoder")), "transformer_lm": ("moe_transformer_lm", ("decoder",))}
_FFN = re.compile(r"^(?P<side>encoder|decoder)\.layers\.(?P<i>\d+)\.fc1\.weight$")


def dense_model_name(arch):
    """fairseq's model name of an arch ('transformer_iwslt_de_en' -> 'transformer'), or None."""
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY, MODEL_REGISTRY

    return ARCH_MODEL_NAME_REGISTRY.get(arch) or (arch if arch in MODEL_REGISTRY else None)


def chosen_layers(layers, side, moe_freq, side_freq):
    """The indices of a side's layers that become MoE (the training rule of models/moe_transformer.py)."""
    freq = side_freq or moe_freq
    return [i for i in range(layers) if freq > 0 and (i + 1) % freq == 0]


def read_dense(path):
    """(state, model config dict, dense model name, sides) of a dense fairseq checkpoint, checked."""
    state = shards.read_file(path, what="the dense checkpoint to upcycle")
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise CheckpointError(f"{path} is not a fairseq checkpoint (no model state)")
    safe_load.check_config(state, path)
    if state.get("cfg") is None:
        raise CheckpointError(f"{path} was saved by fairseq < 0.10 (args, no cfg): load and save it once with "
                              f"fairseq 0.12 (fairseq-train --restore-file ... --max-update of its own) first")
    if any(".moe." in key for key in state["model"]):
        raise CheckpointError(f"{path} already has MoE layers: upcycling starts from a dense checkpoint")
    model = section(state["cfg"], "model", path)
    arch = model.get("_name") or model.get("arch")
    name = dense_model_name(arch)
    if name not in MODELS:
        raise CheckpointError(f"{path} is a {arch!r} model ({name}); upcycling takes fairseq's transformer or "
                              f"transformer_lm (any of their archs)")
    if name == "transformer_lm" and not model.get("decoder_normalize_before"):
        # fairseq's LM archs (and ours) force pre-norm (base_lm_architecture): the MoE model could generate
        # like this one, but no fairseq-train command line could fine-tune it as the same model.
        raise CheckpointError(f"{path} is a post-norm transformer_lm (plain --arch transformer_lm without "
                              f"--decoder-normalize-before); fairseq's LM archs, and moe_transformer_lm, are "
                              f"pre-norm: upcycle a pre-norm one (any named transformer_lm_* arch, or the flag)")
    activation = model.get("activation_fn", "relu")
    if activation not in ACTIVATIONS:
        raise CheckpointError(f"{path} uses --activation-fn {activation}; an MoE layer has {', '.join(ACTIVATIONS)}")
    return state, model, name, MODELS[name][1]


def expert_copies(fc1_w, fc1_b, fc2_w, fc2_b, experts, noise=0.0, generator=None, granularity=1):
    """E copies of fc2(act(fc1(x))) in the Experts layout: w1 [E, d, f], b1 [E, f], w2 [E, f, d], b2 [E, d]
    (each weight times 1 + noise * N(0, 1), drawn per copy, when noise > 0). granularity G: E / G copies, each cut
    into G experts of width f / G (expert e: slice e % G of copy e // G), each slice's fc2 times G with the whole
    fc2 bias: the G slices of a copy, each weighted 1 / G, sum to the FFN."""
    G = granularity
    width = fc1_w.shape[0] // G
    cut = lambda t, dim: torch.stack(t.split(width, dim))  # noqa: E731  [G, ...]: the slices of one copy
    one = {"w1": cut(fc1_w.t(), 1), "b1": cut(fc1_b, 0), "w2": cut(fc2_w.t(), 0) * G if G > 1 else cut(fc2_w.t(), 0),
           "b2": fc2_b.unsqueeze(0).repeat(G, 1)}
    out = {}
    for name, t in one.items():
        copies = t.repeat(experts // G, *([1] * (t.dim() - 1))).contiguous()
        if noise:
            jitter = torch.randn(copies.shape, generator=generator, dtype=torch.float32)
            copies = (copies.float() * (1 + noise * jitter)).to(t.dtype)
        out[name] = copies
    return out


def router_weights(experts, model_dim, router, generator):
    """[E, d] fp32: as a fresh linear gate starts (nn.Linear's init), or zeros (uniform routing)."""
    weight = torch.zeros(experts, model_dim)
    if router == "random":
        bound = 1 / math.sqrt(model_dim)  # kaiming_uniform_(a=sqrt(5)), the gate's own init
        weight.uniform_(-bound, bound, generator=generator)
    return weight


def upcycle(src, out, experts, moe_freq=2, encoder_moe_freq=0, decoder_moe_freq=0, top_k=2, top1_weight="prob",
            router="random", noise=0.0, seed=1, granularity=1):
    """Write OUT from DENSE (see the module's doc); returns {MoE layer: E}. experts: one count for every MoE layer,
    or one per MoE layer (a list, or "4,8": encoder layers first)."""
    G = granularity
    if G < 1:
        raise FlagError(f"--granularity {G}: must be >= 1")
    try:
        counts = expert_counts(experts)
    except ValueError as e:
        raise FlagError(f"--experts {e}") from None
    if min(counts) < 1 or top_k < 1 or top_k > min(counts):
        raise FlagError(f"--experts {experts} and --top-k {top_k}: need 1 <= k <= E")
    if min(moe_freq, encoder_moe_freq, decoder_moe_freq) < 0:
        raise FlagError("--moe-freq, --encoder-moe-freq and --decoder-moe-freq must be >= 0")
    if not (math.isfinite(noise) and noise >= 0):
        raise FlagError(f"--noise {noise}: must be >= 0")
    if G > 1:
        if any(e % G for e in counts) or top_k % G:
            raise FlagError(f"--granularity {G}: --experts ({experts}) and --top-k ({top_k}) must be multiples of it "
                            f"(E / G copies of the FFN, each cut into G experts; K / G copies chosen per token)")
        if router == "zero":
            raise FlagError(f"--granularity {G} with --router zero: every copy's slices would tie with every other "
                            f"copy's, and the top-{top_k} could take slices of no whole copy: use --router random")
    new_checkpoint(out)
    state, model_cfg, name, sides = read_dense(src)
    if "encoder" not in sides and encoder_moe_freq:
        raise FlagError(f"--encoder-moe-freq: {src} is a language model (decoder only)")
    weights = dict(state["model"])
    layers = {side: sorted({int(m["i"]) for m in map(_FFN.match, weights) if m and m["side"] == side})
              for side in sides}
    generator = torch.Generator().manual_seed(seed)
    chosen = []
    for side in sides:
        freq = {"encoder": encoder_moe_freq, "decoder": decoder_moe_freq}[side]
        count = len(layers[side])
        if layers[side] != list(range(count)):
            raise CheckpointError(f"{src}: the FFNs of its {side} are layers {layers[side]}, not 0..{count - 1}")
        chosen += [(side, i) for i in chosen_layers(count, side, moe_freq, freq)]
    if not chosen:
        flags = ", ".join(f"--{s}-moe-freq" for s in sides)
        raise FlagError(f"--moe-freq {moe_freq} ({flags}) chooses none of the FFN layers of {src} "
                        f"({', '.join(f'{len(layers[s])} {s} layers' for s in sides)})")
    if len(counts) == 1:
        counts = counts * len(chosen)
    elif len(counts) != len(chosen):
        raise FlagError(f"--experts {experts} gives {len(counts)} counts for {len(chosen)} MoE layers "
                        f"({', '.join(f'{s} {i}' for s, i in chosen)}): give one count, or one per MoE layer, "
                        f"encoder layers first")
    ffn_dims = {side: model_cfg.get(f"{side}_ffn_embed_dim") for side in sorted({s for s, _ in chosen})}
    if G > 1 and any(f is None or f % G for f in ffn_dims.values()):
        raise FlagError(f"--granularity {G}: the FFN width ({', '.join(f'{s} {f}' for s, f in ffn_dims.items())}) "
                        f"must be a multiple of it (slices of f / G hidden units)")
    if G > 1 and len(set(ffn_dims.values())) > 1:
        widths = ", ".join(f"{s} {f}" for s, f in ffn_dims.items())
        raise FlagError(f"--granularity {G}: the sides' FFN widths differ ({widths}), and the experts' one width "
                        f"(--moe-expert-ffn-dim) is f / G")
    done = {}
    for (side, i), E in zip(chosen, counts):
        p = f"{side}.layers.{i}."
        try:
            fc = [weights.pop(p + k) for k in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")]
        except KeyError as e:
            raise CheckpointError(f"{src}: layer {p[:-1]} has no {e.args[0]} (an FFN without biases?)") from None
        for key, t in expert_copies(*fc, E, noise, generator, G).items():
            weights[f"{p}fc1.moe.experts.{key}"] = t
        weights[f"{p}fc1.moe.gate.weight"] = router_weights(E // G, fc[0].shape[1], router, generator) \
            .repeat_interleave(G, 0)  # (a copy's G slices tie: their router rows are one)
        done[f"{p}fc1"] = E

    moe_name = MODELS[name][0]
    flag = counts[0] if len(set(counts)) == 1 else ",".join(map(str, counts))  # (--moe-expert-count's value)
    model_cfg.update(_name=moe_name, arch=moe_name, moe_expert_count=flag, moe_freq=moe_freq,
                     decoder_moe_freq=decoder_moe_freq, moe_top_k=top_k, moe_top1_expert=False,
                     moe_top1_weight=top1_weight, moe_gate="linear", moe_eval_capacity_token_fraction=0.0)
    if "encoder" in sides:
        model_cfg["encoder_moe_freq"] = encoder_moe_freq
    if G > 1:
        model_cfg["moe_expert_ffn_dim"] = next(iter(ffn_dims.values())) // G
    upcycled = moe_checkpoint(state, weights, model_cfg, src, {
        "what": f"upcycled from the dense {os.path.abspath(src)}", "experts": flag, "layers": sorted(done),
        "router": router, "noise": noise, "seed": seed, "granularity": G})
    write_new(out, lambda save: save(upcycled, out))
    return done


def main(argv=None):
    p = parser(PROG.format("upcycle"), __doc__, epilog="See the module's documentation (python -m pydoc fairseq_moe.upcycle).")
    p.add_argument("dense", help="checkpoint of a fairseq transformer or transformer_lm (DENSE.pt)")
    p.add_argument("output", help="the MoE checkpoint to write (OUT.pt, never overwritten)")
    p.add_argument("--experts", required=True, metavar="E[,E...]",
                   help="experts per MoE layer: one count, or one per MoE layer (encoder layers first)")
    p.add_argument("--moe-freq", type=int, default=2, metavar="N", help="every N-th layer becomes MoE (default 2)")
    p.add_argument("--encoder-moe-freq", type=int, default=0, metavar="N", help="the encoder's own N (0: --moe-freq)")
    p.add_argument("--decoder-moe-freq", type=int, default=0, metavar="N", help="the decoder's own N (0: --moe-freq)")
    p.add_argument("--top-k", type=int, default=2, metavar="K", help="experts per token (default 2)")
    p.add_argument("--top1-weight", choices=("prob", "one"), default="prob",
                   help="with --top-k 1: the expert's output times its router probability (prob) or as it is "
                        "(one: the upcycled model then starts exactly dense)")
    p.add_argument("--router", choices=("random", "zero"), default="random",
                   help="the new routers: a fresh linear gate's init, or zeros (equal probabilities: the ties "
                        "send every token to the same k experts until the router learns; with a capacity limit "
                        "most tokens are dropped at first, so prefer random unless fine-tuning is dropless)")
    p.add_argument("--noise", type=float, default=0.0, metavar="S",
                   help="multiply each weight of each expert copy by 1 + S * N(0, 1) (default 0: exact copies)")
    p.add_argument("--seed", type=int, default=1, help="seed of the router init and the noise")
    p.add_argument("--granularity", type=int, default=1, metavar="G",
                   help="granular upcycling: each FFN cut into G experts of width f / G (E / G copies; --experts and "
                        "--top-k multiples of G; default 1: whole copies)")
    a = p.parse_args(argv)
    return run(p.prog, lambda: upcycle(a.dense, a.output, a.experts, a.moe_freq, a.encoder_moe_freq,
                                       a.decoder_moe_freq, a.top_k, a.top1_weight, a.router, a.noise, a.seed,
                                       a.granularity),
               lambda done: f"{a.output}: {len(done)} MoE layers of {a.experts} experts ({', '.join(done)}); no "
                            f"optimizer state: continue with fairseq-train ... --finetune-from-model {a.output}",
               setup=safe_globals)


if __name__ == "__main__":
    sys.exit(main())
