"""--criterion moe_distillation: the loss against its formula computed by hand (plain loops over the target tokens,
fairseq's own label-smoothed NLL), the teacher's logits against fairseq's own loading and forward of its checkpoint,
two ranks (the MoE teacher's experts spread) against one process, the refusals, and fairseq-train with it."""
import json
import math
import shutil

import pytest
import torch

import fairseq_moe

fairseq_moe.load_plugin()  # (first, as fairseq's --user-dir does: a spawned rank imports this module alone)

from fairseq_moe.errors import FlagError  # noqa: E402
from fairseq_moe.models.moe_ffn import moe_blocks  # noqa: E402

from tests.fairseq_moe.criterions.test_moe_loss import first_batch  # noqa: E402
from tests.fairseq_moe.helpers import build, run_train, train_argv  # noqa: E402

DENSE = ("--arch", "transformer", "--task", "translation", "--criterion", "label_smoothed_cross_entropy")
DROPLESS = ("--moe-expert-count", "4", "--moe-capacity-factor", "0", "--moe-eval-capacity-token-fraction", "0")


@pytest.fixture(scope="module")
def teachers(data_bin, tmp_path_factory):
    """{"moe": a dropless MoE teacher of 4 experts, "dense": a dense one}: 3 updates each on the toy corpus."""
    out = {}
    for name, flags in (("moe", DROPLESS), ("dense", DENSE)):
        save = tmp_path_factory.mktemp(f"teacher_{name}")
        run_train(train_argv(data_bin, save, "--max-update", "3", "--required-batch-size-multiple", "1", *flags))
        out[name] = str(save / "checkpoint_last.pt")
    return out


def student_argv(data_bin, tmp_path, teacher, student="moe", *extra):
    return train_argv(data_bin, tmp_path, *(DENSE if student == "dense" else DROPLESS), "--criterion",
                      "moe_distillation", "--kd-teacher", teacher, *extra)


def _logsumexp(values):
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))


def kd_by_hand(student, teacher, target, pad, T, topk):
    """sum over the target tokens of KL(q_T || p_T), each a loop over the vocabulary (or the teacher's topk most
    likely tokens, renormalised), in float64."""
    total = 0.0
    for b in range(target.shape[0]):
        for t in range(target.shape[1]):
            if target[b, t] == pad:
                continue
            s = [x / T for x in student[b, t].double().tolist()]
            q = [x / T for x in teacher[b, t].double().tolist()]
            kept = sorted(range(len(q)), key=lambda v: -q[v])[:topk] if topk else range(len(q))
            zq, zp = _logsumexp([q[v] for v in kept]), _logsumexp(s)
            total += sum(math.exp(q[v] - zq) * ((q[v] - zq) - (s[v] - zp)) for v in kept)
    return total


@pytest.mark.parametrize("student, teacher, T, topk", [("moe", "dense", 2.0, 0), ("dense", "moe", 1.0, 5)])
def test_loss_is_the_formula_by_hand(data_bin, tmp_path, teachers, student, teacher, T, topk):
    from fairseq import checkpoint_utils
    from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss

    a = 0.7
    task, model, criterion, args = build(student_argv(
        data_bin, tmp_path, teachers[teacher], student, "--kd-alpha", str(a), "--kd-temperature", str(T),
        "--kd-topk", str(topk), "--moe-gate-loss-wt", "0.5"))
    model.eval()  # (no dropout: the by-hand forward below is the same)
    sample = first_batch(task, args)
    loss, sample_size, log = criterion(model, sample)

    # The teacher: fairseq's own loading (its own task, from its checkpoint) and forward.
    (reference,), _, _ = checkpoint_utils.load_model_ensemble_and_task([teachers[teacher]])
    with torch.no_grad():
        want_teacher = reference.eval()(**sample["net_input"])[0]
        student_logits = model(**sample["net_input"])[0]
    assert torch.equal(criterion.teacher_logits(sample, model), want_teacher)

    target, pad = sample["target"], task.target_dictionary.pad()
    lprobs = torch.log_softmax(student_logits.double(), -1)
    ls, nll = label_smoothed_nll_loss(lprobs.view(-1, lprobs.shape[-1]), target.view(-1), 0.1, ignore_index=pad)
    kd = kd_by_hand(student_logits, want_teacher, target, pad, T, topk)
    want = (1 - a) * ls.item() + a * T * T * kd
    auxes = [b.last_aux for _, b in moe_blocks(model)]
    assert bool(auxes) == (student == "moe")
    if auxes:  # the MoE router losses, as moe_label_smoothed_cross_entropy adds them
        want += sample_size * 0.5 * sum(x.balance_loss.item() for x in auxes) / len(auxes)
    assert loss.item() == pytest.approx(want, rel=1e-5)
    assert float(log["kd_loss"]) == pytest.approx(kd, rel=1e-5) and kd > 0
    assert float(log["nll_loss"]) == pytest.approx(nll.item(), rel=1e-5)
    if not auxes:  # unreduced: one loss per target position, which sum to the loss
        per_position, _, _ = criterion(model, sample, reduce=False)
        assert per_position.shape == (target.numel(),)
        assert per_position.sum().item() == pytest.approx(want, rel=1e-5)


def _distil_on_ranks(rank, W, argv, out):
    """On each rank: the student's loss of its half of the batch (sentences rank, rank + W, ...), the MoE teacher's
    experts spread over the ranks; rank 0 writes the sum over the ranks."""
    task, model, criterion, args = build(argv)
    model.eval()
    sample = first_batch(task, args)
    assert all(b.moe.ep is not None for _, b in moe_blocks(criterion.__dict__["teacher"]))
    mine = torch.arange(rank, sample["target"].shape[0], W)
    part = {"net_input": {k: v[mine] for k, v in sample["net_input"].items()}, "target": sample["target"][mine]}
    part["ntokens"] = int(part["target"].ne(task.target_dictionary.pad()).sum())
    loss, _, log = criterion(model, part)
    total = torch.stack([loss.detach(), log["kd_loss"].float()])
    torch.distributed.all_reduce(total)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(total.tolist(), f)


@pytest.mark.slow
def test_two_ranks_with_the_teachers_experts_spread_equal_one_process(data_bin, tmp_path, teachers):
    from tests.fairseq_moe_layer.test_comm import spawn

    argv = student_argv(data_bin, tmp_path, teachers["moe"], "dense", "--kd-topk", "4")
    task, model, criterion, args = build(argv)
    model.eval()
    loss, _, log = criterion(model, first_batch(task, args))
    out = tmp_path / "ranks.json"
    spawn(_distil_on_ranks, 2, argv, str(out))
    got = json.loads(out.read_text())
    assert got == pytest.approx([loss.item(), float(log["kd_loss"])], rel=1e-5)


def test_refused_by_name(data_bin, tmp_path, teachers):
    """No teacher, a missing one, a bad setting, a teacher of another vocabulary size or of another dictionary of the
    same size: one FlagError naming the flag (and the files), before any training."""
    from fairseq import checkpoint_utils
    from omegaconf import OmegaConf

    cases = [(student_argv(data_bin, tmp_path, "")[:-2], "needs --kd-teacher PATH"),
             (student_argv(data_bin, tmp_path, str(tmp_path / "none.pt")), "--kd-teacher .*none.pt: .*no such"),
             (student_argv(data_bin, tmp_path, teachers["dense"], "moe", "--kd-alpha", "1.5"), "--kd-alpha must be"),
             (student_argv(data_bin, tmp_path, teachers["dense"], "moe", "--kd-temperature", "0"),
              "--kd-temperature must be")]
    state = checkpoint_utils.load_checkpoint_to_cpu(teachers["dense"])
    for key in ("decoder.embed_tokens.weight", "decoder.output_projection.weight"):
        state["model"][key] = state["model"][key][:-8]
    state["cfg"] = OmegaConf.to_container(state["cfg"])  # (as fairseq saves it)
    small = tmp_path / "small_vocabulary.pt"
    torch.save(state, small)
    cases.append((student_argv(data_bin, tmp_path, str(small)), r"decoder has a vocabulary of \d+ types, the "
                                                                 r"student's dictionary \d+"))
    other = tmp_path / "other_dictionary"
    shutil.copytree(data_bin, other)
    lines = (other / "dict.tgt.txt").read_text().splitlines(keepends=True)
    (other / "dict.tgt.txt").write_text("".join([lines[1], lines[0], *lines[2:]]))  # (same size, two swapped)
    cases.append((student_argv(str(other), tmp_path, teachers["dense"]),
                  "its dictionary .*dict.tgt.txt is not the student's .*other_dictionary/dict.tgt.txt"))
    for argv, match in cases:
        with pytest.raises(FlagError, match=match):
            build(argv)


def test_a_multilingual_teacher_of_an_argparse_task(ml_data_bin, tmp_path):
    """fairseq's multilingual task is an argparse task (its config a Namespace in the checkpoint): its teacher distils
    into a student of the same task, and a student on another copy of the data is checked against its dictionary
    files."""
    from tests.fairseq_moe.helpers import ML_ARGS

    ml = (*ML_ARGS, "--share-all-embeddings", "--max-source-positions", "64", "--max-target-positions", "64")
    run_train(train_argv(ml_data_bin, tmp_path / "teacher", *ml, "--max-update", "2"))
    teacher = str(tmp_path / "teacher" / "checkpoint_last.pt")
    student = ("--criterion", "moe_distillation", "--kd-teacher", teacher, "--moe-expert-count", "2")
    task, model, criterion, args = build(train_argv(ml_data_bin, tmp_path / "student", *ml, *student))
    task.load_dataset("valid")
    itr = task.get_batch_iterator(dataset=task.dataset("valid"), max_tokens=400, seed=1)
    loss, _, log = criterion(model, next(iter(itr.next_epoch_itr(shuffle=False))))
    assert torch.isfinite(loss) and float(log["kd_loss"]) > 0
    other = tmp_path / "other"
    shutil.copytree(ml_data_bin, other)
    lines = (other / "dict.en.txt").read_text().splitlines(keepends=True)
    (other / "dict.en.txt").write_text("".join([lines[1], lines[0], *lines[2:]]))
    with pytest.raises(FlagError, match="its dictionary .*dict.en.txt is not the student's"):
        build(train_argv(str(other), tmp_path / "student", *ml[:-5], *ml[-4:], *student))  # (its own embeddings)


@pytest.mark.slow
def test_fairseq_train_distils_and_saves_the_student_alone(data_bin, tmp_path, teachers, caplog):
    """fairseq-train with the criterion: the distillation term is logged and falls; the student's checkpoint holds
    the student alone (the teacher is neither trained nor saved with it)."""
    from fairseq import checkpoint_utils

    caplog.set_level("INFO")
    run_train(student_argv(data_bin, tmp_path, teachers["moe"], "dense", "--max-update", "6", "--kd-alpha", "1"))
    kd = [float(part.split("=")[1]) for rec in caplog.records for part in str(rec.getMessage()).split(", ")
          if part.startswith("kd_loss=") and "num_updates" in rec.getMessage()]
    assert len(kd) == 6 and kd[-1] < kd[0], kd
    state = checkpoint_utils.load_checkpoint_to_cpu(str(tmp_path / "checkpoint_last.pt"))
    teacher = checkpoint_utils.load_checkpoint_to_cpu(teachers["moe"])
    assert not any("teacher" in key or ".moe." in key for key in state["model"])
    assert state.get("criterion") is None and set(state["model"]) != set(teacher["model"])
