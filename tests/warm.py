"""The tests' commands started warm: `run` and `Popen` stand in for subprocess's, and where a command's start-up
is known (a fairseq console script of this environment with `--user-dir` naming this plugin, alone or under
`python -m fairseq_moe.launch` forking its ranks) it is forked from a server process that has already imported what
that command imports first, in the same order (fairseq_moe.launch's own preload: the tool's module, torch._dynamo
for fairseq-train, then the plugin through fairseq's import of the --user-dir). A cold start costs 6-8 s of CPU
(torch, fairseq, the plugin) on this project's 2-core machines; the suite starts about a hundred of them.

The forked command is the process a cold start would be, past its imports: its own pid (signals, process groups and
exit statuses as subprocess gives them: start_new_session makes it a group leader), the argv, sys.path[0],
environment, working directory, stdin/stdout/stderr and signal dispositions a cold start has, the plugin's patches
applied again for its environment, and the end of a program started alone (fairseq_moe.launch.fork_rank, as the
launcher forks a rank). What the server's imports printed is written to the command's stdout and stderr first.
NumPy's global generator is seeded anew, as in a cold process. What differs: the commands of one server share its
hash seed (str hashes, set orders), where cold processes each draw one; and ps shows the server's command line.

A server is started per (imports, environment), where the environment is the command's apart from RUNTIME_ENV, the
variables read only after start-up, and AFTER_START_ENV's, set during the suite and no part of a start-up
(OMP_NUM_THREADS is read when torch is imported: its value is part of the key).
Anything else (python -c, other modules, a plugin not named, cwd or env variants the key cannot hold) runs cold,
through subprocess itself; so does everything with FAIRSEQ_MOE_TESTS_COLD=1 in the environment, to compare.
"""
import atexit
import contextlib
import importlib
import inspect
import io
import json
import logging
import os
import pickle
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from fairseq_moe import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Read after the start-up by the programs the server runs (the launcher's rendezvous, the rank, pytest's own note).
RUNTIME_ENV = frozenset({"PYTEST_CURRENT_TEST", "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                         "LOCAL_WORLD_SIZE", "FAIRSEQ_MOE_LAUNCH_RANK"})
# Set in the tests' own process during the suite, and no part of a start-up: torch's inductor reads its cache folder
# when it compiles (from the command's environment, which a forked command has), and fairseq's iterators set this
# PYTHONWARNINGS for their DataLoader workers (a filter of a warning Python 3.8 renamed: it matches nothing). Without
# them in the key, the suite starts 15 servers fewer (of about 30, 6-7 s of CPU each).
AFTER_START_ENV = {"TORCHINDUCTOR_CACHE_DIR": None, "PYTHONWARNINGS": "ignore:semaphore_tracker:UserWarning"}
START_SECONDS = 300  # for a server's imports, on a busy machine


def _launcher_options(args):
    """fairseq_moe.launch's options for `python -m fairseq_moe.launch ARGS` (its own parser), or None where they
    are a usage error (the launcher's to print: cold)."""
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            options = launch.build_parser().parse_args(args)
    except SystemExit:
        return None
    options.command = options.command[1:] if options.command[:1] == ["--"] else options.command
    return options if options.nproc > 0 and options.command else None


def _names_this_plugin(args):
    """Whether args' --user-dir is this package's folder, given as an absolute path (a relative one is resolved
    against the command's working directory, by fairseq: such commands run cold)."""
    values = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--user-dir"]
    values += [a.split("=", 1)[1] for a in args if a.startswith("--user-dir=")]
    return bool(values) and all(os.path.isabs(v) for v in values) and launch.user_dir_is_this_plugin(args)


def _tool(program):
    return os.path.basename(program).startswith("fairseq-") or program == sys.executable


def plan(cmd, env, cwd=None):
    """(how it starts: "launch" or "alone", then the modules it imports first; the environment its server starts
    with), or None: run it cold."""
    if os.environ.get("FAIRSEQ_MOE_TESTS_COLD") or not isinstance(cmd, (list, tuple)) or not cmd:
        return None
    cmd = [str(c) for c in cmd]
    if cmd[1:3] == ["-m", "fairseq_moe.launch"] and cmd[0] == sys.executable:
        if os.path.abspath(cwd or os.getcwd()) != ROOT:  # (cold, `-m` finds fairseq_moe from the cwd first)
            return None
        options = _launcher_options(cmd[3:])
        if options is None or options.start != "fork":
            return None
        try:
            rank = launch.rank_command(options.command, options.nproc)
        except ValueError:
            return None
        how = launch.in_process(rank, options.preload)
        # (what the launcher forks; a rank with nothing to import first gains nothing here)
        if how is None or not how[0] or not _tool(rank[0]) or not _names_this_plugin(rank[1:]):
            return None
        # What the launcher sets before its imports, where the environment has none.
        env = dict(env, OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", str(launch.rank_threads(options))))
        return ("launch", *how[0]), env
    how = launch.in_process(cmd, [])
    if how is None or not how[0] or not _tool(cmd[0]) or not _names_this_plugin(cmd[1:]):
        return None
    return ("alone", *how[0]), dict(env)


class Server:
    """A process that has imported `modules` and forks the commands sent to it (serve)."""

    def __init__(self, modules, env):
        self.folder = tempfile.mkdtemp(prefix="warm-")
        self.path = os.path.join(self.folder, "socket")
        self.log = open(os.path.join(self.folder, "log"), "w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.warm", self.path, *modules], cwd=ROOT,
                                     env=env, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
                                     preexec_fn=launch.die_with(os.getpid()))

    def connect(self):
        deadline = time.monotonic() + START_SECONDS
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                sock.connect(self.path)
                return sock
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.log.seek(0)
                    raise RuntimeError(f"the warm server for {self.proc.args[3:]} did not start:\n{self.log.read()}")
                time.sleep(0.05)

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()
        shutil.rmtree(self.folder, ignore_errors=True)


_SERVERS = {}


def _start_env(env):
    """What of env a server starts with: not RUNTIME_ENV, nor AFTER_START_ENV's (a name, or that name's value)."""
    return {k: v for k, v in env.items()
            if k not in RUNTIME_ENV and not (k in AFTER_START_ENV and AFTER_START_ENV[k] in (None, v))}


def _server(modules, env):
    start = _start_env(env)
    key = (modules, frozenset(start.items()))
    if key not in _SERVERS or _SERVERS[key].proc.poll() is not None:
        _SERVERS[key] = Server(modules, start)
    return _SERVERS[key]


@atexit.register
def _close_servers():
    for server in _SERVERS.values():
        server.close()


def _fd(spec, default, pipes, reading):
    """The fd a child gets for stdin/stdout/stderr `spec`, noting a pipe's other end in pipes."""
    if spec is None:
        return os.dup(default)
    if spec == subprocess.DEVNULL:
        return os.open(os.devnull, os.O_RDONLY if reading else os.O_WRONLY)
    if spec == subprocess.PIPE:
        r, w = os.pipe()
        pipes.append(w if reading else r)
        return r if reading else w
    return os.dup(spec if isinstance(spec, int) else spec.fileno())


class WarmPopen:
    """What subprocess.Popen gives the tests (pid, poll, wait, communicate, send_signal, kill, returncode, the
    pipes), for a command forked by a Server."""

    def __init__(self, server, args, stdin=None, stdout=None, stderr=None, text=False, env=None, cwd=None,
                 start_new_session=False, call=None):
        self.args, self.returncode = args, None
        ends = []
        fds = [_fd(stdin, 0, ends, True), _fd(stdout, 1, ends, False)]
        fds.append(os.dup(fds[1]) if stderr == subprocess.STDOUT else _fd(stderr, 2, ends, False))
        mode = "" if text else "b"
        files = iter(ends)
        self.stdin = open(next(files), "w" + mode) if stdin == subprocess.PIPE else None
        self.stdout = open(next(files), "r" + mode) if stdout == subprocess.PIPE else None
        self.stderr = open(next(files), "r" + mode) if stderr == subprocess.PIPE else None
        request = dict(argv=[str(a) for a in args], env=dict(os.environ if env is None else env),
                       cwd=os.path.abspath(cwd or os.getcwd()), session=bool(start_new_session), call=call,
                       umask=_umask(), ignored=[s for s in launch.FORWARDED if signal.getsignal(s) == signal.SIG_IGN])
        try:
            self._sock = server.connect()
            socket.send_fds(self._sock, [json.dumps(request).encode()], fds)
        finally:
            for fd in fds:
                os.close(fd)
        reply = self._sock.recv(1 << 16)
        if not reply:
            raise RuntimeError(f"the warm server did not start {args}")
        self.pid = json.loads(reply)["pid"]
        self._readers = None

    def poll(self):
        if self.returncode is None and select.select([self._sock], [], [], 0)[0]:
            self._read_status()
        return self.returncode

    def _read_status(self):
        reply = self._sock.recv(1 << 16)
        self.returncode = json.loads(reply)["returncode"] if reply else -signal.SIGKILL  # (the server died)
        self._sock.close()

    def wait(self, timeout=None):
        if self.returncode is None:
            if not select.select([self._sock], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read_status()
        return self.returncode

    def communicate(self, input=None, timeout=None):
        if self._readers is None:
            self._out = {}

            def read(name, stream):
                self._out[name] = stream.read()
                stream.close()

            def write():
                try:
                    if input:
                        self.stdin.write(input)
                    self.stdin.close()
                except BrokenPipeError:
                    pass
            self._readers = [threading.Thread(target=read, args=(name, stream), daemon=True)
                             for name, stream in (("stdout", self.stdout), ("stderr", self.stderr)) if stream]
            if self.stdin is not None:
                self._readers.append(threading.Thread(target=write, daemon=True))
            for thread in self._readers:
                thread.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self._readers:
            thread.join(None if deadline is None else max(0, deadline - time.monotonic()))
            if thread.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0, deadline - time.monotonic()))
        return self._out.get("stdout"), self._out.get("stderr")

    def send_signal(self, signum):
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:  # (ended, its status not read yet)
                pass

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for stream in (self.stdout, self.stderr, self.stdin):
            if stream is not None and self._readers is None:
                stream.close()
        self.wait()


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


_WARM_KEYWORDS = {"stdin", "stdout", "stderr", "text", "env", "cwd", "start_new_session"}


def Popen(args, **kwargs):
    """subprocess.Popen(args, **kwargs), warm where plan() knows the command."""
    how = plan(args, dict(os.environ if kwargs.get("env") is None else kwargs["env"]), kwargs.get("cwd"))
    if how is None or set(kwargs) - _WARM_KEYWORDS:
        return subprocess.Popen(args, **kwargs)
    return WarmPopen(_server(*how), args, **kwargs)


def run(args, input=None, capture_output=False, timeout=None, check=False, **kwargs):
    """subprocess.run(...), warm where plan() knows the command."""
    if capture_output:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    with Popen(args, **kwargs) as proc:
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:  # (as subprocess.run: killed, waited for, the exception raised)
            proc.kill()
            proc.wait()
            raise
        except BaseException:
            proc.kill()
            raise
    done = subprocess.CompletedProcess(args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


def spawn(fn, nprocs, args=()):
    """torch.multiprocessing.spawn(fn, args, nprocs, join=True): fn(rank, *args) in nprocs processes, forked from a
    server that has imported fn's module and those of the functions in args, which is what a spawned process imports
    to unpickle them (torch, and fairseq where they import it), with this process's environment, working directory
    and stdout/stderr. As spawn does, the first process to fail stops the others and raises
    torch.multiprocessing.ProcessExitedException."""
    import torch.multiprocessing as mp

    if os.environ.get("FAIRSEQ_MOE_TESTS_COLD"):
        return mp.spawn(fn, args=args, nprocs=nprocs, join=True)
    env = dict(os.environ)
    # (and the modules of the functions among args, which the spawned process imports to unpickle them too)
    modules = dict.fromkeys([fn.__module__, *(a.__module__ for a in args if inspect.isfunction(a))])
    server = _server(("spawn", *modules), env)
    folder = tempfile.mkdtemp(prefix="warm-spawn-")
    try:
        procs = []
        for rank in range(nprocs):
            call = os.path.join(folder, str(rank))
            with open(call, "wb") as f:
                pickle.dump((fn, rank, tuple(args)), f)
            procs.append(WarmPopen(server, ["spawn", f"{fn.__module__}.{fn.__qualname__}", str(rank)],
                                   stdin=subprocess.DEVNULL, env=env, call=call))
        while not any(p.returncode for p in procs) and any(p.poll() is None for p in procs):
            time.sleep(0.02)
        failed = next(((rank, p.returncode) for rank, p in enumerate(procs) if p.returncode), None)
        for p in procs:
            p.kill()
            p.wait()
    finally:
        for name in os.listdir(folder):
            os.remove(os.path.join(folder, name))
        os.rmdir(folder)
    if failed is not None:
        rank, code = failed
        name = signal.Signals(-code).name if code < 0 else None
        how = f"was killed by signal {name}" if name else f"terminated with exit code {code}"
        raise mp.ProcessExitedException(f"process {rank} {how}", error_index=rank, error_pid=procs[rank].pid,
                                        exit_code=code, signal_name=name)


# The server.

def serve(path, start, modules):
    """Import `modules` as fairseq_moe.launch does before it forks, then fork every command sent to `path`."""
    parser = type("Parser", (), {"error": staticmethod(lambda message: sys.exit(f"warm server: {message}"))})
    start_out, start_err = _capture_start(lambda: _preload(start, modules, parser))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path + ".new")
    listener.listen(64)
    os.rename(path + ".new", path)  # (a client connects only once it is listening)
    children = {}
    parent = os.getppid()
    while os.getppid() == parent:
        ready = select.select([listener], [], [], 0.05)[0]
        if ready:
            conn, _ = listener.accept()
            fds = []
            try:  # (a request that fails is that request's: the server and the other commands go on)
                message, fds, _, _ = socket.recv_fds(conn, 1 << 22, 3)
                child = _fork(json.loads(message), fds, [listener, conn, *children.values()], start_out, start_err)
                children[child.pid] = conn
                conn.send(json.dumps({"pid": child.pid}).encode())
            except Exception:
                traceback.print_exc()
                if conn not in children.values():
                    conn.close()
            for fd in fds:
                os.close(fd)
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                conn = children.pop(pid)
                try:
                    conn.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
                except OSError:
                    pass  # (the test went away)
                conn.close()


def _preload(start, modules, parser):
    if start == "spawn":  # (fn's module, as a spawned process imports it: the plugin's import hook kept)
        for module in modules:
            importlib.import_module(module)
        return
    launch.preload_program(modules, [], parser)
    if "fairseq" in sys.modules:
        # fairseq notes that the plugin is imported already (this module imported fairseq_moe.launch, as the
        # launcher has): a fairseq tool started alone imports it first, in its parse of --user-dir.
        quiet = start == "alone" and _AlreadyImported()
        logger = logging.getLogger("fairseq.utils")
        if quiet:
            logger.addFilter(quiet)
        launch.load_this_plugin()
        if quiet:
            logger.removeFilter(quiet)


class _AlreadyImported:
    def filter(self, record):
        return not str(record.msg).endswith("has already been imported.")


def _capture_start(work):
    """Run work() with this process's stdout and stderr (fds 1, 2) going to files; -> what they got (bytes)."""
    saved, files = [os.dup(1), os.dup(2)], [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, file in zip((1, 2), files):
        os.dup2(file.fileno(), fd)
    try:
        work()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
    out = []
    for file in files:
        file.seek(0)
        out.append(file.read())
        file.close()
    return out


def _fork(request, fds, sockets, start_out, start_err):
    """Fork the command of `request` with fds as its stdin, stdout and stderr."""
    how = (None, _called(request["call"])) if request.get("call") else launch.in_process(request["argv"], [])
    if how is None:
        raise RuntimeError(f"warm server: cannot run {request['argv']}")
    parent = os.getpid()
    started, ready = os.pipe()  # (the pid is told once the child is set up, as Popen returns after exec)

    def preexec():
        os.close(started)
        launch.die_with(parent)()
        for fd, target in zip(fds, (0, 1, 2)):
            os.dup2(fd, target)
        for fd in fds:
            os.close(fd)
        for sock in sockets:
            sock.close()
        if request["session"]:
            os.setsid()
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        if request["argv"][1:2] == ["-m"]:  # (a cold `python -m MODULE` has not imported MODULE before it runs it)
            sys.modules.pop(request["argv"][2], None)
        if "numpy" in sys.modules:  # (NumPy's global generator: seeded from the OS in every cold process)
            sys.modules["numpy"].random.seed()
        os.close(ready)  # (before the replay: the caller reads its pipes only once it has the pid)
        for fd, text in ((1, start_out), (2, start_err)):
            while text:
                text = text[os.write(fd, text):]

    # A cold start's dispositions: Python's SIGINT handler and the defaults, but what the caller ignores is ignored.
    fresh = {signum: signal.SIG_IGN if signum in request["ignored"] else
             signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL for signum in launch.FORWARDED}
    child = launch.fork_rank(how[1], request["env"], preexec, fresh)
    os.close(ready)
    os.read(started, 1)  # (EOF: the child closed its end, or died setting up)
    os.close(started)
    return child


def _called(path):
    """A spawned process's work: fn(rank, *args), unpickled from path (its module is imported)."""
    def run():
        sys.argv = ["-c"]
        with open(path, "rb") as f:
            fn, rank, args = pickle.load(f)
        fn(rank, *args)
    return run


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2], sys.argv[3:])
