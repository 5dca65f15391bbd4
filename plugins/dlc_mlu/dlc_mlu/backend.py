"""The ``mlu`` backend: Cambricon MLUs through torch_mlu, imported only when first asked."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dlcore import hookimpl
from dlcore.declarations.backend import Availability, Backend
from dlcore.declarations.device import DeviceProfile
from dlcore.errors import BackendUnavailableError
from dlcore.plugins.vendor import import_runtime

if TYPE_CHECKING:
    from dlcore.compiler.lowering import Lowering
    from dlcore.compiler.passes import Pipeline
    from dlcore.declarations.implementation import KernelCall

INSTALL_HINT = "install Cambricon's torch_mlu from the Neuware SDK"


class MluBackend(Backend):
    name = "mlu"
    device_types = ("mlu",)

    def __init__(self) -> None:
        self._availability: Availability | None = None

    def available(self) -> Availability:
        if self._availability is None:
            self._availability = self._probe()
        return self._availability

    def _probe(self) -> Availability:
        runtime, reason = import_runtime("torch_mlu", INSTALL_HINT)
        if runtime is None:
            return Availability(False, reason)
        mlu = getattr(torch, "mlu", None)
        if mlu is None or not mlu.is_available():
            return Availability(False, "torch_mlu imported but torch.mlu.is_available() is False (no MLU visible)")
        return Availability(True)

    def profile(self, device: torch.device) -> DeviceProfile:
        availability = self.available()  # imports the runtime, which adds torch.mlu
        if not availability:
            raise BackendUnavailableError(f"backend {self.name!r} is not available: {availability.reason}")
        props = torch.mlu.get_device_properties(device)
        name = getattr(props, "name", "MLU")
        clusters = getattr(props, "cluster_count", 0)
        cores_per_cluster = getattr(props, "core_num_per_cluster", 0)
        return DeviceProfile(
            backend=self.name,
            vendor="cambricon",
            name=name,
            arch=str(getattr(props, "major", "mlu")) + str(getattr(props, "minor", "")),
            cores=clusters or 1,
            memory_bytes=getattr(props, "total_memory", 0),
            programs_per_core=cores_per_cluster or 1,
        )

    def synchronize(self, device: torch.device) -> None:
        torch.mlu.synchronize(device)

    def lower(self, call: KernelCall, target: str, passes: Pipeline | None = None,
              specialize: bool = True) -> Lowering:
        """ttir from upstream Triton; the later stages need Cambricon's toolchain (``triton-linalg-opt``,
        Neuware's ``cncc``): until the MLU pipeline is wired this raises
        :class:`~dlcore.compiler.lowering.ToolchainMissingError` naming the missing tools, with the
        ttir in its ``partial``."""
        from dlcore.compiler.lowering import parse_target, ttir_then_missing
        from dlcore.compiler.passes import default_pipeline
        from dlcore.errors import LoweringError

        if parse_target(target)[0] != self.name:
            raise LoweringError(f"target {target!r} is not a {self.name} target (e.g. mlu:MLU370)")
        passes = passes if passes is not None else default_pipeline(self.name)
        tools = {"triton-linalg-opt": "Cambricon triton-linalg", "cncc": "the Cambricon Neuware SDK"}
        ttir_then_missing(call, target, passes, ("linalg", "bin"), tools, specialize)


@hookimpl
def dlcore_backends() -> list[Backend]:
    return [MluBackend()]
