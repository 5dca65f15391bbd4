"""A kernel without a backward (as a third party writes one from the guide) never drops autograd
silently: on inputs that require grad it warns once, naming the op and the fix."""

from __future__ import annotations

import warnings

import pytest
import torch
import triton
import triton.language as tl

from dlcore.declarations.implementation import KernelCall, LaunchPlan, TritonImplementation
from dlcore.declarations.op import Op, TensorArg
from dlcore.declarations.signature import cdiv
from dlcore.runtime.runner import runner
from dlcore.runtime.template import define_kernel
from dlcore.runtime.torch_ops import ForwardOnlyWarning


@triton.jit
def _double(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(y_ptr + offs, x * 2, mask=offs < n)


def _plan(args, config, profile=None):
    (x,) = args
    y = torch.empty_like(x)
    return LaunchPlan([KernelCall(_double, (cdiv(x.numel(), 64),), (x, y, x.numel()), {"BLOCK": 64})], y)


OP = Op("double_fwd_only", args=(TensorArg("x", (torch.float32,), layouts=("contiguous",)),),
        reference=lambda x: x * 2, doc="2 * x")
KERNEL = define_kernel(OP, _plan, kernels=(_double,), namespace="dlc_forward_only_test",
                       results=lambda x: torch.empty_like(x), default_config=lambda signature, profile: {})


def forward_only_warnings(call, x: torch.Tensor) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = call(x)
    assert torch.equal(y.detach(), x.detach() * 2) and y.grad_fn is None
    return [str(w.message) for w in caught if issubclass(w.category, ForwardOnlyWarning)]


PLAIN = TritonImplementation("double_fwd_only", "plain", plan=_plan, kernels=(_double,),
                             default_config=lambda signature, profile: {})


@pytest.mark.parametrize("call", [KERNEL.function, lambda x: runner(KERNEL.implementation, {})((x,)),
                                  lambda x: runner(PLAIN, {})((x,))],
                         ids=["function", "bound op's runner", "implementation built without the template"])
def test_a_forward_only_kernel_warns_once_on_inputs_that_require_grad(call, device):
    x = torch.randn(100, device=device, requires_grad=True)
    [message] = forward_only_warnings(call, x)
    assert "double_fwd_only" in message and "forward only" in message and "torch.no_grad()" in message
    assert forward_only_warnings(call, x) == []  # once


def test_no_warning_without_grad(device):
    assert forward_only_warnings(KERNEL.function, torch.randn(100, device=device)) == []
    with torch.no_grad():
        assert forward_only_warnings(KERNEL.function, torch.randn(100, device=device, requires_grad=True)) == []


def test_a_kernel_with_a_backward_is_differentiable():
    assert not KERNEL.implementation.differentiable
    from dlblas_kernels.kernels import rms_norm

    assert rms_norm.KERNEL.implementation.differentiable
