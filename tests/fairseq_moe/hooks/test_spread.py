"""fairseq-generate on W ranks with the experts spread (spread.py) gives, sentence by sentence, what one
process gives from the same checkpoint: the same hypotheses and scores, the same BLEU; a set saved by 2 ranks
generates on 2 and on 4 ranks (cut on load; 4: one expert per rank, and a rank whose shard is empty), a
hash-routed single file on 2. Beam search runs a different number of steps on each rank, and every rank leaves
together. --eval-bleu in training on 2 ranks gives one process's BLEU."""
import os
import sys

import pytest

from tests import warm
from tests.fairseq_moe.helpers import USER_DIR, error_lines, run_train, tail, train_argv
from tests.fairseq_moe.hooks.test_trainer_expert_parallel import COMMON, launch, finish

GENERATE = ("--task", "moe_translation", "--gen-subset", "test", "--beam", "4", "--batch-size", "8", "--cpu")


def generate(data_bin, path, W, *extra):
    """fairseq-generate on W ranks (1: fairseq's own, one process): its CompletedProcess."""
    argv = ["fairseq-generate", data_bin, "--user-dir", USER_DIR, "--path", str(path), *GENERATE, *extra]
    cmd = argv if W == 1 else [sys.executable, "-m", "fairseq_moe.launch", "--nproc", str(W), "--", *argv]
    if W == 1:
        cmd = [os.path.join(os.path.dirname(sys.executable), "fairseq-generate"), *argv[1:]]
    return warm.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                    timeout=600)


def sentences(stdout):
    """{"H-12": [(score, text), ...], "P-12": [...], ...} (several with --nbest) and the BLEU line, from
    generate's output."""
    lines, bleu = {}, [line for line in stdout.splitlines() if line.startswith("Generate test")]
    for line in stdout.splitlines():
        if line[:2] in ("S-", "T-", "H-", "D-", "P-"):
            key, rest = line.split("\t", 1)
            lines.setdefault(key, []).append(rest)
    return lines, bleu


def assert_same(one, many, nbest=1, count=20):
    """The lines of count sentences (S, T, H, D, P each) and the BLEU line: the same in both outputs (scores within
    1e-5, positional scores within 1e-4)."""
    a, bleu_a = sentences(one)
    b, bleu_b = sentences(many)
    assert a.keys() == b.keys() and len(a) == 5 * count
    for key in a:
        assert len(a[key]) == len(b[key]) == (nbest if key[0] in "HDP" else 1), key
        for x, y in zip(a[key], b[key]):
            if key[0] in "HD":
                (sx, tx), (sy, ty) = x.split("\t"), y.split("\t")
                assert tx == ty and float(sx) == pytest.approx(float(sy), abs=1e-5), key
            elif key[0] == "P":
                assert [float(v) for v in x.split()] == pytest.approx([float(v) for v in y.split()], abs=1e-4), key
            else:
                assert x == y, key
    assert len(bleu_a) == len(bleu_b) == 1 and bleu_a == bleu_b


@pytest.fixture(scope="module")
def spread_set(data_bin, tmp_path_factory):
    """checkpoint_last of a 2-rank run (4 experts, top-2): a set."""
    save = tmp_path_factory.mktemp("spread_set")
    finish(launch(2, save, *train_argv(data_bin, save, *COMMON)))
    return save / "checkpoint_last.pt"


@pytest.mark.slow
@pytest.mark.parametrize("W, extra", [(2, ()), (4, ()), (2, ("--nbest", "2")), (2, ("--score-reference",))],
                         ids=["2", "4", "2-nbest", "2-score-reference"])
def test_a_set_generates_on_w_ranks_as_on_one_process(data_bin, spread_set, W, extra):
    one, many = generate(data_bin, spread_set, 1, *extra), generate(data_bin, spread_set, W, *extra)
    assert one.returncode == 0 and many.returncode == 0, tail(one.stderr + many.stderr)
    assert_same(one.stdout, many.stdout, nbest=2 if "--nbest" in extra else 1)


@pytest.mark.slow
def test_a_hash_routed_file_generates_on_two_ranks_as_on_one_process(data_bin, tmp_path):
    """A single file of one process (hash routing, k = 1): each rank cuts its experts out of it."""
    run_train(train_argv(data_bin, tmp_path, "--max-update", "3", "--moe-expert-count", "4", "--moe-routing",
                         "hash", "--moe-top-k", "1", "--required-batch-size-multiple", "1"))
    path = tmp_path / "checkpoint_last.pt"
    one, many = generate(data_bin, path, 1), generate(data_bin, path, 2, "--results-path", str(tmp_path / "out"))
    assert one.returncode == 0 and many.returncode == 0, tail(one.stderr + many.stderr)
    assert many.stdout.strip() == ""  # (all of it went to the results file, once)
    assert_same(one.stdout, (tmp_path / "out" / "generate-test.txt").read_text())


@pytest.mark.slow
def test_per_layer_expert_counts_generate_on_four_ranks_as_on_one_process(data_bin, tmp_path):
    """--moe-expert-count 2,4 (the encoder's MoE layer 2 experts, the decoder's 4), a file of one process: on 4 ranks
    the encoder's experts have 2 replicas each and the decoder's none (two expert-parallel sizes, whose layers meet
    in one lockstep while the beam searches differ)."""
    run_train(train_argv(data_bin, tmp_path, "--max-update", "3", "--moe-expert-count", "2,4",
                         "--required-batch-size-multiple", "1"))
    path = tmp_path / "checkpoint_last.pt"
    one, many = generate(data_bin, path, 1), generate(data_bin, path, 4)
    assert one.returncode == 0 and many.returncode == 0, tail(one.stderr + many.stderr)
    assert_same(one.stdout, many.stdout)
    # resharded into a set of 4 ranks, which 2 ranks read (each layer's experts cut again): the same
    from fairseq_moe import reshard

    assert reshard.main([str(path), str(tmp_path / "set" / "model.pt"), "--world-size", "4"]) == 0
    again = generate(data_bin, tmp_path / "set" / "model.pt", 2)
    assert again.returncode == 0, tail(again.stderr)
    assert_same(one.stdout, again.stdout)


@pytest.mark.slow
def test_ranks_that_do_not_divide_the_experts_are_one_line(data_bin, spread_set):
    out = generate(data_bin, spread_set, 3)
    errors = error_lines(out.stderr)
    assert out.returncode == 2 and len(errors) == 1 and "--moe-expert-count 4" in errors[0], tail(out.stderr)


# (max_len_b 20: the targets have at most 12 tokens, and a barely trained model's searches would run to fairseq's 200)
EVAL_BLEU = ("--eval-bleu", "--eval-bleu-detok", "space", "--eval-bleu-args", '{"beam": 2, "max_len_b": 20}')
# One update per epoch, a validation (with its BLEU) after each: 12 BLEUs, several of them far from 0.
BLEU_RUN = (*COMMON, "--max-update", "12", "--max-tokens", "1600", *EVAL_BLEU)


def valid_bleus(log):
    """The BLEU of every validation in a training log."""
    found = [line.split("| bleu ")[1].split()[0] for line in log.splitlines() if "| bleu " in line and "valid" in line]
    assert found, log[-3000:]
    return [float(x) for x in found]


@pytest.mark.slow
def test_eval_bleu_on_two_ranks_is_the_bleu_of_one_process(data_bin, tmp_path):
    """--eval-bleu with the experts spread (the task's valid_step keeps the layers in lockstep): every
    validation BLEU of the 2-rank run is the 1-process run's with the same global batch (--update-freq 2), and so
    with --ddp-backend fully_sharded (each layer its own unit; the beam search runs with every unit gathered, since
    the ranks' searches take different numbers of steps)."""
    many = launch(2, tmp_path / "many", *train_argv(data_bin, tmp_path / "many", *BLEU_RUN))
    sharded = launch(2, tmp_path / "fsdp", *train_argv(data_bin, tmp_path / "fsdp", *BLEU_RUN, "--ddp-backend",
                                                       "fully_sharded", "--min-params-to-wrap", "0"))
    one = warm.run([os.path.join(os.path.dirname(sys.executable), "fairseq-train"),
                    *train_argv(data_bin, tmp_path / "one", *BLEU_RUN, "--update-freq", "2")],
                   capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=600)
    assert one.returncode == 0, tail(one.stderr)
    out, fsdp = finish(many), finish(sharded)
    bleus = valid_bleus(one.stdout + one.stderr)
    assert len(bleus) == 12 and max(bleus) > 0.5
    assert valid_bleus(out.stdout + out.stderr) == bleus
    assert "fully_sharded (torch's FSDP)" in fsdp.stderr + fsdp.stdout
    assert valid_bleus(fsdp.stdout + fsdp.stderr) == bleus


@pytest.mark.slow
def test_an_upcycled_top1_file_generates_on_two_ranks_as_on_one_process(data_bin, tmp_path):
    """An upcycled file (python -m fairseq_moe.upcycle: no expert manifest), top-1, MoE in every layer."""
    from fairseq_moe import upcycle

    from tests.fairseq_moe.test_upcycle import dense_argv

    pairs = zip(COMMON[::2], COMMON[1::2])
    argv = [x for flag, value in pairs if not flag.startswith("--moe-") for x in (flag, value)]
    run_train(dense_argv(train_argv(data_bin, tmp_path / "dense", *argv, "--max-update", "3"), "transformer",
                         "translation", "label_smoothed_cross_entropy"))
    path = tmp_path / "moe.pt"
    assert upcycle.main([str(tmp_path / "dense" / "checkpoint_last.pt"), str(path), "--experts", "4", "--top-k", "1",
                         "--moe-freq", "1"]) == 0
    one, many = generate(data_bin, path, 1), generate(data_bin, path, 2)
    assert one.returncode == 0 and many.returncode == 0, tail(one.stderr + many.stderr)
    assert_same(one.stdout, many.stdout)


DIES = """
import os, signal, sys
import fairseq_moe_layer.layer as layer
from fairseq_cli.generate import cli_main
if os.environ["RANK"] == "1":  # killed in its 5th MoE layer call: in the middle of a beam search
    forward, calls = layer.MoELayer.forward, []
    def dying(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        return forward(self, *args, **kwargs)
    layer.MoELayer.forward = dying
sys.argv[0] = "fairseq-generate"
sys.exit(cli_main())
"""


@pytest.mark.slow
def test_a_rank_killed_mid_generation_stops_the_job_with_a_line(data_bin, spread_set, tmp_path):
    import time

    script = tmp_path / "dies.py"
    script.write_text(DIES)
    start = time.monotonic()
    out = warm.run([sys.executable, "-m", "fairseq_moe.launch", "--nproc", "2", "--grace-seconds", "5",
                    "--preload", "fairseq_cli.generate", "--", sys.executable, str(script), data_bin,
                    "--user-dir", USER_DIR, "--path", str(spread_set),
                    *GENERATE], capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                   timeout=300)
    assert out.returncode != 0 and time.monotonic() - start < 120, tail(out.stderr)
    assert "rank 1 of 2 ended with signal SIGKILL" in out.stderr, tail(out.stderr)


@pytest.mark.slow
def test_interactive_on_two_ranks_prints_what_one_process_prints(data_bin, spread_set):
    """fairseq-interactive on 2 ranks, input on stdin: rank 0 reads it and shares each buffer; the same S/H/D/P
    lines as one process, once."""
    text = "a b c\nd e f g h i j k l m n o p q r s t\nk\nq r s a b c d\n"
    argv = ["fairseq-interactive", data_bin, "--user-dir", USER_DIR, "--path", str(spread_set), "--task",
            "moe_translation", "--source-lang", "src", "--target-lang", "tgt", "--beam", "4", "--cpu",
            "--buffer-size", "2", "--batch-size", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    one = warm.run([os.path.join(os.path.dirname(sys.executable), argv[0]), *argv[1:]], input=text,
                   capture_output=True, text=True, env=env, timeout=600)
    many = warm.run([sys.executable, "-m", "fairseq_moe.launch", "--nproc", "2", "--", *argv], input=text,
                    capture_output=True, text=True, env=env, timeout=600)
    assert one.returncode == 0 and many.returncode == 0, tail(one.stderr + many.stderr)

    def lines(out):
        return [line for line in out.splitlines() if line[:2] in ("S-", "H-", "D-", "P-")]

    a, b = lines(one.stdout), lines(many.stdout)
    assert len([x for x in a if x.startswith("H-")]) == 4 and len(a) == len(b)
    for x, y in zip(a, b):  # the same lines in the same order; scores within float rounding
        (kx, *rest_x), (ky, *rest_y) = x.split("\t"), y.split("\t")
        assert kx == ky and (rest_x[-1] == rest_y[-1] if kx[0] in "SHD" else True), (x, y)
        if kx[0] in "HD":
            assert float(rest_x[0]) == pytest.approx(float(rest_y[0]), abs=1e-5), (x, y)
        if kx[0] == "P":
            assert [float(v) for v in rest_x[0].split()] == pytest.approx([float(v) for v in rest_y[0].split()],
                                                                          abs=1e-4), (x, y)


@pytest.mark.slow
def test_sampling_on_two_ranks_is_repeatable(data_bin, spread_set):
    """--sampling with a seed on 2 ranks: every sentence once, and the same samples in a second run (one process
    draws in another order, so its samples differ)."""
    runs = [generate(data_bin, spread_set, 2, "--sampling", "--beam", "1", "--nbest", "1", "--seed", "7")
            for _ in range(2)]
    assert all(out.returncode == 0 for out in runs), tail(runs[0].stderr + runs[1].stderr)
    first, _ = sentences(runs[0].stdout)
    assert len([key for key in first if key.startswith("H-")]) == 20
    assert sentences(runs[1].stdout) == sentences(runs[0].stdout)
