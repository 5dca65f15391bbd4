"""The Cambricon runtime as the mlu backend sees it: what a device has, and the MLU's clock.

torch_mlu is imported only when the backend is first asked (``Backend.available``).

**The numbers.** An MLU has clusters of cores (MLU370: 4 cores per cluster); a Triton program runs
on one core (``num_warps=1``, a Block task) or on a whole cluster (``num_warps=4``, a Union1 task).
The profile's ``cores`` holds the clusters and ``programs_per_core`` the cores per cluster, so that
``cores x programs_per_core`` (what grid folding launches) is every core of the device, one program
each: Cambricon's own tutorials size grids so (``TOTAL_CORE_NUM = cluster_num x
core_num_per_cluster``).

- torch_mlu's ``torch.mlu.get_device_properties(index)`` (``_MLUDeviceProperties`` in Cambricon's
  torch_mlu, ``torch_mlu/csrc/python/Module.cpp``): ``name``, ``cluster_count``,
  ``core_num_per_cluster``, ``total_memory`` (bytes), ``major``, ``minor``;
- Cambricon's Triton driver, when it is the active Triton
  (``triton.runtime.driver.active.utils.get_device_properties(index)``, a dict: ``cluster_num``
  (the clusters visible to this context), ``core_num_per_cluster``, ``max_nram_size`` (NRAM per
  core, bytes), ``max_l2_cache_size``, ``isa_version``): its counts win, and it alone gives the NRAM
  (``shared_memory_per_program``: what a program's tiles live in), L2 and the ISA (``arch``
  ``mtp_<isa>``, the name Cambricon's compiler targets). Without it ``arch`` is the device's name.
"""

from __future__ import annotations

import warnings
from typing import Any

from dlcore.api import DeviceProfile


def _positive(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def driver_properties(index: int) -> dict[str, Any]:
    """What Cambricon's Triton driver reports for device ``index``; empty when the active Triton has
    no MLU driver (upstream Triton, triton-ascend, no device)."""
    try:
        from triton.runtime import driver

        found = driver.active.utils.get_device_properties(index)
    except Exception:  # noqa: BLE001 - any Triton without an MLU driver fails its own way
        return {}
    return found if isinstance(found, dict) and _positive(found.get("cluster_num")) else {}


def profile(index: int, props: Any, driver: dict[str, Any] | None = None) -> DeviceProfile:
    """The profile of device ``index`` from its torch_mlu properties ``props`` and what Cambricon's
    Triton driver reports (``driver``; asked when ``None``)."""
    found = driver_properties(index) if driver is None else driver
    name = str(getattr(props, "name", "") or "MLU").strip()
    clusters = _positive(found.get("cluster_num")) or _positive(getattr(props, "cluster_count", 0))
    per_cluster = _positive(found.get("core_num_per_cluster")) or _positive(getattr(props, "core_num_per_cluster", 0))
    if not clusters or not per_cluster:
        warnings.warn(f"the mlu backend found no cluster or core count for {name!r} (torch_mlu reports "
                      f"cluster_count={getattr(props, 'cluster_count', None)}, core_num_per_cluster="
                      f"{getattr(props, 'core_num_per_cluster', None)}); grids are sized for one core", stacklevel=3)
    isa = _positive(found.get("isa_version"))
    return DeviceProfile(
        backend="mlu",
        vendor="cambricon",
        name=name,
        arch=f"mtp_{isa}" if isa else name,
        cores=clusters or 1,
        memory_bytes=_positive(getattr(props, "total_memory", 0)),
        programs_per_core=per_cluster or 1,
        shared_memory_per_program=_positive(found.get("max_nram_size")),
        l2_bytes=_positive(found.get("max_l2_cache_size")),
    )
