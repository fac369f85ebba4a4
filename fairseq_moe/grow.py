"""Growth: N experts added to a trained MoE model's layers, the grown model computing exactly what it did.

    python -m fairseq_moe.grow CKPT OUT.pt --add N [--layers decoder | NAME,...] [--init fresh | --init copy
        --data DATA [--lang-pairs PAIRS] [--subset valid]] [--freeze-old] [--bias-update-rate R] [--seed S]
    fairseq-train DATA ... --finetune-from-model OUT.pt        (with the --moe-* flags grow prints)

CKPT: a moe_transformer or moe_transformer_lm checkpoint (a file or a set) with top-k routing and a linear gate.
Each chosen MoE layer (every one by default; --layers: a side, or layer names as inspect prints them) gets N
experts after its E: fresh (as a new expert starts: each weight uniform in +-1/sqrt(fan-in), and a fresh router
row), or (--init copy) copies of the layer's N most used experts on --subset of --data (the routed weight, as prune
measures it), each with its source's router row. Until its first update the grown model computes exactly what
CKPT computed, because no token chooses a new expert yet: each new expert's choosing bias (DeepSeek-V3's
aux-loss-free balancing bias, added to the scores for choosing only) starts below every old expert's by more than
any score (scores are in [0, 1]), and
  - the weights of a token's experts do not depend on the other experts: top-k with k >= 2 renormalises over the
    chosen, top-1 takes 1 (--moe-top1-weight one), sigmoid scores are each expert's own (a top-1 softmax model whose
    weight is the probability, Switch's, is refused: the new experts' logits would lower it);
  - the capacity per expert stays: the training capacity factor is multiplied by (E + N) / E (exactly: a factor
    that a float cannot hold exactly is refused, as are grown layers of different E at a capacity); a capacity as
    a fraction of the tokens (at evaluation) does not depend on E.
The new experts then join as the balancing bias moves them up after every update (--moe-bias-update-rate: the
model's, or --bias-update-rate R where it had none: after about 1 / (2R) updates), and their weights learn once they
are chosen. (Exact: the outputs. The balance and z losses, over E + N experts, differ from the first step.)
--freeze-old keeps the old experts and router rows as they are while training goes on (--moe-frozen-experts: their
gradients zeroed).

OUT.pt has no optimizer state (continue with --finetune-from-model, on one process or W ranks: E + N and W must
fit), is never overwritten and is written whole or not at all. Tested in tests/fairseq_moe/test_grow.py.
"""
import math
import sys
from argparse import Namespace
from fractions import Fraction

import torch

from . import with_fairseq
from .checkpoints.command import PROG, new_checkpoint, parser, run
from .checkpoints.new_files import write_new
from .checkpoints.state import moe_checkpoint
from .errors import FlagError
from fairseq_moe_layer.experts import EXPERT_KINDS
from fairseq_moe_layer.gates import GATES

class Grown(dict):
    """{layer: (E before, E after, sources)}, and .flags: the --moe-* flags a run continuing from OUT gives."""


MARGIN = 0.01  # how far below every old expert's bias, past the largest score (1), a new expert's starts


def _exact_float(value):
    """value (a Fraction) as a float whose repr is exactly it, or None."""
    f = float(value)
    return f if Fraction(repr(f)) == value else None


def chosen_layers(names, layers):
    """The MoE layers --layers names: all (None), a side ('encoder', 'decoder'), or names as inspect prints them."""
    if not layers:
        return list(names)
    wanted = [w.strip() for w in layers.split(",") if w.strip()]
    out = []
    for w in wanted:
        hits = [n for n in names if n == w or n.split(".")[0] == w]
        if not hits:
            raise FlagError(f"--layers {layers}: {w!r} is neither a side nor an MoE layer of the model "
                            f"({', '.join(names)})")
        out += [n for n in hits if n not in out]
    return [n for n in names if n in out]  # (the model's order)


def check_model(model_cfg, layers, ckpt):
    """FlagError naming what keeps a model of these layers (name -> MoEConfig) from staying exact when grown."""
    for name, cfg in layers.items():
        if cfg.routing != "topk":
            raise FlagError(f"{ckpt}: {name} has --moe-routing {cfg.routing}; growth keeps a model exact with topk "
                            f"routing only")
        if cfg.gate != "linear":
            raise FlagError(f"{ckpt}: {name} has --moe-gate {cfg.gate}; grow extends linear gates only")
        if cfg.expert_groups != 1:
            raise FlagError(f"{ckpt}: {name} has --moe-expert-groups {cfg.expert_groups}: the new experts would "
                            f"fall outside its groups")
        if cfg.second_expert_policy == "sampling":
            raise FlagError(f"{ckpt}: {name} has --moe-second-expert-policy sampling, which draws among every "
                            f"expert (the new ones too)")
        if cfg.gate_noise == "gaussian":
            raise FlagError(f"{ckpt}: {name} has --moe-gate-noise gaussian, whose noise is drawn per expert (the new "
                            f"ones would change the old ones' draws)")
        if cfg.score == "softmax" and cfg.second_expert_policy == "random" and \
                not cfg.normalize_gate_prob_before_dropping:
            raise FlagError(f"{ckpt}: {name} keeps its second choices with --moe-second-expert-policy random by their "
                            f"softmax probabilities, which the new experts' logits would lower")
        one = [k for k in (cfg.top_k, cfg.eval_top_k) if k == 1]
        if one and cfg.score == "softmax" and cfg.top1_weight == "prob":
            raise FlagError(f"{ckpt}: {name} routes top-1 with its router probability as the weight (Switch): the "
                            f"new experts' logits would lower every weight (a model with --moe-top1-weight one, "
                            f"--moe-score sigmoid or k >= 2 can grow exactly)")


def grow(ckpt, out, add, layers=None, init="fresh", data=None, lang_pairs=None, subset="valid", freeze_old=False,
         bias_update_rate=1e-3, seed=1, max_tokens=4000):
    """Write OUT.pt; returns {layer: (E before, E after, the new experts' sources or 'fresh')}."""
    from .models.expert_use import load, read_moe, routed_weight
    from .models.moe_transformer import moe_base_architecture, moe_config

    if add < 1:
        raise FlagError(f"--add {add}: must be >= 1")
    if init not in ("fresh", "copy"):
        raise FlagError(f"--init {init}: fresh or copy")
    if init == "copy" and not data:
        raise FlagError("--init copy copies the most used experts: give --data DATA to measure their use on")
    if init == "fresh" and (data or lang_pairs or subset != "valid"):
        raise FlagError("--data, --lang-pairs and --subset measure expert use for --init copy; fresh experts need none")
    if not (math.isfinite(bias_update_rate) and bias_update_rate > 0):
        raise FlagError(f"--bias-update-rate {bias_update_rate}: must be > 0")
    new_checkpoint(out)
    state, model_cfg = read_moe(ckpt)
    # Each MoE layer's settings, as the model builds them (its saved flags, its experts' count).
    old = {key[:-len(".moe.experts.w1")]: t.shape[0] for key, t in state["model"].items()
           if key.endswith(".moe.experts.w1")}
    args = Namespace(**vars(model_cfg))
    moe_base_architecture(args)
    all_layers = {n: moe_config(args, n.split(".")[0], E, 0) for n, E in old.items()}
    names = chosen_layers(list(all_layers), layers)
    check_model(model_cfg, {n: all_layers[n] for n in names}, ckpt)
    for n in names:  # (what the new experts' share of a softmax would change)
        c, bias = all_layers[n], state["model"].get(f"{n}.moe.routing_bias")
        if c.score == "softmax" and bias is not None and bias.numel() and float(bias.max()) != float(bias.min()):
            raise FlagError(f"{ckpt}: {n} chooses by its softmax scores plus a balancing bias that differs between "
                            f"experts: the new experts' logits would shrink the scores, and the old experts' order "
                            f"with them (a model with --moe-score sigmoid can grow exactly)")
        if c.batch_prioritized_routing and not (c.capacity(1, True) is None and c.capacity(1, False) is None):
            raise FlagError(f"{ckpt}: {n} has --moe-batch-prioritized-routing at a capacity: tokens queue by their "
                            f"top softmax probability, which the new experts' logits would change token by token")
    if init == "copy":
        model, task = load(ckpt, data, {"lang_pairs": lang_pairs} if lang_pairs else {})
        mass, _ = routed_weight(model, task, subset, max_tokens)
    grown = {n: old[n] + (add if n in names else 0) for n in all_layers}
    for n in names:
        if init == "copy" and add > old[n]:
            raise FlagError(f"--add {add} --init copy: {n} has {old[n]} experts to copy")

    cfg = dict(vars(model_cfg))
    cf = Fraction(repr(float(cfg.get("moe_capacity_factor", 1.0) or 0)))
    if cf > 0:  # the capacity per expert stays: CF * k * T / E = CF' * k * T / (E + N)
        ratios = {Fraction(grown[n], old[n]) for n in all_layers}
        if len(ratios) > 1:
            said = ", ".join(f"{n} {old[n]} -> {grown[n]}" for n in all_layers)
            raise FlagError(f"--add {add}: the MoE layers would grow by different ratios ({said}), so no one "
                            f"--moe-capacity-factor keeps each one's capacity: grow every layer of one count alike, "
                            f"or train dropless (--moe-capacity-factor 0)")
        scaled = _exact_float(cf * ratios.pop())
        if scaled is None:
            raise FlagError(f"--add {add}: the capacity factor {float(cf)} x (E + N) / E is not exact in a float, so "
                            f"the grown model's capacity could differ: choose N so that (E + N) / E is, or train "
                            f"dropless (--moe-capacity-factor 0)")
        cfg["moe_capacity_factor"] = scaled
    if not cfg.get("moe_bias_update_rate"):
        cfg["moe_bias_update_rate"] = bias_update_rate
    counts = [grown[n] for n in all_layers]
    cfg["moe_expert_count"] = counts[0] if len(set(counts)) == 1 else ",".join(map(str, counts))
    frozen = [old[n] if n in names and freeze_old else 0 for n in all_layers]
    cfg["moe_frozen_experts"] = frozen[0] if len(set(frozen)) == 1 else ",".join(map(str, frozen))

    weights = dict(state["model"])
    torch.manual_seed(seed)  # (the fresh experts and router rows start as the layer's own: Experts, LinearGate)
    report = {}
    for n in names:
        p = f"{n}.moe."
        E = old[n]
        keys = [k for k in ("w1", "b1", "w2", "b2") if p + f"experts.{k}" in weights]  # (swiglu: no biases)
        tensors = [weights[p + f"experts.{k}"] for k in keys]
        gate = weights[p + "gate.weight"]
        if init == "copy":
            sources = sorted(range(E), key=lambda e: (-float(mass[n][e]), e))[:add]
            new = [torch.stack([t[e] for e in sources]) for t in tensors]
            rows = gate[sources].clone()
        else:
            sources = "fresh"
            w2 = weights[p + "experts.w2"]
            fresh = EXPERT_KINDS[cfg.get("moe_expert_kind") or "ffn"](add, w2.shape[2], w2.shape[1])
            new = [getattr(fresh, k).detach() for k in keys]
            rows = GATES["linear"](gate.shape[1], add).weight.detach().to(gate.dtype)
        for key, t, extra in zip(keys, tensors, new):
            weights[p + f"experts.{key}"] = torch.cat([t, extra.to(t.dtype)])
        weights[p + "gate.weight"] = torch.cat([gate, rows])
        bias = weights.get(p + "routing_bias", torch.zeros(E))
        start = float(bias.min()) - 1.0 - MARGIN  # (below every old expert's choosing value: scores are in [0, 1])
        weights[p + "routing_bias"] = torch.cat([bias.float(), torch.full((add,), start)])
        report[n] = (E, E + add, sources)
    keys = ("moe_expert_count", "moe_capacity_factor", "moe_bias_update_rate", "moe_frozen_experts")
    report = Grown(report)
    report.flags = " ".join(f"--{k.replace('_', '-')} {cfg[k]}" for k in keys if cfg.get(k) not in (None, 0, 0.0))
    for n in all_layers:  # (a layer not grown: its balancing bias starts at zero, as a model trained without one)
        weights.setdefault(f"{n}.moe.routing_bias", torch.zeros(old[n]))
    grown_state = moe_checkpoint(state, weights, cfg, ckpt, {
        "what": f"grown by fairseq_moe.grow: {add} experts added to {', '.join(names)}", "init": init,
        "seed": seed, "frozen": bool(freeze_old), "layers": {n: list(report[n][:2]) for n in names}})
    write_new(out, lambda save: save(grown_state, out))
    return report


def main(argv=None):
    p = parser(PROG.format("grow"), __doc__)
    p.add_argument("checkpoint", help="CKPT: a moe_transformer checkpoint (a single file, or NAME.pt of a set)")
    p.add_argument("output", help="OUT.pt (new)")
    p.add_argument("--add", type=int, required=True, metavar="N", help="experts to add to each chosen MoE layer")
    p.add_argument("--layers", help="the MoE layers to grow: a side (encoder, decoder) or layer names, "
                                    "comma-separated (default: every MoE layer)")
    p.add_argument("--init", default="fresh", choices=("fresh", "copy"),
                   help="the new experts: fresh, or copies of each layer's most used (with --data)")
    p.add_argument("--data", help="--init copy: the data-bin to measure expert use on (the model's dictionaries)")
    p.add_argument("--lang-pairs", help="--init copy: the pairs to measure on (default: the task's)")
    p.add_argument("--subset", default="valid", help="--init copy: the split of DATA to read (default: valid)")
    p.add_argument("--freeze-old", action="store_true", help="the old experts and router rows do not train further")
    p.add_argument("--bias-update-rate", type=float, default=1e-3, metavar="R",
                   help="the balancing bias's step where the model has none (default 0.001): how fast the new "
                        "experts join")
    p.add_argument("--seed", type=int, default=1, help="seed of the fresh experts and router rows")
    a = p.parse_args(argv)

    def report(done):
        return "\n".join([f"{a.output}: {a.add} experts added; continue with fairseq-train ... {done.flags} "
                          f"--finetune-from-model {a.output}"] + [
            f"  {name}: {before} -> {after} experts" + ("" if sources == "fresh" else
                                                        f" (copies of {','.join(map(str, sources))})")
            for name, (before, after, sources) in done.items()])

    return run(p.prog, lambda: grow(a.checkpoint, a.output, a.add, a.layers, a.init, a.data, a.lang_pairs, a.subset,
                                    a.freeze_old, a.bias_update_rate, a.seed), report, setup=with_fairseq)


if __name__ == "__main__":
    sys.exit(main())
