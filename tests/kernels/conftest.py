"""Shared fixtures of the kernel tests.

Without a CUDA device the kernels run in Triton's interpreter on CPU tensors; that needs
``TRITON_INTERPRET=1`` before triton is first imported, which is set here when it is missing.
The interpreter gets bfloat16 math wrong, so bfloat16 is tested on a GPU only.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dlcore.declarations.device import DeviceProfile  # noqa: E402
from dlcore.declarations.implementation import KernelCall  # noqa: E402
from dlcore.declarations.signature import make_signature  # noqa: E402
from dlcore.runtime import replay  # noqa: E402
from dlcore.runtime.profile import first_device  # noqa: E402
from dlcore.runtime.template import device_profile  # noqa: E402
from dlcore.testing import poison, strided_like  # noqa: E402

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "dtype" in metafunc.fixturenames:
        metafunc.parametrize("dtype", DTYPES, ids=[str(d).removeprefix("torch.") for d in DTYPES])


@pytest.fixture(autouse=True)
def triton_candidates_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the Triton kernels: the vendor candidates (``dlblas_kernels/vendor.py``)
    are left out of get_op's selection, which on a GPU might otherwise choose cuBLAS."""
    monkeypatch.setenv("DLCORE_DISABLE_IMPLS", "matmul:torch,ffn:torch,fused_moe:torch,fp8_gemm:scaled_mm")


@pytest.fixture
def device() -> str:
    return "cuda" if ON_GPU else "cpu"


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """A generator seeded per test (from its id): inputs differ between tests, and reruns repeat."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any kernel launch fails the test."""

    def launch(self: KernelCall) -> None:
        raise AssertionError(f"{self.kernel} was launched")

    monkeypatch.setattr(KernelCall, "launch", launch)


def _tensors(result) -> list[torch.Tensor]:
    return [t for t in (result if isinstance(result, (tuple, list)) else (result,)) if isinstance(t, torch.Tensor)]


@pytest.fixture
def launch():
    """``launch(plan)``: run a launch plan with its outputs poisoned (NaN) first; return its result.
    Not for plans that write into their inputs (in-place ops)."""

    def _launch(plan):
        for t in _tensors(plan.result):
            poison(t)
        return plan.run()

    return _launch


@pytest.fixture
def run(launch):
    """``run(op, impl, args, config=None)``: run ``impl``'s plan on bound ``args`` with its outputs
    poisoned (NaN) before the launch; ``config`` defaults to the one the public function uses."""

    def _run(op, impl, args: tuple, config: dict | None = None):
        if config is None:
            config = impl.default_config(make_signature(op, args, args[0].device), device_profile(args[0].device))
        return launch(impl.plan(args, config, device_profile(first_device(args))))

    return _run


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list:
    """The kernel launches of the test so far, as ``(kernel name, kwargs)``; the launches still run.

    Launch replays are turned off meanwhile: on a GPU, a custom op's body replays what an earlier
    call (perhaps another test's) recorded, calling the compiled kernels without a launch plan."""
    seen: list = []
    original = KernelCall.launch

    def launch(self: KernelCall) -> None:
        seen.append((self.kernel.__name__, dict(self.kwargs)))
        original(self)

    monkeypatch.setattr(KernelCall, "launch", launch)
    monkeypatch.setattr(replay.Replay, "__call__", lambda self, args: self._planned(args).run())
    return seen


@pytest.fixture(params=["pad", "column step"])
def relayout(request: pytest.FixtureRequest):
    """``relayout(t)``: a non-contiguous copy of ``t`` with the same values, in two ``rows`` layouts:
    ``pad`` (row stride > row length) and ``column step`` (every other element of wider rows:
    a last-dimension stride of 2)."""

    def _relayout(t: torch.Tensor) -> torch.Tensor:
        if request.param == "pad":
            return strided_like(t, "pad")
        wide = poison(torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device))
        view = wide[..., ::2]
        view.copy_(t)
        return view

    return _relayout


@pytest.fixture
def profile(device: str) -> DeviceProfile:
    """The profile of the test device, as the kernels' plans get it."""
    return device_profile(torch.device(device))
