"""Flags reach the MoE layers; every bad setting fails at build time with the flag's name."""
import pytest

from fairseq_moe.models.moe_ffn import moe_blocks

from tests.fairseq_moe.helpers import build, parse_train, train_argv


def blocks(data_bin, tmp_path, *extra):
    _, model, _, _ = build(train_argv(data_bin, tmp_path, *extra))
    return dict(moe_blocks(model))


def test_placement_and_settings(data_bin, tmp_path):
    b = blocks(data_bin, tmp_path, "--encoder-layers", "4", "--moe-freq", "2", "--decoder-moe-freq", "1",
               "--moe-expert-count", "3", "--moe-top-k", "3", "--moe-expert-ffn-dim", "24",
               "--moe-capacity-factor", "0", "--moe-eval-capacity-token-fraction", "-1")
    assert sorted(b) == ["decoder.layers.0.fc1", "decoder.layers.1.fc1",
                         "encoder.layers.1.fc1", "encoder.layers.3.fc1"]
    cfg = b["encoder.layers.1.fc1"].moe.cfg
    assert (cfg.num_experts, cfg.top_k, cfg.ffn_dim, cfg.capacity_factor) == (3, 3, 24, 0.0)
    assert cfg.eval_capacity_token_fraction == -1
    assert b["encoder.layers.1.fc1"].moe.experts.w1.shape == (3, 32, 24)


def test_an_expert_count_per_moe_layer(data_bin, tmp_path):
    """--moe-expert-count takes one count per MoE layer, encoder layers first; each layer has its own experts and
    router, and computes what the loop oracle computes with its weights (tests/fairseq_moe_layer/oracle.py)."""
    import torch

    from tests.fairseq_moe_layer.oracle import moe_oracle

    b = blocks(data_bin, tmp_path, "--encoder-layers", "4", "--moe-expert-count", "3,5,6,2", "--decoder-moe-freq",
               "1", "--moe-capacity-factor", "0", "--moe-eval-capacity-token-fraction", "0", "--moe-top-k", "2")
    counts = {name: (block.moe.cfg.num_experts, block.moe.experts.w1.shape[0], block.moe.gate.weight.shape[0])
              for name, block in b.items()}
    assert counts == {"encoder.layers.1.fc1": (3, 3, 3), "encoder.layers.3.fc1": (5, 5, 5),
                      "decoder.layers.0.fc1": (6, 6, 6), "decoder.layers.1.fc1": (2, 2, 2)}
    torch.manual_seed(0)
    for name, block in b.items():
        moe = block.moe.eval()
        x = torch.randn(7, 32)
        ex = moe.experts
        want = moe_oracle(x, moe.gate.weight, ex.w1, ex.b1, ex.w2, ex.b2, 2)
        torch.testing.assert_close(moe(x)[0], want, rtol=1e-5, atol=1e-6, msg=name)
    assert blocks(data_bin, tmp_path, "--moe-expert-count", "6,6")["decoder.layers.1.fc1"].moe.cfg.num_experts == 6


def test_routing_noise_and_eval_top_k_reach_the_layers(data_bin, tmp_path):
    b = blocks(data_bin, tmp_path, "--moe-routing", "dense", "--moe-gate-noise", "jitter", "--moe-gate-noise-scale",
               "0.05", "--moe-eval-top-k", "1")
    cfg = b["decoder.layers.1.fc1"].moe.cfg
    assert (cfg.routing, cfg.gate_noise, cfg.gate_noise_scale, cfg.eval_top_k) == ("dense", "jitter", 0.05, 1)
    b = blocks(data_bin, tmp_path, "--moe-second-expert-policy", "random", "--moe-normalize-gate-prob-before-dropping",
               "--moe-batch-prioritized-routing", "--moe-normalize-expert-grad", "sqrt_world_size")
    cfg = b["encoder.layers.1.fc1"].moe.cfg
    assert (cfg.second_expert_policy, cfg.normalize_gate_prob_before_dropping, cfg.batch_prioritized_routing,
            cfg.random_token_selection, cfg.expert_grad_normalization) == ("random", True, True, False, "sqrt_world_size")
    assert blocks(data_bin, tmp_path, "--moe-random-token-selection")["encoder.layers.1.fc1"].moe.cfg.random_token_selection
    cfg = blocks(data_bin, tmp_path, "--moe-score", "sigmoid", "--moe-bias-update-rate", "0.01", "--moe-expert-groups",
                 "2", "--moe-topk-groups", "1")["decoder.layers.1.fc1"].moe.cfg
    assert (cfg.score, cfg.bias_update_rate, cfg.expert_groups, cfg.topk_groups) == ("sigmoid", 0.01, 2, 1)
    block = blocks(data_bin, tmp_path, "--moe-shared-expert-count", "2")["encoder.layers.1.fc1"]
    assert block.moe.cfg.shared_experts == 2 and block.moe.shared.w1.shape == (2, 32, 64)
    b = blocks(data_bin, tmp_path, "--moe-routing", "expert_choice", "--moe-freq", "0", "--encoder-moe-freq", "2")
    assert sorted(b) == ["encoder.layers.1.fc1"] and b["encoder.layers.1.fc1"].moe.cfg.routing == "expert_choice"


def test_defaults_and_aliases(data_bin, tmp_path):
    cfg = blocks(data_bin, tmp_path)["encoder.layers.1.fc1"].moe.cfg
    assert (cfg.top_k, cfg.ffn_dim, cfg.gate, cfg.gate_fp32) == (2, 64, "linear", True)
    cfg = blocks(data_bin, tmp_path, "--moe-top1-expert", "--no-moe-gating-use-fp32",
                 "--moe-gate", "cosine")["decoder.layers.1.fc1"].moe.cfg
    assert (cfg.top_k, cfg.gate, cfg.gate_fp32) == (1, "cosine", False)


@pytest.mark.parametrize("extra, flag", [
    (("--moe-top-k", "5", "--moe-expert-count", "4"), "--moe-top-k"),
    (("--moe-top-k", "0"), "--moe-top-k"),
    (("--moe-expert-count", "0"), "--moe-expert-count"),
    (("--moe-expert-count", "4,0"), "--moe-expert-count"),
    (("--moe-expert-count", "4,4,4"), "--moe-expert-count 4,4,4 gives 3 counts for 2 MoE layers (encoder [1], "
                                      "decoder [1])"),
    (("--moe-expert-count", "4,8", "--moe-top-k", "5"), "--moe-top-k"),
    (("--moe-capacity-factor", "-1"), "--moe-capacity-factor"),
    (("--moe-eval-capacity-token-fraction", "1.5"), "--moe-eval-capacity-token-fraction"),
    (("--moe-freq", "3"), "--moe-freq"),  # 2 layers per side: (i + 1) % 3 never 0
    (("--moe-freq", "0"), "--moe-freq"),
    (("--moe-top1-expert", "--moe-top-k", "2"), "--moe-top1-expert"),
    (("--activation-fn", "tanh"), "--activation-fn"),
    (("--moe-gate-loss-wt", "-0.1"), "--moe-gate-loss-wt"),
    (("--moe-a2a-overlap-degree", "0"), "--moe-a2a-overlap-degree"),
    (("--moe-routing", "expert_choice"), "--moe-routing"),  # the decoder has MoE layers: refused
    (("--moe-routing", "soft"), "--moe-routing"),
    (("--moe-soft-slots", "2"), "--moe-soft-slots"),  # not soft routing
    (("--moe-routing", "expert_choice", "--moe-capacity-factor", "0", "--moe-freq", "0", "--encoder-moe-freq", "2"),
     "--moe-capacity-factor"),
    (("--moe-gate-noise", "jitter", "--moe-gate-noise-scale", "1.5"), "--moe-gate-noise-scale"),
    (("--moe-eval-top-k", "9"), "--moe-eval-top-k"),
    (("--moe-second-expert-policy", "sampling", "--moe-top-k", "1"), "--moe-second-expert-policy"),
    (("--moe-batch-prioritized-routing", "--moe-random-token-selection"), "--moe-random-token-selection"),
    (("--quant-noise-pq", "0.1"), "--quant-noise-pq"),  # would skip the experts
    (("--moe-capacity-counts-padding",), "--moe-capacity-counts-padding needs --use-moe-pad-mask"),
    (("--moe-capacity-counts-padding", "--use-moe-pad-mask", "--moe-routing", "dense"),
     "--moe-capacity-counts-padding (capacity_counts_padding) has no capacity to set with --moe-routing dense"),
    (("--moe-stats-file", "/nonexistent/folder/x.jsonl"), "--moe-stats-file"),
    (("--moe-stats-file", "stats.jsonl", "--moe-stats-interval", "0"), "--moe-stats-interval"),
    (("--moe-stats-file", "/dev/full"), "--moe-stats-file /dev/full is not a regular file"),
])
def test_bad_settings_name_the_flag(data_bin, tmp_path, extra, flag):
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        build(train_argv(data_bin, tmp_path, *extra))
    assert flag in str(err.value)


@pytest.mark.parametrize("extra, flag", [
    (("--moe-gate", "nope"), "--moe-gate"),
    (("--moe-routing", "nope"), "--moe-routing"),
    (("--moe-gate-noise", "nope"), "--moe-gate-noise"),
    (("--moe-gate-loss-combine-method", "median"), "--moe-gate-loss-combine-method"),
    (("--moe-expert-count", "two"), "--moe-expert-count"),
    (("--moe-expert-count", "4,x"), "--moe-expert-count"),
])
def test_unknown_choices_rejected_by_the_parser(data_bin, tmp_path, capsys, extra, flag):
    with pytest.raises(SystemExit):
        parse_train(train_argv(data_bin, tmp_path, *extra))
    assert flag in capsys.readouterr().err


def test_moe_task_needs_moe_layers(data_bin, tmp_path):
    argv = train_argv(data_bin, tmp_path)
    argv[argv.index("moe_transformer_tiny")] = "transformer"
    with pytest.raises(ValueError, match="moe_translation"):
        build(argv)


def test_kernel_backend_flag(data_bin, tmp_path, monkeypatch):
    cfg = blocks(data_bin, tmp_path)["encoder.layers.1.fc1"].moe.cfg
    assert cfg.kernel_backend == "auto"
    cfg = blocks(data_bin, tmp_path, "--moe-kernel-backend", "torch")["encoder.layers.1.fc1"].moe.cfg
    assert cfg.kernel_backend == "torch"
    # The overlapped all-to-alls run the chosen backend's kernels too (tests/fairseq_moe_layer/test_comm.py).
    cfg = blocks(data_bin, tmp_path, "--moe-kernel-backend", "triton",
                 "--moe-a2a-overlap-degree", "2")["encoder.layers.1.fc1"].moe.cfg
    assert cfg.kernel_backend == "triton"
    # Asked for where it cannot run (a CPU run without Triton's interpreter): an error before training.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="--moe-kernel-backend triton cannot run on cpu"):
        build(train_argv(data_bin, tmp_path, "--moe-kernel-backend", "triton"))


def test_keep_freed_memory_is_set_by_the_trainer_only(data_bin, tmp_path, monkeypatch, caplog):
    """--moe-keep-freed-memory calls malloc.keep_freed_memory() once, when the Trainer is built, never at model build
    (which also runs wherever a checkpoint is loaded: generate, eval-lm, the hub). What the call does to glibc:
    tests/fairseq_moe_layer/test_malloc.py, in a fresh interpreter; here it is replaced, so that this test process keeps glibc's
    defaults. Where the C library cannot take it, one line names the flag."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.trainer import Trainer

    from fairseq_moe_layer import malloc

    calls = []
    monkeypatch.setattr(malloc, "keep_freed_memory", lambda: calls.append("malloc") or True)
    for extra, expect in (((), []), (("--moe-keep-freed-memory",), ["malloc"])):
        task, model, criterion, args = build(train_argv(data_bin, tmp_path, *extra))
        assert calls == []  # (the model is built: nothing set yet)
        with caplog.at_level("INFO"):
            Trainer(convert_namespace_to_omegaconf(args), task, model, criterion)
        assert calls == expect
        assert ("glibc's malloc keeps freed memory in this process" in caplog.text) == bool(expect)
        calls.clear()
    monkeypatch.setattr(malloc, "keep_freed_memory", lambda: False)
    task, model, criterion, args = build(train_argv(data_bin, tmp_path, "--moe-keep-freed-memory"))
    with pytest.raises(ValueError, match="--moe-keep-freed-memory needs glibc's malloc"):
        Trainer(convert_namespace_to_omegaconf(args), task, model, criterion)


def test_checkpoint_unfriendly_setups_refused_with_spread_experts():
    from argparse import Namespace

    from fairseq_moe import refusals

    def check_supported(args, spread):
        refusals.check("trainer", refusals.Context(flags=args, spread=spread))

    check_supported(Namespace(bf16=True, fp16_no_flatten_grads=True), spread=True)
    check_supported(Namespace(fp16=True), spread=False)
    check_supported(Namespace(store_ema=True), spread=True)  # (each rank keeps the EMA of its own experts)
    check_supported(Namespace(ddp_backend="fully_sharded"), spread=True)  # (torch's FSDP: tests/fairseq_moe/hooks/test_fsdp.py)
    check_supported(Namespace(fp16=True), spread=True)  # (the flat fp32 copy with experts: tests/fairseq_moe/hooks/test_optim.py)
    for args, flag in ((Namespace(ddp_backend="fully_sharded", store_ema=True), "--store-ema"),
                       (Namespace(write_checkpoints_asynchronously=True), "--write-checkpoints-asynchronously")):
        with pytest.raises(ValueError, match=flag):
            check_supported(args, spread=True)


def test_layerdrop_skips_the_layers_drawn_for_the_update(data_bin, tmp_path):
    """With MoE layers, fairseq's LayerDrop lists draw from (--seed, update, side): every rank (another model
    built with the same seed) and every micro-batch of one update skip the same layers (an MoE layer is a
    collective of all ranks); another update draws anew; at eval none is skipped."""
    from fairseq_moe.models.moe_transformer import UpdateLayerDrop, at_update

    flags = ("--encoder-layerdrop", "0.5", "--decoder-layerdrop", "0.5", "--encoder-layers", "6")
    models = [build(train_argv(data_bin, tmp_path, *flags))[1] for _ in range(2)]

    def kept(layers):  # the indices of the layers one forward runs
        ran = {id(m) for m in layers}
        return tuple(i for i, m in enumerate(layers._modules.values()) if id(m) in ran)

    for model in models:
        assert isinstance(model.encoder.layers, UpdateLayerDrop) and isinstance(model.decoder.layers, UpdateLayerDrop)
        model.train()
    drawn = []
    for update in range(8):
        for model in models:
            at_update(model, update)
        mine = kept(models[0].encoder.layers)
        assert kept(models[0].encoder.layers) == mine == kept(models[1].encoder.layers)  # micro-batch, rank
        drawn.append(mine)
    assert len(set(drawn)) > 1 and any(len(k) < 6 for k in drawn)
    models[0].eval()
    assert kept(models[0].encoder.layers) == tuple(range(6))


def test_offload_activations_refused(data_bin, tmp_path):
    with pytest.raises(ValueError, match="--offload-activations"):
        build(train_argv(data_bin, tmp_path, "--offload-activations"))


def test_trainer_refuses_unfriendly_setups_from_the_whole_config(data_bin, tmp_path, monkeypatch):
    """The check runs when fairseq builds its Trainer, from the sectioned config that fairseq-train and
    fairseq-hydra-train both pass (a hydra model config has no optimizer or fp16 flags)."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.trainer import Trainer

    from fairseq_moe.refusals import training_flags
    from fairseq_moe.models import moe_transformer
    from fairseq_moe_layer.comm import ExpertParallel

    task, _, criterion, args = build(train_argv(data_bin, tmp_path, "--optimizer", "adafactor", "--lr", "0.01",
                                                "--scale-parameter", "--zero-sharding", "os"))
    cfg = convert_namespace_to_omegaconf(args)
    flags = training_flags(cfg)
    assert (flags.optimizer, flags.fp16, flags.ddp_backend) == ("adafactor", False, args.ddp_backend)
    spread = ExpertParallel(group=None, size=2, ep_rank=0, num_local_experts=2, replicas=1, replica_group=None)
    monkeypatch.setattr(moe_transformer, "build_expert_parallel", lambda args: {4: spread})
    model = task.build_model(cfg.model)
    with pytest.raises(ValueError, match="--scale-parameter"):
        Trainer(cfg, task, model, criterion)


def test_defaults_live_in_one_place():
    """The layer flags' defaults are MoEConfig's; the criterion's are MoELossConfig's."""
    import inspect
    from argparse import Namespace

    from dataclasses import fields

    from fairseq_moe.criterions.moe_cross_entropy import (MoECrossEntropyConfig, MoECrossEntropyCriterion,
                                                          MoELabelSmoothedCrossEntropyCriterion)
    from fairseq_moe.criterions.moe_loss import MoELossConfig
    from fairseq_moe.models.moe_transformer import LAYER_FLAGS, moe_base_architecture
    from fairseq_moe_layer import MoEConfig

    args = Namespace()
    moe_base_architecture(args)
    assert {flag: getattr(args, flag) for flag in LAYER_FLAGS} == {
        flag: getattr(MoEConfig, name) for flag, name in LAYER_FLAGS.items()}
    # The criterions take their MoE settings from the config at build time (MoECriterionMixin):
    # no MoE default is written in their signatures.
    for criterion in (MoELabelSmoothedCrossEntropyCriterion, MoECrossEntropyCriterion):
        assert not [p for p in inspect.signature(criterion).parameters if p.startswith("moe_")]
    assert {f.name for f in fields(MoELossConfig)} <= {f.name for f in fields(MoECrossEntropyConfig)}


def test_a_stats_file_that_cannot_be_written_later_is_one_warning(data_bin, tmp_path, caplog):
    """The disk fills (here: the file's name turns into a folder) after the checks at start: training goes
    on, one warning says the statistics stop."""
    import torch

    from fairseq_moe.models.moe_ffn import moe_blocks
    from fairseq_moe.tasks.expert_stats import ExpertLoadLog

    _, model, _, _ = build(train_argv(data_bin, tmp_path))
    path = tmp_path / "stats.jsonl"
    log = ExpertLoadLog(str(path), 1)
    path.mkdir()
    caplog.set_level("WARNING")
    for update in (1, 2):
        log.sums = {name: torch.ones(block.moe.cfg.num_experts + 3, dtype=torch.float64)
                    for name, block in moe_blocks(model)}
        log.maybe_write(update, model)
    warnings = [r.getMessage() for r in caplog.records if "--moe-stats-file" in r.getMessage()]
    assert len(warnings) == 1 and f"cannot append to --moe-stats-file {path}" in warnings[0], warnings


def test_every_flag_of_the_models_is_in_docs_flags_and_reaches_the_layer():
    """Every flag add_moe_args makes is documented in docs/flags.md, and every layer flag sets its MoEConfig
    field (a setting with no flag, or a flag read by nothing, fails here)."""
    import argparse
    from pathlib import Path

    from fairseq_moe.models.moe_transformer import LAYER_FLAGS, add_moe_args
    from fairseq_moe_layer.options import settings
    from fairseq_moe_layer import MoEConfig

    parser = argparse.ArgumentParser(add_help=False)
    add_moe_args(parser)
    doc = (Path(__file__).parents[3] / "docs" / "flags.md").read_text()
    flags = [s for action in parser._actions for s in action.option_strings if s.startswith("--")]
    assert [flag for flag in flags if f"`{flag}" not in doc] == [], "document these flags in docs/flags.md"
    cli = {f.name for f in settings(MoEConfig) if f.metadata["cli"]}
    assert set(LAYER_FLAGS.values()) == cli and set(LAYER_FLAGS) <= {a.dest for a in parser._actions}
