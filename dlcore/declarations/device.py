"""What dlcore knows about one device: the input to heuristics, search spaces and cache keys."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class DeviceProfile:
    """A device as a backend describes it: what kernels size their tiles, grids and search spaces by.

    ``arch`` is what makes a tuned config valid elsewhere (``sm_90``, ``Ascend910B``, ``x86_64``):
    it is part of every cache key. ``cores`` counts the units blocks are scheduled on (SMs, AI
    cores, MLU clusters, CPU cores). The per-core limits are 0 where the device has no such limit
    or the backend cannot say (the CPU under Triton's interpreter): a kernel then sets no bound by
    them.
    """

    backend: str
    vendor: str
    name: str
    arch: str
    cores: int
    memory_bytes: int = 0
    programs_per_core: int = 1
    #: the most on-chip shared memory (bytes) one program may use (CUDA: the opt-in limit per block)
    shared_memory_per_program: int = 0
    #: 32-bit registers per core (CUDA: per multiprocessor)
    registers_per_core: int = 0
    #: threads resident on one core at most (CUDA: per multiprocessor)
    threads_per_core: int = 0
    #: lanes of one warp (CUDA 32, AMD 64), 0 where kernels are not scheduled by warps
    warp_size: int = 0
    #: the last-level cache shared by all cores, bytes
    l2_bytes: int = 0

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        memory = f", {self.memory_bytes / 2**30:.0f} GiB" if self.memory_bytes else ""
        return f"{self.name} ({self.vendor} {self.arch}, {self.cores} cores{memory})"


#: the profile of a device no available backend owns (meta tensors while lowering, a space asked for
#: without a device): no cores known and every limit 0, and a limit of 0 bounds nothing
UNKNOWN_DEVICE = DeviceProfile(backend="", vendor="", name="unknown device", arch="", cores=0)


_target: contextvars.ContextVar[DeviceProfile | None] = contextvars.ContextVar("dlcore_planning_target",
                                                                              default=None)


@contextlib.contextmanager
def planning_for(profile: DeviceProfile) -> Iterator[DeviceProfile]:
    """Plans built on ``meta`` tensors inside this block are for ``profile``'s device: what lowering
    for a target without the device does (``dlcore lower --target cuda:90``)."""
    token = _target.set(profile)
    try:
        yield profile
    finally:
        _target.reset(token)


def planning_target() -> DeviceProfile | None:
    """The profile :func:`planning_for` set, if any."""
    return _target.get()
