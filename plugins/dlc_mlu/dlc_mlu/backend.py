"""The ``mlu`` backend: Cambricon MLUs through torch_mlu, imported only when first asked.

Device numbers: :mod:`dlc_mlu.runtime`; timing: MLU events; search spaces: :mod:`dlc_mlu.refine`;
lowering: :mod:`dlc_mlu.stages` (TTIR from upstream Triton, then the Cambricon tools that are
installed; the toolchain itself is :data:`dlc_mlu.toolchain.TOOLCHAIN`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from dlc_mlu import refine, runtime
from dlc_mlu.toolchain import TOOLCHAIN
from dlcore import hookimpl
from dlcore.declarations.backend import Availability, Backend
from dlcore.declarations.device import DeviceProfile
from dlcore.errors import BackendUnavailableError
from dlcore.plugins.vendor import device_index, event_time, import_runtime

if TYPE_CHECKING:
    from dlcore.compiler.lowering import Lowering
    from dlcore.compiler.passes import Pipeline
    from dlcore.declarations.implementation import KernelCall
    from dlcore.declarations.signature import Signature
    from dlcore.declarations.space import SearchSpace

INSTALL_HINT = "install Cambricon's torch_mlu from the Neuware SDK"


class MluBackend(Backend):
    name = "mlu"
    device_types = ("mlu",)
    toolchains = (TOOLCHAIN,)

    def __init__(self) -> None:
        self._availability: Availability | None = None

    def available(self) -> Availability:
        if self._availability is None:
            self._availability = self._probe()
        return self._availability

    def _probe(self) -> Availability:
        module, reason = import_runtime("torch_mlu", INSTALL_HINT)
        if module is None:
            return Availability(False, reason)
        mlu = getattr(torch, "mlu", None)
        if mlu is None or not mlu.is_available():
            return Availability(False, "torch_mlu imported but torch.mlu.is_available() is False (no MLU visible)")
        return Availability(True)

    def _mlu(self) -> Any:
        availability = self.available()  # imports the runtime, which adds torch.mlu
        if not availability:
            raise BackendUnavailableError(f"backend {self.name!r} is not available: {availability.reason}")
        return torch.mlu

    def profile(self, device: torch.device) -> DeviceProfile:
        """Clusters (``cores``), cores per cluster (``programs_per_core``), memory, NRAM and L2 of
        ``device``; see :mod:`dlc_mlu.runtime` for where each number comes from."""
        mlu = self._mlu()
        return runtime.profile(device_index(mlu, device), mlu.get_device_properties(device))

    def synchronize(self, device: torch.device) -> None:
        self._mlu().synchronize(device)

    def timer(self, fn: Callable[[], object], device: torch.device, *, warmup: int = 1, reps: int = 5) -> float:
        """Median milliseconds between MLU events (``torch.mlu.Event(enable_timing=True)``), warm-up excluded."""
        return event_time(self._mlu(), fn, device, warmup, reps)

    def lower(self, call: KernelCall, target: str, passes: Pipeline | None = None,
              specialize: bool = True) -> Lowering:
        """ttir from upstream Triton, then each later stage (linalg, mlisa, cnbin) whose driver and tools
        exist (:func:`dlc_mlu.stages.lower`). Cambricon's Triton toolchain is not published, so without
        a Cambricon toolchain plugin this raises :class:`~dlcore.errors.ToolchainMissingError` saying so,
        the stages reached in its ``partial``."""
        # the compiler modules load with the first lowering, not with the plugin
        from dlc_mlu import stages
        from dlcore.compiler.passes import default_pipeline

        return stages.lower(call, target, passes if passes is not None else default_pipeline(self.name), specialize)


@hookimpl
def dlcore_backends() -> list[Backend]:
    return [MluBackend()]


@hookimpl
def dlcore_refine_space(space: SearchSpace, signature: Signature, profile: DeviceProfile) -> SearchSpace | None:
    """Spaces searched on an mlu device, narrowed for its clusters (:func:`dlc_mlu.refine.refine`)."""
    return refine.refine(space, signature, profile) if profile.backend == MluBackend.name else None
