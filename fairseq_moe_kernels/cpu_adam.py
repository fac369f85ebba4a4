"""fairseq's Adam step of an fp32 master copy from a bf16 gradient, writing the bf16 weight back, in one pass over
memory on the CPU: adam_bf16_ (cpu_adam.c, compiled here at first use) and adam_bf16_reference (torch's ops, the
same signature and arithmetic: the ground truth of the tests).

Why: in --bf16 training fairseq's FP16Optimizer keeps an fp32 master of each bf16 parameter; per update it copies
the bf16 gradient into an fp32 master gradient, multiplies it by the 1 / sample size (and any clip), checks it is
finite, steps Adam on the master, and copies the master back into the bf16 weight: five passes over each tensor,
about 50 bytes a parameter with torch's CPU ops, where one pass needs 28 (gradient 2, master 8, moments 16, weight
2). With MoE the experts hold most parameters (E times an FFN's), while their FLOPs per token are one FFN's, so at
4,096 tokens per update these passes were a tenth of a bf16 update on one core (benchmarks/README.md). Measured on
this project's CPU (one core, 67 M parameters, 2026-12-04): the five passes 65 ms, this kernel 29 ms (plus 6 ms
for the finite check of the bf16 gradient, which stays apart: fairseq skips or stops an update on a non-finite
gradient before any parameter moves). No master gradient is kept at all (4 bytes a parameter less).

The kernel is plain C (no torch headers, no ninja): it is compiled with $CC, else the C compiler this Python was
built with (sysconfig's CC) where it is on PATH, else cc/gcc/clang, with -O3 -march=native, into a cache
($XDG_CACHE_HOME/fairseq_moe, else ~/.cache/fairseq_moe, else $TMPDIR/fairseq_moe-UID) under a name that hashes
the source, the compiler, its flags and this CPU's (a cluster's nodes may differ). The ranks of a node take a lock
file, so one compiles and the others load its file; the file is written to a temporary name and renamed (a
shared cache never holds half a file). A folder or library that another user owns or may write is never used
(anyone may create a name in /tmp first). Loaded, it is checked against the reference on 200,000 elements.
Where none of that works (no compiler, no usable folder, a mismatch, a compile over 300 s) library() says why in
one log line, and available() is False: callers keep torch's ops (hooks/masters.py), which compute the same up to
float rounding (torch's add_ with alpha may fuse a multiply-add; the kernel rounds each operation as written).
A compile that failed or timed out leaves a note beside the lock (cpu_adam-KEY.failed, its reason): for NOTE_S
seconds the node's other ranks refuse at once instead of each compiling again (a job's ranks start together); a
later run tries again (a compiler fixed, a header installed, a machine less loaded).
FAIRSEQ_MOE_CPU_ADAM=off in the environment keeps torch's ops without trying (to reproduce a run made without the
kernel: the two differ in float rounding).
"""
import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import shlex
import shutil
import subprocess
import stat
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

try:
    import fcntl
except ImportError:  # (Windows: no lock; each process compiles to its own temporary name)
    fcntl = None

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_adam.c")
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fPIC", "-shared", "-pthread")


def _scalars(lr, beta1, beta2, eps, weight_decay, step):
    """fairseq's per-step scalars, in Python's double as fairseq computes them."""
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    step_size = lr * math.sqrt(bias_correction2) / bias_correction1
    return dict(one_minus_beta1=1 - beta1, one_minus_beta2=1 - beta2, decay=-weight_decay * lr,
                step_size=-step_size, eps=eps)


def _check(master, weight, grad, exp_avg, exp_avg_sq):
    for name, t, dtype in (("master", master, torch.float32), ("weight", weight, torch.bfloat16),
                           ("grad", grad, torch.bfloat16), ("exp_avg", exp_avg, torch.float32),
                           ("exp_avg_sq", exp_avg_sq, torch.float32)):
        if (type(t) is not torch.Tensor or t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous()
                or t.shape != master.shape):
            raise ValueError(f"adam_bf16_: {name} must be a contiguous {dtype} CPU tensor of the master's shape "
                             f"{tuple(master.shape)}, not {type(t).__name__} {t.dtype} {t.device} {tuple(t.shape)}")


def adam_bf16_reference(master, weight, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step,
                        grad_scale=1.0, threads=None):
    """In place: step `step` (1 for the first) of fairseq's Adam on the fp32 master from the bf16 gradient times
    grad_scale (FP16Optimizer's multiply factor), the fp32 moments updated, the bf16 weight set to the master
    rounded. torch's ops, one at a time, as fairseq.optim.adam.Adam.step runs them after FP16Optimizer's unscale.
    threads: ignored (the kernel's; torch's ops use torch's threads)."""
    _check(master, weight, grad, exp_avg, exp_avg_sq)
    s = _scalars(lr, beta1, beta2, eps, weight_decay, step)
    g = grad.float()
    if grad_scale != 1.0:  # (FP16Optimizer skips a factor of 1)
        g.mul_(grad_scale)
    exp_avg.mul_(beta1).add_(g, alpha=s["one_minus_beta1"])
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=s["one_minus_beta2"])
    denom = exp_avg_sq.sqrt().add_(eps)
    if weight_decay != 0:
        master.add_(master, alpha=s["decay"])
    master.addcdiv_(exp_avg, denom, value=s["step_size"])
    weight.copy_(master)


def adam_bf16_(master, weight, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step,
               grad_scale=1.0, threads=None):
    """adam_bf16_reference's step by the compiled kernel, in one pass, on `threads` threads (default: torch's);
    -> the chunks it ran in. Raises RuntimeError where available() is False."""
    _check(master, weight, grad, exp_avg, exp_avg_sq)
    lib = library()
    if lib is None:
        raise RuntimeError(f"the CPU Adam kernel is not available here: {unavailable_reason()}")
    s = _scalars(lr, beta1, beta2, eps, weight_decay, step)
    f = ctypes.c_float
    return lib.fm_adam_bf16(
        *(ctypes.c_void_p(t.data_ptr()) for t in (master, weight, grad, exp_avg, exp_avg_sq)),
        ctypes.c_int64(master.numel()), f(grad_scale), f(beta1), f(s["one_minus_beta1"]), f(beta2),
        f(s["one_minus_beta2"]), f(s["decay"]), ctypes.c_int(weight_decay != 0), f(s["step_size"]), f(s["eps"]),
        ctypes.c_int(threads or torch.get_num_threads()))


def available():
    """Whether adam_bf16_ runs here (compiled, loaded and checked once per process)."""
    return library() is not None


def unavailable_reason():
    return _build()[1]


def library():
    return _build()[0]


def _compiler():
    """The C compiler's argv: $CC, else the one this Python was built with if it is here, else cc, gcc, clang."""
    for cc in (os.environ.get("CC"), sysconfig.get_config_var("CC")):
        argv = shlex.split(cc or "")
        if argv and shutil.which(argv[0]):
            return argv
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return [name]
    return None


def _cpu():
    """What -march=native compiles for: this CPU's model and feature flags (a shared cache serves every node)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


def _cache_dirs():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    yield Path(base) / "fairseq_moe"
    yield Path(tempfile.gettempdir()) / f"fairseq_moe-{os.getuid() if hasattr(os, 'getuid') else 'user'}"


def _not_ours(path, kind):
    """'' if `path` is a `kind` ('folder' or 'file', not a link) that this user owns and nobody else may write,
    else why not: a library is loaded from it, and a shared temporary folder's names can be taken by anyone."""
    st = os.lstat(path)
    if not (stat.S_ISDIR(st.st_mode) if kind == "folder" else stat.S_ISREG(st.st_mode)):
        return f"{path} is not a plain {kind}"
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"{path} belongs to uid {st.st_uid}, not to this user"
    if st.st_mode & 0o022:
        return f"{path} may be written by others (mode {stat.S_IMODE(st.st_mode):o})"
    return ""


@functools.lru_cache(maxsize=None)
def _build():
    """(the loaded, checked library, None) or (None, why not). Never raises: training keeps torch's ops."""
    try:
        return _build_or_raise()
    except Exception as e:  # (a missing source, a broken toolchain, a ctypes error: never a crashed training)
        return _refuse(f"{type(e).__name__}: {e}")


def _build_or_raise():
    if os.environ.get("FAIRSEQ_MOE_CPU_ADAM") == "off":
        return _refuse("FAIRSEQ_MOE_CPU_ADAM=off")
    cc = _compiler()
    if cc is None:
        return _refuse("no C compiler on PATH (cc, gcc or clang; or set CC)")
    try:
        version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return _refuse(f"{cc[0]} --version failed: {e}")
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(cc), version, " ".join(FLAGS), _cpu(),
                                    platform.machine()]).encode()).hexdigest()[:20]
    errors = []
    for folder in _cache_dirs():
        path = folder / f"cpu_adam-{key}.so"
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            why = _not_ours(folder, "folder")
        except OSError as e:
            why = f"{folder}: {e}"
        if why:
            errors.append(why)
            continue
        try:
            with open(folder / f".cpu_adam-{key}.lock", "a") as lock:
                if fcntl is not None:  # (ranks of one node compile once; the others wait and load its file)
                    fcntl.flock(lock, fcntl.LOCK_EX)
                failed = folder / f"cpu_adam-{key}.failed"
                if not path.exists() and failed.exists() and time.time() - failed.stat().st_mtime < NOTE_S:
                    # (another rank's failed compile, moments ago: the job's ranks start together)
                    return _refuse(f"{failed.read_text().strip()} (noted in {failed} less than {NOTE_S} s ago)")
                if not path.exists():
                    why = _compile(cc, folder, path)
                    if why:
                        failed.write_text(why + "\n")
                        return _refuse(why)
        except OSError as e:
            errors.append(f"{folder}: {e}")
            continue
        why = _not_ours(path, "file")
        if why:
            errors.append(why)
            continue
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            errors.append(f"{path}: {e}")
            continue
        lib.fm_adam_bf16.restype = ctypes.c_int
        lib.fm_adam_bf16.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] + [ctypes.c_float] * 6 + [
            ctypes.c_int, ctypes.c_float, ctypes.c_float, ctypes.c_int]
        wrong = _self_check(lib)
        if wrong:
            return _refuse(f"{path} disagrees with its reference ({wrong})")
        return lib, None
    return _refuse("no cache folder to build in: " + "; ".join(errors))


NOTE_S = 600  # how long a failed compile's note stands (above)


def _compile(cc, folder, path):
    """Compiles SOURCE into path (through a temporary name); -> '' or why not."""
    fd, tmp = tempfile.mkstemp(prefix=".cpu_adam-", suffix=".so", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run([*cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines()  # (the first error, not the linker driver's summary of it)
            message = next((ln for ln in lines if "error" in ln and not ln.startswith("collect2")),
                           lines[0] if lines else "(no message)")
            return f"{' '.join(cc)} could not compile {SOURCE}: {message.strip()}"
        os.chmod(tmp, 0o755)  # (whatever the linker and umask left: _not_ours refuses a file others may write)
        os.replace(tmp, path)
        return ""
    except subprocess.TimeoutExpired:
        return f"{' '.join(cc)} took over 300 s to compile {SOURCE}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _refuse(why):
    logger.warning("fairseq_moe_kernels.cpu_adam: %s; the bf16 master-weight step keeps torch's ops", why)
    return None, why


def _self_check(lib):
    """'' if the library's step equals the reference's up to float rounding on 200,000 elements (every chunk and
    the tail), each tensor's largest difference within 1e-6 of its largest element (1e-2 for the bf16 weight, one
    rounding step of bf16 where the masters round to either side), else what differed."""
    g = torch.Generator().manual_seed(0)
    n = 3 * 65536 + 77  # (several chunks on 3 threads, a tail past the vector width)
    settings = dict(lr=0.01, beta1=0.9, beta2=0.98, eps=1e-8, weight_decay=0.01, step=3, grad_scale=0.25)
    master = torch.randn(n, generator=g)
    tensors = [master, master.bfloat16(), torch.randn(n, generator=g).bfloat16(),
               torch.randn(n, generator=g) * 0.1, torch.rand(n, generator=g) * 0.01]
    ref = [t.clone() for t in tensors]
    adam_bf16_reference(*ref, **settings)
    f = ctypes.c_float
    s = _scalars(**{k: v for k, v in settings.items() if k != "grad_scale"})
    lib.fm_adam_bf16(*(ctypes.c_void_p(t.data_ptr()) for t in tensors), ctypes.c_int64(n), f(0.25), f(0.9),
                     f(s["one_minus_beta1"]), f(0.98), f(s["one_minus_beta2"]), f(s["decay"]), ctypes.c_int(1),
                     f(s["step_size"]), f(s["eps"]), ctypes.c_int(3))
    for name, got, want in zip(("master", "weight", "grad", "exp_avg", "exp_avg_sq"), tensors, ref):
        err = (got.double() - want.double()).abs().max().item() / want.double().abs().max().item()
        if err > (1e-2 if name == "weight" else 1e-6):
            return f"{name}: relative difference {err:.2g}"
    return ""
