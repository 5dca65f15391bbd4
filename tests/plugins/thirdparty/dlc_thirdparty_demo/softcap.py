"""A brand-new op, softcap(x, cap) = cap * tanh(x / cap), with its Triton kernel: the custom op
``dlc_thirdparty_demo::softcap``, its implementation and hooks made by dlcore's kernel template."""

import torch
import triton
import triton.language as tl

from dlcore.declarations.implementation import KernelCall, LaunchPlan
from dlcore.declarations.op import Op, ScalarArg, TensorArg
from dlcore.declarations.space import PowerOfTwo, SearchSpace
from dlcore.runtime.template import define_kernel


@triton.jit
def _softcap(x_ptr, y_ptr, n, cap, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # tanh(u) = 2 * sigmoid(2u) - 1, portable (no libdevice)
    y = cap * (2.0 * tl.sigmoid(2.0 * x / cap) - 1.0)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def softcap_reference(x, cap=30.0):
    return (cap * torch.tanh(x.float() / cap)).to(x.dtype)


def _plan(args, config, profile):
    x, cap = args
    y = torch.empty_like(x)
    n = x.numel()
    block = config["BLOCK"]
    return LaunchPlan([KernelCall(_softcap, (triton.cdiv(n, block),), (x, y, n, float(cap)), {"BLOCK": block})], y)


OP = Op(
    "softcap",
    args=(TensorArg("x", (torch.float16, torch.float32), layouts=("contiguous",)), ScalarArg("cap", default=30.0)),
    reference=softcap_reference,
    fallback=False,
    doc="cap * tanh(x / cap)",
    example=lambda sizes, dtype, device, generator: (
        (torch.randn(sizes["n"], generator=generator) * 50).to(device=device, dtype=dtype), 30.0),
    example_sizes={"n": 1000},
)

KERNEL = define_kernel(
    OP, _plan, kernels=(_softcap,), namespace="dlc_thirdparty_demo",
    results=lambda x, cap: torch.empty_like(x),
    default_config=lambda signature, profile: {"BLOCK": 256},
    space=lambda profile: SearchSpace([PowerOfTwo("BLOCK", 64, 1024)]),
)
softcap = KERNEL.function
dlcore_ops, dlcore_implementations = KERNEL.dlcore_ops, KERNEL.dlcore_implementations
