"""Backend plugins over a vendor's torch extension (torch_npu, torch_mlu): :class:`TorchDeviceBackend`
and its helpers.

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

from dlcore.declarations.backend import Availability, Backend
from dlcore.errors import BackendUnavailableError


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


class TorchDeviceBackend(Backend):
    """A backend whose device comes with a torch extension that adds ``torch.<device type>`` with
    ``torch.cuda``'s API (torch_npu's ``torch.npu``, torch_mlu's ``torch.mlu``): availability (the
    extension imports, a device is visible; otherwise why not and what to do), synchronising and
    timing between the device's events. A chip's plugin sets ``name``, ``device_types`` (the first
    names the torch module), ``runtime`` and ``install_hint``, and adds ``profile`` (and ``lower``,
    ``target_profile`` where it lowers without the hardware). Nothing is imported before
    :meth:`available` is asked."""

    #: the extension's module (``torch_npu``)
    runtime: str = ""
    #: how to get it, said when it is not installed
    install_hint: str = ""
    #: what to do when it is installed but fails to import ("": nothing more to say)
    import_hint: str = ""

    def __init__(self) -> None:
        self._availability: Availability | None = None

    @property
    def device_type(self) -> str:
        return self.device_types[0]

    def available(self) -> Availability:
        if self._availability is None:
            self._availability = self._probe()
        return self._availability

    def _probe(self) -> Availability:
        module, reason = import_runtime(self.runtime, self.install_hint)
        if module is None:
            installed = importlib.util.find_spec(self.runtime) is not None
            return Availability(False, f"{reason}; {self.import_hint}" if installed and self.import_hint else reason)
        device = getattr(torch, self.device_type, None)
        if device is None or not device.is_available():
            return Availability(False, f"{self.runtime} imported but torch.{self.device_type}.is_available() is "
                                       f"False (no {self.device_type.upper()} visible)")
        return Availability(True)

    def device_module(self) -> Any:
        """``torch.<device type>``, once the extension has imported; the reason raised otherwise."""
        availability = self.available()  # imports the runtime, which adds the module to torch
        if not availability:
            raise BackendUnavailableError(f"backend {self.name!r} is not available: {availability.reason}")
        return getattr(torch, self.device_type)

    def synchronize(self, device: torch.device) -> None:
        self.device_module().synchronize(device)

    def timer(self, fn: Callable[[], object], device: torch.device, *, warmup: int = 1, reps: int = 5) -> float:
        """Median milliseconds between the device's events (``Event(enable_timing=True)``), warm-up
        excluded (:func:`event_time`)."""
        return event_time(self.device_module(), fn, device, warmup, reps)
