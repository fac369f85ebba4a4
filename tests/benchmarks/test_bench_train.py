"""benchmarks/bench_train.py on the CPU (--smoke): it trains both models, interleaved, and writes its JSON; the MoE
model has the experts' extra parameters and the same active width. Its speed figures are not checked here (the
GPU run in benchmarks/gpu_check.sh is what they are for)."""
import importlib.util
import json
import math
import os

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def test_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_train", os.path.join(ROOT, "benchmarks", "bench_train.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "train.json"
    result = bench.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["device"] == "cpu" and result["kernel_backend"] == "torch"
    assert set(result["tokens_per_s"]) == {"moe", "dense"} and all(v > 0 for v in result["tokens_per_s"].values())
    assert all(math.isfinite(v) for v in result["last_loss"].values())
    d, f, E, k = 32, 64, 4, 2  # (--smoke's shapes): one MoE block of E experts against one dense FFN of k * f
    extra = (E * (2 * d * f + f + d)) - (2 * d * k * f + k * f + d) + d * E  # experts + router - the wide FFN
    assert result["params"]["moe"] - result["params"]["dense"] == extra
