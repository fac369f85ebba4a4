"""Red-team trial table (issue 30, item 5 and item 8's unknown-node message): Slurm environments that cannot be
one srun step. Each is one line that names the variable, on every task, within seconds (torch's rendezvous would
wait 30 minutes; a non-number was a ValueError traceback, '1(x100000000000)' a MemoryError). The variables of one
task are checked alone (compat.slurm_step, compat.step_hosts: no other task, no network); two tasks with one
SLURM_PROCID, or one missing, are found when the tasks meet (compat.meet_step), in threads here and in real
processes started by hand with a hand-made SLURM_* environment. scripts/slurm_up.sh gives its node the
machine's CPUs whatever OMP_NUM_THREADS says."""
import concurrent.futures
import os
import subprocess
import sys

import pytest

from fairseq_moe.hooks import compat
from fairseq_moe.errors import FlagError

from tests.conftest import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# A healthy task: the second of a 2-task step on one node, n1.
TASK = {"SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NODELIST": "n1", "SLURM_STEP_TASKS_PER_NODE": "2"}
DROP = None  # a row's value that removes the variable

# (what the row changes in TASK, a fragment of the one line)
TABLE = [
    ({"SLURM_PROCID": "2"}, "SLURM_PROCID=2 but the step has SLURM_STEP_NUM_TASKS=2 tasks"),
    ({"SLURM_PROCID": "7", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "4"},
     "SLURM_PROCID=7 but the step has SLURM_STEP_NUM_TASKS=4 tasks"),
    ({"SLURM_PROCID": "abc"}, "SLURM_PROCID='abc' is not a number"),
    ({"SLURM_PROCID": "-1"}, "SLURM_PROCID='-1' is not a number"),
    ({"SLURM_PROCID": " 1"}, "SLURM_PROCID=' 1' is not a number"),
    ({"SLURM_PROCID": "\u0661"}, "SLURM_PROCID='\u0661' is not a number"),  # (an Arabic-Indic one: int() takes it)
    ({"SLURM_PROCID": "1" * 40}, "SLURM_PROCID='111"),
    ({"SLURM_STEP_NUM_TASKS": "two"}, "SLURM_STEP_NUM_TASKS='two' is not a number"),
    ({"SLURM_STEP_TASKS_PER_NODE": "1(x100000000000)"}, "SLURM_STEP_TASKS_PER_NODE='1(x100000000000)' has"),
    ({"SLURM_STEP_TASKS_PER_NODE": "100000000000"}, "SLURM_STEP_TASKS_PER_NODE='100000000000' has"),
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x0)"}, "SLURM_STEP_TASKS_PER_NODE='2(x0)' has"),
    ({"SLURM_STEP_TASKS_PER_NODE": "0,2"}, "SLURM_STEP_TASKS_PER_NODE='0,2' has"),
    ({"SLURM_STEP_TASKS_PER_NODE": "1"}, "SLURM_STEP_TASKS_PER_NODE='1' does not add up"),
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x"}, "SLURM_STEP_TASKS_PER_NODE='2(x' does not say how many"),
    ({"SLURM_STEP_TASKS_PER_NODE": DROP, "SLURM_STEP_NUM_NODES": "2"},
     "SLURM_STEP_TASKS_PER_NODE='' does not say how many"),
    ({"SLURM_STEP_NUM_NODES": "2"}, "SLURM_STEP_NUM_NODES=2 but SLURM_STEP_TASKS_PER_NODE='2' has 1 node"),
    ({"SLURM_STEP_NUM_NODES": "x"}, "SLURM_STEP_NUM_NODES='x' is not a number"),
    ({"SLURM_NODEID": "1"}, "SLURM_NODEID=1 but the step has 1 node(s)"),
    ({"SLURM_NODEID": "n1"}, "SLURM_NODEID='n1' is not a number"),
    ({"SLURM_LOCALID": "2"}, "SLURM_LOCALID=2 but node SLURM_NODEID=0 runs 2 task(s)"),
    ({"SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
      "SLURM_STEP_NODELIST": "n[1-2]"}, "SLURM_LOCALID=1 but node SLURM_NODEID=1 runs 1 task(s)"),
    ({"SLURM_STEP_NODELIST": DROP}, "SLURM_STEP_NODELIST is not set, so the step's first node"),
    ({"SLURM_STEP_NODELIST": "n[1-2]"}, "SLURM_STEP_NODELIST='n[1-2]' names 2 host(s) but the step has 1 node"),
    ({"SLURM_STEP_NODELIST": "n[1-"}, "`scontrol show hostnames` does not read SLURM_STEP_NODELIST='n[1-' (exit code"),
    ({"PATH": "/nonexistent"}, "scontrol, which reads SLURM_STEP_NODELIST='n1', cannot be run"),
    ({compat.MEET_SECONDS_VAR: "soon"}, f"{compat.MEET_SECONDS_VAR}='soon'"),
    ({compat.MEET_SECONDS_VAR: "0"}, f"{compat.MEET_SECONDS_VAR}='0'"),
]

# scontrol show hostnames, for the nodelists of the table (a real Slurm: tests/fairseq_moe/hooks/test_compat_slurm.py)
SCONTROL = """#!/bin/sh
case "$3" in
  n1|localhost) echo "$3" ;;
  'n[1-2]') printf 'n1\\nn2\\n' ;;
  *) echo "scontrol: error: Invalid hostlist: $3" >&2; exit 1 ;;
esac
"""


@pytest.fixture
def scontrol(tmp_path):
    (tmp_path / "scontrol").write_text(SCONTROL)
    (tmp_path / "scontrol").chmod(0o755)
    return f"{tmp_path}{os.pathsep}{os.environ['PATH']}"


def task_env(change, path):
    env = dict(TASK, PATH=path)
    env.update(change)
    return {key: value for key, value in env.items() if value is not DROP}


def check_task(env):
    """What each task checks alone, before meeting the others (slurm_as_torchrun's first steps)."""
    step = compat.slurm_step(env)
    compat.step_hosts(env, step)
    compat.meet_seconds(env)
    return step


@pytest.mark.parametrize("change,line", TABLE, ids=[" ".join(f"{k}={v}" for k, v in c.items()) for c, _ in TABLE])
def test_an_environment_that_cannot_be_one_step_is_one_line(change, line, scontrol):
    env = task_env(change, scontrol)
    with pytest.raises(FlagError) as err:
        check_task(env)
    message = str(err.value)
    assert line in message and "\n" not in message and "Error" not in message, message


def test_the_healthy_task_passes_the_table(scontrol):
    """The table's base is a task of a step (each row's failure is its change)."""
    assert check_task(task_env({}, scontrol)) == compat.SlurmStep(tasks=2, procid=1, nodeid=0, localid=1, nodes=1,
                                                                  tasks_here=1 + 1, layout="2")
    big = task_env({"SLURM_STEP_NUM_TASKS": "100000000002", "SLURM_STEP_TASKS_PER_NODE": "2,1(x100000000000)",
                    "SLURM_STEP_NUM_NODES": "100000000001", "SLURM_NODEID": "99999999999", "SLURM_LOCALID": "0"},
                   scontrol)
    step = compat.slurm_step(big)  # (a layout of 10^11 nodes, read without expanding it)
    assert (step.nodes, step.tasks_here) == (100000000001, 1)


def test_a_bad_step_gives_every_task_rank_0(monkeypatch):
    """cli.py prints the line on rank 0: a task of a step that is not one has no rank, so every task prints it
    (and a non-number is not a ValueError at the plugin's load, where launcher_rank is read)."""
    for key, value in TASK.items():
        monkeypatch.setenv(key, value)
    for key in compat.LAUNCHERS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(compat._Meeting, "failed", False)
    assert compat.launcher_rank() == 1
    monkeypatch.setenv("SLURM_PROCID", "abc")
    assert compat.launcher_rank() == 0 and compat.one_rank_of_a_job()
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setattr(compat._Meeting, "failed", True)  # (the tasks met and found the step is not one)
    assert compat.launcher_rank() == 0


def meet(procids, tasks, seconds=2.0):
    """compat.meet_step for tasks of these SLURM_PROCIDs, each in a thread: each one's outcome (None: met)."""
    port = free_port()

    def one(procid):
        step = compat.SlurmStep(tasks=tasks, procid=procid, nodeid=0, localid=procid % tasks, nodes=1,
                                tasks_here=tasks, layout=str(tasks))
        try:
            compat.meet_step(step, "127.0.0.1", port, seconds)
        except FlagError as e:
            return str(e)

    with concurrent.futures.ThreadPoolExecutor(len(procids)) as pool:
        return list(pool.map(one, procids))


# (the tasks' SLURM_PROCIDs of a step of `tasks`, the fragment of every task's line; None: they meet)
MEETINGS = [
    ((0, 1), 2, None),
    ((2, 0, 1), 3, None),
    ((0, 0), 2, "SLURM_PROCID=0 is on more than one task of the step"),
    ((0, 1, 1), 3, "SLURM_PROCID=1 is on more than one task of the step"),
    ((0,), 2, "SLURM_STEP_NUM_TASKS=2 but 1 task(s) met at 127.0.0.1:"),
    ((0, 2), 4, "none with SLURM_PROCID 1, 3"),
    ((1,), 2, "no task with SLURM_PROCID=0 listened at 127.0.0.1:"),
]


@pytest.mark.parametrize("procids,tasks,line", MEETINGS, ids=[f"{p} of {t}" for p, t, _ in MEETINGS])
def test_tasks_that_are_not_one_step_find_it_when_they_meet(procids, tasks, line, monkeypatch):
    for name, value in (("store", None), ("port", None), ("failed", False)):
        monkeypatch.setattr(compat._Meeting, name, value)
    outcomes = meet(procids, tasks)
    if line is None:  # (met before the wait ran out: else every task's line would say who was missing)
        assert outcomes == [None] * len(procids)
    else:
        assert all(o is not None and line in o and "\n" not in o for o in outcomes), outcomes
        assert len(set(outcomes)) == 1, outcomes  # the same line on every task


TASK_SCRIPT = """
import sys
import torch
import torch.distributed as dist
from fairseq_moe.hooks import cli, compat

def main():
    for _ in range(2):  # (as fairseq-eval-lm does: fairseq's start, then spread.py)
        compat.slurm_as_torchrun(int(sys.argv[1]))
    dist.init_process_group("gloo", init_method="env://")
    total = torch.ones(1)
    dist.all_reduce(total)
    sys.stdout.write(f"met {dist.get_rank()} {int(total.item())}\\n")  # (one write: the tasks share a pipe)
    sys.stdout.flush()
    dist.destroy_process_group()

cli.one_line_errors(main)()
"""

# (each hand-made task's SLURM_PROCID, the fragment of each task's one line; None: they train together)
PROCESSES = [
    (("0", "1"), None),
    (("0", "0"), "SLURM_PROCID=0 is on more than one task of the step"),
    (("1",), "no task with SLURM_PROCID=0 listened"),
    (("0",), "SLURM_STEP_NUM_TASKS=2 but 1 task(s) met"),
    (("abc", "1"), ("SLURM_PROCID='abc' is not a number", "no task with SLURM_PROCID=0 listened")),
]


def start_tasks(procids, argv, scontrol, tmp_path, seconds="3"):
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "FAIRSEQ_MOE_"))
            and k not in (*compat.TORCHRUN_ENV, "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    base.update(TASK, SLURM_STEP_NODELIST="localhost", PATH=scontrol, OMP_NUM_THREADS="1", RANK="0", PYTHONPATH=ROOT,
                **{compat.MEET_SECONDS_VAR: seconds})
    procs = [subprocess.Popen([*argv, "--distributed-port", str(port)] if argv[0] != sys.executable else
                              [*argv, str(port)], cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=dict(base, SLURM_PROCID=p, SLURM_LOCALID=p))
             for p in procids]
    return procs


def finish(procs, timeout):
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"a task still runs after {timeout} s: the tasks wait as torch's rendezvous did")
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("procids,line", PROCESSES, ids=["+".join(p) for p, _ in PROCESSES])
def test_hand_made_tasks_say_it_on_every_task_within_seconds(procids, line, scontrol, tmp_path):
    (tmp_path / "task.py").write_text(TASK_SCRIPT)
    procs = start_tasks(procids, [sys.executable, "task.py"], scontrol, tmp_path)
    outs = finish(procs, timeout=60)
    if line is None:
        assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
        assert sorted(out.split()[1] for out, _ in outs) == ["0", "1"]
        assert all(out.split()[2] == "2" for out, _ in outs)
        return
    lines = line if isinstance(line, tuple) else (line,) * len(procids)
    for p, (out, err), want in zip(procs, outs, lines):
        errors = [x for x in err.splitlines() if x.startswith("task.py: error:")]
        assert p.returncode == 2 and len(errors) == 1 and want in errors[0], err[-2000:]
        assert "Traceback" not in err, err[-2000:]


@pytest.mark.slow
def test_fairseq_train_tasks_of_one_procid_stop_within_seconds(scontrol, tmp_path):
    """The same through fairseq-train (the plugin's hook on fairseq's start): two tasks that are both
    SLURM_PROCID 0 each print one line and exit 2 at their start (before any data is read), not after 30 minutes
    (the timeout leaves room for two fairseq start-ups on a busy machine)."""
    train = os.path.join(os.path.dirname(sys.executable), "fairseq-train")
    argv = [train, str(tmp_path / "no-data"), "--user-dir", os.path.join(ROOT, "fairseq_moe"), "--cpu", "--task",
            "moe_translation", "--arch", "moe_transformer_tiny", "--max-tokens", "64", "--save-dir",
            str(tmp_path / "save"), "--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp"]
    procs = start_tasks(("0", "0"), argv, scontrol, tmp_path)
    outs = finish(procs, timeout=180)
    for p, (_, err) in zip(procs, outs):
        errors = [x for x in err.splitlines() if x.startswith("fairseq-train: error:")]
        assert p.returncode == 2 and len(errors) == 1, err[-3000:]
        assert "SLURM_PROCID=0 is on more than one task" in errors[0], errors
    assert not (tmp_path / "save").exists()


def test_slurm_up_gives_the_node_every_cpu_whatever_omp_num_threads_says():
    """nproc honours OMP_NUM_THREADS, which the README and docs/parallel.md have multi-process CPU users set: the node had 1 CPU and a
    2-task srun waited forever. The script's CPU count, run as the script runs it, under OMP_NUM_THREADS=1."""
    script = open(os.path.join(ROOT, "scripts", "slurm_up.sh")).read()
    (line,) = [x for x in script.splitlines() if x.startswith("CPUS=")]
    out = subprocess.run(["bash", "-c", f"{line}; echo $CPUS"], capture_output=True, text=True, check=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert int(out.stdout) == os.sysconf("SC_NPROCESSORS_CONF")
    assert "NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS" in script
