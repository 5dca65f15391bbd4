"""Helpers for backend plugins over a vendor's torch extension (torch_npu, torch_mlu).

Importing such a runtime can fail in many ways (missing driver libraries, CANN not sourced): the
failure becomes a reason, never a crash, and nothing is imported before a backend is asked. The
device modules these extensions add (``torch.npu``, ``torch.mlu``) follow ``torch.cuda``'s API,
so one way of naming a device and of timing on it serves them all.
"""

from __future__ import annotations

import importlib
import importlib.util
import statistics
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch


def import_runtime(module: str, install_hint: str) -> tuple[ModuleType | None, str]:
    """``(module, "")`` if ``module`` imports, else ``(None, reason)``."""
    if importlib.util.find_spec(module) is None:
        return None, f"{module} is not installed ({install_hint})"
    try:
        return importlib.import_module(module), ""
    except Exception as exc:  # noqa: BLE001 - vendor runtimes fail with arbitrary errors
        return None, f"{module} is installed but failed to import: {type(exc).__name__}: {exc}"


def device_index(module: Any, device: torch.device | int | str) -> int:
    """The index of ``device`` (a device of ``module``'s type, its index, or ``"npu:N"``); the
    current device of ``module`` (``torch.npu``, ``torch.mlu``) when it names none."""
    if isinstance(device, int):
        return device
    index = torch.device(device).index if isinstance(device, str) else device.index
    return module.current_device() if index is None else index


def event_time(module: Any, fn: Callable[[], object], device: Any, warmup: int, reps: int) -> float:
    """Median milliseconds of ``fn()`` between two device events (``module.Event(enable_timing=True)``)
    on the device's current stream (or queue): ``warmup`` runs first, untimed; the ``reps`` runs
    follow one another without a host wait, so each one's time is the device's, not the host's."""
    for _ in range(warmup):
        fn()
    module.synchronize(device)
    stream = module.current_stream(device)
    pairs = []
    for _ in range(reps):
        start, end = module.Event(enable_timing=True), module.Event(enable_timing=True)
        start.record(stream)
        fn()
        end.record(stream)
        pairs.append((start, end))
    module.synchronize(device)
    return statistics.median(start.elapsed_time(end) for start, end in pairs)
