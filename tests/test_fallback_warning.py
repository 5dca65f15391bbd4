"""get_op says once, not only in ``.explain()``, that the torch reference serves and why."""

import warnings

import torch

import dlcore
from dlcore.dispatch.dispatcher import FallbackWarning


def fallback_warnings(call) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]


def test_cpu_tensors_without_the_interpreter_warn_once_that_the_reference_runs(monkeypatch):
    monkeypatch.setattr("dlcore.declarations.implementation.TritonImplementation.interpreted",
                        property(lambda self: False))  # as if TRITON_INTERPRET were not set
    x, w1, w3, rms_w = torch.randn(3, 32), torch.randn(16, 32), torch.randn(16, 32), torch.ones(32)
    [message] = fallback_warnings(lambda: dlcore.get_op("ffn", (x, w1, w3, rms_w)))
    assert "ffn" in message and "runs its torch reference" in message and "TRITON_INTERPRET=1" in message
    bigger = torch.randn(5, 32)
    assert fallback_warnings(lambda: dlcore.get_op("ffn", (bigger, w1, w3, rms_w))) == []  # once


def test_no_warning_when_a_kernel_serves():
    x, w = torch.randn(4, 32), torch.randn(32)
    assert fallback_warnings(lambda: dlcore.get_op("rms_norm", (x, w))) == []
