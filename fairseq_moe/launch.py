"""Run a fairseq command on several CPU processes of this machine, one per rank: what torchrun does, the
same way (the plugin's torchrun-on-CPU path, compat.torchrun_on_cpu), with a few conveniences.

    python -m fairseq_moe.launch --nproc 4 -- fairseq-train data-bin --user-dir fairseq_moe --cpu ...
    torchrun --nproc-per-node 4 $(which fairseq-train) data-bin --user-dir fairseq_moe --cpu \
        --distributed-backend gloo --ddp-backend legacy_ddp ...                        # the same job

It adds: gloo and legacy_ddp unless the command chooses; OMP_NUM_THREADS split over the ranks
(oversubscribed cores slow training tenfold); when a rank fails, the others get SETTLE_SECONDS to end,
then are stopped, so none waits forever in a collective; SIGTERM, SIGINT and SIGHUP are passed on to
every rank, and ranks still running --grace-seconds later are killed; the ranks die with the launcher,
however it ends (SIGKILL included: Linux's parent-death signal), so none trains on alone into the folder
of a relaunch; a usage error is printed by rank 0 alone (FAIRSEQ_MOE_LAUNCH_RANK, read by cli.py). On GPUs
use torchrun or Slurm as usual.

--start fork (the default where it can) imports the command's program once, here, and forks the ranks from
this process: one start-up (torch, fairseq, the plugin, torch._dynamo: 6-8 s of CPU) instead of one per rank. It
applies to this environment's console scripts (fairseq-train, -generate, ...) with `--user-dir` naming this
plugin, and to `python SCRIPT|-c CODE|-m MODULE` of this very interpreter (what to import first: --preload; where
that imports fairseq, the command must name this plugin too). Each forked rank gets the environment, argv,
sys.path and signal dispositions the program started alone would have, the plugin's patches for its rank, and
ends as that program would: its return value, SystemExit or exception leaves the launcher's frames and the
interpreter ends the process as usual (threads joined, atexit run, files flushed, a traceback, death by SIGINT
for an unhandled KeyboardInterrupt). Anything else, or `--start exec`, starts each rank as its own program
(torchrun's way).
"""
import argparse
import ctypes
import importlib
import importlib.metadata
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback

SETTLE_SECONDS = 5  # after a rank fails, before the others are stopped
GRACE_SECONDS = 30  # default time ranks get to exit (and save) after a stop, before SIGKILL
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
_PATH0 = sys.path[0]  # the launcher's own script folder (a forked rank puts its program's there)
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def die_with(parent):
    """The preexec_fn of every rank: the kernel sends the rank SIGKILL when its parent, the launcher, ends,
    whatever ends it (a launcher that died before this ran is seen at once). Only ctypes' prctl, loaded
    before the fork, runs between fork and exec."""
    def preexec():
        if _PRCTL is not None:
            _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
    return preexec


def free_port():
    """A port free now, below the kernel's ephemeral range: a port the kernel hands out for a bind to 0 comes from
    that range, and before rank 0 listens on it another process's outgoing connection (a gloo rank of a job beside
    this one) can take it as its local port: EADDRINUSE."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(10000, max(ephemeral, 10001))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # (none found below the range: the kernel's choice)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What a console script's ranks all import later, beyond its module: torch's optimizers import torch._dynamo when
# the first is built (1.5-4 s a rank).
ALSO_PRELOADED = {"fairseq-train": ("torch._dynamo",)}


def user_dir_is_this_plugin(args):
    """Whether the command's --user-dir (the last one, as argparse reads it) is this package's folder (fairseq
    refuses a second fairseq_moe)."""
    value = None
    for i, arg in enumerate(args):
        if arg == "--user-dir" and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--user-dir="):
            value = arg[len("--user-dir="):]
    return value is not None and os.path.abspath(value) == PACKAGE_DIR


def in_process(command, preload):
    """How a forked rank runs `command` (the rank's, with the distributed flags) in this interpreter, or None where
    it cannot (--start fork then means exec): (modules to import here first, run), run() called in the rank and
    returning what the program would exit with."""
    program, args = command[0], command[1:]
    if os.path.dirname(program) == os.path.dirname(os.path.abspath(sys.executable)):
        name = os.path.basename(program)
        scripts = importlib.metadata.entry_points(group="console_scripts").select(name=name)
        if scripts and os.path.abspath(program) != os.path.abspath(sys.executable):
            if not user_dir_is_this_plugin(args):
                return None  # (a plugin loaded here would then act in ranks that did not ask for it)
            script = next(iter(scripts))

            def run_script():
                sys.argv = [program, *args]
                script_folder(os.path.dirname(program))
                sys.path.insert(0, os.path.dirname(PACKAGE_DIR))  # what fairseq's import of the --user-dir does
                return script.load()()
            return [script.module, *ALSO_PRELOADED.get(name, ()), *preload], run_script
    if os.path.abspath(program) != os.path.abspath(sys.executable) or not args:
        return None
    first, rest = args[0], args[1:]
    if first == "-c" and rest:
        def run_code():
            sys.argv = ["-c", *rest[1:]]
            script_folder("")
            main = type(sys)("__main__")
            sys.modules["__main__"] = main
            exec(compile(rest[0], "<string>", "exec"), main.__dict__)
        return list(preload), run_code
    if first == "-m" and rest:
        import runpy

        def run_module():
            sys.argv = [rest[0], *rest[1:]]
            script_folder(os.getcwd())
            runpy.run_module(rest[0], run_name="__main__", alter_sys=True)
        return list(preload), run_module
    if not first.startswith("-") and os.path.isfile(first):
        import runpy

        def run_path():
            sys.argv = [first, *rest]
            script_folder(os.path.dirname(os.path.abspath(first)))
            runpy.run_path(first, run_name="__main__")
        return list(preload), run_path
    return None


def script_folder(folder):
    """sys.path[0] of a forked rank: its program's folder, where the launcher had its own."""
    if sys.path and sys.path[0] == _PATH0:
        sys.path[0] = folder
    else:
        sys.path.insert(0, folder)


class Forked:
    """A rank forked from this launcher, with the part of Popen's interface wait_all and stop use."""

    def __init__(self, pid):
        self.pid, self.returncode = pid, None

    def poll(self):
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its status is lost (Popen says 0 too)
                pid, status = self.pid, 0
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, signum):
        if self.poll() is None:  # (not reaped yet: the pid is still this rank's)
            os.kill(self.pid, signum)

    def kill(self):
        self.send_signal(signal.SIGKILL)


class RankExit(SystemExit):
    """Raised in a forked rank when its program has returned: it leaves the launcher's frames and ends this
    process as the interpreter ends any program (threads joined, atexit, open files flushed as modules go)."""


def fork_rank(run, env, preexec, fresh):
    """Fork a rank that runs run() with env as its environment and `fresh` as its signal dispositions. In the rank
    this never returns: the program's end (a return, SystemExit, an exception, KeyboardInterrupt) travels up to
    the interpreter, which ends the process as it would have ended the program started alone."""
    sys.stdout.flush()
    sys.stderr.flush()
    # Blocked across the fork: one that comes before the rank has its own dispositions waits for them (else
    # the launcher's handler, copied into the rank, would swallow it).
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    pid = os.fork()
    if pid:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        return Forked(pid)
    try:
        preexec()
        for signum, disposition in fresh.items():
            signal.signal(signum, disposition)
        os.environ.clear()
        os.environ.update(env)
        if "fairseq_moe.patches" in sys.modules:  # the patches that depend on the rank (FAIRSEQ_MOE_LAUNCH_RANK)
            sys.modules["fairseq_moe.patches"].apply()
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    raise RankExit(run())


def preload_program(modules, asked, parser):
    """Import the modules the ranks will fork with, in the program's order: a fairseq tool's module first, as its
    console script does (fairseq_cli.train sets up the log format before any fairseq import, which would set
    another). This package's hook that loads the plugin as soon as fairseq is imported is taken off first: the
    plugin loads after them, as a rank loads it (--user-dir, once its program is whole)."""
    plugin = sys.modules.get("fairseq_moe")
    if plugin is not None and hasattr(plugin, "_AfterFairseq"):
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, plugin._AfterFairseq)]
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as err:
            parser.error(f"--preload {module}: {err}" if module in asked else str(err))


def load_this_plugin():
    """The plugin loaded as a rank's `--user-dir` of this package loads it (fairseq's own import of a user dir,
    which then skips it in the ranks), and registered."""
    from fairseq import utils

    utils.import_user_module(argparse.Namespace(user_dir=PACKAGE_DIR))
    sys.modules["fairseq_moe"].load_plugin()


def start_rank(cmd, env, preexec, runner, fresh):
    """Start one rank: forked running runner (in_process's run), or cmd as its own program where runner is None."""
    if runner is None:
        return subprocess.Popen(cmd, env=env, preexec_fn=preexec)
    return fork_rank(runner, env, preexec, fresh)


def rank_command(command, nproc):
    """The command of every rank: the user's, plus the distributed flags it did not set itself."""
    given = {a.split("=")[0] for a in command if a.startswith("--")}
    for flag in ("--distributed-rank", "--distributed-init-method", "--distributed-port"):
        if flag in given:
            raise ValueError(f"{flag} is set by fairseq_moe.launch (through the environment); remove it")
    extra = [x for flag, value in (("--distributed-world-size", str(nproc)), ("--distributed-backend", "gloo"),
                                   ("--ddp-backend", "legacy_ddp")) if flag not in given for x in (flag, value)]
    # A console script of this interpreter's environment first (the venv need not be on PATH).
    beside = os.path.join(os.path.dirname(sys.executable), command[0])
    program = beside if os.path.isfile(beside) else shutil.which(command[0]) or command[0]
    return [program, *command[1:], *extra]


def build_parser():
    """The launcher's options (main's; what a caller that plans a launch reads them with)."""
    parser = argparse.ArgumentParser(prog="python -m fairseq_moe.launch", description=__doc__.split("\n\n")[0],
                                     usage="python -m fairseq_moe.launch --nproc N -- COMMAND ...")
    parser.add_argument("--nproc", type=int, required=True, help="processes (ranks) to start")
    parser.add_argument("--port", type=int, default=0, help="rendezvous port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--threads", type=int, default=0,
                        help="OMP_NUM_THREADS per rank (default: cores / nproc, at least 1)")
    parser.add_argument("--grace-seconds", type=float, default=GRACE_SECONDS,
                        help="after a signal or a failed rank, seconds the other ranks get to exit before "
                             f"they are killed with SIGKILL (default: {GRACE_SECONDS})")
    parser.add_argument("--start", choices=("fork", "exec"), default="fork",
                        help="fork: import the command once here and fork the ranks (one start-up, not one per rank) "
                             "where the command allows it (see above), else exec; exec: each rank its own program")
    parser.add_argument("--preload", action="append", default=[], metavar="MODULE",
                        help="with --start fork, a module to import before the ranks fork (repeatable; a console "
                             "script's own module is imported anyway). It must not run torch operations: a rank "
                             "forked after OpenMP's threads have started would wait for them forever")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the fairseq command")
    return parser


def rank_threads(args):
    """OMP_NUM_THREADS of every rank where the environment has none: --threads, or the cores split over --nproc."""
    return args.threads or max(1, (os.cpu_count() or 1) // args.nproc)


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.nproc < 1:
        parser.error(f"--nproc must be >= 1, got {args.nproc}")
    if not command:
        parser.error("no command given after --")
    port = args.port or free_port()
    threads = rank_threads(args)
    try:
        commands = [rank_command(command, args.nproc)] * args.nproc
    except ValueError as err:
        parser.error(str(err))
    how = in_process(commands[0], args.preload) if args.start == "fork" else None
    runner = None
    if how is not None:
        modules, runner = how
        # The threads the ranks will have, before torch, numpy and OpenMP are loaded here and read it.
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        preload_program(modules, args.preload, parser)
        if "fairseq" in sys.modules:
            if user_dir_is_this_plugin(commands[0][1:]):
                load_this_plugin()
            else:
                runner = None  # (the ranks would have fairseq here without the plugin they did not name: exec them)
    # A forked rank's dispositions are a fresh interpreter's: Python's SIGINT handler, the others' defaults.
    fresh = {signum: signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
             for signum in FORWARDED if signal.getsignal(signum) != signal.SIG_IGN}

    # Installed before any rank starts: a signal that comes while ranks start stops the launch, and
    # the ranks started by then get it too. The handler only records it; the wait loop passes it on.
    received = []
    for signum in FORWARDED:
        # One that is ignored stays so (nohup: a hangup must not stop the run), for the ranks too.
        if signal.getsignal(signum) != signal.SIG_IGN:
            signal.signal(signum, lambda signum, frame: received.append(signum))
    procs = []
    for rank, cmd in enumerate(commands):
        if received:
            break
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   LOCAL_RANK=str(rank), WORLD_SIZE=str(args.nproc), LOCAL_WORLD_SIZE=str(args.nproc),
                   FAIRSEQ_MOE_LAUNCH_RANK=str(rank))
        env.setdefault("OMP_NUM_THREADS", str(threads))
        procs.append(start_rank(cmd, env, die_with(os.getpid()), runner, fresh))
    return wait_all(procs, received, args.grace_seconds)


def wait_all(procs, received, grace):
    """Wait for every rank. At the first signal in `received`, pass it on to the ranks and return
    128 + its number, as a shell would; at the first failed rank, stop the rest and return its code."""
    while True:
        if received:
            stop(procs, received[0], grace)
            return 128 + received[0]
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            rank = next(r for r, c in enumerate(codes) if c not in (None, 0))
            how = f"signal {signal.Signals(-failed[0]).name}" if failed[0] < 0 else f"exit code {failed[0]}"
            print(f"fairseq_moe.launch: rank {rank} of {len(procs)} ended with {how}; the other ranks get "
                  f"{SETTLE_SECONDS} s to end, then are stopped", file=sys.stderr, flush=True)
            # The others often meet the same error a moment later (rank 0 prints it): let them end
            # on their own first; one left waiting in a collective is stopped after SETTLE_SECONDS.
            settle = time.monotonic() + SETTLE_SECONDS
            while any(p.poll() is None for p in procs) and time.monotonic() < settle and not received:
                time.sleep(0.1)
            stop(procs, signal.SIGTERM, grace)
            return failed[0]
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.1)


def stop(procs, signum, grace):
    """Send signum to the ranks still running and wait for them; SIGKILL those still running after
    `grace` seconds (one stuck in a collective or ignoring the signal would otherwise hold us forever)."""
    for p in procs:
        p.send_signal(signum)  # a no-op for a rank that has exited
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


if __name__ == "__main__":
    sys.exit(main())
