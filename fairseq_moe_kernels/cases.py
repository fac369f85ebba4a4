"""The inputs and calls every op of backend.OPS is checked and timed with: one factory shared by the
kernel tests (tests/fairseq_moe_kernels/test_cases.py) and the benchmarks (benchmarks/kernel_cases.py).

CASES: op -> (call(ops, inputs, activation), names of its differentiable inputs). make_inputs builds the
inputs: tokens, a routing by the reference router (so every backend sees the same), expert weights.
Legend: T tokens, N = T*k expert-sorted rows (dropless), d model dim, f expert ffn dim, E experts.
"""
import torch

from . import backend

SKEWS = (0.0, 0.5, 1.0)  # input set s adds a per-expert logit bias of std SKEWS[s % 3]: load imbalance


def make_inputs(ref, E, T, d, k, dtype, device, seed, empty_expert=False, f=None, activation=None):
    """One input set (a dict of leaves that require grad); with f, also expert weights w1, b1, w2, b2 (activation
    "swiglu": w1 [E, d, 2f], and no biases: b1 and b2 None)."""
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(T, E, generator=g, device=device)  # [T, E] fp32
    logits += SKEWS[seed % len(SKEWS)] * torch.randn(E, generator=g, device=device)
    if empty_expert:
        logits[:, 0] -= 30  # expert 0 gets no row
    with torch.no_grad():
        weights, _, counts, order = ref.router(logits, k, renormalize=k > 1)  # [T, k], [E], [N]
    x = torch.randn(T, d, generator=g, device=device, dtype=dtype)
    I = {"T": T, "k": k, "counts": counts, "token_index": order % T,  # [N]: a = j*T + t is token t
         "logits": logits, "x": x, "rows": x[order % T],  # rows: [N, d], sorted by expert
         "row_weights": weights.t().reshape(-1)[order]}  # [N] fp32, the weight of each sorted row
    if f is not None:
        swiglu = activation == "swiglu"
        for name, shape in (("w1", (E, d, 2 * f if swiglu else f)), ("b1", (E, f)), ("w2", (E, f, d)),
                            ("b2", (E, d))):
            I[name] = None if swiglu and name[0] == "b" else \
                torch.randn(*shape, generator=g, device=device, dtype=dtype) / shape[-2 if name[0] == "w" else -1] ** 0.5
    for n in ("logits", "x", "rows", "row_weights", "w1", "b1", "w2", "b2"):
        if I.get(n) is not None:
            I[n].requires_grad_()
    return I


def _w(I):
    return I["w1"], I["b1"], I["w2"], I["b2"]


CASES = {
    "router": (lambda o, I, a: o.router(I["logits"], I["k"], renormalize=I["k"] > 1), ("logits",)),
    "permute": (lambda o, I, a: o.permute(I["x"], I["token_index"]), ("x",)),
    "unpermute": (lambda o, I, a: o.unpermute(I["rows"], I["token_index"], I["row_weights"], I["T"]),
                  ("rows", "row_weights")),
    "grouped_mlp": (lambda o, I, a: o.grouped_mlp(I["rows"], I["counts"], *_w(I), a, 0.0),
                    ("rows", "w1", "b1", "w2", "b2")),
    "moe_mlp": (lambda o, I, a: o.moe_mlp(I["x"], I["token_index"], I["row_weights"], I["counts"], *_w(I),
                                          a, 0.0),
                ("x", "row_weights", "w1", "b1", "w2", "b2")),
}
assert set(CASES) == set(backend.OPS), "every op of backend.OPS has a case here"
