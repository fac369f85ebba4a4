"""python -m fairseq_moe.prune: a multilingual MoE model (en-xx, en-yy; 8 experts, top-2) pruned for en-xx keeps, per
layer, the experts of most routed weight on en-xx, and the pruned model computes what the full model computes
with the other experts' router logits at -inf; it generates on 1 and on 2 ranks alike; bad input is one line and
writes nothing. And the routed weight itself, per language pair (inspect --by-lang-pair)."""
import pytest
import torch
from fairseq import checkpoint_utils

from fairseq_moe import prune
from fairseq_moe.inspect import moe_layers

from tests.fairseq_moe.helpers import ML_ARGS, run_train, tail, train_argv

E = 8


@pytest.fixture(scope="module")
def multilingual(ml_data_bin, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ml")
    run_train(train_argv(ml_data_bin, folder, *ML_ARGS, "--share-all-embeddings", "--max-update", "4",
                         "--moe-expert-count", str(E)))
    return ml_data_bin, folder / "checkpoint_last.pt"


def load(path, data, pairs="en-xx"):
    (model,), _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(path)], arg_overrides={"data": data, "lang_pairs": pairs})
    return model.eval(), task


def outputs(model, task):
    """The decoder's output on the en-xx valid sentences (teacher forcing), batch by batch."""
    task.load_dataset("valid")
    itr = task.get_batch_iterator(dataset=task.dataset("valid"), max_tokens=400, seed=1).next_epoch_itr(shuffle=False)
    with torch.no_grad():
        return [model(**sample["net_input"])[0] for sample in itr]


def test_the_pruned_model_is_the_full_one_with_the_others_logits_at_minus_inf(multilingual, tmp_path, capsys):
    data, full_path = multilingual
    out = tmp_path / "pruned.pt"
    assert prune.main([str(full_path), str(out), "--data", data, "--lang-pairs", "en-xx", "--keep", "0.5"]) == 0
    printed = capsys.readouterr().out
    assert "encoder.layers.1.fc1: 4 of 8, experts" in printed and "decoder.layers.1.fc1: 4 of 8" in printed
    state = torch.load(out, weights_only=True)
    kept = state["extra_state"]["made_by"]["kept"]
    assert state["cfg"]["model"].moe_expert_count == 4 and "last_optimizer_state" not in state
    assert all(len(ids) == 4 for ids in kept.values())

    pruned, task = load(out, data)
    full, full_task = load(full_path, data)
    for name, layer in moe_layers(full):
        gate = layer.gate

        def masked(x, _gate=gate, _drop=[e for e in range(E) if e not in kept[name]]):
            logits = type(_gate).forward(_gate, x)
            return logits.index_fill(-1, torch.tensor(_drop), float("-inf"))

        gate.forward = masked  # (the full model, its pruned experts' logits at -inf)
    for a, b in zip(outputs(pruned, task), outputs(full, full_task)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_kept_experts_hold_the_most_routed_weight():
    """choose(): per layer the n heaviest experts; n from --keep (of that layer's E), --keep-mass (the fewest holding
    that share) or --keep-count, per layer, at least top-k, rounded up to --multiple-of; --uniform: the largest n of
    any layer for every layer."""
    mass = {"a": torch.tensor([5.0, 0.0, 3.0, 2.0], dtype=torch.float64),
            "b": torch.tensor([1.0, 1.0, 1.0, 7.0, 0.5, 0.5], dtype=torch.float64)}
    each = lambda v: dict.fromkeys(mass, v)  # noqa: E731
    assert prune.choose(mass, keep=each(0.5)) == ({"a": 2, "b": 3}, {"a": [0, 2], "b": [0, 1, 3]})  # (ties: lower id)
    assert prune.choose(mass, keep_mass=each(0.7)) == ({"a": 2, "b": 2}, {"a": [0, 2], "b": [0, 3]})  # a: .5, .8
    assert prune.choose(mass, keep_mass=each(0.81)) == ({"a": 3, "b": 3}, {"a": [0, 2, 3], "b": [0, 1, 3]})
    assert prune.choose(mass, keep_mass={"a": 0.5, "b": 1.0}) == ({"a": 2, "b": 6}, {"a": [0, 2],
                                                                                      "b": [0, 1, 2, 3, 4, 5]})
    assert prune.choose(mass, keep_mass=each(0.7), uniform=True)[0] == {"a": 2, "b": 2}
    assert prune.choose(mass, keep=each(0.5), uniform=True) == ({"a": 3, "b": 3}, {"a": [0, 2, 3], "b": [0, 1, 3]})
    assert prune.choose(mass, keep_count={"a": 4, "b": 1}, top_k=2)[0] == {"a": 4, "b": 2}
    assert prune.choose(mass, keep=each(0.25), top_k=2)[0] == {"a": 2, "b": 2}
    assert prune.choose(mass, keep=each(0.5), multiple_of=4)[0] == {"a": 4, "b": 4}
    with pytest.raises(ValueError, match="a: keeping 6 experts .* is more than its 4"):
        prune.choose(mass, keep=each(1.0), uniform=True)
    names = ["encoder.layers.1.fc1", "decoder.layers.1.fc1"]
    assert prune.per_layer("0.5", names, "--keep") == dict.fromkeys(names, 0.5)
    assert prune.per_layer("1,0.25", names, "--keep") == dict(zip(names, [1.0, 0.25]))
    assert prune.per_layer("encoder=1,decoder=0.5", names, "--keep") == dict(zip(names, [1.0, 0.5]))
    for spec, match in (("1,2,3", "3 values for 2 MoE layers"), ("encoder=1", "says nothing of the decoder"),
                        ("middle=1,decoder=1", "'middle' is not a side"), ("x", "not a number"),
                        ("encoder=1,encoder=0.5,decoder=1", "a side said twice")):
        with pytest.raises(ValueError, match=match):
            prune.per_layer(spec, names, "--keep")


def test_each_layer_keeps_its_own_count_and_the_model_loads_with_them(multilingual, tmp_path, capsys):
    """--keep encoder=1,decoder=0.25: the encoder keeps its 8 experts, the decoder 2; OUT.pt's --moe-expert-count
    is then 8,2, and the pruned model is the full one with the decoder's other experts' logits at -inf."""
    data, full_path = multilingual
    out = tmp_path / "pruned.pt"
    assert prune.main([str(full_path), str(out), "--data", data, "--lang-pairs", "en-xx", "--keep",
                       "encoder=1,decoder=0.25"]) == 0
    assert "decoder.layers.1.fc1: 2 of 8" in capsys.readouterr().out
    state = torch.load(out, weights_only=True)
    assert state["cfg"]["model"].moe_expert_count == "8,2"
    kept = state["extra_state"]["made_by"]["kept"]
    pruned, task = load(out, data)
    assert [layer.experts.w1.shape[0] for _, layer in moe_layers(pruned)] == [8, 2]
    full, full_task = load(full_path, data)
    for name, layer in moe_layers(full):
        gate = layer.gate

        def masked(x, _gate=gate, _drop=[e for e in range(E) if e not in kept[name]]):
            logits = type(_gate).forward(_gate, x)
            return logits.index_fill(-1, torch.tensor(_drop, dtype=torch.long), float("-inf")) if _drop else logits

        gate.forward = masked
    for a, b in zip(outputs(pruned, task), outputs(full, full_task)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_bad_input_is_one_line_and_writes_nothing(multilingual, tmp_path, capsys):
    data, full_path = multilingual
    for argv, match in ((["--lang-pairs", "en-zz", "--keep", "0.5"], "en-zz is not one of the model's pairs"),
                        (["--keep", "1.5"], "--keep 1.5: 1.5 for encoder.layers.1.fc1: a fraction in (0, 1]"),
                        (["--keep", "0.5", "--keep-mass", "0.9"],
                         "give one of --keep F, --keep-mass M and --keep-count N"),
                        (["--keep-mass", "0"], "--keep-mass 0: 0.0 for encoder.layers.1.fc1: a fraction in (0, 1]"),
                        (["--keep", "1,0.5,1"], "--keep 1,0.5,1: 3 values for 2 MoE layers"),
                        (["--keep-count", "9"], "keeping 9 experts"),
                        (["--keep-count", "encoder=0,decoder=2"], "a count >= 1")):
        assert prune.main([str(full_path), str(tmp_path / "out.pt"), "--data", data, *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("python -m fairseq_moe.prune: error: ") and match in err, err
        assert not (tmp_path / "out.pt").exists()


def test_a_model_that_does_not_route_by_scores_is_refused(data_bin, tmp_path, capsys):
    """Hash routing sends token t to expert t mod E: with fewer experts it would be another model."""
    run_train(train_argv(data_bin, tmp_path / "hash", "--max-update", "1", "--moe-routing", "hash", "--moe-top-k", "1"))
    assert prune.main([str(tmp_path / "hash" / "checkpoint_last.pt"), str(tmp_path / "out.pt"), "--data", data_bin,
                       "--keep", "0.5"]) == 2
    assert "--moe-routing hash does not choose experts by router scores alone" in capsys.readouterr().err
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.slow
def test_a_pruned_model_generates_on_two_ranks_as_on_one(multilingual, tmp_path):
    from tests.fairseq_moe.hooks.test_spread import assert_same, generate

    data, full_path = multilingual
    out = tmp_path / "pruned.pt"
    assert prune.main([str(full_path), str(out), "--data", data, "--lang-pairs", "en-xx", "--keep", "0.5"]) == 0
    runs = [generate(data, out, W, *ML_ARGS, "--source-lang", "en", "--target-lang", "xx") for W in (1, 2)]
    for run in runs:
        assert run.returncode == 0, tail(run.stderr)
    assert "expert parallel: 2 experts per rank on 2 ranks" in runs[1].stderr
    assert_same(runs[0].stdout, runs[1].stdout, count=12)


def test_expert_use_by_language_pair(multilingual, tmp_path, capsys):
    """inspect --by-lang-pair: per pair and MoE layer, each expert's share of the routed weight (summing to 1) over
    the pair's test sentences, recomputed here from the router's top-2 weights, token by token; the table and the
    heat maps are written; a pair the model lacks is one line."""
    from fairseq_moe import inspect

    data, full_path = multilingual
    assert inspect.main([str(full_path), "--data", data, "--by-lang-pair", "--out", str(tmp_path / "out")]) == 0
    use = inspect.expert_use_by_pair(full_path, data)
    assert list(use) == ["en-xx", "en-yy"]
    model, task = load(full_path, data, "en-xx")
    inputs = {}  # each MoE layer's real tokens [T, d], as its gate sees them (padding left out: it is no use)
    hooks = [layer.gate.register_forward_hook(lambda m, args, out, _n=name: inputs.setdefault(_n, []).append(args[0]))
             for name, layer in moe_layers(model)]
    task.load_dataset("test")
    itr = task.get_batch_iterator(dataset=task.dataset("test"), max_tokens=4000, seed=1).next_epoch_itr(shuffle=False)
    with torch.no_grad(), inspect.padding_kept_out(model):
        for sample in itr:
            model(**sample["net_input"])
            pads = (sample["net_input"]["src_tokens"] == task.source_dictionary.pad()).sum()
            assert sum(x.shape[0] for x in inputs[moe_layers(model)[0][0]][-1:]) == sample["net_input"][
                "src_tokens"].numel() - pads  # (the encoder's layer saw no padding)
    for h in hooks:
        h.remove()
    for name, layer in moe_layers(model):
        weight = torch.zeros(E, dtype=torch.float64)
        for x in inputs[name]:
            probs = torch.softmax(x.float() @ layer.gate.weight.float().t(), -1)
            top_p, top_e = probs.topk(2, -1)
            weight.index_add_(0, top_e.reshape(-1), (top_p / top_p.sum(-1, keepdim=True)).reshape(-1).double())
        torch.testing.assert_close(torch.tensor(use["en-xx"][name], dtype=torch.float64), weight / weight.sum())
    text = (tmp_path / "out" / "expert_use_by_pair.txt").read_text()
    assert "en-yy" in text and (tmp_path / "out" / "expert_use_by_pair.png").stat().st_size > 1000
    capsys.readouterr()
    assert inspect.main([str(full_path), "--data", data, "--by-lang-pair", "--lang-pairs", "en-zz", "--out",
                         str(tmp_path / "other")]) == 2
    assert "en-zz is not one of the model's pairs" in capsys.readouterr().err
