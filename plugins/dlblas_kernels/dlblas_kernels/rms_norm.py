"""rms_norm: ``x * rsqrt(mean(x**2, -1) + eps) * weight`` over the last dimension.

The input is viewed as ``[rows, K]``; each program normalises one row. When the row fits in one
block (``BLOCK_N >= K``) it is read once and kept in registers; otherwise the program loops over
the row twice (sum of squares, then scale and store). Math in float32, output in ``x``'s dtype;
``weight`` may have another float dtype than ``x``.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from dlcore import hookimpl
from dlcore.device import DeviceProfile
from dlcore.implementation import Config, KernelCall, LaunchPlan, TritonImplementation, call_directly
from dlcore.layout import as_rows
from dlcore.op import Op, ScalarArg, TensorArg
from dlcore.signature import Signature, next_power_of_2

DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Widest row kept whole in registers by the default config; longer rows loop in blocks this wide.
MAX_BLOCK_N = 8192


@triton.jit
def rms_norm_kernel(
    x_ptr, w_ptr, out_ptr,
    K, eps,
    stride_x_row, stride_x_col,
    stride_w,
    stride_out_row, stride_out_col,
    BLOCK_N: tl.constexpr,
    ONE_BLOCK: tl.constexpr,
):
    # 64-bit row offsets: rows * row stride may pass 2**31 elements.
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x_row
    out_row = out_ptr + row * stride_out_row
    cols = tl.arange(0, BLOCK_N)

    if ONE_BLOCK:
        mask = cols < K
        x = tl.load(x_row + cols * stride_x_col, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / K + eps)
        w = tl.load(w_ptr + cols * stride_w, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_row + cols * stride_out_col, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # Pass 1: sum of squares, accumulated per lane and reduced once at the end.
        sum_sq = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for start in range(0, K, BLOCK_N):
            mask = start + cols < K
            x = tl.load(x_row + (start + cols) * stride_x_col, mask=mask, other=0.0).to(tl.float32)
            sum_sq += x * x
        rstd = tl.rsqrt(tl.sum(sum_sq, axis=0) / K + eps)
        # Pass 2: re-read the row (now in cache), scale and store.
        for start in range(0, K, BLOCK_N):
            mask = start + cols < K
            x = tl.load(x_row + (start + cols) * stride_x_col, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + (start + cols) * stride_w, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_row + (start + cols) * stride_out_col,
                     (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def plan(args: tuple, config: Config) -> LaunchPlan:
    x, weight, eps = args
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return LaunchPlan(calls=[], result=out)
    x2, out2 = as_rows(x), as_rows(out)
    k = x2.shape[1]
    block_n = config["BLOCK_N"]
    call = KernelCall(
        rms_norm_kernel, (x2.shape[0],),
        (x2, weight, out2, k, float(eps),
         x2.stride(0), x2.stride(1), weight.stride(0), out2.stride(0), out2.stride(1)),
        {"BLOCK_N": block_n, "ONE_BLOCK": k <= block_n, "num_warps": config["num_warps"]},
    )
    return LaunchPlan(calls=[call], result=out)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm computed in float32 (or wider) and returned in ``x``'s dtype."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute)
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * rstd * weight.to(compute)).to(x.dtype)


def default_config(sig: Signature, profile: DeviceProfile | None) -> Config:
    k = sig.tensor("x").shape[-1]
    block_n = min(max(next_power_of_2(k), 16), MAX_BLOCK_N)
    # About 16 elements per thread for long rows; one warp for short ones.
    return {"BLOCK_N": block_n, "num_warps": min(max(block_n // 512, 1), 16)}


def check(op: Op, args: dict[str, Any]) -> None:
    x = args["x"]
    op.expect_shape("weight", args["weight"], (x.shape[-1],), "one scale per feature of x's last dimension")


def example(sizes: dict[str, int], dtype: torch.dtype, device: torch.device,
            generator: torch.Generator) -> tuple:
    """Random ``x [tokens, hidden]`` and a weight near 1, as trained norms have."""
    x = torch.randn(sizes["tokens"], sizes["hidden"], generator=generator)
    weight = 1 + 0.2 * torch.randn(sizes["hidden"], generator=generator)
    return (x.to(device=device, dtype=dtype), weight.to(device=device, dtype=dtype), 1e-6)


OP = Op(
    name="rms_norm",
    args=(
        TensorArg("x", DTYPES, bucket="rows"),
        TensorArg("weight", DTYPES, max_rank=1),
        ScalarArg("eps", (float, int), default=1e-6),
    ),
    reference=rms_norm_reference,
    doc="x * rsqrt(mean(x**2, -1) + eps) * weight over the last dimension",
    check=check,
    example=example,
    example_sizes={"tokens": 37, "hidden": 256},
)

TRITON = TritonImplementation(
    "rms_norm", "triton",
    plan=plan,
    kernels=(rms_norm_kernel,),
    default_config=default_config,
    dtypes=DTYPES,
    doc="one program per row; the row in registers up to BLOCK_N, two passes beyond",
)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dimension: the Triton kernel with its default config."""
    return call_directly(OP, TRITON, (x, weight, eps), {})


@hookimpl
def dlcore_ops() -> list[Op]:
    return [OP]


@hookimpl
def dlcore_implementations() -> list[TritonImplementation]:
    return [TRITON]
