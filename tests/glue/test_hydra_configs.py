"""The shipped hydra configs train with fairseq-hydra-train (one CLI start-up each, 2 updates)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .helpers import USER_DIR

CONFIGS = Path(__file__).parents[2] / "configs"


TINY = [("translation/moe_transformer_tiny", "data_bin", ["task.source_lang=src", "task.target_lang=tgt"]),
        ("language_modeling/moe_transformer_lm_tiny", "lm_data_bin", [])]


@pytest.mark.slow
def test_tiny_configs_train(request, tmp_path):
    """Each tiny config trains 2 updates under fairseq-hydra-train (the two side by side)."""
    runs = {}
    for config, data, overrides in TINY:
        folder, name = config.split("/")
        run_dir = tmp_path / name
        cli = os.path.join(os.path.dirname(sys.executable), "fairseq-hydra-train")
        cmd = [cli, "--config-dir", str(CONFIGS / folder), "--config-name", name,
               f"task.data={request.getfixturevalue(data)}", f"common.user_dir={USER_DIR}",
               "optimization.max_update=2", "dataset.max_tokens=500", f"checkpoint.save_dir={run_dir / 'ckpt'}",
               f"hydra.run.dir={run_dir / 'hydra'}", *overrides]
        run_dir.mkdir()
        runs[run_dir] = subprocess.Popen(cmd, cwd=run_dir, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    for run_dir, proc in runs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        assert "moe_balance_loss" in out + err
        state = torch.load(run_dir / "ckpt" / "checkpoint_last.pt", weights_only=True)
        assert state["optimizer_history"][-1]["num_updates"] == 2
        assert any(key.endswith("fc1.moe.experts.w1") for key in state["model"])
