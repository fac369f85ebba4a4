"""fairseq_moe_kernels/backend.py: resolve() picks torch, grouped_mm or triton per --moe-kernel-backend, device and dtype,
and an explicit backend that cannot run is a ValueError naming the flag and the reason (no interpreter on
CPU, triton not importable, an unsupported device or dtype); auto never errors and never picks triton.
ops() returns each backend's five ops. `import fairseq_moe_kernels` works with triton blocked and imports no
triton module."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fairseq_moe_kernels import backend, reference


@pytest.fixture
def no_triton(monkeypatch):
    """`import triton` raises ImportError (a None entry in sys.modules blocks the import); the
    backend's cached answer to "does triton import?" is forgotten before and after."""
    backend._import_error.cache_clear()
    monkeypatch.setitem(sys.modules, "triton", None)
    yield
    backend._import_error.cache_clear()


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:1"])
def test_torch_is_always_torch(device):
    assert backend.resolve("torch", device) == "torch"


def test_auto_is_torch_on_cpu_even_with_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backend.resolve("auto", "cpu") == "torch"


def test_auto_is_grouped_mm_where_torch_runs_its_kernel_never_triton(monkeypatch):
    """auto takes the proven path: torch's grouped GEMM where PyTorch runs its own kernel (bf16 on compute
    capability 9.x/10.x), else the references; the Triton kernels (never run on a GPU yet) only when asked for."""
    from fairseq_moe_kernels import torch_grouped

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch_grouped, "supported", lambda device, dtype: True)
    for capability, dtype, want in (((9, 0), torch.bfloat16, "grouped_mm"), ((10, 0), torch.bfloat16, "grouped_mm"),
                                    ((9, 0), torch.float16, "torch"), ((9, 0), torch.float32, "torch"),
                                    ((8, 0), torch.bfloat16, "torch")):  # (A100: torch's own loop of mm calls)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert backend.resolve("auto", "cuda:0", dtype) == want, (capability, dtype)
    assert backend.resolve("auto", "cpu", torch.bfloat16) == "torch"  # (the CPU keeps the references)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU build's answer")
def test_auto_on_cuda_without_a_gpu_is_torch():
    assert backend.resolve("auto", "cuda:0", torch.bfloat16) == "torch"


def test_grouped_mm_where_it_cannot_run_is_an_error(monkeypatch):
    assert backend.resolve("grouped_mm", "cpu", torch.float32) == "grouped_mm"  # (torch's CPU kernel)
    monkeypatch.setattr(backend.torch_grouped, "supported", lambda device, dtype: False)
    with pytest.raises(ValueError, match=r"--moe-kernel-backend grouped_mm: torch .*grouped_mm does not run"):
        backend.resolve("grouped_mm", "cuda", torch.float16)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backend.resolve("triton", "cpu") == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match=r"--moe-kernel-backend triton.*TRITON_INTERPRET=1"):
        backend.resolve("triton", "cpu")


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_triton_not_importable_is_an_error(no_triton, monkeypatch, device):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match=r"--moe-kernel-backend triton.*triton cannot be imported"):
        backend.resolve("triton", device)


def test_triton_on_other_devices_is_an_error():
    with pytest.raises(ValueError, match=r"--moe-kernel-backend triton.*CUDA devices, not on 'meta'"):
        backend.resolve("triton", "meta")


def test_unknown_name():
    with pytest.raises(ValueError, match=r"--moe-kernel-backend must be one of"):
        backend.resolve("cutlass", "cpu")
    with pytest.raises(ValueError, match="resolved backend"):
        backend.ops("auto")


def test_torch_ops_are_the_references():
    ops = backend.ops("torch")
    for name in backend.OPS:
        assert getattr(ops, name) is getattr(reference, name)
    grouped = backend.ops("grouped_mm")
    for name in backend.OPS:
        assert getattr(grouped, name) is getattr(backend.torch_grouped if name in backend.GROUPED_MM_OPS
                                                 else reference, name)


def test_triton_ops():
    pytest.importorskip("triton")
    mlp = pytest.importorskip("fairseq_moe_kernels.triton_grouped_mlp")  # written separately
    from fairseq_moe_kernels import triton_permute, triton_router

    ops = backend.ops("triton")
    assert (ops.router, ops.permute, ops.unpermute) == (
        triton_router.router, triton_permute.permute, triton_permute.unpermute)
    assert (ops.grouped_mlp, ops.moe_mlp) == (mlp.grouped_mlp, mlp.moe_mlp)


@pytest.mark.slow
def test_import_kernels_without_triton():
    """A fresh interpreter where triton cannot be imported: kernels imports, the torch backend
    works, asking for triton says why, and importing kernels pulled in no triton module."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import fairseq_moe_kernels as kernels\n"
        "assert kernels.backend.resolve('auto', 'cuda') == 'torch'\n"
        "assert kernels.backend.ops('torch').router is kernels.router\n"
        "assert not [m for m in sys.modules if m.startswith('fairseq_moe_kernels.triton')]\n"
        "try:\n"
        "    kernels.backend.resolve('triton', 'cuda')\n"
        "except ValueError as e:\n"
        "    assert 'triton cannot be imported' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('no error')\n"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=120,
                   env={"PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})


def test_dtype_decides_too():
    """The Triton GEMMs compile for fp16/bf16/fp32: explicit triton says so for fp64."""
    assert backend.resolve("auto", "cuda", torch.float64) == "torch"
    assert backend.resolve("torch", "cpu", torch.float64) == "torch"
    with pytest.raises(ValueError, match="--moe-kernel-backend triton runs fp16, bf16 and fp32 tensors"):
        backend.resolve("triton", "cpu", torch.float64)


def installed_top_levels(dist):
    """The top-level import names a distribution installs: the first part of each file it recorded (a
    regular install), or the names its editable finder maps (`pip install -e .`: setuptools'
    __editable___NAME_finder.py, whose MAPPING is {import name: folder})."""
    import ast

    tops = set()
    for f in dist.files or ():
        first = f.parts[0]
        if first.startswith("__editable___") and first.endswith("_finder.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                target = node.target if isinstance(node, ast.AnnAssign) else (
                    node.targets[0] if isinstance(node, ast.Assign) else None)
                if getattr(target, "id", None) == "MAPPING":
                    tops |= set(ast.literal_eval(node.value))
        elif not first.endswith((".dist-info", ".pth")) and first != "__pycache__":
            tops.add(first)
    return tops


def test_installed_under_a_name_that_cannot_clash():
    """setup.py installs fairseq_moe_kernels/ under its own name: a top-level `kernels` would overwrite Hugging
    Face's package of that name (or be overwritten by it). The same for `pip install -e .`."""
    import importlib.metadata

    # What pip installed (its RECORD), not an egg-info that a build left in the checkout.
    installed = [d for d in importlib.metadata.distributions(name="fairseq-moe") if d.read_text("RECORD")]
    if not installed:
        pytest.skip("fairseq-moe is not installed here (scripts/test.sh installs it)")
    tops = installed_top_levels(installed[0])
    assert "fairseq_moe_kernels" in tops and "fairseq_moe" in tops and "kernels" not in tops, tops
