"""silu_and_mul: the SwiGLU activation, ``silu(x[..., :N]) * x[..., N:]`` for ``x`` of shape ``[..., 2N]``.

The input is viewed as ``[rows, 2N]``; each program handles one row and ``BLOCK_N`` output columns,
reading the gate half and the up half of that row. The backward has the same layout: it reads the
gate, the up and the output gradient and writes both halves of ``dx``::

    d gate = dy * up * s * (1 + gate * (1 - s)),   s = sigmoid(gate)
    d up   = dy * gate * s

Math in float32, outputs in the input dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from dlcore.api import (
    Backward,
    Config,
    Constraint,
    DeviceProfile,
    InvalidInputError,
    KernelCall,
    LaunchPlan,
    Op,
    PowerOfTwo,
    SearchSpace,
    Signature,
    TensorArg,
    as_rows,
    cdiv,
    define_kernel,
    next_power_of_2,
    num_warps,
)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Widest column block one program handles; wider rows are split across programs (grid axis 1).
MAX_BLOCK_N = 1024


@triton.jit
def silu_and_mul_kernel(
    x_ptr, out_ptr,
    N,
    stride_x_row, stride_x_col,
    stride_out_row, stride_out_col,
    BLOCK_N: tl.constexpr,
):
    # 64-bit row offsets: rows * row stride may pass 2**31 elements.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N

    x_row = x_ptr + row * stride_x_row
    gate = tl.load(x_row + cols * stride_x_col, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + (cols + N) * stride_x_col, mask=mask, other=0.0).to(tl.float32)
    # silu(g) = g * sigmoid(g)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_out_row + cols * stride_out_col,
             out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def silu_and_mul_backward_kernel(
    dy_ptr, x_ptr, dx_ptr,
    N,
    stride_dy_row, stride_dy_col,
    stride_x_row, stride_x_col,
    stride_dx_row, stride_dx_col,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N

    x_row = x_ptr + row * stride_x_row
    gate = tl.load(x_row + cols * stride_x_col, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + (cols + N) * stride_x_col, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * stride_dy_row + cols * stride_dy_col, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(gate)
    d_gate = dy * up * s * (1.0 + gate * (1.0 - s))
    d_up = dy * gate * s
    dx_row = dx_ptr + row * stride_dx_row
    tl.store(dx_row + cols * stride_dx_col, d_gate.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dx_row + (cols + N) * stride_dx_col, d_up.to(dx_ptr.dtype.element_ty), mask=mask)


def output(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(*x.shape[:-1], x.shape[-1] // 2, dtype=x.dtype, device=x.device)


def plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    (x,) = args
    n = x.shape[-1] // 2
    out = output(x)
    if out.numel() == 0:
        return LaunchPlan(calls=[], result=out)
    x2, out2 = as_rows(x), as_rows(out)
    block_n = config["BLOCK_N"]
    grid = (x2.shape[0], cdiv(n, block_n))
    call = KernelCall(
        silu_and_mul_kernel, grid,
        (x2, out2, n, x2.stride(0), x2.stride(1), out2.stride(0), out2.stride(1)),
        {"BLOCK_N": block_n, "num_warps": config["num_warps"]},
    )
    return LaunchPlan(calls=[call], result=out)


def backward_plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    """The launch for ``dx`` from ``args = (dy, x)``."""
    dy, x = args
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = x.shape[-1] // 2
    if dy.numel() == 0:
        return LaunchPlan(calls=[], result=dx.zero_())
    x2, dx2 = as_rows(x), as_rows(dx)
    # dy comes from autograd in any layout (even expanded); reshape copies only when it must.
    dy2 = dy.reshape(x2.shape[0], n)
    block_n = config["BLOCK_N"]
    call = KernelCall(
        silu_and_mul_backward_kernel, (x2.shape[0], cdiv(n, block_n)),
        (dy2, x2, dx2, n, dy2.stride(0), dy2.stride(1), x2.stride(0), x2.stride(1), dx2.stride(0), dx2.stride(1)),
        {"BLOCK_N": block_n, "num_warps": config["num_warps"]},
    )
    return LaunchPlan(calls=[call], result=dx)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` computed in float32 (or wider) and returned in ``x``'s dtype."""
    compute = torch.promote_types(x.dtype, torch.float32)
    gate, up = x.to(compute).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def silu_and_mul_backward_reference(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The backward formulas of the module docstring in torch, in float32 (or wider)."""
    compute = torch.promote_types(x.dtype, torch.float32)
    gate, up = x.to(compute).chunk(2, dim=-1)
    dyf = dy.to(compute)
    s = torch.sigmoid(gate)
    return torch.cat([dyf * up * s * (1 + gate * (1 - s)), dyf * gate * s], dim=-1).to(x.dtype)


def default_config(sig: Signature, profile: DeviceProfile) -> Config:
    n = sig.tensor("x").shape[-1] // 2
    block_n = min(max(next_power_of_2(n), 16), MAX_BLOCK_N)
    # About 8 elements per thread once the block is wide; one warp for narrow rows.
    return {"BLOCK_N": block_n, "num_warps": min(max(block_n // 256, 1), 8)}


def _elements_per_thread(c: Config) -> float:
    return c["BLOCK_N"] / (32 * c["num_warps"])


def space(profile: DeviceProfile) -> SearchSpace:
    """Output columns per program and warps."""
    return SearchSpace(
        [PowerOfTwo("BLOCK_N", 32, 16384), num_warps(1, 2, 4, 8, 16, 32)],
        [
            Constraint("BLOCK_N / (32 * num_warps) >= 1 (no thread idle)", lambda c: _elements_per_thread(c) >= 1),
            Constraint("BLOCK_N / (32 * num_warps) <= 64 (the gate, up and output tiles fit in registers)",
                       lambda c: _elements_per_thread(c) <= 64),
        ],
    )


def check(op: Op, args: dict[str, Any]) -> None:
    x = args["x"]
    if x.shape[-1] % 2:
        raise InvalidInputError(
            op.name, "x", f"has an odd last dimension (shape {tuple(x.shape)})",
            "x whose last dimension is even (the gate half, then the up half)",
        )


def example(sizes: dict[str, int], dtype: torch.dtype, device: torch.device,
            generator: torch.Generator) -> tuple:
    """Random ``x [tokens, 2 * inter]`` for ``dlcore check`` / ``bench`` / ``tune``."""
    x = torch.randn(sizes["tokens"], 2 * sizes["inter"], generator=generator)
    return (x.to(device=device, dtype=dtype),)


def cost(args: tuple, mode: str = "fwd") -> tuple[int, int]:
    """Forward: read x ([..., 2N]), write the [..., N] output; about 4 flops per output element.
    Backward: read dy ([..., N]) and x, write dx; about 8 flops per element of dy."""
    (x,) = args
    x_bytes = x.numel() * x.element_size()
    if mode == "bwd":
        return x_bytes * 5 // 2, 4 * x.numel()
    return x_bytes * 3 // 2, 2 * x.numel()


def torch_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """What a model runs in eager torch: ``act_fn(gate) * up`` of transformers' LlamaMLP, in x's dtype."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def liger_silu_and_mul():
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except ImportError:
        return None

    def run(x: torch.Tensor) -> torch.Tensor:
        # Liger takes the gate and the up projection as two tensors (and makes each contiguous).
        gate, up = x.chunk(2, dim=-1)
        return LigerSiLUMulFunction.apply(gate, up)

    return run


OP = Op(
    name="silu_and_mul",
    args=(TensorArg("x", DTYPES, bucket="rows"),),
    reference=silu_and_mul_reference,
    doc="silu(x[..., :N]) * x[..., N:] for x of shape [..., 2N] (SwiGLU)",
    check=check,
    example=example,
    example_sizes={"tokens": 37, "inter": 128},
    cost=cost,
    baselines={"torch": lambda: torch_silu_and_mul, "liger": liger_silu_and_mul},
)


def _gradients(backward, saved, grads, needs) -> dict:
    return {"x": backward(grads[0], saved.x)}


KERNEL = define_kernel(
    OP, plan,
    kernels=(silu_and_mul_kernel, silu_and_mul_backward_kernel),
    results=output,
    default_config=default_config,
    space=space,
    backward=Backward(_gradients, saved=("x",), plan=backward_plan, reference=silu_and_mul_backward_reference,
                      results=lambda dy, x: torch.empty(x.shape, dtype=x.dtype, device=x.device)),
    doc="one program per (row, column block); math in float32; backward of the same layout",
)
silu_and_mul = KERNEL.function
dlcore_ops, dlcore_implementations = KERNEL.dlcore_ops, KERNEL.dlcore_implementations
