"""The shipped hydra configs train with fairseq-hydra-train (one CLI start-up each, 2 updates)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.fairseq_moe.helpers import USER_DIR

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


GPU = [("translation/moe_transformer_wmt_en_de", "data_bin", 512, 2048, 6 + 6),
       ("translation/moe_transformer_vaswani_wmt_en_de_big", "data_bin", 1024, 4096, 6 + 6),
       ("language_modeling/moe_transformer_lm_gpt2_small", "lm_data_bin", 1024, 4096, 24),
       ("language_modeling/moe_transformer_lm_gpt2_medium", "lm_data_bin", 1280, 5120, 36)]


@pytest.mark.parametrize("config, data, d, f, layers", GPU, ids=[c.split("/")[1] for c, *_ in GPU])
# (version_base 1.1 is chosen: see below)
@pytest.mark.filterwarnings(r"ignore:\s*version_base=.1\.1. selects Hydra 1\.1:hydra.errors.Hydra14MigrationWarning")
def test_gpu_configs_load_and_build(request, config, data, d, f, layers):
    """Each GPU-sized config composes as fairseq-hydra-train composes it, and its model builds (on the meta
    device: shapes only) with every 2nd layer an MoE of 16 experts of the config's FFN size, fp16, 8 GPUs."""
    from fairseq import tasks
    from fairseq.dataclass.initialize import add_defaults, hydra_init
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from fairseq_moe.models.moe_ffn import moe_blocks

    folder, name = config.split("/")
    hydra_init(name)  # (fairseq-hydra-train registers its schema under the config's name)
    # version_base 1.1, as fairseq 0.12 runs hydra: a newer one would stay set for the whole process and
    # break fairseq's hydra.experimental.initialize (in every later test of this worker)
    with initialize_config_dir(config_dir=str(CONFIGS / folder), version_base="1.1"):
        cfg = compose(config_name=name, overrides=[f"task.data={request.getfixturevalue(data)}",
                                                   f"common.user_dir={USER_DIR}"]
                      + (["task.source_lang=src", "task.target_lang=tgt"] if folder == "translation" else []))
    add_defaults(cfg)
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))
    assert cfg.common.fp16 and cfg.distributed_training.distributed_world_size == 8
    task = tasks.setup_task(cfg.task)
    with torch.device("meta"):
        model = task.build_model(cfg.model)
    blocks = moe_blocks(model)
    assert len(blocks) == layers // 2 and all(b.moe.cfg.num_experts == 16 and b.moe.cfg.top_k == 2 for _, b in blocks)
    w1 = blocks[0][1].moe.experts.w1
    assert w1.is_meta and tuple(w1.shape) == (16, d, f)
