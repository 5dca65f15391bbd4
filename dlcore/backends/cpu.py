"""The built-in ``cpu`` backend.

It runs the ops' torch references, and the Triton kernels themselves when they were created under
``TRITON_INTERPRET=1`` (set before ``triton`` is imported): that is how the kernels are tested on
machines without an accelerator.

It declines ``vendor`` implementations: against kernels run by the interpreter, torch's CPU library
would win every selection, and the tests of the kernels would time the interpreter for nothing.
"""

from __future__ import annotations

import functools
import os
import platform

import torch

from dlcore.declarations.backend import Backend
from dlcore.declarations.device import DeviceProfile
from dlcore.declarations.implementation import Implementation
from dlcore.declarations.signature import Signature
from dlcore.plugins.hookspecs import hookimpl


@functools.cache
def interpreter_problem() -> str | None:
    """Why the installed Triton's interpreter cannot run kernels here, if it cannot: Triton 3.6's
    fails on numpy 2.4 and newer (a TypeError converting arrays to scalars, raised deep in some
    kernels and not others)."""
    import numpy
    import triton

    numpy_version = tuple(int(p) for p in numpy.__version__.split(".")[:2] if p.isdigit())
    if triton.__version__.startswith("3.6.") and numpy_version >= (2, 4):
        return (f"Triton {triton.__version__}'s interpreter fails with numpy {numpy.__version__}: "
                "pip install 'numpy<2.4' (or a newer Triton)")
    return None


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


class CpuBackend(Backend):
    name = "cpu"
    device_types = ("cpu",)
    kinds = ("triton", "torch")
    hardware_timings = False

    def profile(self, device: torch.device) -> DeviceProfile:
        machine = platform.machine() or "unknown"
        return DeviceProfile(
            backend=self.name,
            vendor=platform.processor() or machine,
            name=f"{machine} CPU",
            arch=machine,
            cores=os.cpu_count() or 1,
            memory_bytes=_memory_bytes(),
        )

    def accepts(self, impl: Implementation, signature: Signature) -> str | None:
        if impl.kind == "vendor":
            return ("the cpu backend does not run vendor libraries: its Triton kernels run in the "
                    "interpreter, and timing them against torch's CPU library would choose the library every time")
        reason = super().accepts(impl, signature)
        if reason or impl.kind != "triton":
            return reason
        if not getattr(impl, "interpreted", False):
            return ("Triton kernels run on the CPU only in the interpreter: "
                    "set TRITON_INTERPRET=1 before importing triton")
        if any(spec.dtype == torch.bfloat16 for _, spec in signature.tensors):
            return "the Triton interpreter computes bfloat16 wrongly; run bfloat16 on an accelerator"
        return interpreter_problem()


@hookimpl
def dlcore_backends() -> list[Backend]:
    return [CpuBackend()]
