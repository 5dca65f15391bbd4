"""The built-in ``cpu`` backend.

It runs the ops' torch references, and the Triton kernels themselves when they were created under
``TRITON_INTERPRET=1`` (set before ``triton`` is imported): that is how the kernels are tested on
machines without an accelerator.

It declines ``vendor`` implementations: against kernels run by the interpreter, torch's CPU library
would win every selection, and the tests of the kernels would time the interpreter for nothing.
"""

from __future__ import annotations

import os
import platform

import torch

from dlcore.declarations.backend import Backend
from dlcore.declarations.device import DeviceProfile
from dlcore.declarations.implementation import Implementation
from dlcore.declarations.signature import Signature
from dlcore.plugins.hookspecs import hookimpl


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
        return None


@hookimpl
def dlcore_backends() -> list[Backend]:
    return [CpuBackend()]
