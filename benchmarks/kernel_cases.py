"""What benchmarks/bench_kernels.py runs and checks: input sets, the table of ops, the layer, its dense
limit, and the correctness check of every backend against the torch backend in fp64.

Legend: T tokens, N = T*k expert-sorted rows (dropless), d model dim, f expert ffn dim, E experts,
k experts per token, elt bytes per element.
"""
import math
import sys
from contextlib import contextmanager

import torch
from torch import nn

from fairseq_moe_layer import MoEConfig, MoELayer
from fairseq_moe_layer.experts import Experts
from fairseq_moe_kernels.backend import OPS as BACKEND_OPS
from fairseq_moe_kernels.cases import CASES, SKEWS, make_inputs  # noqa: F401  (bench_kernels imports them here)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}  # relative Frobenius error
# name -> (call(ops, inputs, activation), names of its differentiable inputs): the shared cases of
# fairseq_moe_kernels/cases.py, under the names the benchmark reports ("gmlp").
OPS = {("gmlp" if op == "grouped_mlp" else op): case for op, case in CASES.items()}


def op_work(E, T, d, f, k, elt):
    """Work of each measurement: FLOPs of the GEMMs; bytes of the least traffic of the data movers.

    permute: N rows read (gathered) + N written + index; backward: N rows read, T written.
    unpermute: N rows read + T written + index + weights; backward: N gathered grads + N rows read,
    N row grads + N weight grads written. Router: logits read, weights, experts, order written.
    """
    N = T * k
    p_f, p_b = elt * 2 * N * d + 8 * N, elt * (N * d + T * d) + 8 * N
    u_f, u_b = elt * (N * d + T * d) + 12 * N, elt * 3 * N * d + 16 * N
    gemm = 2 * N * d * f  # FLOPs of one [N, d] x [d, f] GEMM
    w = {"permute_fwd": ("GB/s", p_f), "permute_fwdbwd": ("GB/s", p_f + p_b), "unpermute_fwd": ("GB/s", u_f),
         "unpermute_fwdbwd": ("GB/s", u_f + u_b), "router_fwd": ("GB/s", 4 * T * E + 12 * T * k + 8 * N)}
    for name in ("gmlp", "moe_mlp", "dense_gemm"):  # forward 2 GEMMs, backward 4
        w[name + "_fwd"], w[name + "_fwdbwd"] = ("TFLOP/s", 2 * gemm), ("TFLOP/s", 6 * gemm)
    return w


def first_output(out):
    return out[0] if isinstance(out, tuple) else out


def no_grad(fn):
    def call():
        with torch.no_grad():
            return fn()
    return call


def fwd_bwd(fn, inputs, grad):
    """Forward+backward to every input (autograd.grad: nothing accumulates from call to call)."""
    return lambda: torch.autograd.grad(first_output(fn()), inputs, grad)


@contextmanager
def _skip_expert_init():
    """Experts.reset_parameters draws each expert on the CPU in fp64 (seconds at E=128, f=8192):
    skipped while building, the parameters are drawn on the device instead (their values do not matter)."""
    saved = Experts.reset_parameters
    Experts.reset_parameters = lambda self: None
    try:
        yield
    finally:
        Experts.reset_parameters = saved


def make_layer(E, d, f, k, activation, name, device, dtype, seed):
    """A dropless MoELayer on the device, running the kernels of backend `name`."""
    kw = dict(model_dim=d, ffn_dim=f, num_experts=E, top_k=k, capacity_factor=0.0, activation=activation,
              kernel_backend=name)
    with torch.device("meta"), _skip_expert_init():
        layer = MoELayer(MoEConfig(**kw))
    layer = layer.to_empty(device=device).to(dtype).train()
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for pname, p in layer.named_parameters():  # uniform(+-1/sqrt(fan_in)), as nn.Linear
            bound = (f if pname.endswith(("w2", "b2")) else d) ** -0.5
            p.uniform_(-bound, bound, generator=g)
    return layer


def layer_step(layer, x, gy):
    """Forward+backward of the layer: y and its aux losses (weighted as in training) to x and each param."""
    params = list(layer.parameters())

    def step():
        y, aux = layer(x)
        up = [gy, torch.full_like(aux.balance_loss, 0.01), torch.full_like(aux.z_loss, 0.001)]
        torch.autograd.grad([y, aux.balance_loss, aux.z_loss], [x] + params, up)
    return step


class DenseFFNs(nn.Module):
    """The layer's limit: k dense FFNs Linear(d, f) -> act -> Linear(f, d) on the same T tokens, summed."""

    def __init__(self, d, f, k, activation, device, dtype):
        super().__init__()
        act = {"relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU}[activation]
        lin = lambda i, o: nn.Linear(i, o, device=device, dtype=dtype)  # noqa: E731
        self.ffns = nn.ModuleList(nn.Sequential(lin(d, f), act(), lin(f, d)) for _ in range(k))

    def forward(self, x):
        return sum(ffn(x) for ffn in self.ffns)


# ---------------------------------------------------------------------------------------------
# Correctness


def compare(got, want, tol):
    """({name: error}, all within tol): relative Frobenius error of floats, 0/1 (equal or not) of integers."""
    errs = {}
    for name, t in got.items():
        a, b = t.detach(), want[name].detach()
        if not t.is_floating_point():
            errs[name] = float(not torch.equal(a, b))
        else:
            errs[name] = ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()
    ok = all(math.isfinite(e) and e <= (tol if got[n].is_floating_point() else 0) for n, e in errs.items())
    return errs, ok


def compare_router(got, want, tol):
    """compare() for router outputs at full size, where two scores within float rounding of each other
    (about one token in 10^5-10^6) may rank either way: a few tokens may choose other experts, which
    then moves their rows in `order`. Exact equality is still required when no token's choice differs."""
    weights, experts, counts, order = got
    differ = int((experts != want[1]).any(1).sum())  # tokens whose choices differ
    errs = {"weights": compare({0: weights}, {0: want[0]}, tol)[0][0], "tokens_choosing_otherwise": differ,
            "counts_moved": int((counts - want[2]).abs().sum()),
            "order_differs": float(not torch.equal(order, want[3]))}
    ok = errs["weights"] <= tol and differ <= max(2, 1e-4 * experts.shape[0])
    return errs, ok and errs["counts_moved"] <= 2 * differ and (differ > 0 or not errs["order_differs"])


def outputs_and_grads(fn, inputs):
    """{out<i>..., grad_<input>...} of fn() for a fixed upstream gradient of its first output."""
    outs = fn()
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = torch.Generator(device=outs[0].device).manual_seed(7)
    up = torch.randn(outs[0].shape, generator=g, device=outs[0].device, dtype=torch.float64).to(outs[0].dtype)
    grads = torch.autograd.grad(outs[0], list(inputs.values()), up, allow_unused=True)
    res = {f"out{i}": o for i, o in enumerate(outs)}
    res.update({f"grad_{n}": torch.zeros_like(inputs[n]) if t is None else t for n, t in zip(inputs, grads)})
    return res


def _cast(I, dtype, dt):
    """New leaves holding I's values rounded to dtype, stored as dt; routing inputs stay fp32."""
    out = dict(I)
    for n in ("x", "rows", "w1", "b1", "w2", "b2"):
        out[n] = I[n].detach().to(dtype).to(dt).requires_grad_()
    for n in ("logits", "row_weights"):
        out[n] = I[n].detach().float().requires_grad_()
    return out


def _dt(dtype):
    return str(dtype).replace("torch.", "")


def check_ops(args, ref, ops_by_name, device):
    """Each op and the layer, in fp32 and --dtype, against the torch backend in fp64 on the same values."""
    T, d, f, E, k = args.check_shape
    I = make_inputs(ref, E, T, d, k, torch.float64, device, args.seed + 99, empty_expert=True)
    layer = make_layer(E, d, f, k, args.activation, "torch", device, torch.float64, args.seed)
    I.update({n: getattr(layer.experts, n) for n in ("w1", "b1", "w2", "b2")})
    rows = []
    for dtype in dict.fromkeys([torch.float32, DTYPES[args.dtype]]):
        for op, (call, diff) in OPS.items():
            I64 = _cast(I, dtype, torch.float64)
            want = outputs_and_grads(lambda: call(ref, I64, args.activation), {n: I64[n] for n in diff})
            tol = TOL[torch.float32 if op == "router" else dtype]  # the router works in fp32 in any dtype
            for name, ops in ops_by_name.items():
                Id = _cast(I, dtype, dtype)
                row = {"backend": name, "op": op, "dtype": _dt(dtype), "tol": tol}
                try:
                    got = outputs_and_grads(lambda: call(ops, Id, args.activation), {n: Id[n] for n in diff})
                    row["errors"], row["pass"] = compare(got, want, tol)
                except Exception as e:  # one broken op must not hide the others
                    row["error"], row["pass"] = repr(e), False
                rows.append(row)
        rows += check_layer(args, ops_by_name, layer, dtype, device)
    return rows


def check_layer(args, ops_by_name, ref_layer, dtype, device):
    """The whole layer per backend (y, grads of x and of every parameter) against the torch layer in fp64,
    and which ops of its backend the layer called (a layer that ignores kernel_backend calls none)."""
    T, d, f, E, k = args.check_shape
    g = torch.Generator(device).manual_seed(3)
    x = torch.randn(T, d, device=device, dtype=torch.float64, generator=g)
    want, rows = None, []
    for name in ["torch"] + list(ops_by_name):  # the first is the fp64 reference
        dt = torch.float64 if want is None else dtype
        row = {"backend": name, "op": "layer", "dtype": _dt(dtype), "tol": 1.5 * TOL[dtype]}
        try:
            with count_calls(ops_by_name[name] if want is not None and name != "torch" else None) as calls:
                layer = make_layer(E, d, f, k, args.activation, name, device, dt, 0)
                with torch.no_grad():  # the same (rounded) weights in every layer
                    for p, q in zip(layer.parameters(), ref_layer.parameters()):
                        p.copy_(q.to(dtype).to(dt))
                xi = x.to(dtype).to(dt).requires_grad_()
                out = outputs_and_grads(lambda: layer(xi)[0], {"x": xi, **dict(layer.named_parameters())})
            if want is None:
                want = out
                continue
            row["errors"], row["pass"] = compare(out, want, row["tol"])
            if name != "torch":
                row["ops_called"] = dict(calls)
        except Exception as e:
            row["error"], row["pass"] = repr(e), False
            if want is None:
                return [row]
        rows.append(row)
    return rows


@contextmanager
def count_calls(ops):
    """{op: calls} of the functions of a backend's namespace while inside (None: count nothing).

    Wraps them where a caller finds them at call time: on the namespace and in their own module.
    """
    calls, undo = {}, []
    for op in BACKEND_OPS if ops is not None else ():
        fn = getattr(ops, op)

        def counted(*a, _fn=fn, _op=op, **kw):
            calls[_op] = calls.get(_op, 0) + 1
            return _fn(*a, **kw)
        for obj, attr in ((ops, op), (sys.modules.get(fn.__module__), fn.__name__)):
            if obj is not None and getattr(obj, attr, None) is fn:
                setattr(obj, attr, counted)
                undo.append((obj, attr, fn))
    try:
        yield calls
    finally:
        for obj, attr, fn in reversed(undo):
            setattr(obj, attr, fn)
