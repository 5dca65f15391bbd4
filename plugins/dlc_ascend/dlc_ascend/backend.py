"""The ``npu`` backend: Ascend NPUs through torch_npu, imported only when first asked.

On a real Ascend host (torch_npu, CANN and triton-ascend installed) the kernels run through
triton-ascend's JIT on ``npu`` tensors. dlcore's warm launch path (:mod:`dlcore.runtime.launch`)
checks, once, every Triton internal it relies on; triton-ascend 3.2.0 lacks ``triton.knobs`` and its
launcher takes ``(*args, **kwargs)``, so that check fails, one warning names what is missing, and
every launch goes through ``kernel[grid](...)``: the capability decides, not the backend's name.

Device numbers: :mod:`dlc_ascend.runtime` (driver, then torch_npu, then :mod:`dlc_ascend.chips`);
timing: NPU events; search spaces: :mod:`dlc_ascend.refine`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dlc_ascend import refine, runtime
from dlc_ascend.toolchain import TOOLCHAIN
from dlcore.api import Backend, DeviceProfile, LoweringError, TorchDeviceBackend, device_index, hookimpl

if TYPE_CHECKING:
    from dlcore.api import KernelCall, Lowering, Pipeline, SearchSpace, Signature

INSTALL_HINT = "pip install 'dlc-ascend[npu]' with Huawei CANN installed and sourced"
#: what to do when torch_npu is installed but does not import
IMPORT_HINT = ("source CANN's set_env.sh (e.g. /usr/local/Ascend/ascend-toolkit/set_env.sh) before starting Python; "
               "without CANN, set TORCH_DEVICE_BACKEND_AUTOLOAD=0 so that `import torch` does not import torch_npu")


class AscendBackend(TorchDeviceBackend):
    name = "npu"
    device_types = ("npu",)
    toolchains = (TOOLCHAIN,)
    runtime = "torch_npu"
    install_hint = INSTALL_HINT
    import_hint = IMPORT_HINT

    def profile(self, device: torch.device) -> DeviceProfile:
        """Cores, memory, unified buffer (``shared_memory_per_program``) and L2 of ``device``; see
        :mod:`dlc_ascend.runtime` for where each number comes from and what ``cores`` counts."""
        npu = self.device_module()
        return runtime.profile(device_index(npu, device), npu.get_device_properties(device))

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
        from dlcore.api import parse_target

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
        from dlcore.api import default_pipeline

        return pipeline.lower(call, target, passes if passes is not None else default_pipeline(self.name), specialize)


@hookimpl
def dlcore_backends() -> list[Backend]:
    return [AscendBackend()]


@hookimpl
def dlcore_refine_space(space: SearchSpace, signature: Signature, profile: DeviceProfile) -> SearchSpace | None:
    """Spaces searched on an npu device, narrowed for its AI cores (:func:`dlc_ascend.refine.refine`)."""
    return refine.refine(space, signature, profile) if profile.backend == AscendBackend.name else None
