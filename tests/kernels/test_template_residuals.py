"""Residuals through the kernel template, shown to the caller on request: ``scale(x, show=False)``
returns ``2 x`` and computes ``x * x`` for its backward (``d x = dy * 2``, checked through the
saved residual: the backward reads it); with ``show=True`` the residual comes back too, as flash
attention's ``return_lse`` hands back its log-sum-exp."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from dlcore.declarations.device import DeviceProfile
from dlcore.declarations.implementation import Config, KernelCall, LaunchPlan
from dlcore.declarations.op import Op, ScalarArg, TensorArg
from dlcore.errors import DeclarationError
from dlcore.runtime.template import Backward, Residuals, define_kernel
from dlcore.testing import randn

NAMESPACE = "dlc_template_residuals_test"


@triton.jit
def _scale_kernel(x_ptr, y_ptr, sq_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(y_ptr + offs, x * 2, mask=offs < n)
    tl.store(sq_ptr + offs, x * x, mask=offs < n)


def _launch(x: torch.Tensor) -> tuple[KernelCall, torch.Tensor, torch.Tensor]:
    y, sq = torch.empty_like(x), torch.empty_like(x)
    return KernelCall(_scale_kernel, (triton.cdiv(x.numel(), 64),), (x, y, sq, x.numel()), {"BLOCK": 64}), y, sq


def plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    x, show = args
    call, y, sq = _launch(x)
    return LaunchPlan([call], (y, sq) if show else y)


def training_plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    call, y, sq = _launch(args[0])
    return LaunchPlan([call], (y, sq))


def scale_reference(x: torch.Tensor, show: bool = False):
    return (2 * x, x * x) if show else 2 * x


def scale_backward_reference(dy: torch.Tensor, sq: torch.Tensor) -> torch.Tensor:
    return dy * 2 + 0 * sq


#: per backward, which output gradients reached the formula as None
SEEN: list[tuple[bool, ...]] = []


def _gradients(backward, saved, grads, needs) -> dict:
    SEEN.append(tuple(g is None for g in grads))
    return {"x": backward(grads[0], saved.sq)}


def _declare(shown_by: str) -> object:
    op = Op("scale", args=(TensorArg("x", (torch.float32,), layouts=("contiguous",)),
                           ScalarArg("show", (bool,), default=False, keyed=True)),
            reference=scale_reference, doc="2 x")
    return define_kernel(
        op, plan, kernels=(_scale_kernel,), results=lambda x, show: torch.empty_like(x),
        default_config=lambda sig, profile: {}, namespace=NAMESPACE, replayable=False,
        backward=Backward(_gradients, saved=("sq",), plan=lambda args, config, profile: LaunchPlan([], 2 * args[0]),
                          reference=scale_backward_reference, results=lambda dy, sq: torch.empty_like(dy),
                          renames={"x": "dy"},
                          residuals=Residuals(("sq",), training_plan,
                                              lambda x, show: (torch.empty_like(x), torch.empty_like(x)),
                                              lambda x, show: (2 * x, x * x), shown_by=shown_by)),
    )


KERNEL = _declare("show")


@pytest.mark.parametrize("show", [False, True])
@pytest.mark.parametrize("grad", [False, True])
def test_the_residual_comes_back_only_when_asked(device, gen, show, grad):
    x = randn(70, device=device, generator=gen).requires_grad_(grad)
    result = KERNEL.function(x, show)
    if show:
        y, sq = result
        torch.testing.assert_close(sq, x.detach() ** 2)
    else:
        y = result
        assert isinstance(y, torch.Tensor)
    torch.testing.assert_close(y, 2 * x.detach())
    if grad:
        (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
        torch.testing.assert_close(dx, torch.full_like(dx, 2.0))


def test_shown_by_names_a_scalar_argument():
    with pytest.raises(DeclarationError, match="shown_by names 'x'"):
        _declare("x")


@pytest.mark.parametrize("show", [False, True])
def test_a_hidden_residual_gets_no_gradient(device, gen, show):
    """A residual the caller never sees reaches the formula as None (autograd allocates and zero-fills
    no gradient for it); one shown to the caller, who may not use it, as zeros as before."""
    x = randn(70, device=device, generator=gen).requires_grad_()
    result = KERNEL.function(x, show)
    y = result[0] if show else result
    SEEN.clear()
    torch.autograd.grad(y, x, torch.ones_like(y))
    assert SEEN == [(False, not show)]
