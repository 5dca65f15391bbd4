"""The ``mlu`` backend: Cambricon MLUs through torch_mlu, imported only when first asked.

Device numbers: :mod:`dlc_mlu.runtime`; timing: MLU events; search spaces: :mod:`dlc_mlu.refine`;
lowering: :mod:`dlc_mlu.stages` (TTIR from upstream Triton, then the Cambricon tools that are
installed; the toolchain itself is :data:`dlc_mlu.toolchain.TOOLCHAIN`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dlc_mlu import refine, runtime
from dlc_mlu.toolchain import TOOLCHAIN
from dlcore.api import Backend, DeviceProfile, TorchDeviceBackend, device_index, hookimpl

if TYPE_CHECKING:
    from dlcore.api import KernelCall, Lowering, Pipeline, SearchSpace, Signature

INSTALL_HINT = "install Cambricon's torch_mlu from the Neuware SDK"


class MluBackend(TorchDeviceBackend):
    name = "mlu"
    device_types = ("mlu",)
    toolchains = (TOOLCHAIN,)
    runtime = "torch_mlu"
    install_hint = INSTALL_HINT

    def profile(self, device: torch.device) -> DeviceProfile:
        """Clusters (``cores``), cores per cluster (``programs_per_core``), memory, NRAM and L2 of
        ``device``; see :mod:`dlc_mlu.runtime` for where each number comes from."""
        mlu = self.device_module()
        return runtime.profile(device_index(mlu, device), mlu.get_device_properties(device))

    def lower(self, call: KernelCall, target: str, passes: Pipeline | None = None,
              specialize: bool = True) -> Lowering:
        """ttir from upstream Triton, then each later stage (linalg, mlisa, cnbin) whose driver and tools
        exist (:func:`dlc_mlu.stages.lower`). Cambricon's Triton toolchain is not published, so without
        a Cambricon toolchain plugin this raises :class:`~dlcore.errors.ToolchainMissingError` saying so,
        the stages reached in its ``partial``."""
        # the compiler modules load with the first lowering, not with the plugin
        from dlc_mlu import stages
        from dlcore.api import default_pipeline

        return stages.lower(call, target, passes if passes is not None else default_pipeline(self.name), specialize)


@hookimpl
def dlcore_backends() -> list[Backend]:
    return [MluBackend()]


@hookimpl
def dlcore_refine_space(space: SearchSpace, signature: Signature, profile: DeviceProfile) -> SearchSpace | None:
    """Spaces searched on an mlu device, narrowed for its clusters (:func:`dlc_mlu.refine.refine`)."""
    return refine.refine(space, signature, profile) if profile.backend == MluBackend.name else None
