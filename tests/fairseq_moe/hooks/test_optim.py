"""--zero-sharding os with the experts spread (optim.py): W ranks, each holding the optimizer state of about 1/W of
the dense parameters and of its own experts, train as one process does with --update-freq W on the same global
batches; a set keeps each rank's share in its rank file, resumes (3 + 3 updates == 6), reshards 4 -> 2 ranks and
continues as the 4 ranks do, and resumes on one process without the flag."""
from pathlib import Path

import pytest
import torch

from fairseq_moe.checkpoints import sets as shards
from fairseq_moe import reshard
from fairseq_moe.hooks.optim import owners

from tests.fairseq_moe.helpers import assert_same_params, run_train, train_argv
from tests.fairseq_moe.hooks.test_trainer_expert_parallel import COMMON, Launched, finish, launch

# (--seed 4: with seed 3's clipped steps one token's top-2 sits so near a tie at update 2 that float rounding at 4
# ranks flips it, with or without --zero-sharding: a difference of routing, not of sharding)
CLIP = ("--clip-norm", "0.5", "--seed", "4")
ZERO = ("--zero-sharding", "os", *CLIP)


def test_owners_balance_the_sizes_the_same_way_on_every_rank():
    assert owners([10, 1, 1, 10, 4], 2) == [0, 1, 1, 1, 0]  # largest first, to the least loaded: 14 and 12
    assert owners([3], 4) == [0] and owners([], 2) == []


def assert_same_optimizer_state(b, a):
    """The per-parameter optimizer state (SGD's momentum) of two full checkpoints: the same entries, within 1e-6
    relative."""
    sa, sb = a["last_optimizer_state"]["state"], b["last_optimizer_state"]["state"]
    assert sorted(sa) == sorted(sb) and len(sa) > 10
    for index in sa:
        for key, value in sa[index].items():
            torch.testing.assert_close(sb[index][key], value, rtol=1e-6, atol=1e-7, msg=f"{index} {key}")


def full(base):
    return shards.assemble(str(base))


@pytest.mark.slow
def test_zero_sharding_with_spread_experts(data_bin, tmp_path):
    def argv(save, *extra, updates=3):
        return train_argv(data_bin, save, *COMMON, *ZERO, "--max-update", str(updates), *extra)

    # 2 and 4 ranks run while the 1-process references train here
    two = Launched(2, tmp_path / "two", argv(tmp_path / "two"))
    run_train(train_argv(data_bin, tmp_path / "one2", *COMMON, *CLIP, "--max-update", "3",
                         "--update-freq", "2"))
    two.result()
    four = Launched(4, tmp_path / "four", argv(tmp_path / "four"))
    run_train(train_argv(data_bin, tmp_path / "one4", *COMMON, *CLIP, "--max-update", "3",
                         "--update-freq", "4"))
    four.result()
    for W, one in ((2, "one2"), (4, "one4")):
        a = torch.load(tmp_path / one / "checkpoint_last.pt", weights_only=True)
        b = full(tmp_path / ("two" if W == 2 else "four") / "checkpoint_last")
        assert_same_params(b["model"], a["model"])
        assert_same_optimizer_state(b, a)

    # Each rank file holds its own share of the dense state; the shared file none of it.
    base = str(tmp_path / "two" / "checkpoint_last")
    shared, rank_files = shards.read_set(base)
    assert shared["last_optimizer_state"]["state"] == {}
    first, second = (set(f["dense_optimizer"]) for f in rank_files)
    assert first and second and not first & second
    expert_index = set(shared["extra_state"]["moe_checkpoint"]["optimizer_index"].values())
    assert not (first | second) & expert_index

    # A set whose shares disagree: one line naming the file, before any work, nothing on disk changed
    bad_input(data_bin, tmp_path, base)

    resumes_and_reshards(data_bin, tmp_path, argv)


def resumes_and_reshards(data_bin, tmp_path, argv):
    """After 3 updates of the sharded runs in tmp_path/two and tmp_path/four (argv(save, *extra, updates=N): their
    command) and of the 1-process reference tmp_path/one2 (--update-freq 2): 3 + 3 updates == 6 on one process
    without the flag (every rank's state read back) and on 2 ranks with it; and the 4-rank set resharded to 2 ranks
    continues as the 4 ranks do."""
    base = str(tmp_path / "two" / "checkpoint_last")
    (tmp_path / "one_from_two").mkdir()
    run_train(train_argv(data_bin, tmp_path / "one_from_two", *COMMON, *CLIP, "--max-update", "6",
                         "--update-freq", "2", "--restore-file", base + ".pt"))
    finish(launch(2, tmp_path / "two", *argv(tmp_path / "two", updates=6)))
    run_train(train_argv(data_bin, tmp_path / "one2", *COMMON, *CLIP, "--max-update", "6",
                         "--update-freq", "2"))
    six = torch.load(tmp_path / "one2" / "checkpoint_last.pt", weights_only=True)
    for resumed in (full(tmp_path / "two" / "checkpoint_last"),
                    torch.load(tmp_path / "one_from_two" / "checkpoint_last.pt", weights_only=True)):
        assert [h["num_updates"] for h in resumed["optimizer_history"]][-2:] == [3, 6]
        assert_same_params(resumed["model"], six["model"])
        assert_same_optimizer_state(resumed, six)

    # A 4-rank set at update 3, resharded to 2 ranks, continues as the 4 ranks do.
    assert reshard.main([str(tmp_path / "four" / "checkpoint_last.pt"), str(tmp_path / "as2" / "checkpoint_last.pt"),
                         "--world-size", "2"]) == 0
    on_four = Launched(4, tmp_path / "four", argv(tmp_path / "four", updates=6))
    finish(launch(2, tmp_path / "as2", *argv(tmp_path / "as2", "--update-freq", "2", updates=6)))
    on_four.result()
    a, b = full(tmp_path / "four" / "checkpoint_last"), full(tmp_path / "as2" / "checkpoint_last")
    assert_same_params(b["model"], a["model"])
    assert_same_optimizer_state(b, a)


def bad_input(data_bin, tmp_path, base):
    import shutil

    from fairseq_moe.errors import CheckpointError

    for case, change in (("missing", lambda r0, r1: r1.pop("dense_optimizer")),
                         ("twice", lambda r0, r1: r1["dense_optimizer"].update(r0["dense_optimizer"]))):
        bad = tmp_path / f"bad_{case}"
        bad.mkdir()
        for f in Path(base).parent.glob("checkpoint_last-*.pt"):
            shutil.copy(f, bad / f.name)
        r0, r1 = (torch.load(bad / f"checkpoint_last-rank-{r}.pt", weights_only=True) for r in (0, 1))
        change(r0, r1)
        torch.save(r1, bad / "checkpoint_last-rank-1.pt")
        before = {f.name: f.read_bytes() for f in bad.iterdir()}
        with pytest.raises(CheckpointError) as err:
            run_train(train_argv(data_bin, bad, *COMMON, *ZERO, "--max-update", "6", "--update-freq", "2"))
        assert "checkpoint_last-rank-1.pt" in str(err.value) and len(str(err.value).splitlines()) == 1
        assert ("lacks its share" if case == "missing" else "both hold") in str(err.value), err.value
        assert {f.name: f.read_bytes() for f in bad.iterdir()} == before


@pytest.mark.parametrize("settings", [
    dict(lr=0.01, scale_parameter=False, relative_step=False),  # fairseq's defaults: an external lr
    dict(lr=0.01, scale_parameter=False, relative_step=False, beta1=0.9, weight_decay=0.1, clip_threshold=0.5),
    dict(lr=None, scale_parameter=True, relative_step=True),  # Adafactor's paper: relative steps, scaled by RMS
    dict(lr=None, scale_parameter=True, relative_step=True, warmup_init=True),
])
def test_adafactor_steps_each_expert_as_fairseq_steps_a_parameter_of_its_own(settings):
    """--optimizer adafactor on a stacked expert tensor [E, ...] (marked .expert) and a dense one: fairseq's own
    Adafactor on each expert's slice as a separate parameter gives the same parameters after 4 steps; the state is
    [E, ...] throughout (a set cuts it per expert)."""
    from fairseq.optim.adafactor import Adafactor as fairseq_adafactor

    from fairseq_moe.hooks.optim import expert_adafactor_class

    g = torch.Generator().manual_seed(0)
    E = 3
    w = torch.nn.Parameter(torch.randn(E, 5, 4, generator=g))
    b = torch.nn.Parameter(torch.randn(E, 4, generator=g))
    dense = torch.nn.Parameter(torch.randn(6, 5, generator=g))
    for p in (w, b):
        p.expert = True
    ours = expert_adafactor_class()([w, b, dense], **settings)
    theirs = [torch.nn.Parameter(t.detach().clone()) for t in (*w, *b, dense)]
    reference = fairseq_adafactor(theirs, **settings)
    for _ in range(4):
        grads = [torch.randn(t.shape, generator=g) for t in (w, b, dense)]
        for p, grad in zip((w, b, dense), grads):
            p.grad = grad.clone()
        for p, grad in zip(theirs, (*grads[0], *grads[1], grads[2])):
            p.grad = grad.clone()
        ours.step()
        reference.step()
    torch.testing.assert_close(w.detach(), torch.stack([t.detach() for t in theirs[:E]]), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(b.detach(), torch.stack([t.detach() for t in theirs[E:2 * E]]), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(dense.detach(), theirs[-1].detach(), rtol=0, atol=0)
    for p in (w, b):
        for key, value in ours.state[p].items():
            assert not torch.is_tensor(value) or value.dim() == 0 or value.shape[0] == E, key


EXACT = ("--moe-capacity-factor", "0", "--dropout", "0", "--attention-dropout", "0", "--moe-expert-count", "4",
         "--required-batch-size-multiple", "1", *CLIP)  # (dropless, no dropout: W ranks can equal one process)
ADAFACTOR = ("--optimizer", "adafactor", "--lr", "0.01", *EXACT)
# The key projections' biases have an exactly-zero gradient (softmax ignores a shift): Adafactor, which divides by
# the gradient's RMS, turns its float rounding into full steps of random sign, on one process as on W ranks.
NOISE = ".k_proj.bias"


def assert_same_but_noise(b, a):
    """Parameters and Adafactor state of two full checkpoints, the key biases' left out."""
    keep = [n for n in a["model"] if not n.endswith(NOISE)]
    assert_same_params({n: b["model"][n] for n in keep}, {n: a["model"][n] for n in keep})
    order = [n for n in a["model"] if not n.endswith(".version")]  # (fairseq's parameter order: the optimizer's)
    noise = {i for i, n in enumerate(order) if n.endswith(NOISE)}
    sa, sb = a["last_optimizer_state"]["state"], b["last_optimizer_state"]["state"]
    assert sorted(sa) == sorted(sb)
    for index in set(sa) - noise:
        for key, value in sa[index].items():
            if torch.is_tensor(value):
                torch.testing.assert_close(sb[index][key], value, rtol=1e-5, atol=1e-7, msg=f"{index} {key}")


@pytest.mark.slow
def test_adafactor_with_spread_experts(data_bin, tmp_path):
    """2 ranks (with --zero-sharding os) and 4 ranks (one expert each) == 1 process; the 2-rank set resumes on one
    process, and the 1-process checkpoint on 2 ranks (each expert's statistics cut out), 3 + 2 updates == 5."""
    def argv(save, updates, *extra):
        return train_argv(data_bin, save, *ADAFACTOR, "--max-update", str(updates), *extra)

    two = Launched(2, tmp_path / "two", argv(tmp_path / "two", 3, "--zero-sharding", "os"))
    run_train(argv(tmp_path / "one", 3, "--update-freq", "2"))
    two.result()
    a, b = torch.load(tmp_path / "one" / "checkpoint_last.pt", weights_only=True), full(tmp_path / "two" /
                                                                                        "checkpoint_last")
    w1 = b["extra_state"]["moe_checkpoint"]["optimizer_index"]["encoder.layers.1.fc1.moe.experts.w1"]
    assert b["last_optimizer_state"]["state"][w1]["exp_avg_sq_row"].shape[0] == 4  # (per expert, all 4)
    assert_same_but_noise(b, a)
    four = Launched(4, tmp_path / "four", argv(tmp_path / "four", 3))
    run_train(argv(tmp_path / "one4", 3, "--update-freq", "4"))
    four.result()
    assert_same_but_noise(full(tmp_path / "four" / "checkpoint_last"),
                          torch.load(tmp_path / "one4" / "checkpoint_last.pt", weights_only=True))
    (tmp_path / "one_from_two").mkdir()
    run_train(argv(tmp_path / "one_from_two", 5, "--update-freq", "2", "--restore-file",
                   str(tmp_path / "two" / "checkpoint_last.pt")))
    finish(launch(2, tmp_path / "two_from_one", *argv(tmp_path / "two_from_one", 5, "--restore-file",
                                                      str(tmp_path / "one" / "checkpoint_last.pt"))))
    run_train(argv(tmp_path / "one", 5, "--update-freq", "2"))
    five = torch.load(tmp_path / "one" / "checkpoint_last.pt", weights_only=True)
    for resumed in (torch.load(tmp_path / "one_from_two" / "checkpoint_last.pt", weights_only=True),
                    full(tmp_path / "two_from_one" / "checkpoint_last")):
        assert [h["num_updates"] for h in resumed["optimizer_history"]][-2:] == [3, 5]
        assert_same_but_noise(resumed, five)


def test_zero_keeps_the_saved_state_of_half_parameters():
    """--memory-efficient-fp16 with ZeRO: fp16 parameters keep their fp32 optimizer state through a load (torch
    would cast it: an exp_avg_sq of 1e-9 is 0 in fp16), copied out of what was loaded."""
    from fairseq_moe.hooks.optim import ExpertZeRO

    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
    zero = ExpertZeRO([{"params": [p], "lr": 0.1}], torch.optim.Adam, lr=0.1)
    saved = {"step": torch.tensor(3.0), "exp_avg": torch.full((4,), 1e-9), "exp_avg_sq": torch.full((4,), 1e-9)}
    zero.load_state_dict({"state": {0: saved}, "param_groups": [{"params": [0], "lr": 0.05}]})
    state = zero.inner.state[p]
    assert state["exp_avg_sq"].dtype == torch.float32 and state["exp_avg_sq"][0].item() == pytest.approx(1e-9)
    assert state["exp_avg"].data_ptr() != saved["exp_avg"].data_ptr()
    assert zero.param_groups[0]["lr"] == 0.05 and zero.state_dict()["state"][0]["exp_avg_sq"].dtype == torch.float32


def test_adafactor_state_of_a_stacked_bias_from_before_is_converted():
    """A run of fairseq's Adafactor on one process (before the experts were stepped each as its own) resumes: the
    stacked bias's factored statistics become its per-expert second moment, and stepping goes on."""
    from fairseq.optim.adafactor import Adafactor as fairseq_adafactor

    from fairseq_moe.hooks.optim import expert_adafactor_class

    b = torch.nn.Parameter(torch.randn(3, 4))
    b.expert = True
    old = fairseq_adafactor([b], lr=0.01, scale_parameter=False, relative_step=False)
    b.grad = torch.randn(3, 4)
    old.step()
    assert set(old.state[b]) >= {"exp_avg_sq_row", "exp_avg_sq_col"}
    new = expert_adafactor_class()([b], lr=0.01, scale_parameter=False, relative_step=False)
    new.load_state_dict(old.state_dict())
    new.step()
    assert new.state[b]["exp_avg_sq"].shape == (3, 4) and "exp_avg_sq_row" not in new.state[b]


@pytest.mark.slow
def test_zero_with_memory_efficient_fp16_is_the_unsharded_run(data_bin, tmp_path):
    """--memory-efficient-fp16 (fp16 parameters, fp32 optimizer state) on 2 ranks: with --zero-sharding os the
    parameters and the state are bit for bit those of the run without it, the state stays fp32, and so after a
    resume (3 + 3 updates). (A resumed fp16 run is not the uninterrupted one, with or without ZeRO: fairseq saves
    the loss scale but not its scaler's count since the last change.)"""
    def run(name, *extra, updates=3):
        finish(launch(2, tmp_path / name, *train_argv(data_bin, tmp_path / name, "--memory-efficient-fp16",
                                                      *EXACT, "--optimizer", "adam", "--lr", "0.001",
                                                      "--max-update", str(updates), *extra)))
        return full(tmp_path / name / "checkpoint_last")

    for updates in (3, 6):
        zero, plain = run("zero", "--zero-sharding", "os", updates=updates), run("plain", updates=updates)
        assert all(torch.equal(zero["model"][k], plain["model"][k]) for k in plain["model"])
        sz, sp = zero["last_optimizer_state"]["state"], plain["last_optimizer_state"]["state"]
        assert sorted(sz) == sorted(sp)
        for index, entry in sp.items():
            for key, value in entry.items():
                if torch.is_tensor(value):
                    assert sz[index][key].dtype == value.dtype and torch.equal(sz[index][key], value), (index, key)
        assert {v.dtype for e in sz.values() for v in e.values() if torch.is_tensor(v) and v.dim()} == {torch.float32}


def test_zero_state_dict_is_numbered_like_the_unsharded_one_across_groups():
    """Two parameter groups, an expert among them: ExpertZeRO's state dict equals torch's own optimizer's on the
    same steps (one process), and loads back into a fresh ExpertZeRO and into torch's optimizer."""
    from fairseq_moe.hooks.optim import ExpertZeRO

    def params():
        g = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (3, 5, 2, 4)]
        ps[2].expert = True
        return ps

    def groups(ps):
        return [{"params": ps[:2], "lr": 0.1}, {"params": ps[2:], "lr": 0.01}]

    ours_p, theirs_p = params(), params()
    ours, theirs = ExpertZeRO(groups(ours_p), torch.optim.Adam, lr=0.1), torch.optim.Adam(groups(theirs_p), lr=0.1)
    for step in range(2):
        for ps in (ours_p, theirs_p):
            for i, p in enumerate(ps):
                p.grad = torch.full_like(p, 0.1 * (i + 1 + step))
        ours.step()
        theirs.step()
    a, b = ours.state_dict(), theirs.state_dict()
    assert [g["params"] for g in a["param_groups"]] == [g["params"] for g in b["param_groups"]] == [[0, 1], [2, 3]]
    assert sorted(a["state"]) == sorted(b["state"]) == [0, 1, 2, 3]
    for i in b["state"]:
        for key in b["state"][i]:
            torch.testing.assert_close(a["state"][i][key], b["state"][i][key])
    again = ExpertZeRO(groups(params()), torch.optim.Adam, lr=0.1)
    again.load_state_dict(b)
    for i in b["state"]:
        torch.testing.assert_close(again.state_dict()["state"][i]["exp_avg"], b["state"][i]["exp_avg"])
    torch.optim.Adam(groups(params()), lr=0.1).load_state_dict(a)  # (the other way: torch reads ours)


def assert_bit_identical(a, b):
    """Two full checkpoints: the same parameters and optimizer state, bit for bit, the state fp32."""
    assert all(torch.equal(b["model"][k], a["model"][k]) for k in a["model"])
    sa, sb = a["last_optimizer_state"]["state"], b["last_optimizer_state"]["state"]
    assert sorted(sa) == sorted(sb) and len(sa) > 10
    for index, entry in sa.items():
        for key, value in entry.items():
            same = torch.equal(sb[index][key], value) if torch.is_tensor(value) else sb[index][key] == value
            assert same and (not torch.is_tensor(value) or value.dtype == sb[index][key].dtype), (index, key)
    assert {v.dtype for e in sb.values() for v in e.values() if torch.is_tensor(v) and v.dim()} == {torch.float32}


@pytest.mark.slow
def test_flat_fp16_with_spread_experts_is_the_run_without_the_flat_copy(data_bin, tmp_path):
    """--fp16 with its flat fp32 copy (ExpertFlatFP16Optimizer: the dense parameters flat, each expert tensor its own
    copy) on 1, 2 and 4 ranks, clipping on: parameters and Adam state after 3 updates are bit for bit those of
    --fp16-no-flatten-grads (state numbered by parameter alike); a flat set resumes without the flat copy and a
    non-flat one with it, and the two continue bit for bit alike (3 + 3 updates)."""
    def argv(name, *extra, updates=3):
        return train_argv(data_bin, tmp_path / name, *EXACT, "--fp16", "--max-update", str(updates), *extra)

    adam = ("--optimizer", "adam", "--lr", "0.003")
    for W in (1, 2, 4):
        for name, extra in ((f"flat{W}", ()), (f"plain{W}", ("--fp16-no-flatten-grads",))):
            if W == 1:
                run_train(argv(name, *adam, *extra))
            else:
                finish(launch(W, tmp_path / name, *argv(name, *adam, *extra)))
        read = (lambda name: torch.load(tmp_path / name / "checkpoint_last.pt", weights_only=True)) if W == 1 else (
            lambda name: full(tmp_path / name / "checkpoint_last"))
        assert_bit_identical(read(f"plain{W}"), read(f"flat{W}"))
    # across: the flat set on without the flat copy, the non-flat one with it
    finish(launch(2, tmp_path / "flat2", *argv("flat2", *adam, "--fp16-no-flatten-grads", updates=6)))
    finish(launch(2, tmp_path / "plain2", *argv("plain2", *adam, updates=6)))
    a, b = full(tmp_path / "flat2" / "checkpoint_last"), full(tmp_path / "plain2" / "checkpoint_last")
    assert [h["num_updates"] for h in b["optimizer_history"]][-2:] == [3, 6]
    assert_bit_identical(a, b)


def _grads(expert_grad):
    dense, expert = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    expert.expert = True
    dense.grad, expert.grad = torch.tensor([3.0, 4.0, 0.0]), expert_grad
    return [dense, expert]


def test_an_overflow_in_an_expert_gradient_makes_the_norm_inf():
    """fairseq's clip_grad_norm_ leaves the experts out of the norm (and clips them by it), so an inf in an expert's
    gradient went unseen and the fp16 scaler kept the step: with the plugin the norm is inf (fp16 skips the step)."""
    from fairseq import utils

    from fairseq_moe import patches

    fairseq_clip = patches.original("fairseq.utils", "clip_grad_norm_")
    assert fairseq_clip(_grads(torch.tensor([float("inf"), 1.0])), 0).item() == 5.0  # (what fairseq returned)
    assert utils.clip_grad_norm_(_grads(torch.tensor([1.0, 1.0])), 0).item() == 5.0
    for bad in (float("inf"), float("nan"), -float("inf")):
        assert utils.clip_grad_norm_(_grads(torch.tensor([bad, 1.0])), 0).item() == float("inf")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_finite_sees_a_bad_element_anywhere(dtype):
    """The check from each tensor's extremes (aminmax) against torch.isfinite, element by element: a NaN or an inf at
    the start, in the middle of a vectorised run, or in the tail of a tensor, in any of several tensors."""
    from fairseq_moe.hooks.optim import all_finite

    tensors = [torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype) for n in (1, 33, 4099)]
    assert all_finite(tensors).item() and all_finite([]).item() and all_finite([torch.empty(0)]).item()
    for which, t in enumerate(tensors):
        for i in sorted({0, t.numel() // 2, t.numel() - 1}):
            for bad in (float("nan"), float("inf"), -float("inf")):
                spoiled = [u.clone() for u in tensors]
                spoiled[which][i] = bad
                assert all_finite(spoiled).item() is False and not all(torch.isfinite(u).all() for u in spoiled)


def test_all_finite_takes_each_tensor_in_its_own_dtype():
    from fairseq_moe.hooks.optim import all_finite

    assert all_finite([torch.tensor([1e300, -1e300], dtype=torch.float64), torch.ones(3)]).item()


def _overflow_on_one_rank(rank, W):
    from fairseq import utils

    import fairseq_moe  # noqa: F401  (the plugin's patches, as fairseq-train loads them)

    bad = float("inf") if rank == W - 1 else 1.0  # only the last rank's expert overflows
    norm = utils.clip_grad_norm_(_grads(torch.tensor([bad, 1.0])), 0.5)
    assert norm.item() == float("inf"), (rank, norm)


@pytest.mark.slow
def test_an_overflow_in_one_ranks_expert_makes_every_ranks_norm_inf():
    """Each rank holds other experts: one rank's overflow is every rank's (a flag all-reduced), so they skip the step
    together and keep one loss scale."""
    from tests.fairseq_moe_layer.test_comm import spawn

    spawn(_overflow_on_one_rank, 2)
