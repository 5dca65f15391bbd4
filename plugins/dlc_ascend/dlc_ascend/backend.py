"""The ``npu`` backend: Ascend NPUs through torch_npu, imported only when first asked."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dlc_ascend.toolchain import TOOLCHAIN
from dlcore import hookimpl
from dlcore.declarations.backend import Availability, Backend
from dlcore.declarations.device import DeviceProfile
from dlcore.errors import BackendUnavailableError
from dlcore.plugins.vendor import import_runtime

if TYPE_CHECKING:
    from dlcore.compiler.lowering import Lowering
    from dlcore.compiler.passes import Pipeline
    from dlcore.declarations.implementation import KernelCall

INSTALL_HINT = "pip install 'dlc-ascend[npu]' with Huawei CANN installed and sourced"

#: AI-core (cube) counts of known chips, for runtimes that do not report them
KNOWN_CORES = {"Ascend910B1": 24, "Ascend910B2": 24, "Ascend910B3": 20, "Ascend910B4": 20, "Ascend310P3": 8}


class AscendBackend(Backend):
    name = "npu"
    device_types = ("npu",)
    toolchains = (TOOLCHAIN,)

    def __init__(self) -> None:
        self._availability: Availability | None = None

    def available(self) -> Availability:
        if self._availability is None:
            self._availability = self._probe()
        return self._availability

    def _probe(self) -> Availability:
        runtime, reason = import_runtime("torch_npu", INSTALL_HINT)
        if runtime is None:
            return Availability(False, reason)
        npu = getattr(torch, "npu", None)
        if npu is None or not npu.is_available():
            return Availability(False, "torch_npu imported but torch.npu.is_available() is False (no NPU visible)")
        return Availability(True)

    def profile(self, device: torch.device) -> DeviceProfile:
        availability = self.available()  # imports the runtime, which adds torch.npu
        if not availability:
            raise BackendUnavailableError(f"backend {self.name!r} is not available: {availability.reason}")
        props = torch.npu.get_device_properties(device)
        name = getattr(props, "name", "Ascend")
        cores = getattr(props, "cube_core_num", 0) or KNOWN_CORES.get(name, 0) or 1
        return DeviceProfile(
            backend=self.name,
            vendor="huawei",
            name=name,
            arch=name,
            cores=cores,
            memory_bytes=getattr(props, "total_memory", 0),
        )

    def synchronize(self, device: torch.device) -> None:
        torch.npu.synchronize(device)

    def lower(self, call: KernelCall, target: str, passes: Pipeline | None = None,
              specialize: bool = True) -> Lowering:
        """ttir from upstream Triton; linalg (``triton-adapter-opt``), HIVM (``bishengir-compile``) and the
        device binary (CANN's ``hivmc``) come with the Ascend pipeline: until then this raises
        :class:`~dlcore.compiler.lowering.ToolchainMissingError` naming the missing tools, with the
        ttir in its ``partial``."""
        from dlcore.compiler.lowering import parse_target, ttir_then_missing
        from dlcore.compiler.passes import default_pipeline
        from dlcore.errors import LoweringError

        if parse_target(target)[0] != self.name:
            raise LoweringError(f"target {target!r} is not a {self.name} target (e.g. npu:Ascend910B)")
        passes = passes if passes is not None else default_pipeline(self.name)
        tools = {"triton-adapter-opt": "triton-ascend", "bishengir-compile": "ascendnpu-ir", "hivmc": "Huawei CANN"}
        ttir_then_missing(call, target, passes, ("linalg", "hivm", "bin"), tools, specialize)


@hookimpl
def dlcore_backends() -> list[Backend]:
    return [AscendBackend()]
