"""A fake vendor accelerator namespace (``torch.npu`` as torch_npu adds it, ``torch.mlu`` as torch_mlu
does), its events and the importable stand-in for the vendor's torch extension: the npu and mlu
backend tests run their runtimes against these, with a device clock that ``advance`` moves."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest
import torch

from dlcore.declarations.signature import Signature, TensorSpec


class FakeEvent:
    """``torch.<device>.Event``: records the fake device clock."""

    def __init__(self, device: FakeAccelerator, enable_timing: bool = False):
        self.device, self.enable_timing, self.at, self.stream = device, enable_timing, None, None

    def record(self, stream=None):
        self.at, self.stream = self.device.clock, stream

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.enable_timing and end.enable_timing, "events made without enable_timing=True cannot time"
        return end.at - self.at


class FakeAccelerator(types.SimpleNamespace):
    """``torch.npu`` / ``torch.mlu``: availability, properties, the current device and stream,
    synchronisation and timing events, with a device clock that ``advance`` moves."""

    def __init__(self, props=None, available: bool = True):
        super().__init__(clock=0.0, synchronized=[], events=[], stream=object())
        self.props, self.available = props, available

    def is_available(self) -> bool:
        return self.available

    def get_device_properties(self, device):
        return self.props

    def current_device(self) -> int:
        return 0

    def current_stream(self, device=None):
        return self.stream

    def synchronize(self, device=None) -> None:
        self.synchronized.append(device)

    def Event(self, enable_timing: bool = False) -> FakeEvent:  # noqa: N802 - torch's name
        event = FakeEvent(self, enable_timing)
        self.events.append(event)
        return event

    def advance(self, ms: float) -> None:
        self.clock += ms


def installer(monkeypatch: pytest.MonkeyPatch, extension: str, device_type: str):
    """Make ``extension`` (``torch_npu``) importable as an empty module; returns a setter of
    ``torch.<device_type>`` to a :class:`FakeAccelerator`."""
    module = types.ModuleType(extension)
    module.__spec__ = importlib.machinery.ModuleSpec(extension, None)
    monkeypatch.setitem(sys.modules, extension, module)

    def install(fake: FakeAccelerator) -> FakeAccelerator:
        monkeypatch.setattr(torch, device_type, fake, raising=False)
        return fake

    return install


def signature(op: str, device_type: str, dtype: torch.dtype, *shapes: tuple[int, ...]) -> Signature:
    """A contiguous signature of ``op`` on ``device_type`` with one tensor per shape."""
    tensors = tuple((f"t{i}", TensorSpec(dtype, shape, "contiguous", True)) for i, shape in enumerate(shapes))
    return Signature(op, device_type, tensors, ())
