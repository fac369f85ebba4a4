"""The shipped hydra configs train with fairseq-hydra-train (one CLI start-up each, 2 updates)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .helpers import USER_DIR

CONFIGS = Path(__file__).parents[2] / "configs"


@pytest.mark.slow
@pytest.mark.parametrize("config, data, overrides", [
    ("translation/moe_transformer_tiny", "data_bin", ["task.source_lang=src", "task.target_lang=tgt"]),
    ("language_modeling/moe_transformer_lm_tiny", "lm_data_bin", []),
])
def test_config_trains(request, tmp_path, config, data, overrides):
    folder, name = config.split("/")
    cli = os.path.join(os.path.dirname(sys.executable), "fairseq-hydra-train")
    cmd = [cli, "--config-dir", str(CONFIGS / folder), "--config-name", name,
           f"task.data={request.getfixturevalue(data)}", f"common.user_dir={USER_DIR}",
           "optimization.max_update=2", "dataset.max_tokens=500", f"checkpoint.save_dir={tmp_path / 'ckpt'}",
           f"hydra.run.dir={tmp_path / 'hydra'}", *overrides]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "moe_balance_loss" in out.stdout + out.stderr
    state = torch.load(tmp_path / "ckpt" / "checkpoint_last.pt", weights_only=True)
    assert state["optimizer_history"][-1]["num_updates"] == 2
    assert any(key.endswith("fc1.moe.experts.w1") for key in state["model"])
