"""python -m fairseq_moe.grow: the grown model computes exactly what the model did (at evaluation, and in training
at a capacity, top-1 and top-2, fresh experts and copies), its new experts join as training goes on, --freeze-old
keeps the old ones as they were, two ranks train it as one process does, and what cannot stay exact is refused."""
import pytest
import torch
from fairseq import checkpoint_utils

from fairseq_moe import grow
from fairseq_moe.checkpoints import sets as shards

from tests.fairseq_moe.criterions.test_moe_loss import first_batch
from tests.fairseq_moe.helpers import assert_same_params, run_train, tail, train_argv

TOP2 = ("--moe-expert-count", "4", "--moe-capacity-factor", "1.0", "--moe-eval-capacity-token-fraction", "0.5")
TOP1 = ("--moe-expert-count", "4", "--moe-top-k", "1", "--moe-top1-weight", "one", "--moe-capacity-factor", "1.5")


@pytest.fixture(scope="module")
def trained(data_bin, tmp_path_factory):
    """{name: checkpoint} of 3 updates of the toy model: top-2 at a capacity (and a capacity at evaluation), top-1
    (weight one) at a capacity, top-2 dropless, top-2 at a capacity with swiglu experts (no biases)."""
    out = {}
    for name, flags in (("top2", TOP2), ("top1", TOP1), ("dropless", ("--moe-expert-count", "4",
                                                                       "--moe-capacity-factor", "0")),
                        ("swiglu", (*TOP2, "--moe-expert-kind", "swiglu"))):
        save = tmp_path_factory.mktemp(name)
        run_train(train_argv(data_bin, save, "--max-update", "3", "--required-batch-size-multiple", "1", *flags))
        out[name] = save / "checkpoint_last.pt"
    return out


def load(path):
    (model,), _, task = checkpoint_utils.load_model_ensemble_and_task([str(path)])
    return model, task


def forwards(model, sample, training):
    """The decoder's output, at evaluation or in training (the same dropout masks: seeded)."""
    model.train(training)
    torch.manual_seed(0)
    with torch.no_grad():
        return model(**sample["net_input"])[0]


@pytest.mark.parametrize("kind, add, init", [("top2", 4, "fresh"), ("top1", 4, "fresh"), ("dropless", 3, "fresh"),
                                             ("top2", 2, "copy"), ("swiglu", 4, "fresh"), ("swiglu", 2, "copy")])
def test_the_grown_model_computes_what_the_model_did(data_bin, trained, tmp_path, capsys, kind, add, init):
    out = tmp_path / "grown.pt"
    argv = [str(trained[kind]), str(out), "--add", str(add), "--init", init]
    assert grow.main(argv + (["--data", data_bin] if init == "copy" else [])) == 0
    printed = capsys.readouterr().out
    assert f"encoder.layers.1.fc1: 4 -> {4 + add} experts" in printed and "--finetune-from-model" in printed
    (old, task), (new, _) = load(trained[kind]), load(out)
    sample = first_batch(task, None)
    layers = {n: m.moe for n, m in new.named_modules() if hasattr(m, "moe")}
    assert all(m.experts.w1.shape[0] == 4 + add and m.gate.weight.shape[0] == 4 + add for m in layers.values())
    for training in (False, True):  # (training: the training capacity, CF x (E + N) / E, and dropout)
        torch.testing.assert_close(forwards(new, sample, training), forwards(old, sample, training), rtol=1e-5,
                                   atol=1e-6, msg=f"training={training}")
    state = torch.load(out, weights_only=True)
    cfg = state["cfg"]["model"]
    assert cfg.moe_expert_count == 4 + add and cfg.moe_bias_update_rate == 1e-3
    if kind == "top2":
        assert cfg.moe_capacity_factor == 1.0 * (4 + add) / 4
    w1 = state["model"]["decoder.layers.1.fc1.moe.experts.w1"]
    gate = state["model"]["decoder.layers.1.fc1.moe.gate.weight"]
    if init == "copy":  # the most used experts (by the routed weight, as prune measures it), with their router rows
        from fairseq_moe.models.expert_use import routed_weight

        mass, _ = routed_weight(old.eval(), task, "valid", 4000)
        top = sorted(range(4), key=lambda e: (-float(mass["decoder.layers.1.fc1"][e]), e))[:add]
        assert all(torch.equal(w1[4 + i], w1[e]) and torch.equal(gate[4 + i], gate[e]) for i, e in enumerate(top))
    else:  # fresh: not copies of any old expert
        assert not any(torch.equal(w1[4 + i], w1[e]) for i in range(add) for e in range(4))


def _grown_flags(path):
    """The flags a run continuing from the grown checkpoint gives (those grow wrote into its config)."""
    cfg = torch.load(path, weights_only=True)["cfg"]["model"]
    flags = ["--moe-expert-count", str(cfg.moe_expert_count), "--moe-capacity-factor", str(cfg.moe_capacity_factor),
             "--moe-bias-update-rate", str(cfg.moe_bias_update_rate)]
    frozen = getattr(cfg, "moe_frozen_experts", 0)
    return flags + (["--moe-frozen-experts", str(frozen)] if frozen else [])


@pytest.mark.parametrize("freeze", [False, True])
def test_the_new_experts_join_and_freeze_old_keeps_the_old(data_bin, trained, tmp_path, freeze):
    """Training goes on (--finetune-from-model): the balancing bias raises the new experts until tokens choose them
    and they learn; with --freeze-old the old experts and router rows stay as they were."""
    out = tmp_path / "grown.pt"
    assert grow.main([str(trained["dropless"]), str(out), "--add", "4", "--bias-update-rate", "0.4",
                      *(["--freeze-old"] if freeze else [])]) == 0
    save = tmp_path / "more"
    run_train(train_argv(data_bin, save, "--max-update", "8", "--required-batch-size-multiple", "1",
                         *_grown_flags(out), "--finetune-from-model", str(out)))
    before, after = (torch.load(p, weights_only=True)["model"] for p in (out, save / "checkpoint_last.pt"))
    for side in ("encoder", "decoder"):
        p = f"{side}.layers.1.fc1.moe."
        assert not torch.equal(after[p + "experts.w1"][4:], before[p + "experts.w1"][4:]), "no token chose a new one"
        assert (after[p + "routing_bias"][4:] > before[p + "routing_bias"][4:]).all()
        for key in ("experts.w1", "experts.b2", "gate.weight"):
            assert torch.equal(after[p + key][:4], before[p + key][:4]) == freeze, key


@pytest.mark.slow
def test_two_ranks_train_the_grown_model_as_one_process(data_bin, trained, tmp_path):
    from tests.fairseq_moe.hooks.test_trainer_expert_parallel import COMMON, Launched

    out = tmp_path / "grown.pt"
    assert grow.main([str(trained["dropless"]), str(out), "--add", "4", "--bias-update-rate", "0.4"]) == 0
    argv = (*COMMON, *_grown_flags(out), "--finetune-from-model", str(out))
    many, one = tmp_path / "many", tmp_path / "one"
    run = Launched(2, many, train_argv(data_bin, many, *argv))
    run_train(train_argv(data_bin, one, *argv, "--update-freq", "2"))
    _, launched = run.result()
    assert "expert parallel: 4 experts per rank on 2 ranks" in launched.stderr + launched.stdout, tail(launched.stderr)
    a = torch.load(one / "checkpoint_last.pt", weights_only=True)
    b = shards.assemble(str(many / "checkpoint_last"))
    assert_same_params(b["model"], a["model"])


def test_refused_by_name(data_bin, trained, tmp_path, capsys):
    def fails(ckpt, match, *argv):
        assert grow.main([str(ckpt), str(tmp_path / "out.pt"), *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("python -m fairseq_moe.grow: error: ") and match in err, err
        assert not (tmp_path / "out.pt").exists()

    fails(trained["top2"], "--add 0: must be >= 1", "--add", "0")
    fails(trained["top2"], "--layers middle: 'middle' is neither a side nor an MoE layer", "--add", "2", "--layers",
          "middle")
    fails(trained["top2"], "--init copy copies the most used experts: give --data", "--add", "2", "--init", "copy")
    fails(trained["top2"], "has 4 experts to copy", "--add", "5", "--init", "copy", "--data", data_bin)
    fails(trained["top2"], "fresh experts need none", "--add", "4", "--data", data_bin)
    switch = tmp_path / "switch"
    run_train(train_argv(data_bin, switch, "--max-update", "1", "--moe-top-k", "1"))
    fails(switch / "checkpoint_last.pt", "routes top-1 with its router probability as the weight (Switch)", "--add",
          "2")
    for flags, match in ((("--moe-bias-update-rate", "0.2"), "plus a balancing bias that differs between experts"),
                         (("--moe-batch-prioritized-routing",), "--moe-batch-prioritized-routing at a capacity"),
                         (("--moe-gate-noise", "gaussian", "--moe-gate-noise-scale", "1"), "--moe-gate-noise gaussian")):
        save = tmp_path / flags[0].strip("-")
        run_train(train_argv(data_bin, save, "--max-update", "2", *flags))
        fails(save / "checkpoint_last.pt", match, "--add", "4")
    three = tmp_path / "three"
    run_train(train_argv(data_bin, three, "--max-update", "1", "--moe-expert-count", "3"))
    fails(three / "checkpoint_last.pt", "the capacity factor 1.0 x (E + N) / E is not exact", "--add", "1")
    mixed = tmp_path / "mixed"
    run_train(train_argv(data_bin, mixed, "--max-update", "1", "--moe-expert-count", "2,4"))
    fails(mixed / "checkpoint_last.pt", "the MoE layers would grow by different ratios", "--add", "2")
    fails(trained["top2"], "the MoE layers would grow by different ratios", "--add", "2", "--layers", "decoder")
    # dropless: any layers, any counts (here the decoder's alone: one count per MoE layer after)
    assert grow.main([str(trained["dropless"]), str(tmp_path / "decoder.pt"), "--add", "4", "--layers",
                      "decoder"]) == 0
    assert torch.load(tmp_path / "decoder.pt", weights_only=True)["cfg"]["model"].moe_expert_count == "4,8"
