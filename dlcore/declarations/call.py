"""One call of an op, as known before anything is chosen: what selection and tuning take."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from dlcore.declarations.backend import Backend
    from dlcore.declarations.device import DeviceProfile
    from dlcore.declarations.implementation import Implementation, PlanTransform
    from dlcore.declarations.op import Op
    from dlcore.declarations.signature import Signature


@dataclass
class Call:
    """A validated call: the op, its bound arguments, where it runs, and who may compute it.

    ``candidates`` accept the signature on the backend; ``declined`` says why each other
    implementation does not; ``transform`` is the plan rewrite of the backend's launch passes.
    """

    op: Op
    args: tuple
    device: torch.device
    backend: Backend
    profile: DeviceProfile
    signature: Signature
    candidates: list[Implementation]
    declined: dict[str, str]
    transform: PlanTransform | None = None

    def candidate(self, name: str) -> Implementation | None:
        return next((c for c in self.candidates if c.name == name), None)
