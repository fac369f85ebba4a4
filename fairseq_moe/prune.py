"""Language-specific expert pruning (Koishekenov et al. 2023, "Memory-efficient NLLB-200"): keep, per MoE layer,
the experts that some language pairs use most, and write a smaller checkpoint whose router chooses among them only.

    python -m fairseq_moe.prune CKPT OUT.pt --data DATA [--lang-pairs en-fr,...] [--subset valid]
        (--keep F | --keep-mass M | --keep-count N) [--uniform] [--multiple-of N]

CKPT: a moe_transformer checkpoint (a single file or a set, read on one process). The model reads --subset of
DATA (teacher-forced, at evaluation: its eval capacity and top-k), for --lang-pairs only with a multilingual task
(default: every pair of the task), and each expert's routed weight is added up: the weights its tokens are
combined with, as `inspect` sees them. Per layer the experts are ranked by that weight and the first n kept:
--keep F keeps n = ceil(F * E); --keep-mass M the fewest whose weight is at least M of the layer's; --keep-count N
those N. Each takes one value for every MoE layer, one per MoE layer (encoder layers first: 1,1,0.5,0.5), or one
per side (encoder=1,decoder=0.5). n is at least the top-k and is rounded up to a multiple of --multiple-of (so
that N ranks can spread it); each layer keeps its own n (OUT.pt's --moe-expert-count is then one count per MoE
layer where they differ), or with --uniform every layer the largest n of any (one count, as NllbMoe needs); each
its own experts, in their order. The router's
rows of the others go with their experts: the pruned model's softmax runs over the kept experts only, which is
the full model with the others' router logits at -inf. With top-2 (weights renormalised over the chosen pair), a
token none of whose choices was pruned is computed exactly as before; a top-1 model's weight is the softmax
probability, which pruning raises. Capacities given as a fraction of the tokens are unchanged; the training
capacity (and so an eval fraction < 0) scales with 1 / E. The measurement leaves padding out (it is no use of an
expert), as --use-moe-pad-mask does: for a model without it and an eval fraction in (0, 1), the capacity during
the measurement counts the real tokens only, so a few tokens may drop otherwise than in generation.

OUT.pt has no optimizer state and no EMA (fine-tune it with --finetune-from-model); the table of what each layer
kept is printed. Never overwrites.
"""
import math
import sys
from argparse import Namespace
from fractions import Fraction

import torch

from .errors import FlagError
from .checkpoints.new_files import write_new
from . import with_fairseq
from .checkpoints.command import PROG, language_pair, new_checkpoint, parser, run
from .checkpoints.state import moe_checkpoint, task_config


def per_layer(spec, names, flag, kind=float):
    """{layer: value} from a --keep / --keep-mass / --keep-count value: one value for every MoE layer ("0.5"), one
    per MoE layer in the model's order, encoder layers first ("1,0.5"), or one per side ("encoder=1,decoder=0.5");
    None -> None."""
    if spec is None:
        return None
    text = str(spec).replace(" ", "")
    try:
        if "=" in text:
            parts = [part.split("=", 1) for part in text.split(",")]
            sides = dict(parts)
            if len(sides) != len(parts):
                raise FlagError(f"{flag} {spec}: a side said twice")
            unknown = sorted(set(sides) - {"encoder", "decoder"})
            if unknown:
                raise FlagError(f"{flag} {spec}: {unknown[0]!r} is not a side (encoder=..., decoder=...)")
            missing = sorted({n.split(".")[0] for n in names} - set(sides))
            if missing:
                raise FlagError(f"{flag} {spec}: says nothing of the {missing[0]}'s MoE layers")
            return {n: kind(sides[n.split(".")[0]]) for n in names}
        values = [kind(v) for v in text.split(",")]
    except FlagError:
        raise
    except ValueError:
        what = "count" if kind is int else "number"
        raise FlagError(f"{flag} {spec}: not a {what}, a comma-separated list of them (one per MoE layer, encoder "
                        f"layers first) or encoder=...,decoder=...") from None
    if len(values) == 1:
        values = values * len(names)
    if len(values) != len(names):
        raise FlagError(f"{flag} {spec}: {len(values)} values for {len(names)} MoE layers ({', '.join(names)})")
    return dict(zip(names, values))


def choose(mass, keep=None, keep_mass=None, multiple_of=1, top_k=2, keep_count=None, uniform=False):
    """({layer: n}, {layer: sorted kept expert ids}): each layer's n experts of most routed weight. n per layer from
    keep ({layer: fraction of its E}), keep_mass ({layer: share of its routed weight}) or keep_count ({layer: n}),
    at least top_k, rounded up to a multiple of multiple_of; uniform: every layer the largest of those n."""
    need = {}
    for name, m in mass.items():
        E = m.numel()
        if keep is not None:
            need[name] = math.ceil(Fraction(repr(float(keep[name]))) * E)  # (in floats 0.07 * 100 is 7.000000000000001)
        elif keep_count is not None:
            need[name] = keep_count[name]
        else:
            share = torch.sort(m, descending=True).values.cumsum(0) / max(float(m.sum()), 1e-300)
            need[name] = int((share < keep_mass[name] - 1e-12).sum()) + 1
    n = {name: -(-max(k, top_k) // multiple_of) * multiple_of for name, k in need.items()}
    if uniform:
        n = dict.fromkeys(n, max(n.values()))
    kept = {}
    for name, m in mass.items():
        E = m.numel()
        if n[name] > E:
            raise FlagError(f"{name}: keeping {n[name]} experts (at least --top-k {top_k}, rounded up to a multiple "
                            f"of --multiple-of {multiple_of}" + (", the most of any layer with --uniform" if uniform
                                                                else "") + f") is more than its {E}")
        order = sorted(range(E), key=lambda e: (-float(m[e]), e))  # (ties: the lower index)
        kept[name] = sorted(order[:n[name]])
    return n, kept


def pruned_state(state, kept, made_by, path):
    """state with each MoE layer's experts, router rows and balancing bias cut to kept[layer] (in the model's order),
    --moe-expert-count the kept counts: one count where every layer keeps the same, else one per layer."""
    model = dict(state["model"])
    for name, ids in kept.items():
        index = torch.tensor(ids)
        prefix = f"{name}.moe."
        for key in [k for k in model if k.startswith(prefix)]:
            rest = key[len(prefix):]
            if rest.startswith("experts.") or rest in ("gate.weight", "routing_bias"):
                model[key] = model[key].index_select(0, index).clone()
            elif rest.startswith("gate."):  # (a gate with more than one row per expert: not cut here)
                raise FlagError(f"{key}: the router of --moe-gate {state['cfg']['model'].moe_gate} keeps state "
                                f"that this tool does not cut per expert; prune linear-gated models")
    counts = [len(ids) for ids in kept.values()]
    flag = counts[0] if len(set(counts)) == 1 else ",".join(map(str, counts))
    # (as upcycle and convert write theirs: no optimizer state, no EMA, marked made_by)
    # (experts kept are renumbered: a grown model's --moe-frozen-experts would name others)
    return moe_checkpoint(state, model, dict(vars(state["cfg"]["model"]), moe_expert_count=flag, moe_frozen_experts=0),
                          path, made_by)


def prune(ckpt, out, data, lang_pairs=None, subset="valid", keep=None, keep_mass=None, multiple_of=1,
          max_tokens=4000, keep_count=None, uniform=False):
    """Write OUT.pt; returns ({layer: n}, {layer: E}, {layer: (kept ids, share of the routed weight kept)}).
    keep, keep_mass, keep_count: one value, or a spec per layer or per side (per_layer)."""
    from .models.expert_use import load, moe_layers, read_moe, routed_weight

    if sum(v is not None for v in (keep, keep_mass, keep_count)) != 1:
        raise FlagError("give one of --keep F, --keep-mass M and --keep-count N")
    if multiple_of < 1:
        raise FlagError(f"--multiple-of {multiple_of}: must be >= 1")
    new_checkpoint(out)
    state, model_cfg = read_moe(ckpt)
    overrides = {}
    task_cfg = state["cfg"].get("task")
    task_pairs = getattr(task_cfg, "lang_pairs", None) if isinstance(task_cfg, Namespace) else None
    if isinstance(task_pairs, str):
        task_pairs = task_pairs.split(",")
    if lang_pairs:
        wanted = lang_pairs.split(",")
        if task_pairs is None:  # a bilingual task: its one pair
            task_pairs = ["-".join(language_pair(task_config(state, ckpt), data))]
            if wanted != task_pairs:
                raise FlagError(f"--lang-pairs {lang_pairs}: the model's task translates {task_pairs[0]} only")
        else:
            missing = [p for p in wanted if p not in task_pairs]
            if missing:
                raise FlagError(f"--lang-pairs {lang_pairs}: {missing[0]} is not one of the model's pairs "
                                f"({','.join(task_pairs)})")
            overrides["lang_pairs"] = ",".join(wanted)
    model, task = load(ckpt, data, overrides)
    layers = moe_layers(model)
    for name, layer in layers:  # the router must pick among the kept experts by their scores alone
        cfg = layer.cfg
        if not layer.policy.picks_by_score or cfg.expert_groups != 1 or not layer.policy.learned_router:
            raise FlagError(f"{name}: --moe-routing {cfg.routing}" + (f" with --moe-expert-groups {cfg.expert_groups}"
                            if cfg.expert_groups != 1 else "") + " does not choose experts by router scores alone "
                            "(pruning keeps some experts and lets the router choose among them): prune top-k models")
    names = [name for name, _ in layers]
    given = {"--keep": keep, "--keep-mass": keep_mass, "--keep-count": keep_count}
    specs = {flag: per_layer(value, names, flag, int if flag == "--keep-count" else float)
             for flag, value in given.items()}
    for flag, values in specs.items():
        for name, value in (values or {}).items():
            if flag == "--keep-count" and value < 1 or flag != "--keep-count" and not 0 < value <= 1:
                raise FlagError(f"{flag} {given[flag]}: {value} for {name}: " + (
                    "a count >= 1" if flag == "--keep-count" else "a fraction in (0, 1]"))
    top_k = max(max(layer.cfg.top_k, layer.cfg.eval_top_k or 0) for _, layer in layers)  # (both must still fit)
    mass, sentences = routed_weight(model, task, subset, max_tokens)
    n, kept = choose(mass, specs["--keep"], specs["--keep-mass"], multiple_of, top_k, specs["--keep-count"], uniform)
    E = {name: m.numel() for name, m in mass.items()}
    report = {name: (ids, float(mass[name][ids].sum() / max(float(mass[name].sum()), 1e-300)))
              for name, ids in kept.items()}
    said = f"{n[names[0]]} of {E[names[0]]}" if len(set(n.values())) == 1 and len(set(E.values())) == 1 else \
        ", ".join(f"{n[name]} of {E[name]}" for name in names)
    pruned = pruned_state(state, kept, {
        "what": f"pruned by fairseq_moe.prune to {said} experts per layer", "subset": subset,
        "lang_pairs": lang_pairs or ",".join(task_pairs or []), "sentences": sentences, "kept": kept}, ckpt)
    write_new(out, lambda save: save(pruned, out))
    return n, E, report


def main(argv=None):
    p = parser(PROG.format("prune"), __doc__)
    p.add_argument("checkpoint", help="CKPT: a moe_transformer checkpoint (a single file, or NAME.pt of a set)")
    p.add_argument("output", help="OUT.pt (new)")
    p.add_argument("--data", required=True, help="the data-bin to measure expert use on (the model's dictionaries)")
    p.add_argument("--lang-pairs", help="the pairs to keep experts for, e.g. en-fr,en-de (default: the task's)")
    p.add_argument("--subset", default="valid", help="the split of DATA to read (default: valid)")
    each = (" (one value for every MoE layer, one per MoE layer: 1,0.5 (encoder layers first), or one per side: "
            "encoder=1,decoder=0.5)")
    p.add_argument("--keep", metavar="F", help="the fraction of each layer's experts to keep, in (0, 1]" + each)
    p.add_argument("--keep-mass", metavar="M", help="keep the fewest experts holding this share of each layer's "
                                                    "routed weight, in (0, 1]" + each)
    p.add_argument("--keep-count", metavar="N", help="keep each layer's N experts of most routed weight" + each)
    p.add_argument("--uniform", action="store_true", help="every layer keeps the same number of experts, the most "
                                                          "any layer needs (one --moe-expert-count, as NllbMoe has)")
    p.add_argument("--multiple-of", type=int, default=1, help="round the kept counts up to a multiple of this "
                                                              "(the world size to spread the pruned model over)")
    p.add_argument("--max-tokens", type=int, default=4000, help="tokens per batch while measuring")
    a = p.parse_args(argv)

    def report(done):
        n, E, kept = done
        lines = [f"{a.output}: the experts kept per MoE layer (the routed weight they held on {a.subset})"]
        lines += [f"  {name}: {n[name]} of {E[name]}, experts {','.join(map(str, ids))} ({100 * share:.1f}%)"
                  for name, (ids, share) in kept.items()]
        return "\n".join(lines)

    return run(p.prog, lambda: prune(a.checkpoint, a.output, a.data, a.lang_pairs, a.subset, a.keep, a.keep_mass,
                                     a.multiple_of, a.max_tokens, a.keep_count, a.uniform), report,
               setup=with_fairseq)


if __name__ == "__main__":
    sys.exit(main())
