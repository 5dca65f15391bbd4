"""rms_norm: ``x * rsqrt(mean(x**2, -1) + eps) * weight`` over the last dimension, with its backward.

Forward: the input is viewed as ``[rows, K]``; each program normalises ``BLOCK_M`` rows (several when
rows are short, so a program still moves a few thousand elements). When a row fits in one block
(``BLOCK_N >= K``) it is read once and kept in registers; otherwise the program loops over the row
twice (sum of squares, then scale and store; the second read hits the cache).

Backward, with ``xhat = x * rstd`` and ``g = dy * weight``::

    dx      = rstd * (g - xhat * mean(g * xhat, -1))  (+ dres, a gradient reaching x by another path)
    dweight = sum over rows of dy * xhat

``rstd`` is recomputed from ``x``, which the backward reads anyway: the forward stores nothing but
its output. Each program takes a contiguous range of rows and accumulates its share of ``dweight``
in float32; it writes that to its own row of a ``[programs, K]`` float32 buffer, whose columns a
second kernel sums. Math in float32; outputs in the input dtypes (``weight`` may have another float
dtype than ``x``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from dlcore import hookimpl
from dlcore.device import DeviceProfile
from dlcore.implementation import Config, KernelCall, LaunchPlan
from dlcore.layout import as_rows
from dlcore.op import Op, ScalarArg, TensorArg
from dlcore.signature import Signature, make_signature, next_power_of_2
from dlcore.torch_ops import CustomOpTritonImplementation, call, config_from_ints, config_ints
from dlcore.tuning.space import Constraint, PowerOfTwo, SearchSpace, num_warps

DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Widest row kept whole in registers by the default config; longer rows loop in blocks this wide.
MAX_BLOCK_N = 8192
# Elements a program aims to hold per tile when rows are short (BLOCK_M rows of BLOCK_N).
TILE = 2048
# Fewest programs the default config keeps before it packs several short rows into one.
MIN_PROGRAMS = 1024
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps")


@triton.jit
def rms_norm_kernel(
    x_ptr, w_ptr, out_ptr,
    rows, K, eps,
    stride_x_row, stride_x_col,
    stride_w,
    stride_out_row, stride_out_col,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ONE_BLOCK: tl.constexpr,
):
    # 64-bit row offsets: rows * row stride may pass 2**31 elements.
    row = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = (row < rows)[:, None]
    x_rows = x_ptr + row[:, None] * stride_x_row
    out_rows = out_ptr + row[:, None] * stride_out_row
    cols = tl.arange(0, BLOCK_N)

    if ONE_BLOCK:
        mask = row_mask & (cols < K)[None, :]
        x = tl.load(x_rows + cols[None, :] * stride_x_col, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / K + eps)
        w = tl.load(w_ptr + cols * stride_w, mask=cols < K, other=0.0).to(tl.float32)
        out = x * rstd[:, None] * w[None, :]
        tl.store(out_rows + cols[None, :] * stride_out_col, out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # Pass 1: sum of squares, accumulated per lane and reduced once at the end.
        sum_sq = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, K, BLOCK_N):
            mask = row_mask & (start + cols < K)[None, :]
            x = tl.load(x_rows + (start + cols)[None, :] * stride_x_col, mask=mask, other=0.0).to(tl.float32)
            sum_sq += x * x
        rstd = tl.rsqrt(tl.sum(sum_sq, axis=1) / K + eps)[:, None]
        # Pass 2: re-read the rows (now in cache), scale and store.
        for start in range(0, K, BLOCK_N):
            mask = row_mask & (start + cols < K)[None, :]
            x = tl.load(x_rows + (start + cols)[None, :] * stride_x_col, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + (start + cols) * stride_w, mask=start + cols < K, other=0.0).to(tl.float32)
            tl.store(out_rows + (start + cols)[None, :] * stride_out_col,
                     (x * rstd * w[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_backward_kernel(
    dy_ptr, x_ptr, w_ptr, dres_ptr, dx_ptr, dw_ptr,
    rows, K, eps, rows_per_program,
    stride_dy_row, stride_dy_col,
    stride_x_row, stride_x_col,
    stride_w,
    stride_dres_row, stride_dres_col,
    stride_dx_row, stride_dx_col,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ONE_BLOCK: tl.constexpr, HAS_DRES: tl.constexpr,
):
    # This program's rows: [first, last); its dweight share goes to row `pid` of dw_ptr ([programs, K]).
    pid = tl.program_id(0)
    first = pid.to(tl.int64) * rows_per_program
    last = tl.minimum(first + rows_per_program, rows)
    dw_row = dw_ptr + pid.to(tl.int64) * K
    cols = tl.arange(0, BLOCK_N)

    if ONE_BLOCK:
        col_mask = (cols < K)[None, :]
        w = tl.load(w_ptr + cols * stride_w, mask=cols < K, other=0.0).to(tl.float32)[None, :]
        dw = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(first, last, BLOCK_M):
            row = start + tl.arange(0, BLOCK_M)
            mask = (row < last)[:, None] & col_mask
            x = tl.load(x_ptr + row[:, None] * stride_x_row + cols[None, :] * stride_x_col,
                        mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row[:, None] * stride_dy_row + cols[None, :] * stride_dy_col,
                         mask=mask, other=0.0).to(tl.float32)
            rstd = tl.rsqrt(tl.sum(x * x, axis=1) / K + eps)[:, None]
            xhat = x * rstd
            g = dy * w
            dx = (g - xhat * (tl.sum(g * xhat, axis=1) / K)[:, None]) * rstd
            if HAS_DRES:
                dx += tl.load(dres_ptr + row[:, None] * stride_dres_row + cols[None, :] * stride_dres_col,
                              mask=mask, other=0.0).to(tl.float32)
            tl.store(dx_ptr + row[:, None] * stride_dx_row + cols[None, :] * stride_dx_col,
                     dx.to(dx_ptr.dtype.element_ty), mask=mask)
            dw += dy * xhat
        tl.store(dw_row + cols, tl.sum(dw, axis=0), mask=cols < K)
    else:
        # Rows longer than a block: per row block, pass 1 sums x**2 and g*x, pass 2 writes dx and
        # adds dy*xhat into this program's dweight row (zeroed by the plan; it stays in cache).
        for start in range(first, last, BLOCK_M):
            row = start + tl.arange(0, BLOCK_M)
            row_mask = (row < last)[:, None]
            sum_sq = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            sum_gx = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for c in range(0, K, BLOCK_N):
                mask = row_mask & (c + cols < K)[None, :]
                x = tl.load(x_ptr + row[:, None] * stride_x_row + (c + cols)[None, :] * stride_x_col,
                            mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + row[:, None] * stride_dy_row + (c + cols)[None, :] * stride_dy_col,
                             mask=mask, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + (c + cols) * stride_w, mask=c + cols < K, other=0.0).to(tl.float32)
                sum_sq += x * x
                sum_gx += dy * w[None, :] * x
            rstd = tl.rsqrt(tl.sum(sum_sq, axis=1) / K + eps)[:, None]
            # mean(g * xhat) = rstd * mean(g * x)
            mean_gxhat = tl.sum(sum_gx, axis=1)[:, None] / K * rstd
            for c in range(0, K, BLOCK_N):
                mask = row_mask & (c + cols < K)[None, :]
                x = tl.load(x_ptr + row[:, None] * stride_x_row + (c + cols)[None, :] * stride_x_col,
                            mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + row[:, None] * stride_dy_row + (c + cols)[None, :] * stride_dy_col,
                             mask=mask, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + (c + cols) * stride_w, mask=c + cols < K, other=0.0).to(tl.float32)
                xhat = x * rstd
                dx = (dy * w[None, :] - xhat * mean_gxhat) * rstd
                if HAS_DRES:
                    dx += tl.load(dres_ptr + row[:, None] * stride_dres_row + (c + cols)[None, :] * stride_dres_col,
                                  mask=mask, other=0.0).to(tl.float32)
                tl.store(dx_ptr + row[:, None] * stride_dx_row + (c + cols)[None, :] * stride_dx_col,
                         dx.to(dx_ptr.dtype.element_ty), mask=mask)
                dw = tl.load(dw_row + c + cols, mask=c + cols < K, other=0.0) + tl.sum(dy * xhat, axis=0)
                tl.store(dw_row + c + cols, dw, mask=c + cols < K)
                # The next row block reads this slice back, possibly from other threads of the program.
                tl.debug_barrier()


@triton.jit
def column_sum_kernel(
    src_ptr, out_ptr,
    rows, K,
    stride_out,
    BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # out[k] = sum over rows of src[row, k], src being a dense float32 [rows, K] buffer.
    cols = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    col_mask = (cols < K)[None, :]
    acc = tl.zeros((BLOCK_P, BLOCK_K), dtype=tl.float32)
    for start in range(0, rows, BLOCK_P):
        row = start + tl.arange(0, BLOCK_P)
        mask = (row < rows)[:, None] & col_mask
        acc += tl.load(src_ptr + row.to(tl.int64)[:, None] * K + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + cols * stride_out, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=cols < K)


def plan(args: tuple, config: Config) -> LaunchPlan:
    x, weight, eps = args
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return LaunchPlan(calls=[], result=out)
    x2, out2 = as_rows(x), as_rows(out)
    rows, k = x2.shape
    block_m, block_n = config["BLOCK_M"], config["BLOCK_N"]
    call = KernelCall(
        rms_norm_kernel, (triton.cdiv(rows, block_m),),
        (x2, weight, out2, rows, k, float(eps),
         x2.stride(0), x2.stride(1), weight.stride(0), out2.stride(0), out2.stride(1)),
        {"BLOCK_M": block_m, "BLOCK_N": block_n, "ONE_BLOCK": k <= block_n, "num_warps": config["num_warps"]},
    )
    return LaunchPlan(calls=[call], result=out)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter, meta tensors, other devices: few programs, each looping more


def backward_programs(rows: int, block_m: int, num_warps: int, device: torch.device) -> tuple[int, int]:
    """``(programs, rows_per_program)`` of the backward: enough programs to fill the device (about
    32 warps per multiprocessor), no more, since each writes a K-wide float32 dweight partial."""
    cap = _multiprocessors(device) * max(32 // num_warps, 1)
    programs = min(triton.cdiv(rows, block_m), cap)
    rows_per_program = triton.cdiv(triton.cdiv(rows, programs), block_m) * block_m
    return triton.cdiv(rows, rows_per_program), rows_per_program


def backward_outputs(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device),
            torch.empty(weight.shape, dtype=weight.dtype, device=weight.device))


def backward_plan(args: tuple, config: Config) -> LaunchPlan:
    """Launches for ``(dx, dweight)`` from ``args = (dy, x, weight, dres | None, eps)``."""
    dy, x, weight, dres, eps = args
    dx, dw = backward_outputs(x, weight)
    k = x.shape[-1]
    if x.numel() == 0:
        return LaunchPlan(calls=[], result=(dx, dw.zero_()))
    x2, dx2 = as_rows(x), as_rows(dx)
    # dy comes from autograd in any layout (even expanded); reshape copies only when it must.
    dy2 = dy.reshape(x2.shape)
    dres2 = dres.reshape(x2.shape) if dres is not None else dy2
    rows = x2.shape[0]
    block_m, block_n, num_warps = config["BLOCK_M"], config["BLOCK_N"], config["num_warps"]
    one_block = k <= block_n
    programs, rows_per_program = backward_programs(rows, block_m, num_warps, x.device)
    # Looping programs add into their partial row, so it starts at zero.
    partial = (torch.empty if one_block else torch.zeros)((programs, k), dtype=torch.float32, device=x.device)
    main = KernelCall(
        rms_norm_backward_kernel, (programs,),
        (dy2, x2, weight, dres2, dx2, partial, rows, k, float(eps), rows_per_program,
         dy2.stride(0), dy2.stride(1), x2.stride(0), x2.stride(1), weight.stride(0),
         dres2.stride(0), dres2.stride(1), dx2.stride(0), dx2.stride(1)),
        {"BLOCK_M": block_m, "BLOCK_N": block_n, "ONE_BLOCK": one_block, "HAS_DRES": dres is not None,
         "num_warps": num_warps},
    )
    block_k = min(max(next_power_of_2(k), 16), 128)
    reduce = KernelCall(
        column_sum_kernel, (triton.cdiv(k, block_k),),
        (partial, dw, programs, k, dw.stride(0)),
        {"BLOCK_P": 32, "BLOCK_K": block_k, "num_warps": 4},
    )
    return LaunchPlan(calls=[main, reduce], result=(dx, dw))


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm computed in float32 (or wider) and returned in ``x``'s dtype."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute)
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * rstd * weight.to(compute)).to(x.dtype)


def rms_norm_backward_reference(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                dres: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward formulas of the module docstring in torch, in float32 (or wider)."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xf, dyf = x.to(compute), dy.to(compute)
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    xhat = xf * rstd
    g = dyf * weight.to(compute)
    dx = rstd * (g - xhat * (g * xhat).mean(dim=-1, keepdim=True))
    if dres is not None:
        dx = dx + dres.to(compute)
    dw = (dyf * xhat).reshape(-1, x.shape[-1]).sum(dim=0)
    return dx.to(x.dtype), dw.to(weight.dtype)


def heuristic_config(rows: int, k: int) -> Config:
    """The default config for ``rows`` rows of ``k`` elements."""
    block_n = min(max(next_power_of_2(k), 16), MAX_BLOCK_N)
    # Short rows: several per program, while at least MIN_PROGRAMS programs remain.
    block_m = min(max(TILE // block_n, 1), max(rows // MIN_PROGRAMS, 1))
    # About 16 elements per thread for long tiles; one warp for short ones.
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": min(max(block_m * block_n // 512, 1), 16)}


def default_config(sig: Signature, profile: DeviceProfile | None) -> Config:
    rows, k = sig.tensor("x").shape  # rows rounded up to a power of two
    return heuristic_config(rows, k)


def _elements_per_thread(c: Config) -> float:
    return c["BLOCK_M"] * c["BLOCK_N"] / (32 * c["num_warps"])


def space() -> SearchSpace:
    """Rows per program, row block width and warps. Rows wider than BLOCK_N loop (two passes)."""
    return SearchSpace(
        [PowerOfTwo("BLOCK_M", 1, 128), PowerOfTwo("BLOCK_N", 16, 16384), num_warps(1, 2, 4, 8, 16, 32)],
        [
            Constraint("BLOCK_M * BLOCK_N / (32 * num_warps) >= 2 (every thread has at least two elements)",
                       lambda c: _elements_per_thread(c) >= 2),
            # The backward runs with the same config and keeps about five float32 values per
            # element (x, dy, xhat, dx, the dweight partial): 32 elements fill 160 registers.
            Constraint("BLOCK_M * BLOCK_N / (32 * num_warps) <= 32 (the tile fits in registers, backward included)",
                       lambda c: _elements_per_thread(c) <= 32),
        ],
    )


def check(op: Op, args: dict[str, Any]) -> None:
    x = args["x"]
    op.expect_shape("weight", args["weight"], (x.shape[-1],), "one scale per feature of x's last dimension")


def example(sizes: dict[str, int], dtype: torch.dtype, device: torch.device,
            generator: torch.Generator) -> tuple:
    """Random ``x [tokens, hidden]`` and a weight near 1, as trained norms have."""
    x = torch.randn(sizes["tokens"], sizes["hidden"], generator=generator)
    weight = 1 + 0.2 * torch.randn(sizes["hidden"], generator=generator)
    return (x.to(device=device, dtype=dtype), weight.to(device=device, dtype=dtype), 1e-6)


def cost(args: tuple, mode: str = "fwd") -> tuple[int, int]:
    """Forward: read x and weight, write y; per element a square, a sum and two products.
    Backward: read dy, x and weight, write dx and dweight; about ten flops per element."""
    x, weight, _ = args
    x_bytes, w_bytes = x.numel() * x.element_size(), weight.numel() * weight.element_size()
    if mode == "bwd":
        return 3 * x_bytes + 2 * w_bytes, 10 * x.numel()
    return 2 * x_bytes + w_bytes, 4 * x.numel()


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """What a model runs in eager torch: transformers' ``LlamaRMSNorm.forward``."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def liger_rms_norm():
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except ImportError:
        return None
    return lambda x, weight, eps=1e-6: LigerRMSNormFunction.apply(x, weight, eps)


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
    cost=cost,
    baselines={"torch": lambda: torch_rms_norm, "liger": liger_rms_norm},
)


# -- PyTorch custom ops ----------------------------------------------------------------------------


def _config(args: tuple, values: tuple[int, ...]) -> Config:
    return config_from_ints(CONFIG_KEYS, values,
                            lambda: default_config(make_signature(OP, args, args[0].device), None))


@torch.library.custom_op("dlblas::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float,
                block_m: int, block_n: int, num_warps: int) -> torch.Tensor:
    """``rms_norm`` with the launch config as trailing ints (all zero: the default). float64 inputs
    take the torch reference (the path ``torch.autograd.gradcheck`` runs)."""
    if x.dtype == torch.float64:
        return rms_norm_reference(x, weight, eps)
    args = (x, weight, eps)
    return plan(args, _config(args, (block_m, block_n, num_warps))).run()


@rms_norm_op.register_fake
def _rms_norm_fake(x, weight, eps, block_m, block_n, num_warps):
    if x.dtype != torch.float64:
        OP.validate((x, weight, eps))
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("dlblas::rms_norm_backward", mutates_args=())
def rms_norm_backward_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, dres: torch.Tensor | None,
                         eps: float, block_m: int, block_n: int,
                         num_warps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dweight)`` of ``rms_norm`` for the output gradient ``dy``; ``dres``, if given, is added
    to ``dx`` (``add_rms_norm``'s gradient of ``residual_out``)."""
    if x.dtype == torch.float64:
        return rms_norm_backward_reference(dy, x, weight, dres, eps)
    config = _config((x, weight, eps), (block_m, block_n, num_warps))
    return backward_plan((dy, x, weight, dres, eps), config).run()


@rms_norm_backward_op.register_fake
def _rms_norm_backward_fake(dy, x, weight, dres, eps, block_m, block_n, num_warps):
    return backward_outputs(x, weight)


def _setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, weight, eps, *config = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps, ctx.config = eps, config


def _backward(ctx: Any, dy: torch.Tensor) -> tuple:
    x, weight = ctx.saved_tensors
    dx, dw = torch.ops.dlblas.rms_norm_backward(dy, x, weight, None, ctx.eps, *ctx.config)
    return dx, dw, None, None, None, None


rms_norm_op.register_autograd(_backward, setup_context=_setup_context)


def custom_op(args: tuple, config: Config | None) -> torch.Tensor:
    x, weight, eps = args
    return torch.ops.dlblas.rms_norm(x, weight, float(eps), *config_ints(config, CONFIG_KEYS))


TRITON = CustomOpTritonImplementation(
    "rms_norm", "triton",
    plan=plan,
    kernels=(rms_norm_kernel, rms_norm_backward_kernel, column_sum_kernel),
    default_config=default_config,
    space=space,
    custom_op=custom_op,
    dtypes=DTYPES,
    doc="BLOCK_M rows per program, each in registers up to BLOCK_N, two passes beyond; "
        "backward: dx per row, dweight from per-program partial sums",
)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dimension with the Triton kernel and its default config; differentiable
    in ``x`` and ``weight``, and one node under ``torch.compile``."""
    return call(OP, TRITON, (x, weight, eps))


@hookimpl
def dlcore_ops() -> list[Op]:
    return [OP]


@hookimpl
def dlcore_implementations() -> list[CustomOpTritonImplementation]:
    return [TRITON]
