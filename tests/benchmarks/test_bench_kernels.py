"""benchmarks/bench_kernels.py on the CPU (its --smoke mode: torch backend, tiny shapes, wall clock).

The GPU sweep itself cannot run here; these tests check that the script runs end to end and writes
every section of its JSON, that its correctness check catches a wrong op, that a failing backend is
reported instead of stopping the sweep, that a spent time budget skips configs, its FLOP/byte counts,
that the real Triton ops pass its correctness check in the interpreter (the layer calling them), and
that the full-size router comparison forgives a near-tie but nothing else.
"""
import importlib.util
import json
import os
import statistics
import types

import pytest
import torch

from fairseq_moe_kernels import backend

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
OPS = ("router", "permute", "unpermute", "gmlp", "moe_mlp")


@pytest.fixture(scope="module")
def bench():
    """The script as a module, loaded from its path (benchmarks/ is not a package)."""
    path = os.path.join(ROOT, "benchmarks", "bench_kernels.py")
    spec = importlib.util.spec_from_file_location("bench_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(bench, tmp_path, *flags):
    out = tmp_path / "bench.json"
    bench.main(["--smoke", "--out", str(out), *flags])
    return json.loads(out.read_text())


def test_smoke_writes_every_section(bench, tmp_path):
    res = run(bench, tmp_path)
    assert {"settings", "device", "baselines", "correctness", "results", "skipped", "checks"} <= set(res)
    assert res["settings"]["smoke"] and res["device"]["device"] == "cpu"
    assert res["baselines"]["matmul"]["TFLOP/s"] > 0 and res["baselines"]["copy"]["GB/s"] > 0

    # Correctness: each op and the layer, against fp64; fp32 rounding errors, not zero, not large.
    checked = {r["op"] for r in res["correctness"]}
    assert checked == set(OPS) | {"layer"}
    for r in res["correctness"]:
        assert r["pass"], r
        assert all(0 <= e < 1e-5 for e in r["errors"].values()), r
    assert max(res["correctness"][-1]["errors"].values()) > 0  # really compared with another precision

    (r,) = res["results"]
    assert (r["E"], r["T"], r["k"], r["N"]) == (4, 64, 2, 128) and len(r["sets"]) == 2
    assert len({s["imbalance"] for s in r["sets"]}) == 2  # the input sets differ in their routing
    names = [f"{op}_{m}" for op in OPS for m in ("fwd", "fwdbwd")] + ["layer_fwdbwd"]
    timed = r["backends"]["torch"]
    base = r["baseline"]
    baselines = ("dense_gemm_fwd", "dense_gemm_fwdbwd", "dense_ffn_fwdbwd")
    for entry in [timed[n] for n in names] + [base[n] for n in baselines]:
        assert entry["ms"] > 0 and len(entry["samples"]) >= 2 * 2  # inputs x min-reps
        assert entry["ms"] == statistics.median(entry["samples"])
    for n in ("gmlp_fwd", "gmlp_fwdbwd", "moe_mlp_fwdbwd"):
        assert timed[n]["TFLOP/s"] > 0
    for n in ("permute_fwd", "permute_fwdbwd", "unpermute_fwd", "unpermute_fwdbwd"):
        assert timed[n]["GB/s"] > 0

    lines = [c["line"] for c in res["checks"]]
    assert all(line.startswith(("PASS  ", "FAIL  ")) for line in lines)
    for target in ("grouped MLP fwd+bwd", "permute_fwd", "permute_fwdbwd", "unpermute_fwd",
                   "unpermute_fwdbwd", "layer fwd+bwd"):
        assert sum(line.split("  ", 1)[1].startswith(target + " at ") for line in lines) == 1, target
    assert not res["skipped"]


def test_time_budget_skips_configs(bench, tmp_path):
    res = run(bench, tmp_path, "--budget-s", "0", "--skip-check")
    assert res["results"] == [] and res["correctness"] == []
    assert [s["reason"] for s in res["skipped"]] == ["time budget (0 s) spent"]
    assert "copy" in res["baselines"]


def _broken(name):
    """The torch ops, but `name` returns a slightly wrong output (or raises, for name == "raise")."""
    ref = backend.ops("torch")
    fns = {n: getattr(ref, n) for n in backend.OPS}
    if name == "raise":
        def fail(*a, **kw):
            raise RuntimeError("CUDA out of memory (simulated)")
        fns["grouped_mlp"] = fail
    else:
        fns[name] = lambda *a, _f=fns[name], **kw: _f(*a, **kw) * 1.01
    return types.SimpleNamespace(**fns)


@pytest.mark.parametrize("op", ["grouped_mlp", "moe_mlp", "permute"])
def test_correctness_check_catches_a_wrong_op(bench, op):
    args = bench.parse_args(["--smoke"])
    ref = backend.ops("torch")
    rows = bench.check_ops(args, ref, {"torch": _broken(op)}, torch.device("cpu"))
    failed = {r["op"] for r in rows if not r["pass"]}
    assert failed == {"gmlp" if op == "grouped_mlp" else op}


def test_failing_backend_is_reported_and_the_sweep_goes_on(bench):
    args = bench.parse_args(["--smoke"])
    ref = backend.ops("torch")
    ops_by_name = {"triton": _broken("raise"), "torch": ref}
    res = bench.run_config(args, torch.device("cpu"), ref, ops_by_name, 4, 64, 32, 48, 2)
    assert "out of memory" in res["backends"]["triton"]["error"]
    assert res["backends"]["torch"]["layer_fwdbwd"]["ms"] > 0
    args.target_backend = "triton"
    checks = bench.target_checks(args, [res], {"copy": {"GB/s": 1.0}, "matmul": {"TFLOP/s": 1.0}}, [])
    # router, permute, unpermute ran and agreed with torch at full size; then grouped_mlp raised.
    assert set(res["agreement"]["triton"]) == {"router", "permute", "unpermute"}
    assert [c["pass"] for c in checks] == [True, False] and "out of memory" in checks[1]["line"]


def test_work_counts(bench):
    E, T, d, f, k, elt = 8, 100, 16, 24, 2, 2
    N = T * k
    w = bench.op_work(E, T, d, f, k, elt)
    assert w["gmlp_fwd"] == ("TFLOP/s", 2 * 2 * N * d * f)  # 2 GEMMs of 2*N*d*f
    assert w["gmlp_fwdbwd"] == ("TFLOP/s", 6 * 2 * N * d * f)  # + 4 in backward
    assert w["dense_gemm_fwdbwd"] == w["moe_mlp_fwdbwd"] == w["gmlp_fwdbwd"]
    assert w["permute_fwd"] == ("GB/s", 2 * N * d * elt + 8 * N)  # N rows read + written, int64 index
    assert w["unpermute_fwd"] == ("GB/s", (N * d + T * d) * elt + 12 * N)  # + fp32 weights


def test_count_calls_sees_namespace_and_module_calls(bench):
    from fairseq_moe_kernels import reference

    count_calls = importlib.import_module("kernel_cases").count_calls  # beside the script, on its path

    ops = backend.ops("torch")
    x, index = torch.randn(5, 3), torch.tensor([4, 0, 2])
    with count_calls(ops) as calls:
        ops.permute(x, index)
        reference.permute(x, index)  # looked up on the module at call time
        ops.unpermute(x[index], index, torch.ones(3), 5)
    assert calls == {"permute": 2, "unpermute": 1}
    assert ops.permute is reference.permute  # restored
    with count_calls(None) as calls:
        ops.permute(x, index)
    assert calls == {}


@pytest.mark.slow
def test_triton_ops_pass_the_check_in_the_interpreter(bench):
    """The script's correctness section on the real Triton backend (interpreter, fp32, tiny shape)."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton interpreter was not chosen before triton was imported")
    args = bench.parse_args(["--smoke", "--backends", "triton"])
    rows = bench.check_ops(args, backend.ops("torch"), {"triton": backend.ops("triton")}, torch.device("cpu"))
    assert {r["op"] for r in rows} == set(OPS) | {"layer"}
    assert all(r["pass"] for r in rows), [r for r in rows if not r["pass"]]
    (layer,) = [r for r in rows if r["op"] == "layer"]
    # MoELayer(kernel_backend="triton") runs the Triton ops (else its timings would be torch's).
    assert layer["ops_called"].get("moe_mlp") == 1
    checks = bench.target_checks(args, [], {"copy": {"GB/s": 1.0}}, rows)
    (line,) = [c for c in checks if "calls its ops" in c["line"]]
    assert line["pass"]


def test_router_agreement_allows_a_near_tie_only(bench):
    compare_router = importlib.import_module("kernel_cases").compare_router
    ref = backend.ops("torch")
    logits = torch.randn(1000, 8, generator=torch.Generator().manual_seed(0))
    want = ref.router(logits, 2, renormalize=True)
    errs, ok = compare_router(want, want, 1e-4)
    assert ok and errs["tokens_choosing_otherwise"] == 0
    # Token 5's 2nd and 3rd scores swap experts (same values): a near-tie ranked the other way.
    top = logits[5].topk(3).indices
    swapped = logits.clone()
    swapped[5, top[1]], swapped[5, top[2]] = logits[5, top[2]], logits[5, top[1]]
    errs, ok = compare_router(ref.router(swapped, 2, renormalize=True), want, 1e-4)
    # (The weights agree to rounding: the softmax sums the same scores in another order.)
    assert ok and errs.pop("weights") < 1e-6
    assert errs == {"tokens_choosing_otherwise": 1, "counts_moved": 2, "order_differs": 1.0}
    # The same choices in another order, or a different routing altogether, fail.
    assert not compare_router((*want[:3], want[3].flip(0)), want, 1e-4)[1]
    assert not compare_router(ref.router(torch.randn(1000, 8), 2, renormalize=True), want, 1e-4)[1]
