"""A brand-new op, softcap(x, cap) = cap * tanh(x / cap), with its Triton kernels forward and
backward: the custom op ``dlc_thirdparty_demo::softcap``, its autograd, implementation and hooks made
by dlcore's kernel template. docs/plugins.md walks through this file."""

import torch
import triton
import triton.language as tl

from dlcore.api import (
    Backward,
    KernelCall,
    LaunchPlan,
    Op,
    PowerOfTwo,
    ScalarArg,
    SearchSpace,
    TensorArg,
    define_kernel,
)

DTYPES = (torch.float16, torch.float32)


@triton.jit
def _softcap(x_ptr, y_ptr, n, cap, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # tanh(u) = 2 * sigmoid(2u) - 1, portable (no libdevice)
    y = cap * (2.0 * tl.sigmoid(2.0 * x / cap) - 1.0)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softcap_backward(dy_ptr, x_ptr, dx_ptr, n, cap, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    t = 2.0 * tl.sigmoid(2.0 * x / cap) - 1.0
    tl.store(dx_ptr + offs, (dy * (1.0 - t * t)).to(dx_ptr.dtype.element_ty), mask=mask)


def softcap_reference(x, cap=30.0):
    return (cap * torch.tanh(x.float() / cap)).to(x.dtype)


def softcap_backward_reference(dy: torch.Tensor, x: torch.Tensor, cap: float) -> torch.Tensor:
    t = torch.tanh(x.to(torch.promote_types(x.dtype, torch.float32)) / cap)
    return (dy * (1 - t * t)).to(x.dtype)


def _plan(args, config, profile):
    x, cap = args
    y = torch.empty_like(x)
    n, block = x.numel(), config["BLOCK"]
    return LaunchPlan([KernelCall(_softcap, (triton.cdiv(n, block),), (x, y, n, float(cap)), {"BLOCK": block})], y)


def _backward_plan(args, config, profile):
    dy, x, cap = args
    dy = dy.contiguous()
    dx = torch.empty_like(x)
    n, block = x.numel(), config["BLOCK"]
    call = KernelCall(_softcap_backward, (triton.cdiv(n, block),), (dy, x, dx, n, float(cap)), {"BLOCK": block})
    return LaunchPlan([call], dx)


def _gradients(backward, saved, grads, needs):
    return {"x": backward(grads[0], saved.x, saved.cap)}


def _cost(args, mode="fwd"):
    """Bytes moved (x read, y written; the backward also reads dy) and flops (about 6 per element)."""
    x, _ = args
    size = x.numel() * x.element_size()
    return (2 * size, 6 * x.numel()) if mode == "fwd" else (3 * size, 8 * x.numel())


OP = Op(
    "softcap",
    args=(TensorArg("x", DTYPES, layouts=("contiguous",), bucket="rows"), ScalarArg("cap", default=30.0)),
    reference=softcap_reference,
    fallback=False,
    doc="cap * tanh(x / cap)",
    example=lambda sizes, dtype, device, generator: (
        (torch.randn(sizes["tokens"], sizes["hidden"], generator=generator) * 50).to(device=device, dtype=dtype),
        30.0),
    example_sizes={"tokens": 37, "hidden": 1000},
    cost=_cost,
    baselines={"torch": lambda: softcap_reference},
)

KERNEL = define_kernel(
    OP, _plan, kernels=(_softcap, _softcap_backward), namespace="dlc_thirdparty_demo",
    results=lambda x, cap: torch.empty_like(x),
    default_config=lambda signature, profile: {"BLOCK": 256},
    space=lambda profile: SearchSpace([PowerOfTwo("BLOCK", 64, 1024)]),
    backward=Backward(_gradients, saved=("x", "cap"), plan=_backward_plan, reference=softcap_backward_reference,
                      results=lambda dy, x, cap: torch.empty_like(x)),
)
softcap = KERNEL.function
dlcore_ops, dlcore_implementations = KERNEL.dlcore_ops, KERNEL.dlcore_implementations
