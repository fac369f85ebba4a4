"""Fixes for the fairseq 0.12 releases this plugin supports, installed by patches.py when fairseq loads
the plugin (dense models run with the plugin get them too: see the README): the dropped last batch,
multi-rank resume under torch >= 2.6, NumPy 2, torchrun and srun on CPU, ranks that exit together.
"""

import os
import re
import types

import numpy as np
import torch

from .errors import FlagError


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
    pickles name) for this in-job transfer; checkpoint files keep the narrow list of checkpoint.py."""
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


def slurm_step_tasks():
    """The tasks of this srun step (0 outside one: in an sbatch script itself, SLURM_NTASKS is the job's and
    SLURM_PROCID 0, but there is no step)."""
    return int(os.environ.get("SLURM_STEP_NUM_TASKS", "0") or 0) if "SLURM_PROCID" in os.environ else 0


def launcher_rank():
    """This process's rank as its launcher gave it, before any process group: an srun step's SLURM_PROCID (srun
    copies a RANK left in the shell to every task: Slurm's wins), else torchrun's or fairseq_moe.launch's RANK."""
    env = os.environ
    if slurm_step_tasks() > 1 and not {"TORCHELASTIC_RUN_ID", "FAIRSEQ_MOE_LAUNCH_RANK"} & set(env):
        return int(env["SLURM_PROCID"])
    return int(env.get("RANK", "0") or 0)


def slurm_as_torchrun(port):
    """Under srun with several tasks (and no launcher inside the step): the environment torchrun gives a
    rank, from Slurm's (MASTER_ADDR: the step's first node; MASTER_PORT: --distributed-port, as fairseq's own Slurm
    rendezvous takes it; WORLD_SIZE, RANK, LOCAL_RANK, LOCAL_WORLD_SIZE: the step's tasks), so the tasks join one
    job as torchrun's ranks do. fairseq 0.12 reads SLURM_* itself only given --distributed-world-size, and on
    CPU then divides by the CUDA device count; without this, srun's tasks train independent models into one
    folder. Slurm's values replace any left in the environment srun copied from the shell (every task would have
    the same RANK). True when it set them."""
    import subprocess

    env, tasks = os.environ, slurm_step_tasks()
    if tasks < 2 or {"TORCHELASTIC_RUN_ID", "FAIRSEQ_MOE_LAUNCH_RANK"} & set(env):  # (torchrun inside the step)
        return False
    if port is None or port <= 0:
        raise FlagError(f"srun started {tasks} tasks: add --distributed-port P (a free port on the step's first "
                        f"node, where the tasks meet), as fairseq's Slurm launch needs")
    try:
        hosts = subprocess.run(["scontrol", "show", "hostnames", env["SLURM_STEP_NODELIST"]], check=True,
                               capture_output=True, text=True).stdout.split()
    except (OSError, KeyError, subprocess.CalledProcessError) as e:
        raise FlagError(f"srun started {tasks} tasks but their first node is unknown (scontrol show hostnames "
                        f"$SLURM_STEP_NODELIST: {e})") from None
    per_node = []  # SLURM_STEP_TASKS_PER_NODE: "2(x3),1" is 2, 2, 2, 1
    layout = env.get("SLURM_STEP_TASKS_PER_NODE") or (str(tasks) if env.get("SLURM_STEP_NUM_NODES", "1") == "1"
                                                       else "")
    for part in layout.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if m is None:
            raise FlagError(f"srun started {tasks} tasks but SLURM_STEP_TASKS_PER_NODE={layout!r} does not say how "
                            f"many run on each node")
        per_node += [int(m.group(1))] * int(m.group(2) or 1)
    node = int(env.get("SLURM_NODEID", "0"))
    if node >= len(per_node) or sum(per_node) != tasks:
        raise FlagError(f"srun started {tasks} tasks but SLURM_STEP_TASKS_PER_NODE={layout!r} does not add up to "
                        f"them on node {node}")
    env.update(MASTER_ADDR=hosts[0], MASTER_PORT=str(port), WORLD_SIZE=str(tasks), RANK=env["SLURM_PROCID"],
               LOCAL_RANK=env.get("SLURM_LOCALID", "0"), LOCAL_WORLD_SIZE=str(per_node[node]))
    return True


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
    env = os.environ
    return bool({"TORCHELASTIC_RUN_ID", "FAIRSEQ_MOE_LAUNCH_RANK"} & set(env)) or slurm_step_tasks() > 1


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
