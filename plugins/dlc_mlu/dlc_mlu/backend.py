"""The ``mlu`` backend: Cambricon MLUs through torch_mlu, imported only when first asked."""

from __future__ import annotations

import torch

from dlcore import hookimpl
from dlcore.backend import Availability, Backend
from dlcore.device import DeviceProfile
from dlcore.errors import BackendUnavailableError
from dlcore.vendor import import_runtime

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


@hookimpl
def dlcore_backends() -> list[Backend]:
    return [MluBackend()]
