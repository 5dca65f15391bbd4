"""What dlcore knows about one device: the input to heuristics, search spaces and cache keys."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class DeviceProfile:
    """A device as a backend describes it.

    ``arch`` is what makes a tuned config valid elsewhere (``sm_90``, ``Ascend910B``, ``x86_64``):
    it is part of every cache key. ``cores`` counts the units blocks are scheduled on (SMs, AI
    cores, MLU clusters, CPU cores).
    """

    backend: str
    vendor: str
    name: str
    arch: str
    cores: int
    memory_bytes: int = 0
    programs_per_core: int = 1

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        memory = f", {self.memory_bytes / 2**30:.0f} GiB" if self.memory_bytes else ""
        return f"{self.name} ({self.vendor} {self.arch}, {self.cores} cores{memory})"
