"""Backends: lazy detection of vendor runtimes, clear reasons when absent, profiles when present."""

import sys
import textwrap

import pytest
import torch
from dlc_ascend.backend import AscendBackend
from dlc_cuda.backend import CudaBackend
from dlc_mlu.backend import MluBackend

from dlcore.backends.cpu import CpuBackend

FAKE_RUNTIME = """
import types
import torch

class _Props:
    name = {name!r}
    total_memory = 64 * 2**30
    {extra}

torch.{attr} = types.SimpleNamespace(
    is_available=lambda: {available},
    get_device_properties=lambda device: _Props(),
    synchronize=lambda device=None: None,
)
"""


@pytest.fixture
def fake_runtime(tmp_path, monkeypatch):
    """Install a fake vendor runtime module (``torch_npu`` / ``torch_mlu``) on the path.

    Without the real runtime torch cannot name an npu or mlu device, so profiles are asked for
    device index 0.
    """

    def install(module: str, attr: str, source: str) -> None:
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.delitem(sys.modules, module, raising=False)
        monkeypatch.setattr(torch, attr, None, raising=False)

    yield install
    for module in ("torch_npu", "torch_mlu"):
        sys.modules.pop(module, None)


@pytest.mark.parametrize("backend, module", [(AscendBackend, "torch_npu"), (MluBackend, "torch_mlu")])
def test_absent_runtime_is_a_reason_not_a_crash(backend, module):
    availability = backend().available()
    assert not availability
    assert f"{module} is not installed" in availability.reason


@pytest.mark.parametrize("backend, module", [(AscendBackend, "torch_npu"), (MluBackend, "torch_mlu")])
def test_runtime_that_fails_to_import(fake_runtime, backend, module):
    fake_runtime(module, module.removeprefix("torch_"), "raise OSError('libascendcl.so: cannot open shared object')")
    availability = backend().available()
    assert not availability
    assert "failed to import: OSError: libascendcl.so" in availability.reason


def test_ascend_profile_from_torch_npu(fake_runtime):
    fake_runtime("torch_npu", "npu", FAKE_RUNTIME.format(name="Ascend910B2", attr="npu", available=True,
                                                         extra="cube_core_num = 24"))
    backend = AscendBackend()
    assert backend.available()
    profile = backend.profile(0)
    assert (profile.backend, profile.vendor, profile.arch, profile.cores) == ("npu", "huawei", "Ascend910B2", 24)


def test_ascend_core_count_from_the_chip_table(fake_runtime):
    fake_runtime("torch_npu", "npu", FAKE_RUNTIME.format(name="Ascend910B3", attr="npu", available=True, extra=""))
    assert AscendBackend().profile(0).cores == 20


def test_ascend_without_a_visible_device(fake_runtime):
    fake_runtime("torch_npu", "npu", FAKE_RUNTIME.format(name="Ascend910B3", attr="npu", available=False, extra=""))
    availability = AscendBackend().available()
    assert not availability and "is_available() is False" in availability.reason


def test_mlu_profile_from_torch_mlu(fake_runtime):
    fake_runtime("torch_mlu", "mlu", FAKE_RUNTIME.format(
        name="MLU370", attr="mlu", available=True, extra="cluster_count = 8\n    core_num_per_cluster = 4"))
    backend = MluBackend()
    assert backend.available()
    profile = backend.profile(0)
    assert (profile.vendor, profile.cores, profile.programs_per_core) == ("cambricon", 8, 4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_cuda_unavailable_without_a_gpu():
    availability = CudaBackend().available()
    assert not availability and "torch.cuda.is_available() is False" in availability.reason


@pytest.mark.gpu
def test_cuda_profile():
    profile = CudaBackend().profile(torch.device("cuda", 0))
    assert profile.cores > 0 and profile.memory_bytes > 0 and profile.arch.startswith(("sm_", "gfx"))


def test_cpu_profile():
    profile = CpuBackend().profile(torch.device("cpu"))
    assert profile.backend == "cpu" and profile.cores >= 1 and profile.arch


@pytest.mark.parametrize("triton_version, numpy_version, declines", [
    ("3.6.0", "2.4.1", True), ("3.6.0", "2.3.5", False), ("3.9.0", "2.4.1", False), ("3.6.0", "1.26.4", False),
])
def test_cpu_names_an_interpreter_that_cannot_run(monkeypatch, triton_version, numpy_version, declines):
    """Triton 3.6's interpreter fails on numpy 2.4 and newer: the cpu backend says so, with the fix,
    rather than letting some kernels raise a TypeError from inside the interpreter."""
    import numpy
    import triton

    from dlcore.backends import cpu

    monkeypatch.setattr(triton, "__version__", triton_version)
    monkeypatch.setattr(numpy, "__version__", numpy_version)
    cpu.interpreter_problem.cache_clear()
    try:
        problem = cpu.interpreter_problem()
    finally:
        cpu.interpreter_problem.cache_clear()
    assert (problem is not None) == declines
    if declines:
        assert "pip install 'numpy<2.4'" in problem and numpy_version in problem
