"""silu_and_mul: the SwiGLU activation, ``silu(x[..., :N]) * x[..., N:]`` for ``x`` of shape ``[..., 2N]``.

The input is viewed as ``[rows, 2N]``; each program handles one row and ``BLOCK_N`` output columns,
reading the gate half and the up half of that row. Math in float32, output in the input dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from dlcore import InvalidInputError, hookimpl
from dlcore.device import DeviceProfile
from dlcore.implementation import Config, KernelCall, LaunchPlan, TritonImplementation, call_directly
from dlcore.layout import as_rows
from dlcore.op import Op, TensorArg
from dlcore.signature import Signature, next_power_of_2

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


def plan(args: tuple, config: Config) -> LaunchPlan:
    (x,) = args
    n = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return LaunchPlan(calls=[], result=out)
    x2, out2 = as_rows(x), as_rows(out)
    block_n = config["BLOCK_N"]
    grid = (x2.shape[0], triton.cdiv(n, block_n))
    call = KernelCall(
        silu_and_mul_kernel, grid,
        (x2, out2, n, x2.stride(0), x2.stride(1), out2.stride(0), out2.stride(1)),
        {"BLOCK_N": block_n, "num_warps": config["num_warps"]},
    )
    return LaunchPlan(calls=[call], result=out)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` computed in float32 (or wider) and returned in ``x``'s dtype."""
    compute = torch.promote_types(x.dtype, torch.float32)
    gate, up = x.to(compute).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def default_config(sig: Signature, profile: DeviceProfile | None) -> Config:
    n = sig.tensor("x").shape[-1] // 2
    block_n = min(max(next_power_of_2(n), 16), MAX_BLOCK_N)
    # About 8 elements per thread once the block is wide; one warp for narrow rows.
    return {"BLOCK_N": block_n, "num_warps": min(max(block_n // 256, 1), 8)}


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


OP = Op(
    name="silu_and_mul",
    args=(TensorArg("x", DTYPES, bucket="rows"),),
    reference=silu_and_mul_reference,
    doc="silu(x[..., :N]) * x[..., N:] for x of shape [..., 2N] (SwiGLU)",
    check=check,
    example=example,
    example_sizes={"tokens": 37, "inter": 128},
)

TRITON = TritonImplementation(
    "silu_and_mul", "triton",
    plan=plan,
    kernels=(silu_and_mul_kernel,),
    default_config=default_config,
    dtypes=DTYPES,
    doc="one program per (row, column block); math in float32",
)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :N]) * x[..., N:]``: the Triton kernel with its default config."""
    return call_directly(OP, TRITON, (x,), {})


@hookimpl
def dlcore_ops() -> list[Op]:
    return [OP]


@hookimpl
def dlcore_implementations() -> list[TritonImplementation]:
    return [TRITON]
