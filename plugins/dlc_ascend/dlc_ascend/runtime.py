"""The Ascend runtime as the npu backend sees it: what a device has, and the NPU's clock.

Nothing here runs before the backend is asked (``Backend.available``), and only then is torch_npu
imported: it needs Huawei CANN to import at all. torch >= 2.5 also imports every installed device
extension when ``import torch`` runs (entry-point group ``torch.backends``, which torch_npu joins),
so on a machine with torch_npu but without CANN, plain ``import torch`` fails unless
``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` is set; the availability reason says so.

**Core counts**, first found wins:

1. triton-ascend's driver, ``triton.runtime.driver.active.utils.get_device_properties(index)``:
   ``{"num_aicore": ..., "num_vectorcore": ...}`` (what vLLM-Ascend and FlagGems' Ascend backend
   read; triton-ascend 3.2.0 asks ACL for the AI cores and counts two vector cores each). Its
   ``max_shared_mem`` is a placeholder (1) and is not used;
2. torch_npu's ``torch.npu.get_device_properties(index)``: ``cube_core_num`` (ACL's AI core count)
   and ``vector_core_num``;
3. the parts table (:mod:`dlc_ascend.chips`) by the device's name (``props.name``, the SoC name
   such as ``Ascend910B2``).

Memory and L2 come from torch_npu (``total_memory``, ``L2_cache_size``), else the parts table; the
unified buffer only from the parts table (no runtime reports it).

**What the profile's cores count.** An A2/A3 AI core pairs one cube core with two vector cores. A
program of a kernel with ``tl.dot`` runs on a whole AI core (its cube core and both vector
cores); a program of a vector-only kernel runs on one vector core. So ``cores`` holds the AI (cube)
core count, the unit every program occupies at least part of, and ``programs_per_core`` the vector
cores per AI core: ``cores x programs_per_core`` (what grid folding launches) is then the vector
core count, every vector core busy for vector kernels; for ``tl.dot`` kernels it is two programs per
AI core, which run in turn.
"""

from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass
from typing import Any

from dlc_ascend import chips
from dlcore.api import DeviceProfile


class CountSource(enum.Enum):
    """Where a profile's core counts came from."""

    DRIVER = "triton-ascend driver"
    TORCH_NPU = "torch_npu device properties"
    PARTS_TABLE = "dlc_ascend.chips"
    NONE = "nowhere"


@dataclass(frozen=True)
class Counts:
    """The AI (cube) cores and vector cores of one device."""

    cube: int
    vector: int
    source: CountSource


def _positive(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def driver_counts(index: int) -> Counts | None:
    """The counts triton-ascend's driver reports for device ``index``; ``None`` when the active
    Triton has no such driver (upstream Triton, or no device it can open)."""
    try:
        from triton.runtime import driver

        found = driver.active.utils.get_device_properties(index)
    except Exception:  # noqa: BLE001 - any Triton without an NPU driver fails its own way
        return None
    if not isinstance(found, dict):
        return None
    cube, vector = _positive(found.get("num_aicore")), _positive(found.get("num_vectorcore"))
    return Counts(cube, vector or cube, CountSource.DRIVER) if cube else None


def torch_counts(props: Any) -> Counts | None:
    """The counts in torch_npu's device properties; ``None`` when they are absent or zero."""
    cube, vector = _positive(getattr(props, "cube_core_num", 0)), _positive(getattr(props, "vector_core_num", 0))
    return Counts(cube, vector or cube, CountSource.TORCH_NPU) if cube else None


def table_counts(part: chips.Chip | None) -> Counts | None:
    return Counts(part.cube_cores, part.vector_cores, CountSource.PARTS_TABLE) if part is not None else None


def counts(index: int, props: Any, part: chips.Chip | None) -> Counts:
    """The device's counts from the first source that has them (see the module doc)."""
    found = driver_counts(index) or torch_counts(props) or table_counts(part)
    if found is None:
        name = getattr(props, "name", "?")
        warnings.warn(f"the npu backend found no core count for {name!r}: neither triton-ascend's driver, "
                      f"torch_npu nor dlc_ascend.chips knows it; grids are sized for one core (add the part to "
                      f"dlc_ascend/chips.py)", stacklevel=3)
        return Counts(1, 1, CountSource.NONE)
    return found


def profile(index: int, props: Any) -> DeviceProfile:
    """The profile of device ``index`` whose torch_npu properties are ``props``."""
    name = str(getattr(props, "name", "") or "Ascend").strip()
    part = chips.find(name)
    found = counts(index, props, part)
    return DeviceProfile(
        backend="npu",
        vendor="huawei",
        name=name,
        arch=name,
        cores=found.cube,
        memory_bytes=_positive(getattr(props, "total_memory", 0)) or (part.memory_bytes if part else 0),
        programs_per_core=max(1, found.vector // found.cube),
        shared_memory_per_program=part.ub_bytes if part else 0,
        l2_bytes=_positive(getattr(props, "L2_cache_size", 0)) or (part.l2_bytes if part else 0),
    )
