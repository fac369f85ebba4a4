"""fairseq_moe_kernels/cpu_adam.py: the compiled one-pass bf16 Adam step against its PyTorch reference (the same
signature, torch's ops one at a time) and against fairseq's own Adam step run in float64 over several steps; its
bf16 rounding against torch's conversion on the special values; its threads' chunks; bad input is one line; no
compiler is a reason, not a crash. With FAIRSEQ_MOE_CPU_ADAM=required (CI) a kernel that does not build here fails
these tests instead of skipping them."""
import os
import subprocess
import sys

import pytest
import torch

from fairseq_moe import patches
from fairseq_moe_kernels import cpu_adam

built = pytest.mark.skipif(os.environ.get("FAIRSEQ_MOE_CPU_ADAM") != "required" and not cpu_adam.available(),
                           reason=f"the CPU Adam kernel does not build here: {cpu_adam.unavailable_reason()}")

SETTINGS = [dict(lr=0.01, beta1=0.9, beta2=0.98, eps=1e-8, weight_decay=0.0),
            dict(lr=0.003, beta1=0.8, beta2=0.999, eps=1e-6, weight_decay=0.1)]


def tensors(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g)
    return [master, master.bfloat16(), torch.randn(n, generator=g).bfloat16(), torch.randn(n, generator=g) * 0.1,
            torch.rand(n, generator=g) * 0.01]


def largest_relative(got, want):
    return (got.double() - want.double()).abs().max().item() / max(want.double().abs().max().item(), 1e-30)


@built
@pytest.mark.parametrize("n", [1, 63, 65, 3 * 65536 + 77])
@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("grad_scale,threads", [(1.0, 1), (0.3, 2), (1 / 4096, 3)])
def test_kernel_is_its_reference_up_to_rounding(n, settings, grad_scale, threads):
    ours, ref = tensors(n), tensors(n)
    chunks = cpu_adam.adam_bf16_(*ours, **settings, step=4, grad_scale=grad_scale, threads=threads)
    cpu_adam.adam_bf16_reference(*ref, **settings, step=4, grad_scale=grad_scale)
    assert chunks == (1 if n < 2 * 65536 else threads)
    for name, got, want in zip(("master", "weight", "grad", "exp_avg", "exp_avg_sq"), ours, ref):
        if name == "grad":
            assert torch.equal(got, want)  # (read only)
        elif name != "weight":
            assert largest_relative(got, want) <= 1e-6, name
            assert not torch.equal(got, tensors(n)[("master", "weight", "grad", "exp_avg", "exp_avg_sq").index(name)])
    assert torch.equal(ours[1], ours[0].bfloat16())  # the weight: the master rounded as torch rounds it


@built
@pytest.mark.parametrize("settings", SETTINGS)
def test_several_steps_are_fairseqs_float64_step_up_to_rounding(settings):
    """Six steps of gradients that change scale: the kernel's master and moments are as near fairseq's own Adam
    in float64 (its step on a float64 master from the same bf16 gradients, unscaled in float64) as fairseq's own
    fp32 step (FP16Optimizer's path: the gradient made fp32, unscaled, fairseq's Adam) is."""
    from fairseq.optim.adam import Adam

    fairseq_step = patches.original("fairseq.optim.adam:Adam", "step")
    n, scale = 5000, 1 / 37.0
    start = torch.randn(n, generator=torch.Generator().manual_seed(1))
    exact = torch.nn.Parameter(start.double())
    plain = torch.nn.Parameter(start.clone())
    opts = [Adam([p], lr=settings["lr"], betas=(settings["beta1"], settings["beta2"]), eps=settings["eps"],
                 weight_decay=settings["weight_decay"]) for p in (exact, plain)]
    master, weight = start.clone(), start.bfloat16()
    m, v = torch.zeros(n), torch.zeros(n)
    for t in range(1, 7):
        grad = (torch.randn(n, generator=torch.Generator().manual_seed(100 + t)) * 10.0 ** (t % 3 - 1)).bfloat16()
        for p, opt in zip((exact, plain), opts):
            p.grad = grad.to(p.dtype) * scale
            fairseq_step(opt)
        cpu_adam.adam_bf16_(master, weight, grad, m, v, **settings, step=t, grad_scale=scale)
    for name, ours, theirs, want in (("master", master, plain.data, exact.data),
                                     ("exp_avg", m, opts[1].state[plain]["exp_avg"], opts[0].state[exact]["exp_avg"]),
                                     ("exp_avg_sq", v, opts[1].state[plain]["exp_avg_sq"],
                                      opts[0].state[exact]["exp_avg_sq"])):
        fairseq_error = (theirs.double() - want).abs().max().item()
        our_error = (ours.double() - want).abs().max().item()
        assert our_error <= 4 * fairseq_error + 1e-7 * want.abs().max().item(), (name, our_error, fairseq_error)
    assert opts[0].state[exact]["step"] == 6
    assert torch.equal(weight, master.bfloat16())


@built
def test_the_weight_rounds_special_values_as_torch_does():
    """A step of zero size leaves the master as it was: the weight is then the kernel's rounding of each value,
    which must be torch's (ties to even, overflow to inf, subnormals, signed zero, NaN)."""
    specials = torch.tensor([0.0, -0.0, 1.0, -1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -8 + 2 ** -20, 3.3895e38,
                             3.4028e38, float("inf"), float("-inf"), 1e-40, -1e-45, 1.17e-38, float("nan"), 65504.0,
                             -2.5e-3])
    n = specials.numel()
    master, weight = specials.clone(), torch.full((n,), 7.0, dtype=torch.bfloat16)
    cpu_adam.adam_bf16_(master, weight, torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n), torch.zeros(n),
                        lr=0.0, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, step=1)
    want = specials.bfloat16()
    assert torch.equal(master.isnan(), specials.isnan())
    assert torch.equal(weight.isnan(), want.isnan()) and weight.isnan().sum() == 1
    keep = ~want.isnan()
    assert torch.equal(weight[keep].view(torch.int16), want[keep].view(torch.int16))


def test_bad_input_is_one_line_naming_the_tensor():
    ts = tensors(10)
    ts[2] = ts[2].float()
    with pytest.raises(ValueError, match=r"adam_bf16_: grad must be a contiguous torch.bfloat16 CPU tensor"):
        cpu_adam.adam_bf16_reference(*ts, lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, step=1)
    ts = tensors(10)
    ts[3] = torch.zeros(20)[::2]
    with pytest.raises(ValueError, match="exp_avg must be"):
        cpu_adam.adam_bf16_(*ts, lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, step=1)


def test_without_a_compiler_it_says_so(monkeypatch, caplog):
    monkeypatch.setattr(cpu_adam, "_compiler", lambda: None)
    lib, why = cpu_adam._build.__wrapped__()
    assert lib is None and "no C compiler" in why
    assert "keeps torch's ops" in caplog.text


def test_a_missing_source_is_a_reason_not_a_crash(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_adam, "SOURCE", tmp_path / "gone.c")
    lib, why = cpu_adam._build.__wrapped__()
    assert lib is None and "gone.c" in why


@built
def test_a_folder_or_library_others_may_write_is_never_loaded(monkeypatch, tmp_path):
    """Anyone may create a name in /tmp first, or a library in a shared folder: such a folder or file is passed
    over for the next folder, and with none left the kernel is refused, each reason named."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_adam.tempfile, "tempdir", str(tmp_path / "tmp"))
    lib, why = cpu_adam._build.__wrapped__()
    assert lib is not None, why
    (so,) = (tmp_path / "cache" / "fairseq_moe").glob("*.so")
    so.chmod(0o777)
    (tmp_path / "tmp").mkdir()
    planted = tmp_path / "tmp" / f"fairseq_moe-{os.getuid()}"
    planted.mkdir(mode=0o777)
    planted.chmod(0o777)
    lib, why = cpu_adam._build.__wrapped__()
    assert lib is None and "no cache folder" in why
    assert f"{so} may be written by others (mode 777)" in why and f"{planted} may be written by others" in why
    so.chmod(0o700)
    planted.chmod(0o700)
    link = tmp_path / "cache" / "fairseq_moe"
    link.rename(tmp_path / "elsewhere")
    link.symlink_to(tmp_path / "elsewhere")
    lib, why = cpu_adam._build.__wrapped__()
    assert lib is not None and list(planted.glob("*.so")), "a linked cache is passed over for the next folder"


@built
def test_a_fresh_cache_builds_in_one_process_and_serves_the_next(tmp_path):
    """A new cache folder: the first process compiles into it (one whole file, no temporary left), the next loads
    that file without compiling."""
    code = ("import sys; from fairseq_moe_kernels import cpu_adam; lib = cpu_adam.library(); "
            "print(lib._name if lib is not None else 'NONE ' + cpu_adam.unavailable_reason())")
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path), PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(cpu_adam.__file__))), os.environ.get("PYTHONPATH", "")]))
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    files = sorted(p.name for p in (tmp_path / "fairseq_moe").iterdir() if p.suffix == ".so")
    assert len(files) == 1 and files[0].startswith("cpu_adam-"), files  # (and its lock file: no temporary left)
    built_at = (tmp_path / "fairseq_moe" / files[0]).stat().st_mtime_ns
    second = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert first.stdout == second.stdout and first.stdout.strip().endswith(files[0])
    assert (tmp_path / "fairseq_moe" / files[0]).stat().st_mtime_ns == built_at


def test_off_in_the_environment_keeps_torchs_ops(monkeypatch):
    monkeypatch.setenv("FAIRSEQ_MOE_CPU_ADAM", "off")
    monkeypatch.setattr(cpu_adam, "_compiler", lambda: pytest.fail("FAIRSEQ_MOE_CPU_ADAM=off looked for a compiler"))
    lib, why = cpu_adam._build.__wrapped__()
    assert lib is None and why == "FAIRSEQ_MOE_CPU_ADAM=off"


def test_a_failed_compile_is_noted_and_not_tried_again(monkeypatch, tmp_path):
    """A compiler that fails (or times out) leaves a note under the lock: for a while the node's other ranks refuse
    at once, naming the error and the note, instead of each compiling again; later, it is tried again."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    fake = tmp_path / "fakecc"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && { echo fakecc 1; exit 0; }\n"
                    "echo 'x.c: In function f:' >&2; echo 'x.c:3: error: broken here' >&2; exit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(cpu_adam, "_compiler", lambda: [str(fake)])
    lib, why = cpu_adam._build.__wrapped__()
    assert lib is None and "could not compile" in why and "error: broken here" in why, why
    (note,) = (tmp_path / "fairseq_moe").glob("cpu_adam-*.failed")
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && { echo fakecc 1; exit 0; }\ntouch " +
                    str(tmp_path / "compiled-again") + "\nexit 1\n")
    lib, why = cpu_adam._build.__wrapped__()
    assert lib is None and "error: broken here" in why and str(note) in why, why
    assert not (tmp_path / "compiled-again").exists()
    assert not list((tmp_path / "fairseq_moe").glob("*.so")), "no library, no temporary left"
    # An old note (a later run: the compiler may have been fixed since) is not taken: it compiles again.
    os.utime(note, (note.stat().st_atime, note.stat().st_mtime - cpu_adam.NOTE_S - 1))
    lib, why = cpu_adam._build.__wrapped__()
    assert lib is None and (tmp_path / "compiled-again").exists() and "(no message)" in why, why
