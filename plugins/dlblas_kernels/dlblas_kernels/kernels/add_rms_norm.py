"""add_rms_norm: the residual add and RMSNorm of a transformer block, in one pass.

    residual_out = x + residual                        (rounded to the input dtype, as a model stores it)
    y            = rms_norm(residual_out, weight, eps)

Forward: the inputs are viewed as ``[rows, K]``; each program handles ``BLOCK_M`` rows, reading
``x`` and ``residual`` once and writing ``residual_out`` and ``y``. Rows wider than ``BLOCK_N`` take
two passes (the second recomputes the sum from ``x`` and ``residual``, now in cache).

Backward: the gradient reaching ``residual_out`` is the RMSNorm gradient of ``y`` plus the gradient
of ``residual_out`` itself, and it is the gradient of both ``x`` and ``residual``. It is
``rms_norm``'s backward (its kernels, through the custom op ``dlblas::rms_norm_backward`` where a
tracer watches) on the saved ``residual_out`` with that
second gradient added as it writes ``dx``: one output, returned for both inputs.

Through :mod:`dlcore.language`, the loops over rows wider than a block mark the inputs they load
for double buffering (triton-ascend then loads the next block while it computes this one;
upstream Triton ignores the mark).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

import dlcore.language as dl
from dlblas_kernels.kernels.rms_norm import KERNEL as RMS_NORM
from dlblas_kernels.kernels.rms_norm import heuristic_config, rms_norm_reference, space, torch_rms_norm
from dlcore.api import (
    Backward,
    Config,
    DeviceProfile,
    KernelCall,
    LaunchPlan,
    Op,
    ScalarArg,
    Signature,
    TensorArg,
    as_rows,
    cdiv,
    define_kernel,
)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def add_rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, h_ptr,
    rows, K, eps,
    stride_x_row, stride_x_col,
    stride_r_row, stride_r_col,
    stride_w,
    stride_y_row, stride_y_col,
    stride_h_row, stride_h_col,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ONE_BLOCK: tl.constexpr,
):
    # 64-bit row offsets: rows * row stride may pass 2**31 elements.
    row = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = (row < rows)[:, None]
    x_rows = x_ptr + row[:, None] * stride_x_row
    r_rows = r_ptr + row[:, None] * stride_r_row
    y_rows = y_ptr + row[:, None] * stride_y_row
    h_rows = h_ptr + row[:, None] * stride_h_row
    cols = tl.arange(0, BLOCK_N)

    if ONE_BLOCK:
        mask = row_mask & (cols < K)[None, :]
        x = tl.load(x_rows + cols[None, :] * stride_x_col, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(r_rows + cols[None, :] * stride_r_col, mask=mask, other=0.0).to(tl.float32)
        # The sum is rounded to the stored dtype, and y normalises what is stored.
        h = (x + r).to(h_ptr.dtype.element_ty)
        tl.store(h_rows + cols[None, :] * stride_h_col, h, mask=mask)
        hf = h.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(hf * hf, axis=1) / K + eps)
        w = tl.load(w_ptr + cols * stride_w, mask=cols < K, other=0.0).to(tl.float32)
        y = hf * rstd[:, None] * w[None, :]
        tl.store(y_rows + cols[None, :] * stride_y_col, y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        # Pass 1: residual_out, and its sum of squares per lane.
        sum_sq = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, K, BLOCK_N):
            mask = row_mask & (start + cols < K)[None, :]
            x = tl.load(x_rows + (start + cols)[None, :] * stride_x_col, mask=mask, other=0.0)
            r = tl.load(r_rows + (start + cols)[None, :] * stride_r_col, mask=mask, other=0.0)
            dl.multibuffer(x, 2)
            dl.multibuffer(r, 2)
            h = (x.to(tl.float32) + r.to(tl.float32)).to(h_ptr.dtype.element_ty)
            tl.store(h_rows + (start + cols)[None, :] * stride_h_col, h, mask=mask)
            hf = h.to(tl.float32)
            sum_sq += hf * hf
        rstd = tl.rsqrt(tl.sum(sum_sq, axis=1) / K + eps)[:, None]
        # Pass 2: recompute residual_out from the inputs (in cache), scale and store y.
        for start in range(0, K, BLOCK_N):
            mask = row_mask & (start + cols < K)[None, :]
            x = tl.load(x_rows + (start + cols)[None, :] * stride_x_col, mask=mask, other=0.0)
            r = tl.load(r_rows + (start + cols)[None, :] * stride_r_col, mask=mask, other=0.0)
            dl.multibuffer(x, 2)
            dl.multibuffer(r, 2)
            hf = (x.to(tl.float32) + r.to(tl.float32)).to(h_ptr.dtype.element_ty).to(tl.float32)
            w = tl.load(w_ptr + (start + cols) * stride_w, mask=start + cols < K, other=0.0).to(tl.float32)
            tl.store(y_rows + (start + cols)[None, :] * stride_y_col,
                     (hf * rstd * w[None, :]).to(y_ptr.dtype.element_ty), mask=mask)


def outputs(x: torch.Tensor, *_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device),
            torch.empty(x.shape, dtype=x.dtype, device=x.device))


def plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    x, weight, residual, eps = args
    y, h = outputs(x)
    if x.numel() == 0:
        return LaunchPlan(calls=[], result=(y, h))
    x2, r2, y2, h2 = as_rows(x), as_rows(residual), as_rows(y), as_rows(h)
    rows, k = x2.shape
    block_m, block_n = config["BLOCK_M"], config["BLOCK_N"]
    call = KernelCall(
        add_rms_norm_kernel, (cdiv(rows, block_m),),
        (x2, r2, weight, y2, h2, rows, k, float(eps),
         x2.stride(0), x2.stride(1), r2.stride(0), r2.stride(1), weight.stride(0),
         y2.stride(0), y2.stride(1), h2.stride(0), h2.stride(1)),
        {"BLOCK_M": block_m, "BLOCK_N": block_n, "ONE_BLOCK": k <= block_n, "num_warps": config["num_warps"]},
    )
    return LaunchPlan(calls=[call], result=(y, h))


def add_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                           eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``: the sum in float32 (or wider), rounded to ``x``'s
    dtype, then normalised as :func:`rms_norm_reference` does."""
    compute = torch.promote_types(x.dtype, torch.float32)
    h = (x.to(compute) + residual.to(compute)).to(x.dtype)
    return rms_norm_reference(h, weight, eps), h


def default_config(sig: Signature, profile: DeviceProfile) -> Config:
    rows, k = sig.tensor("x").shape  # rows rounded up to a power of two
    return heuristic_config(rows, k)


def check(op: Op, args: dict[str, Any]) -> None:
    x = args["x"]
    op.expect_shape("weight", args["weight"], (x.shape[-1],), "one scale per feature of x's last dimension")
    op.expect_shape("residual", args["residual"], tuple(x.shape), "the shape of x")


def example(sizes: dict[str, int], dtype: torch.dtype, device: torch.device,
            generator: torch.Generator) -> tuple:
    """Random ``x, residual [tokens, hidden]`` (the residual stream grows larger than a layer's
    output) and a weight near 1."""
    x = torch.randn(sizes["tokens"], sizes["hidden"], generator=generator)
    residual = 4 * torch.randn(sizes["tokens"], sizes["hidden"], generator=generator)
    weight = 1 + 0.2 * torch.randn(sizes["hidden"], generator=generator)
    return (x.to(device=device, dtype=dtype), weight.to(device=device, dtype=dtype),
            residual.to(device=device, dtype=dtype), 1e-6)


def cost(args: tuple, mode: str = "fwd") -> tuple[int, int]:
    """Forward: read x, residual and weight, write y and residual_out; about five flops per element.
    Backward: read dy, d residual_out, residual_out and weight, write dx (which is also d residual:
    one tensor) and dweight; about eleven flops per element."""
    x, weight, _, _ = args
    x_bytes, w_bytes = x.numel() * x.element_size(), weight.numel() * weight.element_size()
    if mode == "bwd":
        return 4 * x_bytes + 2 * w_bytes, 11 * x.numel()
    return 4 * x_bytes + w_bytes, 5 * x.numel()


def torch_add_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                       eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """What a model runs in eager torch: ``hidden = residual + x``, then transformers' LlamaRMSNorm."""
    h = residual + x
    return torch_rms_norm(h, weight, eps), h


def liger_add_rms_norm():
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
    except ImportError:
        return None
    return lambda x, weight, residual, eps=1e-6: LigerFusedAddRMSNormFunction.apply(x, residual, weight, eps)


OP = Op(
    name="add_rms_norm",
    args=(
        TensorArg("x", DTYPES, bucket="rows"),
        TensorArg("weight", DTYPES, max_rank=1),
        TensorArg("residual", DTYPES, same_dtype_as="x", bucket="rows"),
        ScalarArg("eps", (float, int), default=1e-6, finite=True, minimum=0.0),
    ),
    reference=add_rms_norm_reference,
    doc="(rms_norm(x + residual, weight, eps), x + residual) in one pass",
    check=check,
    example=example,
    example_sizes={"tokens": 37, "hidden": 256},
    example_paths={"wide rows": {"tokens": 4, "hidden": 8192}},
    cost=cost,
    baselines={"torch": lambda: torch_add_rms_norm, "liger": liger_add_rms_norm},
)


def _gradients(backward, saved, grads, needs) -> dict:
    dy, d_residual_out = grads
    dh, dw = backward(dy, saved.residual_out, saved.weight, d_residual_out, saved.eps)
    return {"x": dh, "weight": dw, "residual": dh}


KERNEL = define_kernel(
    OP, plan,
    kernels=(add_rms_norm_kernel,),
    results=outputs,
    outputs=("y", "residual_out"),
    default_config=default_config,
    space=space,
    backward=Backward(_gradients, saved=("residual_out", "weight", "eps"), of=RMS_NORM),
    doc="one pass: residual add, residual_out stored, RMSNorm; backward through rms_norm's kernels",
)
add_rms_norm = KERNEL.function
dlcore_ops, dlcore_implementations = KERNEL.dlcore_ops, KERNEL.dlcore_implementations
