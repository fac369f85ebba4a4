"""fairseq_moe.launch stops its ranks: a signal sent to the launcher reaches every rank, a rank that
ignores it is killed after --grace-seconds, a failed rank stops the others, and the ranks die with a
launcher killed by SIGKILL. No rank is left running.

The ranks are tiny Python programs, not fairseq: each writes its pid to <dir>/<RANK> and sleeps. The
launcher appends its distributed flags to their argv, where they are ignored. The launcher is loaded
from its file, not as fairseq_moe.launch: importing the package imports fairseq, seconds per test.
"""
import importlib.util
import os
import signal
import subprocess
import sys
import time

import pytest

RANK = r"""
import os, signal, sys, time
folder, mode = sys.argv[1], sys.argv[2]
rank = os.environ["RANK"]
if mode == "ignore-term" and rank == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(os.path.join(folder, rank + ".tmp"), "w") as f:
    f.write(str(os.getpid()))
os.replace(os.path.join(folder, rank + ".tmp"), os.path.join(folder, rank))  # whole, or not there
if mode == "fail" and rank == "1":
    while not os.path.exists(os.path.join(folder, "0")):  # rank 0 runs first, so it has a pid to check
        time.sleep(0.01)
    sys.exit(3)
if mode == "exit":
    sys.exit(0)
time.sleep(120)
"""

LAUNCH_PY = os.path.join(importlib.util.find_spec("fairseq_moe").submodule_search_locations[0], "launch.py")

# python -c LAUNCHER LAUNCH_PY FOLDER PATCH ARGS...: the launcher's main(ARGS). With PATCH "signal",
# its start_rank sends the launcher SIGTERM right after it has started rank 0: a signal that comes while
# ranks start. Every rank it starts has its pid recorded in FOLDER/started.
LAUNCHER = r"""
import importlib.util, os, signal, subprocess, sys
path, folder, patch, *args = sys.argv[1:]
spec = importlib.util.spec_from_file_location("launch", path)
launch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launch)
start_rank = launch.start_rank
def recorded(*rank_args):
    rank = start_rank(*rank_args)
    with open(os.path.join(folder, "started"), "a") as f:
        f.write(f"{rank.pid}\n")
    if patch == "signal":
        os.kill(os.getpid(), signal.SIGTERM)
    return rank
launch.start_rank = recorded
sys.exit(launch.main(args))
"""

NPROC = 3
TIMEOUT = 20  # seconds; nothing here should come near it


@pytest.fixture(params=["fork", "exec"])
def run(tmp_path, request):
    """start(*launcher_args, mode=..., ignored=(signals)) -> the launcher's Popen, its ranks forked from it or each
    its own program (--start: every test runs both ways); at teardown nothing it started survives. The launcher
    starts with the forwarded signals at their defaults, except `ignored` (pytest itself may run with SIGINT
    ignored: a shell's background job)."""
    started = []

    def start(*launcher_args, mode="sleep", patch="none", ignored=()):
        def dispositions():
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(signum, signal.SIG_IGN if signum in ignored else signal.SIG_DFL)

        launcher = [sys.executable, "-c", LAUNCHER, LAUNCH_PY, str(tmp_path), patch]
        rank = [sys.executable, "-c", RANK, str(tmp_path), mode]
        proc = subprocess.Popen([*launcher, "--nproc", str(NPROC), "--start", request.param, *launcher_args, "--",
                                 *rank],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                preexec_fn=dispositions)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)
    for pid in pids(tmp_path):
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # the pid is another user's now
        return False
    try:  # a zombie (dead, not yet reaped by whoever inherited it) is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def pids(folder):
    return [int((folder / name).read_text()) for name in os.listdir(folder) if name.isdigit()]


def wait_for(condition, what, timeout=TIMEOUT):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def wait_ranks_up(folder, launcher):
    wait_for(lambda: len(pids(folder)) == NPROC or launcher.poll() is not None, "the ranks to start")
    assert launcher.poll() is None, launcher.communicate()[0]
    return pids(folder)


def finish(launcher):
    output, _ = launcher.communicate(timeout=TIMEOUT)
    return launcher.returncode, output


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_signal_to_launcher_stops_every_rank(run, tmp_path, signum):
    launcher = run()
    ranks = wait_ranks_up(tmp_path, launcher)
    launcher.send_signal(signum)
    code, output = finish(launcher)
    assert code == 128 + signum, output
    assert not [pid for pid in ranks if alive(pid)]


def test_ignored_hangup_stays_ignored(run, tmp_path):
    """Under nohup, a hangup must not stop the run: neither the launcher nor its ranks."""
    launcher = run(ignored=(signal.SIGHUP,))
    ranks = wait_ranks_up(tmp_path, launcher)
    launcher.send_signal(signal.SIGHUP)
    time.sleep(0.5)
    for pid in ranks:
        os.kill(pid, signal.SIGHUP)
    time.sleep(0.5)
    assert launcher.poll() is None and all(alive(pid) for pid in ranks)
    launcher.send_signal(signal.SIGTERM)
    assert finish(launcher)[0] == 128 + signal.SIGTERM


def test_rank_ignoring_sigterm_is_killed_after_grace_period(run, tmp_path):
    grace = 1.5
    launcher = run("--grace-seconds", str(grace), mode="ignore-term")
    ranks = wait_ranks_up(tmp_path, launcher)
    sent = time.monotonic()
    launcher.send_signal(signal.SIGTERM)
    code, output = finish(launcher)
    assert code == 128 + signal.SIGTERM, output
    assert time.monotonic() - sent >= grace - 0.1  # rank 1 got its grace period
    assert not [pid for pid in ranks if alive(pid)]


@pytest.mark.slow
def test_failed_rank_stops_the_others_and_its_code_is_returned(run, tmp_path):
    launcher = run(mode="fail")
    code, output = finish(launcher)
    assert code == 3, output
    ranks = pids(tmp_path)
    assert len(ranks) >= 2 and not [pid for pid in ranks if alive(pid)]


def test_signal_while_ranks_start_stops_the_launch(run, tmp_path):
    launcher = run(patch="signal")
    code, output = finish(launcher)
    assert code == 128 + signal.SIGTERM, output
    started = [int(line) for line in (tmp_path / "started").read_text().split()]
    assert len(started) == 1  # no rank is started after the signal
    assert not alive(started[0])


def test_all_ranks_succeed(run, tmp_path):
    code, output = finish(run(mode="exit"))
    assert code == 0, output
    assert len(pids(tmp_path)) == NPROC


@pytest.mark.parametrize("mode", ["sleep", "ignore-term"])
def test_ranks_die_with_a_launcher_killed_by_sigkill(run, tmp_path, mode):
    """SIGKILL cannot be passed on: the kernel stops the ranks (parent-death signal), even one that ignores
    SIGTERM, so no orphan trains on into the folder of the next launch."""
    launcher = run(mode=mode)
    ranks = wait_ranks_up(tmp_path, launcher)
    launcher.kill()
    launcher.wait(TIMEOUT)
    wait_for(lambda: not [pid for pid in ranks if alive(pid)], "the ranks to die with the launcher", timeout=5)


@pytest.mark.slow
def test_a_launch_inside_an_srun_step_keeps_its_own_ranks(tmp_path):
    """python -m fairseq_moe.launch inside an srun step (here a hand-made one whose tasks could never be one step:
    SLURM_PROCID 5 of 2): its ranks are the launcher's, meeting at its port; the step's variables are not read."""
    from tests.fairseq_moe.hooks.test_compat_slurm_env import TASK, TASK_SCRIPT

    (tmp_path / "task.py").write_text(TASK_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "FAIRSEQ_MOE_"))}
    env.update(TASK, SLURM_PROCID="5", OMP_NUM_THREADS="1",
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    out = subprocess.run([sys.executable, LAUNCH_PY, "--nproc", "2", "--", "python", "task.py", "1"], cwd=tmp_path,
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert sorted(line.split()[1] for line in out.stdout.splitlines()) == ["0", "1"], out.stdout


def load_launch():
    spec = importlib.util.spec_from_file_location("launch", LAUNCH_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_what_a_forked_rank_can_run():
    """--start fork runs in the launcher's interpreter only what that interpreter would run: this environment's console
    scripts with this plugin as their --user-dir (another fairseq_moe folder is fairseq's error, a missing one would
    leave the plugin acting where it was not asked), and python SCRIPT/-c/-m of this very interpreter."""
    launch = load_launch()
    bin_dir = os.path.dirname(os.path.abspath(sys.executable))
    train = os.path.join(bin_dir, "fairseq-train")
    here = os.path.dirname(LAUNCH_PY)
    modules, _ = launch.in_process([train, "data", "--user-dir", here], [])
    assert modules[:2] == ["fairseq_cli.train", "torch._dynamo"]  # (the tool's module first, as its script has it)
    assert launch.in_process([train, "data", f"--user-dir={here}"], ["x"])[0][-1] == "x"
    assert launch.in_process([train, "data", "--user-dir", "/elsewhere/fairseq_moe"], []) is None
    assert launch.in_process([train, "data"], []) is None
    assert launch.in_process(["/usr/bin/fairseq-train", "data", "--user-dir", here], []) is None
    assert launch.in_process([sys.executable, "-c", "pass"], ["m"])[0] == ["m"]
    assert launch.in_process([train, "--user-dir", "/elsewhere/fairseq_moe", "--user-dir", here], []) is not None
    assert launch.in_process([sys.executable, "-m", "json.tool"], [])[0] == []
    assert launch.in_process([sys.executable, LAUNCH_PY], [])[0] == []
    assert launch.in_process([sys.executable, "-u", "-c", "pass"], []) is None
    assert launch.in_process([sys.executable], []) is None
    assert launch.in_process(["/no/such/python", "-c", "pass"], []) is None


@pytest.mark.parametrize("form", ["-c", "-m", "script"])
def test_a_forked_rank_runs_as_its_program_would(tmp_path, form):
    """A forked rank sees what the same rank exec'd sees: its argv, sys.path[0], environment, __name__, and ends with
    the same exit status; its atexit functions and non-daemon threads run to the end."""
    code = ("import atexit, json, os, sys, threading, time\n"
            "def late():\n    time.sleep(0.3)\n    open(os.path.join(sys.argv[1], 'thread' + os.environ['RANK']), 'w').close()\n"
            "threading.Thread(target=late).start()\n"
            "atexit.register(lambda: open(os.path.join(sys.argv[1], 'atexit' + os.environ['RANK']), 'w').close())\n"
            "open(os.path.join(sys.argv[1], 'unclosed' + sys.argv[2] + os.environ['RANK']), 'w').write('kept')\n"
            "seen = dict(argv=sys.argv[3:], path0=sys.path[0], rank=os.environ['RANK'], name=__name__,\n"
            "            world=os.environ['WORLD_SIZE'], omp=os.environ['OMP_NUM_THREADS'])\n"
            "with open(os.path.join(sys.argv[1], sys.argv[2] + os.environ['RANK']), 'w') as f:\n    json.dump(seen, f)\n"
            "if 'xml.dom.minidom' in sys.modules:\n"
            "    open(os.path.join(sys.argv[1], 'forked' + sys.argv[2] + os.environ['RANK']), 'w').close()\n"
            "sys.exit(0)\n")
    (tmp_path / "rankmod.py").write_text(code)
    program = {"-c": ["-c", code], "-m": ["-m", "rankmod"], "script": [str(tmp_path / "rankmod.py")]}[form]
    for start in ("exec", "fork"):
        # (a module no rank imports: there in a rank's sys.modules only if the rank was forked from the launcher)
        out = subprocess.run([sys.executable, LAUNCH_PY, "--nproc", "2", "--start", start, "--preload",
                              "xml.dom.minidom", "--", sys.executable, *program, str(tmp_path), start], cwd=tmp_path,
                             capture_output=True, text=True, timeout=TIMEOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert out.returncode == 0, out.stderr
    for rank in "01":
        assert (tmp_path / f"exec{rank}").read_text() == (tmp_path / f"fork{rank}").read_text()
        assert (tmp_path / f"thread{rank}").exists() and (tmp_path / f"atexit{rank}").exists()
        assert (tmp_path / f"unclosedfork{rank}").read_text() == "kept"  # (flushed as the interpreter ends)
        assert (tmp_path / f"forkedfork{rank}").exists() and not (tmp_path / f"forkedexec{rank}").exists()


def test_a_module_to_preload_that_is_missing_is_one_line():
    out = subprocess.run([sys.executable, LAUNCH_PY, "--nproc", "2", "--preload", "no_such_module_here", "--",
                          sys.executable, "-c", "pass"], capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 2 and out.stderr.splitlines()[-1].endswith(
        "error: --preload no_such_module_here: No module named 'no_such_module_here'"), out.stderr


@pytest.mark.parametrize("how", ["sys.exit(7)", "sys.exit('a message')", "raise ValueError('boom')", "os._exit(5)",
                                 "sys.exit(2**64)", "raise KeyboardInterrupt"])
def test_a_forked_rank_exits_as_its_program_would(tmp_path, how):
    results = {}
    for start in ("exec", "fork"):
        out = subprocess.run([sys.executable, LAUNCH_PY, "--nproc", "1", "--start", start, "--", sys.executable, "-c",
                              f"import os, sys\n{how}"], capture_output=True, text=True, timeout=TIMEOUT)
        results[start] = out.returncode, out.stderr.splitlines()[-1:]
    assert results["fork"] == results["exec"]


@pytest.mark.slow
def test_fairseq_train_forked_and_exec_train_the_same_weights(data_bin, tmp_path):
    """fairseq-train on 2 ranks forked from the launcher (the default) and each its own program: the same set, with
    OpenMP's threads (OMP_NUM_THREADS=2) working in the forked ranks."""
    import torch

    from fairseq_moe.checkpoints import sets
    from tests.fairseq_moe.helpers import train_argv

    launch = load_launch()
    command = launch.rank_command(["fairseq-train", *train_argv(data_bin, tmp_path, "--max-update", "3")], 2)
    assert launch.in_process(command, []) is not None  # (the default, fork, does fork this command)
    states = {}
    for start in ("fork", "exec"):
        save = tmp_path / start
        out = subprocess.run([sys.executable, "-m", "fairseq_moe.launch", "--nproc", "2", "--start", start, "--",
                              "fairseq-train", *train_argv(data_bin, save, "--moe-expert-count", "4", "--max-update",
                                                           "3")],
                             capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="2"))
        assert out.returncode == 0, out.stderr[-3000:]  # (2 threads a rank: OpenMP's pool starts after the fork)
        assert "| INFO | train_inner | epoch 001:" in out.stdout, out.stdout[-3000:]  # (fairseq's log format)
        states[start] = {name: sets.read_file(str(save / name)).get("model", {})
                         for name in sorted(os.listdir(save)) if name.startswith("checkpoint_last")}
    assert states["fork"].keys() == states["exec"].keys() and len(states["fork"]) > 1
    for name, model in states["fork"].items():
        assert model.keys() == states["exec"][name].keys(), name
        for key, value in model.items():
            assert torch.equal(value, states["exec"][name][key]), (name, key)
