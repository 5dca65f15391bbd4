"""The one runner every route calls (``dlcore.runtime.runner.Runner``): a kernel's public function
runs through one, as a bound op does; each exact input is checked and its heuristic config worked
out once, whichever route (launches, or the custom op under autograd) sees it first."""

from __future__ import annotations

import pytest
import torch
from dlblas_kernels.kernels.rms_norm import KERNEL

from dlcore.dispatch.dispatcher import reset
from dlcore.errors import InvalidInputError
from dlcore.runtime.runner import Runner


@pytest.fixture
def counted(monkeypatch):
    """The public function's validation and heuristic, each call counted."""
    reset()
    function, calls = KERNEL.function, {"validate": 0, "heuristic": 0}
    validate, default_config = function.validate, function.default_config

    def counting_validate(args):
        calls["validate"] += 1
        return validate(args)

    def counting_default(signature, profile):
        calls["heuristic"] += 1
        return default_config(signature, profile)

    monkeypatch.setattr(function, "validate", counting_validate)
    monkeypatch.setattr(function, "default_config", counting_default)
    yield calls
    reset()


def test_the_public_function_checks_each_exact_input_once(counted, gen):
    x, w = torch.randn(5, 48, generator=gen), torch.randn(48, generator=gen)
    for _ in range(3):
        torch.testing.assert_close(KERNEL.function(x, w), KERNEL.op.reference(x, w), rtol=1e-5, atol=1e-5)
    assert counted == {"validate": 1, "heuristic": 1}
    KERNEL.function(torch.randn(7, 48, generator=gen), w)  # new metadata: checked and worked out again
    assert counted == {"validate": 2, "heuristic": 2}
    assert len(KERNEL.function.runner.seen) == 2


def test_a_training_call_then_an_inference_call_are_checked_once(counted, gen):
    """Through the custom op (autograd records it) and then through the launches: one check."""
    x = torch.randn(5, 48, generator=gen, requires_grad=True)
    w = torch.randn(48, generator=gen, requires_grad=True)
    KERNEL.function(x, w).sum().backward()
    assert x.grad is not None and counted["validate"] == 1
    with torch.no_grad():
        KERNEL.function(x, w)
    assert counted["validate"] == 1


def test_bad_inputs_raise_on_every_route(gen):
    x, w = torch.randn(5, 48, generator=gen), torch.randn(40, generator=gen)
    with pytest.raises(InvalidInputError, match="w"):
        KERNEL.function(x, w)
    with pytest.raises(InvalidInputError, match="w"):
        KERNEL.function(x.requires_grad_(), w)


def test_a_runner_without_config_needs_a_heuristic():
    with pytest.raises(ValueError, match="heuristic"):
        Runner(KERNEL.implementation, None)
