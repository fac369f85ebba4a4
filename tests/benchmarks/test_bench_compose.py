"""benchmarks/bench_compose.py: that it runs, times both, and finds the two configs equal (it exits otherwise).
Its figures are measured by running the script (benchmarks/README.md)."""
import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def test_both_timed_and_equal(tmp_path):
    out = tmp_path / "compose.json"
    got = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_compose.py"), "--reps", "1",
                          "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, got.stdout[-2000:] + got.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["fairseq"]["median_s"] > 0 and result["plugin"]["median_s"] > 0 and result["ratio"] > 0
    assert "fairseq / plugin" in got.stdout
