"""The routing policies in the layer: how much of MoELayer's forward+backward is not the expert MLP (CPU).

    .venv/bin/python benchmarks/bench_routing.py --threads 1 --timer cpu     # every policy, E=32, T=16384
    .venv/bin/python benchmarks/bench_routing.py --policies topk,hash --E 8 --T 1024

One row per routing policy of the registry (fairseq_moe_layer.ROUTINGS), each followed by the variants of its
settings (VARIANTS). Per sparse policy (--moe-routing and the top-k options) the routing overhead = 1 - (the grouped MLP alone on
the rows that policy routed, with its per-expert counts) / (the layer): everything but the expert GEMMs (the
gate, the policy, the gather/scatter and weighted sum, the aux losses), both forward+backward, interleaved,
medians (bench_layer.py's timing). A policy that sends every token to every expert (Policy.every_expert: dense)
or mixes tokens into slots (Policy.slots: soft) has no "rows routed": it is timed against dense FFNs of the
same expert FLOPs (every expert: E FFNs on T*k/E tokens; slots: groups of --soft-group tokens, k*group/E
slots per expert, against k FFNs on T tokens). See benchmarks/README.md.
"""
import dataclasses
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_layer import dense_backward, dense_forward, finish, interleaved, moe_backward, parser, start  # noqa: E402
from fairseq_moe.inspect import recording  # noqa: E402  (what a layer hands its expert computation)
from fairseq_moe_kernels import backend  # noqa: E402
from fairseq_moe_layer import ROUTINGS, MoEConfig, MoELayer  # noqa: E402
from kernel_cases import DenseFFNs  # noqa: E402

OVERHEAD_TARGET = (32, 16384, 0.15)  # the routing overhead of every sparse policy at (E, T)


def parse_args(argv=None):
    p = parser(__doc__.split("\n\n")[0], E=(32,), T=(16384,))
    p.add_argument("--policies", default="all", metavar="NAMES",
                   help=f"comma-separated, or all: {', '.join(POLICIES)}")
    p.add_argument("--soft-group", type=int, default=128,
                   help="soft: tokens per group (sentence); slots per expert = k * group / E")
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error("--reps must be >= 1")
    args.policies = list(POLICIES) if args.policies == "all" else args.policies.split(",")
    unknown = [n for n in args.policies if n not in POLICIES]
    if unknown or not args.policies:
        p.error(f"--policies: unknown {unknown} (choose from {', '.join(POLICIES)} or all)")
    return args


# Variants of the settings: name -> the MoEConfig fields at E experts. Each runs under the policy whose options
# it sets (Policy.options), or, for the layer's own settings, under --moe-routing's default, as a row
# POLICY-VARIANT after that policy's own row.
VARIANTS = {
    "gaussian-noise": lambda E: dict(gate_noise="gaussian", gate_noise_scale=1.0 / E),
    "moe-branch": lambda E: dict(second_expert_policy="sampling", batch_prioritized_routing=True),
    "random-token-selection": lambda E: dict(random_token_selection=True),
    "sigmoid-bias": lambda E: dict(score="sigmoid", bias_update_rate=1e-3),
    "group-limited": lambda E: dict(expert_groups=4, topk_groups=2),
}
DEFAULT_ROUTING = next(f.default for f in dataclasses.fields(MoEConfig) if f.name == "routing")


def kind_of(policy):
    """"sparse" rows report the routing overhead; "all_experts" (every token to every expert) and "slots" the
    time against dense FFNs of the same expert FLOPs."""
    return "slots" if policy.slots else "all_experts" if policy.every_expert else "sparse"


def _policies():
    """name -> (its policy, the MoEConfig fields for it at E experts, kind), from the registry: every policy
    (with the k it takes, Policy.only_top_k), then the variants of its settings."""
    def owner(variant):
        names = set(variant(8))
        return next((p for p in ROUTINGS.values() if names & set(p.options)), ROUTINGS[DEFAULT_ROUTING])

    rows = {}
    for name, policy in ROUTINGS.items():
        own = dict(routing=name, **({"top_k": policy.only_top_k} if policy.only_top_k else {}))
        rows[name] = (policy, lambda E, own=own: dict(own), kind_of(policy))
        for variant, fields in VARIANTS.items():
            if owner(fields) is policy:
                rows[f"{name}-{variant}"] = (policy, lambda E, own=own, fields=fields: {**own, **fields(E)},
                                             kind_of(policy))
    return rows


POLICIES = _policies()


def run_policy(args, name, E, T):
    """One policy at (E, T): the layer's step against its expert MLP alone (sparse) or dense FFNs of the
    same expert FLOPs (every expert: E FFNs on T*k/E tokens; slots: k FFNs on T tokens, k*group/E slots per
    expert)."""
    policy, fields, kind = POLICIES[name]
    d, f, k = args.d, args.f, args.k
    fields = fields(E)
    if kind == "slots":
        if T % args.soft_group or (k * args.soft_group) % E:
            raise SystemExit(f"{name}: --T {T} must be a multiple of --soft-group {args.soft_group}, "
                             f"and k * group a multiple of E={E}")
        fields["soft_slots"] = k * args.soft_group // E
    tokens = T * k // E if kind == "all_experts" else T  # every token to every expert: the expert FLOPs of top-k at T
    cf = 0.0 if args.dropless else args.capacity_factor
    if not policy.dropless and not cf:
        fields["capacity_factor"] = 1.0  # (no dropless form: expert choice's experts take exactly k * T / E tokens)
    torch.manual_seed(args.seed)
    cfg = MoEConfig(model_dim=d, ffn_dim=f, num_experts=E, top_k=k, capacity_factor=cf, kernel_backend=args.backend)
    layer = MoELayer(dataclasses.replace(cfg, **fields)).train()
    shape = (T // args.soft_group, args.soft_group, d) if kind == "slots" else (tokens, d)
    x = torch.randn(*shape, requires_grad=True)
    grad_y = torch.randn(*shape)
    token_ids = torch.randint(4, 10000, shape[:-1]) if policy.needs_token_ids else None

    def layer_forward(model, x):
        return model(x, token_ids=token_ids) if token_ids is not None else model(x)

    result = {"policy": name, "kind": kind, "E": E, "T": tokens, "d": d, "f": f, "k": layer.cfg.top_k,
              "capacity_factor": cf, "fields": fields}
    if kind == "sparse":
        with recording([("layer", layer)]) as seen, torch.no_grad():
            layer_forward(layer, x)
        routed, token_index, _, counts = seen["layer"][-1]
        rows = routed.index_select(0, token_index).requires_grad_()
        experts = layer.experts
        baseline, base_x, base_grad = experts, rows, torch.randn_like(rows)
        ops = backend.ops(backend.resolve(args.backend, rows.device, rows.dtype))  # (the layer's expert MLP)
        base_forward = lambda model, r: model(r, counts, ops)  # noqa: E731
        result["rows"] = rows.shape[0]
    else:
        baseline = DenseFFNs(d, f, E if kind == "all_experts" else k, "relu", "cpu", torch.float32).train()
        base_x, base_grad, base_forward = x.detach().reshape(-1, d).clone().requires_grad_(), grad_y.reshape(-1, d), \
            dense_forward
    layer_ms, base_ms = interleaved(args, (layer_forward, moe_backward, layer, x, grad_y),
                                    (base_forward, dense_backward, baseline, base_x, base_grad))
    result.update(layer_ms=statistics.median(layer_ms), base_ms=statistics.median(base_ms),
                  layer_ms_all=layer_ms, base_ms_all=base_ms)
    if kind == "sparse":
        result["overhead"] = 1.0 - result["base_ms"] / result["layer_ms"]
    else:
        result["flops_ratio"] = result["layer_ms"] / result["base_ms"]
    return result


def print_policy_row(r=None):
    cols = ("policy", "E", "T", "layer ms", "baseline ms", "baseline", "overhead / ratio")
    widths = (28, 4, 6, 10, 11, 30, 16)
    if r is None:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cols, widths))))
        return
    if r["kind"] == "sparse":
        base, value = f"its expert MLP ({r['rows']} rows)", f"{100 * r['overhead']:.1f}%"
    else:
        n = r["E"] if r["kind"] == "all_experts" else r["k"]
        base, value = f"{n} dense FFNs on {r['T']} tokens", f"{r['flops_ratio']:.3f}x"
    vals = (r["policy"], str(r["E"]), str(r["T"]), f"{r['layer_ms']:.1f}", f"{r['base_ms']:.1f}", base, value)
    print("  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(vals, widths))), flush=True)


def policy_checks(results):
    E, T, target = OVERHEAD_TARGET
    lines = [f"{'PASS' if r['overhead'] <= target else 'FAIL'}  routing overhead {r['policy']} E={E} T={T}: "
             f"{100 * r['overhead']:.1f}% (target <= {100 * target:.0f}%)"
             for r in results if r["kind"] == "sparse" and (r["E"], r["T"]) == (E, T)]
    return lines or [f"note: the overhead target is defined at E={E} T={T}; not measured here"]


def main(argv=None):
    args = parse_args(argv)
    start(args)
    print_policy_row()
    results = []
    for T in args.T:
        for E in args.E:
            for name in args.policies:
                results.append(run_policy(args, name, E, T))
                print_policy_row(results[-1])
    finish(args, results, policy_checks(results))


if __name__ == "__main__":
    main()
