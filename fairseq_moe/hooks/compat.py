"""Fixes for the fairseq 0.12 releases this plugin supports, installed by patches.py when fairseq loads
the plugin (dense models run with the plugin get them too: see docs/architecture.md): the dropped last batch,
multi-rank resume under torch >= 2.6, NumPy 2, torchrun and srun on CPU, ranks that exit together.
"""

import os
import re
import types
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import FlagError


def keep_last_batch(batch_by_size):
    """fairseq 0.12's batch_by_size drops the last batch whenever its size is not a multiple of
    --required-batch-size-multiple (default 8): fairseq-generate then silently skips the longest test
    sentences and training never sees the longest examples. We keep it, as fairseq did before 0.12;
    batches stay within --max-tokens/--batch-size."""
    def wrapped(indices, num_tokens_fn, num_tokens_vec=None, max_tokens=None, max_sentences=None,
                required_batch_size_multiple=1, fixed_shapes=None):
        if not isinstance(indices, np.ndarray):
            indices = np.fromiter(indices, dtype=np.int64, count=-1)
        batches = batch_by_size(indices, num_tokens_fn, num_tokens_vec, max_tokens, max_sentences,
                                required_batch_size_multiple, fixed_shapes)
        covered = sum(len(b) for b in batches)
        if fixed_shapes is None and covered < len(indices):
            # The batches are consecutive slices of indices: what was dropped is the tail.
            batches = list(batches) + [indices[covered:]]
        return batches

    return wrapped


def broadcast_with_omegaconf(broadcast_object_slow):
    """fairseq's resume on several ranks: rank 0 reads the checkpoint (weights_only=True) and
    broadcasts the state, in which fairseq has turned the config into an OmegaConf object; the other
    ranks unpickle it with torch.load, whose weights_only default (torch >= 2.6) refuses OmegaConf
    and fails every multi-rank resume. Allow exactly OmegaConf's config classes (and the builtins its
    pickles name) for this in-job transfer; checkpoint files keep the narrow list of checkpoints/safe_load.py."""
    import collections
    import typing

    import omegaconf
    from fairseq.distributed import utils as distributed_utils
    from omegaconf import base, nodes

    allowed = [omegaconf.DictConfig, omegaconf.ListConfig, base.ContainerMetadata, base.Metadata, typing.Any,
               collections.defaultdict, distributed_utils._TensorPlaceholder, dict, list, int, float, str, bool,
               *(v for v in vars(nodes).values() if isinstance(v, type) and issubclass(v, nodes.ValueNode))]

    def wrapped(obj, src_rank, group, dist_device):
        with torch.serialization.safe_globals(allowed):
            return broadcast_object_slow(obj, src_rank, group, dist_device)

    return wrapped


def _percentile(a, q, *args, interpolation=None, **kwargs):
    if interpolation is not None:
        kwargs["method"] = interpolation
    return np.percentile(a, q, *args, **kwargs)


# numpy as fairseq 0.12's data modules expect it (numpy itself is left as it is): np.compat.long is used
# by TokenBlockDataset and LanguagePairDataset, percentile(interpolation=) by data_utils.get_buckets.
NUMPY_1 = types.ModuleType("numpy")
NUMPY_1.__getattr__ = lambda name: getattr(np, name)
NUMPY_1.compat = types.SimpleNamespace(long=int)
NUMPY_1.percentile = _percentile


TORCHRUN_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")


def torchrun_on_cpu(infer_init_method):
    """fairseq 0.12 under torchrun (or any launcher that sets MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK; or srun with
    several tasks: slurm_as_torchrun) on a machine without CUDA: fairseq keeps its world size of 1 unless
    --distributed-world-size is given, so N ranks train N independent models into one save folder; and with the flag
    it divides the rank by torch.cuda.device_count(), 0. Here the ranks join one job of WORLD_SIZE ranks through the
    environment (env://), each process its own rank. NCCL and PyTorch DDP's device ids need CUDA: without it,
    --distributed-backend gloo and --ddp-backend legacy_ddp (or fully_sharded: torch's FSDP, fsdp.py) are required,
    by name."""

    def wrapped(cfg, force_distributed=False):
        result = infer(cfg, force_distributed)
        refuse_at_start(cfg)
        return result

    def infer(cfg, force_distributed):
        cpu = torch.cuda.device_count() == 0 and cfg.distributed_init_method is None and not cfg.tpu
        if cpu:
            slurm_as_torchrun(cfg.distributed_port)
        launched = all(key in os.environ for key in TORCHRUN_ENV)
        if not launched or not cpu:
            return infer_init_method(cfg, force_distributed)
        world_size = int(os.environ["WORLD_SIZE"])
        if cfg.distributed_world_size not in (1, world_size):
            raise FlagError(f"--distributed-world-size {cfg.distributed_world_size} but the launcher started "
                            f"WORLD_SIZE={world_size} ranks: leave the flag out, or make them agree")
        if world_size == 1:
            return infer_init_method(cfg, force_distributed)
        wrong = [f"--{flag} {value}" for flag, value, ok in (
            ("distributed-backend", cfg.distributed_backend, cfg.distributed_backend == "gloo"),
            ("ddp-backend", cfg.ddp_backend, cfg.ddp_backend in ("legacy_ddp", "no_c10d", "fully_sharded")))
            if not ok]
        if wrong:
            raise FlagError(f"{' and '.join(wrong)} cannot run without CUDA: with {world_size} CPU ranks add "
                            f"--distributed-backend gloo --ddp-backend legacy_ddp")
        cfg.distributed_init_method = "env://"
        cfg.distributed_world_size = world_size
        cfg.distributed_rank = int(os.environ["RANK"])
        cfg.device_id = 0  # no CUDA device to pick
        cfg.distributed_no_spawn = True  # the launcher made the processes

    return wrapped


LAUNCHERS = {"TORCHELASTIC_RUN_ID", "FAIRSEQ_MOE_LAUNCH_RANK"}  # a launcher inside the step: its ranks, not Slurm's
NOT_ONE_STEP = "these tasks are not one srun step (srun gives each task of a step its own SLURM_* variables)"
MEET_SECONDS = 120.0  # how long a task waits for the others of its step at --distributed-port (a large job's
# tasks can start tens of seconds apart: a healthy start must not be taken for a missing task)
MEET_SECONDS_VAR = "FAIRSEQ_MOE_SLURM_MEET_SECONDS"
_MEET_PREFIX = "fairseq_moe/slurm/"  # the meeting's keys in the store (torch's own keys have other names)


def in_srun_step(env=os.environ):
    """This process is a task of an srun step of several tasks with no launcher inside the step (torchrun's or
    fairseq_moe.launch's ranks keep theirs). A step whose SLURM_STEP_NUM_TASKS is not a number is one too: it
    is refused, by name, on every task (slurm_step). In an sbatch script itself there is no step: SLURM_NTASKS is
    the job's and SLURM_PROCID 0, but SLURM_STEP_NUM_TASKS is absent or 1."""
    tasks = env.get("SLURM_STEP_NUM_TASKS", "").strip() if "SLURM_PROCID" in env else ""
    return tasks not in ("", "0", "1") and not LAUNCHERS & set(env)


@dataclass(frozen=True)
class SlurmStep:
    """One task's view of its srun step, from its SLURM_* variables (slurm_step)."""
    tasks: int
    procid: int
    nodeid: int
    localid: int
    nodes: int
    tasks_here: int  # on this task's node
    layout: str  # SLURM_STEP_TASKS_PER_NODE


def _number(env, name, default=None):
    """The non-negative integer in env[name] (default where the variable is absent, if there is one). Digits only:
    int() would also take ' 3', '+3', '3_0' and other scripts' digits."""
    value = env.get(name)
    if value is None and default is not None:
        return default
    if value is None:
        raise FlagError(f"{name} is not set: {NOT_ONE_STEP}")
    if not re.fullmatch(r"[0-9]{1,18}", value):
        raise FlagError(f"{name}={value!r} is not a number: {NOT_ONE_STEP}")
    return int(value)


def tasks_per_node(layout, tasks):
    """SLURM_STEP_TASKS_PER_NODE ('2(x3),1': 2 tasks on each of 3 nodes, then 1 on a fourth) as [(count,
    repeat)], never expanded: every node of a step runs a task, so a count or repeat above the step's task count
    cannot be, and is refused before anything is multiplied; the counts must add up to the tasks."""
    def wrong(why):
        return FlagError(f"SLURM_STEP_TASKS_PER_NODE={layout!r} {why} (SLURM_STEP_NUM_TASKS={tasks}): {NOT_ONE_STEP}")

    groups = []
    for part in layout.split(","):
        m = re.fullmatch(r"([0-9]{1,18})(?:\(x([0-9]{1,18})\))?", part)
        if m is None:
            raise wrong("does not say how many tasks run on each node")
        count, repeat = int(m.group(1)), int(m.group(2) or 1)
        if not 0 < count <= tasks or not 0 < repeat <= tasks:
            raise wrong(f"has {part!r}: more nodes or tasks than the step's tasks, or none")
        groups.append((count, repeat))
    if sum(count * repeat for count, repeat in groups) != tasks:
        raise wrong("does not add up to the step's tasks")
    return groups


def slurm_step(env=os.environ):
    """This task's srun step, checked from its own SLURM_* variables alone (no other task, no network): numbers,
    SLURM_PROCID below the step's tasks, SLURM_NODEID among its nodes, SLURM_LOCALID among the tasks of its
    node. A FlagError names the variable. What needs the other tasks (two with one PROCID, one missing) is
    found when they meet (meet_step)."""
    tasks, procid = _number(env, "SLURM_STEP_NUM_TASKS"), _number(env, "SLURM_PROCID")
    if tasks < 1 or procid >= tasks:
        raise FlagError(f"SLURM_PROCID={procid} but the step has SLURM_STEP_NUM_TASKS={tasks} tasks (SLURM_PROCID 0 "
                        f"to {tasks - 1}): {NOT_ONE_STEP}")
    nodes_given = _number(env, "SLURM_STEP_NUM_NODES", default=-1)
    layout = env.get("SLURM_STEP_TASKS_PER_NODE") or (str(tasks) if nodes_given in (-1, 1) else "")
    groups = tasks_per_node(layout, tasks)
    nodes = sum(repeat for _, repeat in groups)
    if nodes_given not in (-1, nodes):
        raise FlagError(f"SLURM_STEP_NUM_NODES={nodes_given} but SLURM_STEP_TASKS_PER_NODE={layout!r} has {nodes} "
                        f"node(s): {NOT_ONE_STEP}")
    nodeid = _number(env, "SLURM_NODEID", default=0)
    if nodeid >= nodes:
        raise FlagError(f"SLURM_NODEID={nodeid} but the step has {nodes} node(s) (SLURM_STEP_TASKS_PER_NODE="
                        f"{layout!r}): {NOT_ONE_STEP}")
    first, here = 0, 0
    for count, repeat in groups:  # the group of node `nodeid`, found without expanding the layout
        if nodeid < first + repeat:
            here = count
            break
        first += repeat
    localid = _number(env, "SLURM_LOCALID", default=0)
    if localid >= here:
        raise FlagError(f"SLURM_LOCALID={localid} but node SLURM_NODEID={nodeid} runs {here} task(s) of the step "
                        f"(SLURM_STEP_TASKS_PER_NODE={layout!r}): {NOT_ONE_STEP}")
    return SlurmStep(tasks, procid, nodeid, localid, nodes, here, layout)


def step_hosts(env, step):
    """The host names of the step's nodes (scontrol show hostnames $SLURM_STEP_NODELIST: Slurm's own expansion
    of 'gpu[7-9]'), one per node of step."""
    import subprocess

    nodelist = env.get("SLURM_STEP_NODELIST")
    if not nodelist:
        raise FlagError(f"SLURM_STEP_NODELIST is not set, so the step's first node, where its {step.tasks} tasks "
                        f"meet, is unknown: {NOT_ONE_STEP}")
    command = ["scontrol", "show", "hostnames", nodelist]
    try:
        out = subprocess.run(command, check=True, capture_output=True, text=True, env=dict(env))
    except OSError as e:
        raise FlagError(f"the step's first node is unknown: scontrol, which reads SLURM_STEP_NODELIST={nodelist!r}, "
                        f"cannot be run ({e.strerror}); it comes with Slurm's client commands") from None
    except subprocess.CalledProcessError as e:
        said = (e.stderr or "").strip().splitlines()[:1]
        raise FlagError(f"the step's first node is unknown: `scontrol show hostnames` does not read "
                        f"SLURM_STEP_NODELIST={nodelist!r} (exit code {e.returncode}"
                        f"{': ' + said[0] if said else ''})") from None
    hosts = out.stdout.split()
    if len(hosts) != step.nodes:
        raise FlagError(f"SLURM_STEP_NODELIST={nodelist!r} names {len(hosts)} host(s) but the step has {step.nodes} "
                        f"node(s) (SLURM_STEP_TASKS_PER_NODE={step.layout!r}): {NOT_ONE_STEP}")
    return hosts


def meet_seconds(env=os.environ):
    """How long a task waits for the others of its step (FAIRSEQ_MOE_SLURM_MEET_SECONDS, else MEET_SECONDS): the
    tasks of a step start together, so this covers how much longer one takes to import and parse than another."""
    value = env.get(MEET_SECONDS_VAR)
    if value is None:
        return MEET_SECONDS
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < 1e6:
        raise FlagError(f"{MEET_SECONDS_VAR}={value!r}: give the seconds a task waits for the others of its step, "
                        f"a number > 0")
    return seconds


class _Meeting:
    """This process's meeting (meet_step): the port its step met at, task 0's store (its server, which torch's
    rendezvous then shares: multi-tenant, same port), and whether it failed (then every task prints its line:
    launcher_rank)."""
    store = None
    port = None
    failed = False


def launcher_rank():
    """This process's rank as its launcher gave it, before any process group: an srun step's SLURM_PROCID (srun
    copies a RANK left in the shell to every task: Slurm's wins), else torchrun's or fairseq_moe.launch's RANK. A
    task of a step that is not one has no rank: 0, so that every task prints the line that says why (cli.py prints
    rank 0's)."""
    env = os.environ
    if in_srun_step(env):
        if _Meeting.failed:
            return 0
        try:
            return slurm_step(env).procid
        except FlagError:
            return 0
    rank = env.get("RANK", "0")
    return int(rank) if rank.isdigit() else 0


def slurm_as_torchrun(port):
    """Under srun with several tasks (and no launcher inside the step): the environment torchrun gives a
    rank, from Slurm's (MASTER_ADDR: the step's first node; MASTER_PORT: --distributed-port, as fairseq's own Slurm
    rendezvous takes it; WORLD_SIZE, RANK, LOCAL_RANK, LOCAL_WORLD_SIZE: the step's tasks), so the tasks join one
    job as torchrun's ranks do. fairseq 0.12 reads SLURM_* itself only given --distributed-world-size, and on
    CPU then divides by the CUDA device count; without this, srun's tasks train independent models into one
    folder. Slurm's values replace any left in the environment srun copied from the shell (every task would have
    the same RANK). First the step is checked: each task's own variables (slurm_step, step_hosts), then the tasks
    meet (meet_step), so that an environment that cannot be one step is one line on every task within seconds,
    not torch's rendezvous timeout of 30 minutes. True when it set them."""
    env = os.environ
    if not in_srun_step(env):
        return False
    step = slurm_step(env)  # (its FlagError: launcher_rank is 0 on every task, so each prints it)
    if port is None or port <= 0:
        raise FlagError(f"srun started {step.tasks} tasks: add --distributed-port P (a free port on the step's "
                        f"first node, where the tasks meet), as fairseq's Slurm launch needs")
    try:
        hosts = step_hosts(env, step)
        if _Meeting.port != port:  # (once: spread.py and fairseq's start both call this in one process)
            meet_step(step, hosts[0], port, meet_seconds(env))
    except FlagError:
        _Meeting.failed = True  # (every task prints its line)
        raise
    env.update(MASTER_ADDR=hosts[0], MASTER_PORT=str(port), WORLD_SIZE=str(step.tasks), RANK=str(step.procid),
               LOCAL_RANK=str(step.localid), LOCAL_WORLD_SIZE=str(step.tasks_here))
    return True


def meet_step(step, host, port, seconds):
    """The step's tasks meet before torch's rendezvous, which waits 30 minutes for a task that never comes and
    cannot tell two tasks of one SLURM_PROCID apart. Task 0 serves a TCPStore at --distributed-port (multi-tenant:
    torch's env:// rendezvous on that port then shares it, so a healthy start costs a few store calls); every task
    counts itself in, under its SLURM_PROCID, and the first task to see the outcome (all SLURM_STEP_NUM_TASKS
    arrived, a PROCID twice, more tasks than the step's, or `seconds` gone by) writes it: every task then reads
    the same outcome, and raises the same FlagError where it is not a success."""
    import time

    from torch.distributed import DistError

    deadline = time.monotonic() + seconds
    where = f"{host}:{port} (--distributed-port)"
    store, serving = _meeting_store(step, host, port, seconds, deadline)
    try:
        outcome = _outcome(store, step, where, seconds, deadline)
        if outcome != "ok":  # the others read it from task 0's store: it stays up until they have (or 2 s)
            store.add(_MEET_PREFIX + "read", 1)
            until = time.monotonic() + 2
            while serving and time.monotonic() < until and (
                    store.add(_MEET_PREFIX + "read", 0) < store.add(_MEET_PREFIX + "arrived", 0)):
                time.sleep(0.02)
    except DistError:
        outcome = (f"the meeting of the step's tasks at {where} ended before they had all met: the task that "
                   f"held it (SLURM_PROCID=0) ended; see its line")
    if outcome != "ok":
        raise FlagError(outcome)
    _Meeting.port = port
    if serving:
        _Meeting.store = store  # (kept: torch's rendezvous serves from it)


def _outcome(store, step, where, seconds, deadline):
    """Count this task in; then wait for the outcome: "ok", or the line that says what is wrong."""
    import time

    def key(name):
        return _MEET_PREFIX + name

    if store.add(key(f"procid/{step.procid}"), 1) > 1:
        store.append(key("twice"), f"{step.procid} ")
    store.append(key("arrived_ids"), f"{step.procid} ")
    store.add(key("arrived"), 1)  # (after the lines above: a count of all means their writes are all in)
    while not store.check([key("outcome")]):
        arrived = store.add(key("arrived"), 0)
        twice = store.get(key("twice")).decode().split() if store.check([key("twice")]) else []
        decided = None
        if twice:
            decided = (f"SLURM_PROCID={twice[0]} is on more than one task of the step that met at {where}: each "
                       f"task has its own SLURM_PROCID, 0 to {step.tasks - 1} (SLURM_STEP_NUM_TASKS={step.tasks}); "
                       f"{NOT_ONE_STEP}")
        elif arrived > step.tasks:
            decided = (f"more than SLURM_STEP_NUM_TASKS={step.tasks} tasks met at {where} (another step or job on "
                       f"that port?): {NOT_ONE_STEP}")
        elif arrived == step.tasks:
            decided = "ok"
        elif time.monotonic() > deadline:
            decided = _missing(step, store.get(key("arrived_ids")).decode().split(), where, seconds)
        if decided is not None:
            return store.compare_set(key("outcome"), "", decided).decode()  # the first decision wins
        time.sleep(0.02)
    return store.get(key("outcome")).decode()


def _missing(step, arrived_ids, where, seconds):
    """The message for a step whose tasks did not all arrive in `seconds`: which did, and the first few absent."""
    seen = {int(i) for i in arrived_ids}
    absent = []
    for procid in range(step.tasks):  # (stops after a few: at most len(seen) + 4 turns)
        if procid not in seen:
            absent.append(str(procid))
            if len(absent) == 4:
                break
    more = ", ..." if step.tasks - len(seen) > len(absent) else ""
    return (f"SLURM_STEP_NUM_TASKS={step.tasks} but {len(seen)} task(s) met at {where} in {seconds:g} s "
            f"(SLURM_PROCID {', '.join(sorted(arrived_ids, key=int))}; none with SLURM_PROCID "
            f"{', '.join(absent)}{more}): a task of the step is missing, or failed before it got there "
            f"({MEET_SECONDS_VAR} waits longer); {NOT_ONE_STEP}")


def _meeting_store(step, host, port, seconds, deadline):
    """(store, serving): task 0 serves the meeting's store (if the port is taken, maybe by a second task 0 of the
    same step, it joins it as the others do); the others connect once its port answers. The port is tried
    from Python first: torch's TCPStore client logs a stack trace of C++ frames for every refused connection."""
    import datetime
    import socket
    import time

    from torch.distributed import DistNetworkError, TCPStore

    timeout = datetime.timedelta(seconds=seconds + 10)  # (for each store call; the meeting keeps its own deadline)
    if step.procid == 0:
        try:
            return TCPStore(host, port, None, True, timeout=timeout, wait_for_workers=False, multi_tenant=True), True
        except DistNetworkError as e:
            if "EADDRINUSE" not in str(e):
                raise FlagError(f"task SLURM_PROCID=0 cannot serve the step's meeting at {host}:{port} "
                                f"(--distributed-port): {str(e).splitlines()[0]}") from None
    while True:
        try:
            with socket.create_connection((host, port), timeout=1):
                break
        except OSError:
            if time.monotonic() > deadline:
                raise FlagError(f"no task with SLURM_PROCID=0 listened at {host}:{port} (--distributed-port; the "
                                f"first node of SLURM_STEP_NODELIST) in {seconds:g} s: task 0 "
                                f"of the step is missing, failed before it got there, or runs on another node "
                                f"({MEET_SECONDS_VAR} waits longer); {NOT_ONE_STEP}") from None
            time.sleep(0.1)
    return TCPStore(host, port, None, False, timeout=timeout, wait_for_workers=False), False


def refuse_at_start(cfg):
    """refusals.py's "start" stage, on every rank, before a collective or fairseq's main: fairseq's main can end the
    run before the Trainer's refusals (it logs a missing iopath for --write-checkpoints-asynchronously and returns,
    exit code 0). Called where the ranks start: around distributed_main (each rank) and after infer_init_method
    (before fairseq spawns ranks itself), with the whole config, which infer_init_method's section belongs to."""
    from .. import refusals

    refusals.check_start(cfg._get_root() if hasattr(cfg, "_get_root") else cfg)  # (OmegaConf: the section's root)


def leave_together(distributed_main):
    """fairseq's distributed_main ends with a barrier and leaves its process groups, and then the whole process,
    to the interpreter's exit, where a gloo rank can abort (std::terminate, exit code 250, a main thread with no
    Python frame: seen in about one multi-rank run in twenty under load, also with the groups destroyed). So,
    after the barrier, the groups are destroyed here, on every rank, and a launched rank (one_rank_of_a_job)
    then leaves at once with the run's exit code (0, the code of cli.one_line_errors' SystemExit, 1 after
    printing the traceback of any other exception, 130 on Ctrl-C): its output flushed and its atexit handlers
    run (fairseq's tensorboard writers, logging), every file it wrote already closed (a save is fsynced:
    commit.py), without the interpreter's teardown. One process never gets here."""
    def wrapped(*args, **kwargs):
        if len(args) > 2:  # distributed_main(i, main, cfg, kwargs): before distributed_init and fairseq's main
            refuse_at_start(args[2])
        leave = one_rank_of_a_job()
        code = 0
        try:
            distributed_main(*args, **kwargs)
        except SystemExit as e:
            if not leave:
                raise
            code = e.code
        except BaseException as e:
            if not leave:
                raise
            import traceback

            traceback.print_exc()
            code = 130 if isinstance(e, KeyboardInterrupt) else 1
        finally:
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        if leave:
            leave_now(code)

    return wrapped


def one_rank_of_a_job():
    """This process is one rank of a job that a launcher started (torchrun, fairseq_moe.launch, srun with
    several tasks), and nothing of the program's own runs after fairseq's main (not under fairseq-hydra-train,
    whose sweeps and callbacks do)."""
    import sys

    if "fairseq_cli.hydra_train" in sys.modules:
        return False
    return bool(LAUNCHERS & set(os.environ)) or in_srun_step()


def leave_now(code):
    """sys.exit(code) without the interpreter's teardown."""
    import atexit
    import sys

    if code is not None and not isinstance(code, int):  # sys.exit("message") prints it, exit code 1
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code or 0)
