"""export_hf of moe_mixtral_lm: a model trained here (a few updates of fairseq-train) exported to the transformers
family its flags select computes there what it computes here; what the family cannot express is refused by the
flag, nothing written. Skipped without transformers."""
import argparse

import pytest
import torch
from fairseq import checkpoint_utils

from fairseq_moe import export_hf

from tests.fairseq_moe.helpers import lm_train_argv, one_error_line, run_train

transformers = pytest.importorskip("transformers")

SIZES = ("--decoder-attention-heads", "4", "--decoder-kv-heads", "2", "--moe-expert-count", "4",
         "--max-update", "2", "--required-batch-size-multiple", "1")
FAMILIES = {
    "MixtralForCausalLM": (),
    "Qwen2MoeForCausalLM": ("--qkv-bias", "--moe-shared-expert-count", "1", "--moe-shared-expert-ffn-dim", "48",
                            "--moe-shared-expert-gate", "--decoder-moe-freq", "2", "--moe-expert-ffn-dim", "16",
                            "--no-moe-topk-renormalize", "--share-decoder-input-output-embed"),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def trained(request, lm_data_bin, tmp_path_factory):
    """(transformers' class, checkpoint_last.pt) of 2 updates of moe_mixtral_lm_tiny with the family's flags."""
    save = tmp_path_factory.mktemp(request.param)
    argv = lm_train_argv(lm_data_bin, save, *SIZES, *FAMILIES[request.param])
    argv[argv.index("moe_transformer_lm_tiny")] = "moe_mixtral_lm_tiny"
    run_train(argv)
    return request.param, save / "checkpoint_last.pt"


def test_an_exported_model_computes_in_transformers_what_it_computes_here(trained, tmp_path, capsys):
    cls, ckpt = trained
    assert export_hf.main([str(ckpt), str(tmp_path / "hf")]) == 0
    printed = capsys.readouterr().out
    assert f"{cls}.from_pretrained" in printed and "balance loss" in printed
    hf = getattr(transformers, cls).from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    (ours,), _, task = checkpoint_utils.load_model_ensemble_and_task([str(ckpt)])
    assert hf.config.vocab_size == len(task.dictionary) and hf.config.eos_token_id == task.dictionary.eos()
    x = torch.randint(4, len(task.dictionary), (3, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs, mine = hf(x).logits, ours.eval()(x)[0]
    assert float((mine - theirs).abs().max() / theirs.abs().max()) < 1e-5


@pytest.mark.parametrize("change,match", [
    (dict(moe_routing="hash"), "--moe-routing hash is not topk"),
    (dict(moe_score="sigmoid"), "--moe-score sigmoid is not softmax"),
    (dict(moe_gate="cosine"), "--moe-gate cosine is not linear"),
    (dict(moe_expert_kind="ffn"), "--moe-expert-kind ffn is not swiglu"),
    (dict(moe_routed_scaling_factor=2.5), "--moe-routed-scaling-factor 2.5 is not 1"),
    (dict(moe_bias_update_rate=0.001), "--moe-bias-update-rate 0.001 is set"),
    (dict(moe_expert_groups=2), "--moe-expert-groups 2 is set"),
    (dict(moe_eom=0.1), "--moe-eom 0.1 is set"),
    (dict(moe_fom=0.1), "--moe-fom 0.1 is set"),
    (dict(moe_cmr=True), "--moe-cmr is on"),
    (dict(moe_eval_capacity_token_fraction=0.25), "--moe-eval-capacity-token-fraction 0.25 drops tokens"),
    (dict(moe_topk_renormalize=False), "--no-moe-topk-renormalize leaves the top-k weights unnormalised"),
    (dict(moe_shared_expert_count=1), "--moe-shared-expert-count 1 is not one gated shared expert"),
    (dict(moe_shared_expert_count=2, moe_shared_expert_gate=True), "--moe-shared-expert-count 2 is not one gated"),
    (dict(qkv_bias=True), "--qkv-bias/--attention-bias is set (Mixtral's attention has no biases"),
    (dict(qk_norm="full", decoder_head_dim=16), "--decoder-head-dim 16 times 4 heads is not --decoder-embed-dim 32"),
    (dict(qk_norm="head", qkv_bias=True), "--qkv-bias puts biases on q, k, v without o"),
    (dict(moe_shared_expert_count=1, moe_shared_expert_gate=True, attention_bias=True), "--attention-bias is set"),
    (dict(moe_eval_top_k=1), "--moe-eval-top-k 1 differs from k 2"),
])
@pytest.mark.parametrize("trained", ["MixtralForCausalLM"], indirect=True)
def test_what_the_family_cannot_express_is_refused_by_the_flag(trained, tmp_path, capsys, change, match):
    """The trained Mixtral's saved flags changed one by one (the refusal comes before the weights are read)."""
    _, ckpt = trained
    state = torch.load(ckpt, weights_only=False)
    state["cfg"]["model"] = argparse.Namespace(**{**vars(state["cfg"]["model"]), **change})
    torch.save(state, tmp_path / "changed.pt")
    assert export_hf.main([str(tmp_path / "changed.pt"), str(tmp_path / "hf")]) == 2
    line = one_error_line(capsys.readouterr().err, "python -m fairseq_moe.export_hf")
    assert match in line and "cannot express it" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["changed.pt"]


def test_dense_layers_are_refused_for_mixtral(lm_data_bin, tmp_path, capsys):
    argv = lm_train_argv(lm_data_bin, tmp_path, *SIZES, "--decoder-moe-freq", "2", "--max-update", "1")
    argv[argv.index("moe_transformer_lm_tiny")] = "moe_mixtral_lm_tiny"
    run_train(argv)
    assert export_hf.main([str(tmp_path / "checkpoint_last.pt"), str(tmp_path / "hf")]) == 2
    assert "(MoE layers [1]) leaves dense layers (Mixtral: every layer MoE)" in one_error_line(
        capsys.readouterr().err, "python -m fairseq_moe.export_hf")
