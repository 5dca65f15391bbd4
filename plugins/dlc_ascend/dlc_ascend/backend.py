"""The ``npu`` backend: Ascend NPUs through torch_npu, imported only when first asked."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dlcore import hookimpl
from dlcore.declarations.backend import Availability, Backend
from dlcore.declarations.device import DeviceProfile
from dlcore.errors import BackendUnavailableError, LoweringError
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

    def target_profile(self, target: str) -> DeviceProfile:
        """The nominal profile of ``npu:PART`` from :mod:`dlc_ascend.chips` (``npu:Ascend910B``:
        :data:`~dlc_ascend.chips.DEFAULT`).

        ``cores`` counts the part's vector cores, not its cube cores: what sizes a plan's grid here is
        grid folding (``grid_folding``), and the kernels it folds are vector kernels (norms, rotary,
        softmax, activations: ``mix_mode aiv``), each program on one vector core, so folding to the
        cube count would leave half the vector cores idle. A kernel with ``tl.dot`` runs a program
        per cube core (with its two vector cores): folded to the vector count it takes two waves,
        which costs less than idling half of every vector kernel's cores.
        """
        from dlc_ascend.chips import chip
        from dlcore.compiler.lowering import parse_target

        backend, arch = parse_target(target)
        if backend != self.name:
            raise LoweringError(f"target {target!r} is not a {self.name} target (e.g. npu:Ascend910B2)")
        part = chip(arch)
        return DeviceProfile(backend=self.name, vendor="huawei", name=part.name, arch=part.name,
                             cores=part.vector_cores, memory_bytes=part.memory_bytes,
                             shared_memory_per_program=part.ub_bytes, l2_bytes=part.l2_bytes)

    def lower(self, call: KernelCall, target: str, passes: Pipeline | None = None,
              specialize: bool = True) -> Lowering:
        """ttir (upstream Triton) -> linalg (``triton-adapter-opt``) -> HIVM IR (``bishengir-compile``)
        -> binary (CANN's ``hivmc``), each stage checked: :mod:`dlc_ascend.pipeline`. Where a tool is
        missing, :class:`~dlcore.errors.ToolchainMissingError` says how to get it, with the stages
        reached in its ``partial``."""
        from dlc_ascend import pipeline
        from dlcore.compiler.passes import default_pipeline

        return pipeline.lower(call, target, passes if passes is not None else default_pipeline(self.name), specialize)


@hookimpl
def dlcore_backends() -> list[Backend]:
    return [AscendBackend()]
