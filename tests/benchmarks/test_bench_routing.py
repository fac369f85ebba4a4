"""benchmarks/bench_routing.py and benchmarks/gate_ablation.py's table, at tiny sizes.

The figures themselves are measured by running the scripts (benchmarks/README.md); these tests check that every routing
policy runs through the layer benchmark with the right baseline (the rows its routing produced, or dense
FFNs of the same expert FLOPs), and that the ablation's kept rows are reused only for the same budget
and flags.
"""
import importlib.util
import json
import os
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def load(name, *extra_path):
    for folder in extra_path:
        sys.path.insert(0, os.path.join(ROOT, *folder))
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return load("bench_routing", ("benchmarks",))


def test_every_policy_runs_against_its_baseline(bench, tmp_path):
    out = tmp_path / "policies.json"
    E, T, k, group = 4, 96, 2, 16
    bench.main(["--E", str(E), "--T", str(T), "--d", "8", "--f", "12", "--reps", "1",
                "--warmup", "0", "--soft-group", str(group), "--threads", "1", "--dropless", "--json", str(out)])
    results = {r["policy"]: r for r in json.loads(out.read_text())["results"]}
    assert list(results) == list(bench.POLICIES)
    from fairseq_moe_layer import ROUTINGS

    assert [n for n in results if n in ROUTINGS] == list(ROUTINGS)  # every registered policy, from the registry
    for name, r in results.items():
        assert r["layer_ms"] > 0 and r["base_ms"] > 0, name
        if r["kind"] == "sparse":
            assert r["overhead"] == pytest.approx(1 - r["base_ms"] / r["layer_ms"])
    # Dropless top-k: every token's k rows reach the expert MLP; hash: one row per token.
    assert results["topk"]["rows"] == T * k and results["hash"]["rows"] == T and results["hash"]["k"] == 1
    # Expert choice: every expert exactly its capacity (k * T / E, dropless has no factor).
    assert results["expert_choice"]["rows"] == T * k
    assert results["dense"]["T"] == T * k // E  # the expert FLOPs of top-k at T
    assert results["soft"]["fields"]["soft_slots"] == k * group // E
    assert all(r["flops_ratio"] > 0 for r in (results["dense"], results["soft"]))


def test_overhead_target_reported_only_where_it_is_defined(bench):
    E, T, target = bench.OVERHEAD_TARGET
    row = dict(kind="sparse", policy="topk", E=E, T=T, overhead=target + 0.01)
    assert bench.policy_checks([row])[0].startswith("FAIL")
    assert bench.policy_checks([dict(row, overhead=target - 0.01)])[0].startswith("PASS")
    assert bench.policy_checks([dict(row, T=T // 2)])[0].startswith("note:")


def test_bad_policy_and_soft_shape_are_refused(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--policies", "topk,nope"])
    assert "--policies: unknown ['nope']" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--soft-group"):
        bench.main(["--policies", "soft", "--E", "4", "--T", "100", "--soft-group", "16", "--d", "8", "--f", "8"])


def test_ablation_reuses_a_row_only_for_the_same_budget_and_flags(tmp_path):
    ablation = load("gate_ablation", ("examples", "translation"))
    row = dict(flags=["--moe-routing", "hash"], what="hash", bleu=1.5, chrf=20.0, valid_ppl=30.0,
               train_seconds=75.0, train_cpu_seconds=140.0, imbalance=1.25, budget="B", date="2026-11-30 15:00")
    path = tmp_path / "row.json"
    path.write_text(json.dumps(row))
    assert ablation._kept_row(path, "B", row["flags"]) == row
    assert ablation._kept_row(path, "other budget", row["flags"]) is None
    assert ablation._kept_row(path, "B", ["--moe-routing", "dense"]) is None
    assert ablation._kept_row(tmp_path / "missing.json", "B", row["flags"]) is None
    ablation.write_table(tmp_path, "B", {"hash": row}, 80.0)
    table = (tmp_path / "gate_ablation.md").read_text()
    assert "| hash (hash) | `--moe-routing hash` | 1.50 | 20.00 | 30.00 | 1m15s | 2m20s | 1.25 | 2026-11-30 15:00 |" \
        in table
    assert json.loads((tmp_path / "gate_ablation.json").read_text())["results"]["hash"] == row
