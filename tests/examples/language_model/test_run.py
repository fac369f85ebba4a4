"""The language-model example's own arithmetic (examples/language_model/run.py): its tokens per second from
fairseq-train's log, and the Mixtral-style model's flags, which fairseq's parser takes and which give it the active
FFN multiply-adds per token of the MoE model beside it."""
import importlib.util
from pathlib import Path

import pytest

# Under a name of its own: the translation example's run.py is `run` to the benchmarks that import it.
_SPEC = importlib.util.spec_from_file_location(
    "language_model_example_run", Path(__file__).resolve().parents[3] / "examples" / "language_model" / "run.py")
run = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(run)

EPOCH = ("2026-12-06 12:31:07 | INFO | train | epoch {e:03d} | loss 10.81 | ppl 1794.86 | wps 774.7 | ups 0.4 | "
         "wpb {wpb} | bsz 57.6 | num_updates {n} | lr 0.000447214 | gnorm 1.152 | train_wall {s} | wall 70\n")


def test_tokens_per_second_from_the_epoch_lines(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("2026-12-06 12:30:07 | INFO | train_inner | epoch 001:     50 / 143 loss=10.9, wps=700, "
                   "wpb=1900, num_updates=50, train_wall=30\n" + EPOCH.format(e=1, wpb=1910.8, n=30, s=57)
                   + "valid on 'valid' subset | loss 9.1 | wpb 900 | num_updates 30\n"
                   + EPOCH.format(e=2, wpb=2000, n=50, s=40))
    assert run.training_tokens_per_second(log) == pytest.approx((1910.8 * 30 + 2000 * 20) / 97)
    log.write_text(EPOCH.format(e=1, wpb=1000, n=3, s=0))  # (fairseq rounds train_wall to whole seconds)
    assert run.training_tokens_per_second(log) is None
    log.write_text("no epoch ended\n")
    with pytest.raises(run.pipeline.StepError, match="no end-of-epoch"):
        run.training_tokens_per_second(log)


@pytest.mark.parametrize("flags", [(), ("--expert-ffn-dim", "96", "--top-k", "3")])
def test_the_mixtral_style_model_has_the_moe_models_active_ffn(tmp_path, flags):
    """fairseq's training parser takes modern_cmd's flags; per token, each of its layers (an MoE of SwiGLU experts:
    three matrices, k of them) multiply-adds within 1% of each of moe_cmd's (a dense FFN or an MoE: two matrices)."""
    from fairseq import options

    a = run.parse_args(["--workdir", str(tmp_path), *flags])

    def parsed(cmd):
        argv = cmd[cmd.index(str(tmp_path / "data")):]
        return options.parse_args_and_arch(options.get_training_parser(), argv)

    modern = parsed(run.modern_cmd(a, tmp_path / "data", tmp_path / "save"))
    moe = parsed(run.moe_cmd(a, tmp_path / "data", tmp_path / "save", tmp_path / "stats.jsonl"))
    assert modern.arch == "moe_mixtral_lm" and modern.decoder_kv_heads == 2 and modern.decoder_moe_freq == 1
    assert modern.decoder_embed_dim == moe.decoder_embed_dim and modern.decoder_layers == moe.decoder_layers
    ours = 3 * modern.moe_expert_ffn_dim * modern.moe_top_k
    assert abs(ours / (2 * moe.moe_expert_ffn_dim * moe.moe_top_k) - 1) < 0.01
    if not flags:  # (the defaults: k x the expert width is the dense FFN's, 512)
        assert abs(ours / (2 * moe.decoder_ffn_embed_dim) - 1) < 0.01
    same = ("moe_expert_count", "moe_top_k", "moe_capacity_factor", "moe_gate_loss_wt", "lr", "max_tokens", "dropout")
    assert [getattr(modern, k) for k in same] == [getattr(moe, k) for k in same]
