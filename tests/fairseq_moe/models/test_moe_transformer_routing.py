"""Every routing policy and router option trains under fairseq-train: the training loss falls."""
import logging
import re

import pytest

from tests.fairseq_moe.helpers import run_train, train_argv


def train_losses(caplog, data_bin, tmp_path, *extra):
    caplog.set_level(logging.INFO)
    caplog.clear()
    run_train(train_argv(data_bin, tmp_path, "--max-update", "12", "--lr", "0.005", "--no-save", *extra))
    return [float(m) for m in re.findall(r"train_inner:.* loss=([0-9.]+),", caplog.text)]


@pytest.mark.parametrize("extra", [
    ("--moe-gate-noise", "gaussian", "--moe-gate-noise-scale", "0.5", "--moe-eval-top-k", "1", "--moe-log-per-layer"),
    ("--moe-routing", "expert_choice", "--moe-freq", "0", "--encoder-moe-freq", "2"),
    ("--moe-routing", "dense", "--moe-gate-noise", "jitter"),
    ("--moe-second-expert-policy", "sampling", "--moe-normalize-gate-prob-before-dropping",
     "--moe-batch-prioritized-routing", "--moe-capacity-factor", "0.5"),
    ("--moe-second-expert-policy", "random", "--moe-random-token-selection", "--moe-capacity-factor", "0.5"),
    ("--moe-gate-noise", "gaussian", "--moe-gate-noise-scale", "1.0", "--moe-gate-loss-type", "importance_load",
     "--moe-gate-loss-wt", "0.1"),
    ("--moe-routing", "hash", "--moe-top-k", "1", "--moe-shared-expert-count", "1"),
    ("--moe-routing", "soft", "--moe-soft-slots", "2", "--moe-freq", "0", "--encoder-moe-freq", "1"),
], ids=["topk-noise-eval-k", "expert_choice", "dense", "moe-branch-options", "random-rts", "importance-load", "hash",
        "soft"])
def test_routing_trains(caplog, data_bin, tmp_path, extra):
    losses = train_losses(caplog, data_bin, tmp_path, *extra)
    assert len(losses) == 12, caplog.text[-2000:]
    assert sum(losses[-3:]) < sum(losses[:3])
    if "--moe-log-per-layer" in extra:  # through fairseq's aggregation, beside the means
        assert "moe_encoder1_balance=" in caplog.text and "moe_decoder1_entropy=" in caplog.text


def test_balancing_bias_moves_is_saved_and_resumes_exactly(data_bin, tmp_path):
    """--moe-bias-update-rate: the biases move after every update and are checkpointed; 3 + 3 updates
    (a resume in between) end where 6 straight ones do, biases included."""
    import torch

    argv = ("--moe-score", "sigmoid", "--moe-bias-update-rate", "0.01", "--moe-expert-groups", "2",
            "--moe-topk-groups", "1", "--moe-top-k", "2")
    run_train(train_argv(data_bin, tmp_path / "straight", *argv, "--max-update", "6"))
    run_train(train_argv(data_bin, tmp_path / "resumed", *argv, "--max-update", "3"))
    run_train(train_argv(data_bin, tmp_path / "resumed", *argv, "--max-update", "6"))
    a, b = (torch.load(tmp_path / name / "checkpoint_last.pt", weights_only=True)["model"]
            for name in ("straight", "resumed"))
    biases = [key for key in a if key.endswith("routing_bias")]
    assert len(biases) == 2 and all(a[key].any() for key in biases)
    torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_hash_routing_generates(data_bin, tmp_path):
    """Beam search decodes step by step: the decoder's hash-routed layers get each step's token."""
    from tests.fairseq_moe.helpers import USER_DIR, run_generate

    run_train(train_argv(data_bin, tmp_path, "--max-update", "3", "--moe-routing", "hash", "--moe-top-k", "1"))
    scorer = run_generate([data_bin, "--user-dir", USER_DIR, "--path", str(tmp_path / "checkpoint_last.pt"),
                           "--task", "moe_translation", "--gen-subset", "test", "--beam", "3", "--cpu"])
    assert "BLEU" in scorer.result_string()


def test_soft_moe_output_does_not_depend_on_the_batch(data_bin, tmp_path):
    """Soft MoE mixes the tokens of one sentence, padding kept out (without --use-moe-pad-mask too): a
    sentence encodes the same alone and beside a longer one."""
    import torch

    from tests.fairseq_moe.helpers import build

    _, model, _, _ = build(train_argv(data_bin, tmp_path, "--moe-routing", "soft", "--moe-soft-slots", "2",
                                      "--moe-freq", "0", "--encoder-moe-freq", "1"))
    model.eval()
    pad = model.encoder.padding_idx
    short = torch.tensor([[5, 9, 12, 2]])
    batch = torch.tensor([[pad, pad, 5, 9, 12, 2], [7, 8, 6, 11, 10, 2]])  # fairseq pads the source on the left
    with torch.no_grad():
        alone = model.encoder(short, src_lengths=torch.tensor([4]))["encoder_out"][0][:, 0]
        both = model.encoder(batch, src_lengths=torch.tensor([4, 6]))["encoder_out"][0][2:, 0]
    torch.testing.assert_close(both, alone, rtol=1e-5, atol=1e-5)
