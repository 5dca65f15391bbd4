"""Choosing among the candidate implementations of one call, and the record of that choice."""

from __future__ import annotations

import datetime
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from dlcore.backend import Backend
from dlcore.device import DeviceProfile
from dlcore.errors import NoKernelError
from dlcore.implementation import Implementation, PlanTransform
from dlcore.signature import Signature


@dataclass
class Selection:
    """What was chosen for a signature, and why. Serialisable to JSON (the cache stores it)."""

    impl: str
    config: dict[str, Any]
    how: str  # "only candidate" | "requested" | "measured"
    time_ms: float | None = None
    measured: dict[str, float] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    declined: dict[str, str] = field(default_factory=dict)
    strategy: str | None = None
    evaluations: int = 0
    when: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Selection:
        return cls(**data)


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def clone_args(bound: tuple) -> tuple:
    """Copies of the tensor arguments with the same shapes, strides and values."""
    return tuple(_clone(a) if isinstance(a, torch.Tensor) else a for a in bound)


def _clone(t: torch.Tensor) -> torch.Tensor:
    copy = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)
    return copy.copy_(t)


def without_measuring(impl: Implementation, signature: Signature, profile: DeviceProfile, how: str,
                      declined: dict[str, str]) -> Selection:
    return Selection(impl=impl.name, config=impl.default_config(signature, profile), how=how,
                     declined=dict(declined), when=now())


def by_measurement(
    candidates: list[Implementation],
    bound: tuple,
    signature: Signature,
    backend: Backend,
    profile: DeviceProfile,
    device: torch.device,
    declined: dict[str, str],
    transform: PlanTransform | None = None,
) -> Selection:
    """Time each candidate with its default config on cloned inputs; the fastest wins.

    A candidate that raises is skipped, its reason kept. If all fail, :class:`NoKernelError`.
    """
    measured: dict[str, float] = {}
    failed: dict[str, str] = {}
    configs = {}
    for impl in candidates:
        config = configs[impl.name] = impl.default_config(signature, profile)
        inputs = clone_args(bound)
        try:
            run = impl.runner(config, transform)
            elapsed = backend.timer(lambda r=run, a=inputs: r(a), device)
        except Exception as exc:  # noqa: BLE001 - any failure disqualifies only this candidate
            failed[impl.name] = f"{type(exc).__name__}: {exc}".splitlines()[0]
            continue
        if math.isfinite(elapsed):
            measured[impl.name] = elapsed
        else:
            failed[impl.name] = f"timer returned {elapsed}"
    if not measured:
        raise NoKernelError(signature.op, signature.describe(), {**declined, **failed})
    best = min(measured, key=measured.__getitem__)
    return Selection(impl=best, config=configs[best], how="measured", time_ms=measured[best],
                     measured=measured, failed=failed, declined=dict(declined), when=now())
