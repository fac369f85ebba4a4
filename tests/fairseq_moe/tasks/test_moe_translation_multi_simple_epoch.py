"""moe_translation_multi_simple_epoch (fairseq's multilingual task with the MoE tasks' additions): its statistics file
groups expert use by language pair, each sentence's pair read off its language tokens; checked against the pair
that the sentence's own words give away (en-xx targets are upper-case, en-yy targets doubled lower-case words)."""
import json

import pytest
import torch

from tests.fairseq_moe.helpers import ML_ARGS, build, run_train, train_argv


def test_each_sentence_gets_its_pair_from_its_language_tokens(ml_data_bin, tmp_path):
    task, model, _, _ = build(train_argv(ml_data_bin, tmp_path, *ML_ARGS, "--share-all-embeddings"))
    assert task.stats_pairs() == ["en-xx", "en-yy"]
    for side in ("source", "target"):  # (what fairseq-train's model build leaves in the task's args)
        setattr(task.args, f"max_{side}_positions", 1024)
    task.load_dataset("valid")
    d = task.target_dictionary
    seen = set()
    for sample in task.get_batch_iterator(dataset=task.dataset("valid"), max_tokens=300, seed=1).next_epoch_itr():
        labels = task.sentence_labels(sample)
        for row, label in zip(sample["target"], labels.tolist()):
            words = [d[t] for t in row.tolist() if t > d.nspecial and not d[t].startswith("__")]
            upper = all(w.isupper() for w in words)
            assert label == (0 if upper else 1), (words, label)  # (xx: upper-case; yy: doubled lower-case)
            seen.add(label)
    assert seen == {0, 1}  # (batches mix the two pairs)


def test_the_statistics_file_groups_expert_use_by_pair(ml_data_bin, tmp_path):
    stats = tmp_path / "stats.jsonl"
    run_train(train_argv(ml_data_bin, tmp_path / "save", *ML_ARGS, "--share-all-embeddings", "--max-update", "4",
                         "--moe-stats-file", str(stats), "--moe-stats-interval", "2"))
    lines = [json.loads(line) for line in stats.read_text().splitlines()]
    assert [line["update"] for line in lines] == [2, 4]
    for line in lines:
        assert set(line["pairs"]) == {"en-xx", "en-yy"}
        for pair, layers in line["pairs"].items():
            assert layers.keys() == line["layers"].keys()
            for name, shares in layers.items():
                assert abs(sum(shares) - 1) < 1e-9 and len(shares) == 4
        # the whole layer's load lies between its pairs' loads, expert by expert (it is their weighted mean)
        for name, shares in line["layers"].items():
            a, b = (torch.tensor(line["pairs"][p][name]) for p in ("en-xx", "en-yy"))
            assert bool(((torch.minimum(a, b) - 1e-9 <= torch.tensor(shares)) &
                         (torch.tensor(shares) <= torch.maximum(a, b) + 1e-9)).all()), name
    # --moe-second-expert-policy random thins the choices after top-k: per-token counts would not be the demand,
    # so its layers are left out of "pairs" rather than counted wrong
    thinned = tmp_path / "random.jsonl"
    run_train(train_argv(ml_data_bin, tmp_path / "random", *ML_ARGS, "--share-all-embeddings", "--max-update", "2",
                         "--moe-stats-file", str(thinned), "--moe-stats-interval", "2",
                         "--moe-second-expert-policy", "random"))
    (line,) = [json.loads(x) for x in thinned.read_text().splitlines()]
    assert line["layers"] and line["pairs"] == {"en-xx": {}, "en-yy": {}}


@pytest.mark.slow
def test_two_ranks_count_each_pair_as_one_process_does(ml_data_bin, tmp_path):
    """2 ranks (2 experts each) against 1 process with --update-freq 2, the same global batches: every statistics
    line, per pair and per layer, is the one process's (each rank labels its own sentences; the counts are
    summed over the ranks)."""
    from tests.fairseq_moe.hooks.test_trainer_expert_parallel import COMMON, Launched

    def argv(name, *extra):
        return train_argv(ml_data_bin, tmp_path / name, *ML_ARGS, "--share-all-embeddings", *COMMON,
                          "--moe-stats-file", str(tmp_path / f"{name}.jsonl"), "--moe-stats-interval", "2", *extra)

    many = Launched(2, tmp_path / "many", argv("many"))
    run_train(argv("one", "--update-freq", "2"))
    many.result()
    one, two = ([json.loads(x) for x in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
                for name in ("one", "many"))
    assert [line["update"] for line in two] == [2, 4] and len(one) == len(two)
    for a, b in zip(one, two):
        assert a["tokens"] == b["tokens"] and set(a["pairs"]) == set(b["pairs"]) == {"en-xx", "en-yy"}
        for pair in a["pairs"]:
            assert a["pairs"][pair].keys() == b["pairs"][pair].keys() == a["layers"].keys()
            for name in a["pairs"][pair]:
                assert a["pairs"][pair][name] == pytest.approx(b["pairs"][pair][name], rel=1e-5, abs=1e-9)
        for name in a["layers"]:
            assert a["layers"][name] == pytest.approx(b["layers"][name], rel=1e-5, abs=1e-9)
