"""tests/warm.py, the tests' warm starts: which commands it forks warm, and that a warm command is the
cold one (its output, exit status, signals and process group), so that the tests which use it test what users run."""
import os
import re
import signal
import subprocess
import sys

import pytest

from tests import warm
from tests.fairseq_moe.helpers import USER_DIR

BIN = os.path.dirname(sys.executable)
LAUNCH = [sys.executable, "-m", "fairseq_moe.launch", "--nproc", "2"]


def test_the_commands_it_starts_warm_and_those_it_leaves_cold(monkeypatch, tmp_path):
    env = {"PATH": "/usr/bin", "OMP_NUM_THREADS": "1"}
    train = [os.path.join(BIN, "fairseq-train"), "data", "--user-dir", USER_DIR]
    assert warm.plan(train, env) == (("alone", "fairseq_cli.train", "torch._dynamo"), env)
    assert warm.plan([*LAUNCH, "--", "fairseq-generate", "data", "--user-dir", USER_DIR], env)[0] == (
        "launch", "fairseq_cli.generate")
    faulty = tmp_path / "faulty.py"
    faulty.write_text("")
    script = [*LAUNCH, "--preload", "fairseq_cli.train", "--", sys.executable, str(faulty), "--user-dir", USER_DIR]
    assert warm.plan(script, env)[0] == ("launch", "fairseq_cli.train")
    # The launcher sets OMP_NUM_THREADS before its imports: the server imports with the value the ranks get.
    assert warm.plan([*LAUNCH, "--", *train], {"PATH": "/usr/bin"})[1]["OMP_NUM_THREADS"] == str(
        max(1, os.cpu_count() // 2))
    assert warm.plan([*LAUNCH, "--threads", "1", "--", *train], {"PATH": "/usr/bin"})[1]["OMP_NUM_THREADS"] == "1"
    cold = [
        [os.path.join(BIN, "fairseq-train"), "data"],  # no plugin: fairseq's own start-up
        [os.path.join(BIN, "fairseq-train"), "data", "--user-dir", os.path.relpath(USER_DIR)],  # resolved by fairseq
        [*LAUNCH, "--start", "exec", "--", *train],
        [*LAUNCH, "--no-such-option", "--", *train],  # (the launcher's usage error, printed cold)
        [*LAUNCH, "--", sys.executable, str(faulty), "--user-dir", USER_DIR],  # nothing imported before the fork
        [sys.executable, "-c", "print()"],
        [os.path.join(BIN, "torchrun"), "--nproc-per-node", "2", *train],
        ["bash", "-c", " ".join(train)],
    ]
    assert [warm.plan(cmd, env) for cmd in cold] == [None] * len(cold)
    monkeypatch.setenv("FAIRSEQ_MOE_TESTS_COLD", "1")
    assert warm.plan(train, env) is None


def _server_of(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])  # (the field after the state: the parent's pid)


def _logless(text):
    """The lines without fairseq's timestamps, sorted (2 ranks write to one pipe in either order)."""
    return sorted(re.sub(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \| ", "", line) for line in text.splitlines())


@pytest.mark.slow
def test_a_warm_command_is_the_cold_one(data_bin, tmp_path):
    """fairseq-generate refusing a checkpoint that does not exist: the same exit status, stdout and stderr
    (the log's timestamps and the ranks' interleaving aside), alone and on 2 ranks, warm and cold."""
    argv = ["fairseq-generate", data_bin, "--user-dir", USER_DIR, "--path", str(tmp_path / "none.pt"), "--task",
            "moe_translation", "--gen-subset", "test", "--cpu"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for cmd in ([os.path.join(BIN, argv[0]), *argv[1:]], [*LAUNCH, "--", *argv]):
        cold = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        hot = warm.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        assert cold.returncode == hot.returncode == 2, cold.stderr[-2000:] + hot.stderr[-2000:]
        assert _logless(hot.stdout) == _logless(cold.stdout)
        assert _logless(hot.stderr) == _logless(cold.stderr)
        assert "none.pt" in cold.stderr


@pytest.mark.slow
def test_a_warm_command_has_its_own_pid_group_and_exit_status(data_bin, trained_checkpoint, tmp_path):
    """fairseq-interactive waiting on its stdin: a process of its own, a group leader with start_new_session,
    forked by the server (not this process's child); killed by a signal sent to its group, it reports it as
    subprocess does (-SIGTERM)."""
    cmd = [os.path.join(BIN, "fairseq-interactive"), data_bin, "--user-dir", USER_DIR, "--path",
           str(trained_checkpoint), "--task", "moe_translation", "--source-lang", "src", "--target-lang", "tgt",
           "--cpu"]
    proc = warm.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                      env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
    assert isinstance(proc, warm.WarmPopen) and proc.poll() is None
    assert os.getpgid(proc.pid) == proc.pid and _server_of(proc.pid) != os.getpid()
    with pytest.raises(ChildProcessError):
        os.waitpid(proc.pid, os.WNOHANG)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM, err[-2000:]
    done = warm.run([*cmd, "--input", os.devnull], capture_output=True, text=True, timeout=300,
                    env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]


def _note_rank(rank, folder, fail_on):
    if rank == fail_on:
        raise ValueError(f"rank {rank} fails")
    with open(os.path.join(folder, str(rank)), "w") as f:
        f.write(f"{os.getpid()} {os.getppid()}")


def test_spawn_runs_fn_on_every_rank_and_fails_as_torch_spawn_does(tmp_path):
    """warm.spawn(fn, W, args): fn(rank, *args) in W processes forked by a server, not this process; a rank that
    raises makes it raise torch's ProcessExitedException naming that rank, as torch.multiprocessing.spawn does."""
    import torch.multiprocessing as mp

    warm.spawn(_note_rank, 3, (str(tmp_path), None))
    pids = [tuple(map(int, (tmp_path / str(rank)).read_text().split())) for rank in range(3)]
    assert len({pid for pid, _ in pids}) == 3 and {parent for _, parent in pids} != {os.getpid()}
    (tmp_path / "second").mkdir()
    with pytest.raises(mp.ProcessExitedException, match="process 1 terminated with exit code 1") as failed:
        warm.spawn(_note_rank, 2, (str(tmp_path / "second"), 1))
    assert failed.value.error_index == 1


def test_a_servers_environment_is_the_start_ups():
    """The rank's variables and what the suite sets in its own process after start-up stay out of a server's key;
    what a start-up reads stays in (another PYTHONWARNINGS sets other filters)."""
    env = {"OMP_NUM_THREADS": "1", "RANK": "1", "PYTEST_CURRENT_TEST": "x", "TORCHINDUCTOR_CACHE_DIR": "/tmp/i",
           "PYTHONWARNINGS": "ignore:semaphore_tracker:UserWarning"}
    assert warm._start_env(env) == {"OMP_NUM_THREADS": "1"}
    assert warm._start_env({"PYTHONWARNINGS": "error"}) == {"PYTHONWARNINGS": "error"}
