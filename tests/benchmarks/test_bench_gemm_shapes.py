"""benchmarks/bench_gemm_shapes.py, and bench_layer.py's --keep-freed-memory, --tutel and --autocast, at tiny sizes
(in a subprocess each: mallopt changes the allocator of the whole process). The figures are measured by running the
scripts (benchmarks/README.md)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def run(script, *argv):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *argv], capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_the_gemm_sets_of_each_E(tmp_path):
    out = tmp_path / "gemm.json"
    run("bench_gemm_shapes.py", "--E", "4", "8", "--T", "64", "--d", "16", "--f", "24", "--reps", "2",
        "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [(r["E"], r["rows_per_expert"]) for r in rows] == [(4, 32), (8, 16)]  # T * k / E rows each
    assert all(r["experts_ms"] > 0 and r["dense_ms"] > 0 and len(r["reps"]["experts"]) == 2 for r in rows)
    assert "is not a multiple" in subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_gemm_shapes.py"), "--E", "3", "--T", "64"],
        capture_output=True, text=True, timeout=300).stderr


@pytest.mark.slow
def test_the_layer_benchmark_keeps_freed_memory_when_asked():
    assert "malloc keeps freed memory" in run("bench_layer.py", "--E", "4", "--T", "64", "--d", "8", "--f", "12",
                                              "--reps", "1", "--threads", "1", "--dropless", "--keep-freed-memory")
    assert "malloc glibc default" in run("bench_layer.py", "--E", "4", "--T", "64", "--d", "8", "--f", "12",
                                         "--reps", "1", "--threads", "1", "--dropless")


def test_the_layer_benchmark_names_the_tutel_flag_where_tutel_is_missing():
    script = os.path.join(ROOT, "benchmarks", "bench_layer.py")
    code = (f"import os, runpy, sys; sys.modules['tutel'] = None; sys.path.insert(0, os.path.dirname({script!r})); "
            f"sys.argv = [{script!r}, '--E', '4', '--T', '64', "
            f"'--d', '8', '--f', '12', '--reps', '1', '--tutel']; runpy.run_path({script!r}, run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "--tutel: tutel is not importable here" in out.stderr


def test_the_layer_benchmark_times_tutel_beside_ours_where_it_is_installed():
    pytest.importorskip("tutel")
    out = run("bench_layer.py", "--E", "4", "--T", "64", "--d", "8", "--f", "12", "--reps", "1", "--threads", "1",
              "--dropless", "--tutel")
    assert out.count("Tutel's layer:") == 1


def test_the_layer_benchmark_times_both_models_under_autocast(tmp_path):
    out = tmp_path / "layer.json"
    printed = run("bench_layer.py", "--E", "4", "--T", "64", "--d", "8", "--f", "12", "--reps", "1", "--threads", "1",
                  "--dropless", "--autocast", "bf16", "--json", str(out))
    assert "forwards under autocast bf16" in printed and "(target <= 1.3)" in printed
    (row,) = json.loads(out.read_text())["results"]
    assert row["autocast"] == "bf16" and row["moe_ms"] > 0 and row["dense_ms"] > 0
