"""rms_norm: ``x * rsqrt(mean(x**2, -1) + eps) * weight`` over the last dimension, with its backward.

Forward: the input is viewed as ``[rows, K]``; each program normalises ``BLOCK_M`` rows (several when
rows are short, so a program still moves a few thousand elements). When a row fits in one block
(``BLOCK_N >= K``) it is read once and kept in registers; otherwise the program loops over the row
twice (sum of squares, then scale and store; the second read hits the cache).

Backward, with ``xhat = x * rstd`` and ``g = dy * weight``::

    dx      = rstd * (g - xhat * mean(g * xhat, -1))  (+ dres, a gradient reaching x by another path)
    dweight = sum over rows of dy * xhat

``rstd`` is recomputed from ``x``, which the backward reads anyway (two row sums, ``sum(x**2)`` and
``sum(g * x)``, each a single-operand ``tl.sum``: triton-ascend's adapter leaves a two-operand
``tl.reduce`` unlowered): the forward stores nothing but its output. The backward is
memory-bound: it reads ``dy`` and ``x`` and writes ``dx`` (three times the size of ``x``, the
minimum), plus a ``[programs, K]`` float32 buffer of dweight partials written and read once (4 MiB
at hidden 4096 on 132 multiprocessors, against 96 MiB for 4096 tokens in bfloat16). Its grid is
persistent, as many programs as the device's cores hold at once (by its profile's core count,
registers and threads per core); each takes row blocks ``pid,
pid + programs, ...``, issues the loads of its next row block before computing the current one,
keeps its ``dweight`` share in registers, and writes it once at the end; a second kernel sums
the partials' columns. With a single program the share is ``dweight`` itself: one launch. Rows
wider than a block take two passes per row block, the second from cache. Math in float32; outputs
in the input dtypes (``weight`` may have another float dtype than ``x``).

Portable across Tritons through :mod:`dlcore.language`: the backward's loop over row blocks is its
persistent loop, and the forward's loops over rows wider than a block mark the rows they load for
double buffering (triton-ascend then loads the next block while it computes this one; upstream
Triton ignores the mark).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

import dlcore.language as dl
from dlblas_kernels.blocks.npu import buffer_tile
from dlcore.api import (
    Backward,
    Config,
    Constraint,
    DeviceProfile,
    KernelCall,
    LaunchPlan,
    Op,
    PowerOfTwo,
    ScalarArg,
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

# Widest row kept whole in registers by the default config; longer rows loop in blocks this wide.
MAX_BLOCK_N = 8192
# Elements a program aims to hold per tile when rows are short (BLOCK_M rows of BLOCK_N).
TILE = 2048
# Fewest programs the default config keeps before it packs several short rows into one.
MIN_PROGRAMS = 1024
# The backward holds about three times the forward's live values per element (x, dy, the next row
# block's x and dy, weight, the dweight share): its tile is at most this many elements, and each
# thread holds at most BACKWARD_ELEMENTS_PER_THREAD of them (16 warps for the widest tile).
MAX_BACKWARD_TILE = 8192
BACKWARD_ELEMENTS_PER_THREAD = 16
# On npu the backward's tile lives in the unified buffer: bishengir-compile 1.2 asks 30 bytes of it
# per element of an 8192-element tile (245824 of the Ascend 910B2's 196608), 32 with add_rms_norm's
# residual gradient (262208); the budget per element leaves headroom.
UB_BYTES_PER_BACKWARD_ELEMENT = 40
# The elements of the backward tiles resident on one core that keep enough loads in flight to stream
# from DRAM.
RESIDENT_ELEMENTS = 16384


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
            x = tl.load(x_rows + (start + cols)[None, :] * stride_x_col, mask=mask, other=0.0)
            dl.multibuffer(x, 2)
            x = x.to(tl.float32)
            sum_sq += x * x
        rstd = tl.rsqrt(tl.sum(sum_sq, axis=1) / K + eps)[:, None]
        # Pass 2: re-read the rows (now in cache), scale and store.
        for start in range(0, K, BLOCK_N):
            mask = row_mask & (start + cols < K)[None, :]
            x = tl.load(x_rows + (start + cols)[None, :] * stride_x_col, mask=mask, other=0.0)
            dl.multibuffer(x, 2)
            x = x.to(tl.float32)
            w = tl.load(w_ptr + (start + cols) * stride_w, mask=start + cols < K, other=0.0).to(tl.float32)
            tl.store(out_rows + (start + cols)[None, :] * stride_out_col,
                     (x * rstd * w[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_backward_kernel(
    dy_ptr, x_ptr, w_ptr, dres_ptr, dx_ptr, dw_ptr,
    rows, K, eps,
    stride_dy_row, stride_dy_col,
    stride_x_row, stride_x_col,
    stride_w,
    stride_dres_row, stride_dres_col,
    stride_dx_row, stride_dx_col,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ONE_BLOCK: tl.constexpr, HAS_DRES: tl.constexpr,
):
    # A persistent program: row blocks pid, pid + programs, ...; its dweight share goes to row `pid`
    # of dw_ptr (a dense [programs, K] buffer, or dweight itself when there is one program).
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    blocks = tl.cdiv(rows, BLOCK_M)
    step = programs.to(tl.int64) * BLOCK_M
    block_rows = tl.arange(0, BLOCK_M).to(tl.int64)  # 64-bit: rows * row stride may pass 2**31
    cols = tl.arange(0, BLOCK_N)
    dw_row = dw_ptr + pid.to(tl.int64) * K

    if ONE_BLOCK:
        # Rows fit in one block: the dweight share stays in registers across row blocks, and the
        # next row block's loads are issued before this one is reduced (its DRAM latency overlaps
        # this block's reductions, math and stores).
        col_mask = (cols < K)[None, :]
        w = tl.load(w_ptr + cols * stride_w, mask=cols < K, other=0.0).to(tl.float32)[None, :]
        dw = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        row = pid * BLOCK_M + block_rows
        mask = (row < rows)[:, None] & col_mask
        x_next = tl.load(x_ptr + row[:, None] * stride_x_row + cols[None, :] * stride_x_col, mask=mask, other=0.0)
        dy_next = tl.load(dy_ptr + row[:, None] * stride_dy_row + cols[None, :] * stride_dy_col, mask=mask, other=0.0)
        for block in dl.persistent_range(pid, blocks, programs):
            # Rows and masks from the loop index, not carried over: carried, the compiler could not
            # prove the mask constant along a row, and would not vectorise the loads.
            row = block * BLOCK_M + block_rows
            mask = (row < rows)[:, None] & col_mask
            x = x_next.to(tl.float32)
            dy = dy_next.to(tl.float32)
            following = row + step
            next_mask = (following < rows)[:, None] & col_mask
            x_next = tl.load(x_ptr + following[:, None] * stride_x_row + cols[None, :] * stride_x_col,
                             mask=next_mask, other=0.0)
            dy_next = tl.load(dy_ptr + following[:, None] * stride_dy_row + cols[None, :] * stride_dy_col,
                              mask=next_mask, other=0.0)
            if HAS_DRES:
                # Not prefetched (registers): issued now, it overlaps this block's reductions.
                dres = tl.load(dres_ptr + row[:, None] * stride_dres_row + cols[None, :] * stride_dres_col,
                               mask=mask, other=0.0)
            # The row sums: sum(x**2) for rstd, sum(g * x) for mean(g * xhat).
            g = dy * w
            sum_sq = tl.sum(x * x, axis=1)
            sum_gx = tl.sum(g * x, axis=1)
            rstd = tl.rsqrt(sum_sq / K + eps)
            # dx = rstd * g - x * rstd**3 * mean(g * x)
            coef = (sum_gx / K) * rstd * rstd * rstd
            dx = g * rstd[:, None] - x * coef[:, None]
            if HAS_DRES:
                dx += dres.to(tl.float32)
            tl.store(dx_ptr + row[:, None] * stride_dx_row + cols[None, :] * stride_dx_col,
                     dx.to(dx_ptr.dtype.element_ty), mask=mask)
            dw += dy * x * rstd[:, None]
        # Written once, whole: the buffer needs no zeroing.
        tl.store(dw_row + cols, tl.sum(dw, axis=0).to(dw_ptr.dtype.element_ty), mask=cols < K)
    else:
        # Rows longer than a block: per row block, pass 1 sums x**2 and g*x over the row, pass 2
        # re-reads it (from cache), writes dx and adds dy*xhat into this program's dweight row, which
        # the first row block stores and later ones read back (so the buffer needs no zeroing).
        for block in dl.persistent_range(pid, blocks, programs):
            row = block * BLOCK_M + block_rows
            row_mask = (row < rows)[:, None]
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
            coef = (tl.sum(sum_gx, axis=1)[:, None] / K) * rstd * rstd * rstd
            # Columns of the dweight row to read back: none in the program's first row block.
            read_back = tl.where(block == pid, 0, K)
            for c in range(0, K, BLOCK_N):
                mask = row_mask & (c + cols < K)[None, :]
                x = tl.load(x_ptr + row[:, None] * stride_x_row + (c + cols)[None, :] * stride_x_col,
                            mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + row[:, None] * stride_dy_row + (c + cols)[None, :] * stride_dy_col,
                             mask=mask, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + (c + cols) * stride_w, mask=c + cols < K, other=0.0).to(tl.float32)
                dx = dy * w[None, :] * rstd - x * coef
                if HAS_DRES:
                    dx += tl.load(dres_ptr + row[:, None] * stride_dres_row + (c + cols)[None, :] * stride_dres_col,
                                  mask=mask, other=0.0).to(tl.float32)
                tl.store(dx_ptr + row[:, None] * stride_dx_row + (c + cols)[None, :] * stride_dx_col,
                         dx.to(dx_ptr.dtype.element_ty), mask=mask)
                col_ok = c + cols < K
                dw = tl.sum(dy * x * rstd, axis=0)
                dw += tl.load(dw_row + c + cols, mask=c + cols < read_back, other=0.0).to(tl.float32)
                tl.store(dw_row + c + cols, dw.to(dw_ptr.dtype.element_ty), mask=col_ok)
            # The next row block reads these slices back, possibly in other threads of the program.
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


def plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    x, weight, eps = args
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return LaunchPlan(calls=[], result=out)
    x2, out2 = as_rows(x), as_rows(out)
    rows, k = x2.shape
    block_m, block_n = config["BLOCK_M"], config["BLOCK_N"]
    call = KernelCall(
        rms_norm_kernel, (cdiv(rows, block_m),),
        (x2, weight, out2, rows, k, float(eps),
         x2.stride(0), x2.stride(1), weight.stride(0), out2.stride(0), out2.stride(1)),
        {"BLOCK_M": block_m, "BLOCK_N": block_n, "ONE_BLOCK": k <= block_n, "num_warps": config["num_warps"]},
    )
    return LaunchPlan(calls=[call], result=out)


def backward_config(config: Config, profile: DeviceProfile | None = None) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps)`` of the backward for the op's ``config``: its tile narrowed to
    MAX_BACKWARD_TILE elements (on npu, to what the unified buffer holds: 4096 on the Ascend 910B;
    BLOCK_M first; rows wider than BLOCK_N take the two-pass path), and at least one warp per
    BACKWARD_ELEMENTS_PER_THREAD * 32 elements of it."""
    most = buffer_tile(profile, UB_BYTES_PER_BACKWARD_ELEMENT, MAX_BACKWARD_TILE)
    block_n = min(config["BLOCK_N"], most)
    block_m = max(min(config["BLOCK_M"], most // block_n), 1)
    tile = block_m * block_n
    num_warps = min(max(config["num_warps"], tile // (32 * BACKWARD_ELEMENTS_PER_THREAD)), 16)
    return block_m, block_n, num_warps


def backward_programs(blocks: int, tile: int, num_warps: int, profile: DeviceProfile) -> int:
    """Programs of the backward's persistent grid for ``blocks`` row blocks of ``tile`` elements.

    As many as the device's cores hold at once, and no more: a program that waits for a free core
    doubles the time, and each writes a K-wide float32 dweight partial. Registers bound the resident
    threads: ``ptxas`` gives 32-48 registers at 2-4 elements per thread, 74-93 at 8, 117-128 at 16
    (sm_90, bfloat16; 32 + 6 per element bounds them all), and so do the threads a core holds.
    Beyond RESIDENT_ELEMENTS per core, more programs would add partials and no bandwidth. A limit
    the profile does not know (0) bounds nothing; with no core count, one program per row block.
    """
    warp = profile.warp_size or 32
    threads = warp * num_warps
    per_core = cdiv(RESIDENT_ELEMENTS, tile)
    if profile.registers_per_core:
        per_core = min(per_core, profile.registers_per_core // ((32 + 6 * tile // threads) * threads))
    if profile.threads_per_core:
        per_core = min(per_core, profile.threads_per_core // threads)
    if not profile.cores:
        return blocks
    return min(blocks, profile.cores * max(per_core, 1))


def backward_outputs(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device),
            torch.empty(weight.shape, dtype=weight.dtype, device=weight.device))


def backward_plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    """Launches for ``(dx, dweight)`` from ``args = (dy, x, weight, dres | None, eps)``: the persistent
    row kernel, then (with more than one program) the column sum of the dweight partials."""
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
    block_m, block_n, num_warps = backward_config(config, profile)
    one_block = k <= block_n
    blocks = cdiv(rows, block_m)
    programs = backward_programs(blocks, block_m * block_n, num_warps, profile)
    # One program with rows in one block (or one row block) writes dweight itself, in its dtype:
    # one launch, no buffer. Otherwise each program writes a float32 partial, summed by a second kernel.
    direct = programs == 1 and (one_block or blocks == 1)
    partial = dw if direct else torch.empty((programs, k), dtype=torch.float32, device=x.device)
    main = KernelCall(
        rms_norm_backward_kernel, (programs,),
        (dy2, x2, weight, dres2, dx2, partial, rows, k, float(eps),
         dy2.stride(0), dy2.stride(1), x2.stride(0), x2.stride(1), weight.stride(0),
         dres2.stride(0), dres2.stride(1), dx2.stride(0), dx2.stride(1)),
        {"BLOCK_M": block_m, "BLOCK_N": block_n, "ONE_BLOCK": one_block, "HAS_DRES": dres is not None,
         "num_warps": num_warps},
    )
    if direct:
        return LaunchPlan(calls=[main], result=(dx, dw))
    return LaunchPlan(calls=[main, column_sum_call(partial, dw, profile)], result=(dx, dw), scratch=(partial,))


def column_sum_call(partial: torch.Tensor, out: torch.Tensor, profile: DeviceProfile) -> KernelCall:
    """``out = partial.sum(0)``: column strips narrow enough for a program per core or more (at least
    32 float32 columns: whole 128-byte lines), each summed in tiles of up to 4096 elements."""
    programs, k = partial.shape
    block_k = min(max(next_power_of_2(cdiv(k, max(profile.cores, 1))), 32), 256)
    block_p = min(next_power_of_2(programs), 4096 // block_k)
    return KernelCall(
        column_sum_kernel, (cdiv(k, block_k),),
        (partial, out, programs, k, out.stride(0)),
        {"BLOCK_P": block_p, "BLOCK_K": block_k, "num_warps": max(min(block_p * block_k // 512, 8), 1)},
    )


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


def default_config(sig: Signature, profile: DeviceProfile) -> Config:
    rows, k = sig.tensor("x").shape  # rows rounded up to a power of two
    return heuristic_config(rows, k)


def _elements_per_thread(c: Config) -> float:
    return c["BLOCK_M"] * c["BLOCK_N"] / (32 * c["num_warps"])


def space(profile: DeviceProfile) -> SearchSpace:
    """Rows per program, row block width and warps. Rows wider than BLOCK_N loop (two passes). The
    backward derives its launch from the same config (:func:`backward_config`)."""
    return SearchSpace(
        [PowerOfTwo("BLOCK_M", 1, 128), PowerOfTwo("BLOCK_N", 16, 16384), num_warps(1, 2, 4, 8, 16, 32)],
        [
            Constraint("BLOCK_M * BLOCK_N / (32 * num_warps) >= 2 (every thread has at least two elements)",
                       lambda c: _elements_per_thread(c) >= 2),
            # The forward keeps about three float32 values per element; the backward narrows the
            # tile and adds warps itself (backward_config).
            Constraint("BLOCK_M * BLOCK_N / (32 * num_warps) <= 32 (the tile fits in registers)",
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
        ScalarArg("eps", (float, int), default=1e-6, finite=True, minimum=0.0),
    ),
    reference=rms_norm_reference,
    doc="x * rsqrt(mean(x**2, -1) + eps) * weight over the last dimension",
    check=check,
    example=example,
    example_sizes={"tokens": 37, "hidden": 256},
    example_paths={"wide rows": {"tokens": 4, "hidden": 8192}},
    cost=cost,
    baselines={"torch": lambda: torch_rms_norm, "liger": liger_rms_norm},
)


def _gradients(backward, saved, grads, needs) -> dict:
    dx, dw = backward(grads[0], saved.x, saved.weight, None, saved.eps)
    return {"x": dx, "weight": dw}


KERNEL = define_kernel(
    OP, plan,
    kernels=(rms_norm_kernel, rms_norm_backward_kernel, column_sum_kernel),
    results=lambda x, weight, eps: torch.empty(x.shape, dtype=x.dtype, device=x.device),
    default_config=default_config,
    space=space,
    backward=Backward(_gradients, saved=("x", "weight", "eps"), plan=backward_plan,
                      reference=rms_norm_backward_reference,
                      results=lambda dy, x, weight, dres, eps: backward_outputs(x, weight)),
    doc="BLOCK_M rows per program, each in registers up to BLOCK_N, two passes beyond; "
        "backward: dx per row, dweight from per-program partial sums",
)
rms_norm = KERNEL.function
dlcore_ops, dlcore_implementations = KERNEL.dlcore_ops, KERNEL.dlcore_implementations
