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
"""
import argparse
import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time

SETTLE_SECONDS = 5  # after a rank fails, before the others are stopped
GRACE_SECONDS = 30  # default time ranks get to exit (and save) after a stop, before SIGKILL
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


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


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m fairseq_moe.launch", description=__doc__.split("\n\n")[0],
                                     usage="python -m fairseq_moe.launch --nproc N -- COMMAND ...")
    parser.add_argument("--nproc", type=int, required=True, help="processes (ranks) to start")
    parser.add_argument("--port", type=int, default=0, help="rendezvous port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--threads", type=int, default=0,
                        help="OMP_NUM_THREADS per rank (default: cores / nproc, at least 1)")
    parser.add_argument("--grace-seconds", type=float, default=GRACE_SECONDS,
                        help="after a signal or a failed rank, seconds the other ranks get to exit before "
                             f"they are killed with SIGKILL (default: {GRACE_SECONDS})")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the fairseq command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.nproc < 1:
        parser.error(f"--nproc must be >= 1, got {args.nproc}")
    if not command:
        parser.error("no command given after --")
    port = args.port or free_port()
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.nproc)
    try:
        commands = [rank_command(command, args.nproc)] * args.nproc
    except ValueError as err:
        parser.error(str(err))

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
        procs.append(subprocess.Popen(cmd, env=env, preexec_fn=die_with(os.getpid())))
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
