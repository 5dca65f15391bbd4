"""softmax: ``y = exp(x - max(x)) / sum(exp(x - max(x)))`` along ``dim``, with its backward.

The input is seen as ``[outer, N, inner]`` (``N`` the size of ``dim``; a view for every contiguous
tensor whatever ``dim``, a copy only for layouts that do not fold so): ``outer * inner`` rows of
``N`` elements, row ``r`` starting at ``(r // inner, r % inner)``. With ``dim`` last, ``inner`` is 1
and a row is one stride (any row stride: padded or column-stepped rows need no copy). Each program
takes ``BLOCK_M`` rows (several when rows are short, so that a program still moves a few thousand
elements).

- A row that fits one block (``N <= BLOCK_N``) is read once and kept in registers: its maximum,
  the exponentials, their sum and the scaled store, one read and one write.
- A longer row takes two passes over blocks of ``BLOCK_N``: the first is online, keeping the row's
  running maximum ``m`` and per-lane sums of ``exp(x - m)``, rescaled by ``exp(m_old - m)`` when
  the maximum grows (one exponential per element); the second re-reads the row, last block first
  (the blocks read most recently are the likeliest still in L2), and writes ``exp(x - m) / sum``.
  Each block's loads are issued before the previous block is reduced, so a program has two blocks
  in flight; the block is sized by how many programs share a core (:func:`loop_block`). The
  second pass's loads and stores are marked evict-first, so that the blocks still to be re-read
  stay in L2. Reading a row once needs it held on chip across cores (a cluster's distributed
  shared memory, which Triton does not expose). Two ways round that are not used, being no faster
  than the re-read (docs/performance.md, softmax): a grid of a few programs per core taking the
  rows in turn (fewer rows in flight for L2 to hold), and a row split over programs that each hold
  a block in registers and exchange their maxima and sums through global memory (an atomic count
  per row, the programs of a row waiting for each other; the counters need a zeroing launch).

Rows along another ``dim`` (``inner > 1``) step through memory by ``inner`` elements: correct, not
coalesced (a transposed softmax is better served by the caller's layout).

Exponentials are ``exp2`` of ``(x - m) * log2(e)``: the row maximum is subtracted before the
scaling, so that rows far from zero (scores around 5000) keep float32's relative precision. A row
whose every element is ``-inf`` has no finite maximum: its sum is 0 and its output NaN, as in
torch; a row that starts with ``-inf`` and has finite values later is exact (the rescale never
computes ``-inf - -inf``, nor overflows for rows far below zero).

Backward, with ``y`` the forward's output (saved; the input is not)::

    dx = y * (dy - sum(dy * y))

the same two layouts: one block (``y`` and ``dy`` read once), or a pass summing ``dy * y`` and a
second (reversed) pass writing ``dx``. Math in float32, outputs in the input dtype. The formula is
differentiable in ``dy`` and ``y``: gradients of the gradients (``create_graph=True``) are torch's
autograd through :func:`softmax_backward_reference` (``Backward.second_order``), the first-order
gradients still the kernel's.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from dlblas_kernels.blocks.npu import buffer_tile
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
    ScalarArg,
    SearchSpace,
    Signature,
    TensorArg,
    cdiv,
    define_kernel,
    next_power_of_2,
    num_warps,
    prev_power_of_2,
)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Longest row the default config keeps in registers whole; longer rows loop (:func:`loop_block`).
MAX_ONE_BLOCK = 16384
# The looped kernel's blocks: elements of row blocks a core should have in flight, and the bounds.
LOOP_ELEMENTS_PER_CORE = 32768
MIN_LOOP_BLOCK, MAX_LOOP_BLOCK = 4096, 16384
# On npu a program's blocks live in the AI core's unified buffer: bishengir-compile 1.2 asks about
# 18 bytes of it per element of the looped kernel's block (2360576 bits for 16384 elements, over
# the 192 KiB of an Ascend 910B); the budget per element leaves headroom.
UB_BYTES_PER_LOOP_ELEMENT = 24
# Elements a program aims to hold per tile when rows are short (BLOCK_M rows of BLOCK_N).
TILE = 2048
# Fewest programs the default config keeps before it packs several short rows into one.
MIN_PROGRAMS = 1024
# Elements per thread the default config gives a row kept whole (16 warps at most).
ELEMENTS_PER_THREAD = 16
# The backward holds two tiles (y and dy): its tile is at most this many elements, rows beyond loop.
MAX_BACKWARD_TILE = 8192


@triton.jit
def _row_offsets(row, inner, stride_outer, stride_inner, INNER: tl.constexpr):
    # Row r of [outer, N, inner] starts at (r // inner, r % inner); with inner 1, at r.
    if INNER:
        offset = (row // inner) * stride_outer + (row % inner) * stride_inner
    else:
        offset = row * stride_outer
    return offset


@triton.jit
def softmax_kernel(
    x_ptr, out_ptr,
    rows, N, inner,
    stride_x_outer, stride_x_inner, stride_x_col,
    stride_out_outer, stride_out_inner, stride_out_col,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ONE_BLOCK: tl.constexpr, INNER: tl.constexpr,
):
    LOG2E: tl.constexpr = 1.4426950408889634
    # 64-bit rows: rows * row stride may pass 2**31 elements. Rows past the end (the last program's)
    # compute the last row again and store nothing: no mask on loads across rows.
    row = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = (row < rows)[:, None]
    loaded = tl.minimum(row, rows - 1)
    x_rows = x_ptr + _row_offsets(loaded, inner, stride_x_outer, stride_x_inner, INNER)[:, None]
    out_rows = out_ptr + _row_offsets(row, inner, stride_out_outer, stride_out_inner, INNER)[:, None]
    cols = tl.arange(0, BLOCK_N)

    if ONE_BLOCK:
        x = tl.load(x_rows + cols[None, :] * stride_x_col, mask=(cols < N)[None, :],
                    other=-float("inf")).to(tl.float32)
        m = tl.max(x, axis=1)
        # A row of -inf only: its exponentials are 0 (exp2(-inf - 0)), its output 0 / 0 = NaN as in torch.
        m = tl.where(m == -float("inf"), 0.0, m)
        # log2(e) scales the difference, not x: x * log2(e) rounds to x's magnitude, so scores far
        # from zero (5000) would carry that rounding into every exponential.
        e = tl.exp2((x - m[:, None]) * LOG2E)
        y = e * (1.0 / tl.sum(e, axis=1))[:, None]
        tl.store(out_rows + cols[None, :] * stride_out_col, y.to(out_ptr.dtype.element_ty),
                 mask=row_mask & (cols < N)[None, :])
    else:
        # Pass 1, online: the running maximum per row, and per lane sum(exp2(x - m)) rescaled
        # whenever m grows. m_safe stands in for m while the row has seen only -inf. Each block's
        # loads are issued before the previous block is reduced (masked off past the row's end).
        m = tl.full((BLOCK_M,), -float("inf"), tl.float32)
        m_safe = tl.zeros((BLOCK_M,), tl.float32)
        sums = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        x_next = tl.load(x_rows + cols[None, :] * stride_x_col, mask=(cols < N)[None, :], other=-float("inf"))
        for start in range(0, N, BLOCK_N):
            x = x_next.to(tl.float32)
            following = start + BLOCK_N + cols
            x_next = tl.load(x_rows + following[None, :] * stride_x_col, mask=(following < N)[None, :],
                             other=-float("inf"))
            m = tl.maximum(m, tl.max(x, axis=1))
            m_new = tl.where(m == -float("inf"), 0.0, m)
            # m_safe <= m_new once the row has a finite maximum; before that the sums are 0 and
            # m_safe is 0, which may lie far above the first maximum (a row of -20000): the clamp
            # keeps the rescale finite there, where exp2 of the difference would be inf and 0 * inf NaN.
            rescale = tl.exp2(tl.minimum(m_safe - m_new, 0.0) * LOG2E)
            sums = sums * rescale[:, None] + tl.exp2((x - m_new[:, None]) * LOG2E)
            m_safe = m_new
        scale = (1.0 / tl.sum(sums, axis=1))[:, None]
        # Pass 2: last block first, while the row's latest blocks are still in L2; prefetched as
        # pass 1. Its loads and stores are marked evict-first, so that the blocks still to be
        # re-read keep their place in L2.
        last = (N - 1) // BLOCK_N * BLOCK_N
        x_next = tl.load(x_rows + (last + cols)[None, :] * stride_x_col, mask=(last + cols < N)[None, :], other=0.0,
                         eviction_policy="evict_first")
        for done in range(0, N, BLOCK_N):
            start = last - done
            x = x_next.to(tl.float32)
            previous = start - BLOCK_N + cols
            x_next = tl.load(x_rows + previous[None, :] * stride_x_col, mask=(previous >= 0)[None, :], other=0.0,
                             eviction_policy="evict_first")
            y = tl.exp2((x - m_safe[:, None]) * LOG2E) * scale
            tl.store(out_rows + (start + cols)[None, :] * stride_out_col, y.to(out_ptr.dtype.element_ty),
                     mask=row_mask & (start + cols < N)[None, :], eviction_policy="evict_first")


@triton.jit
def softmax_backward_kernel(
    dy_ptr, y_ptr, dx_ptr,
    rows, N, inner,
    stride_dy_outer, stride_dy_inner, stride_dy_col,
    stride_y_outer, stride_y_inner, stride_y_col,
    stride_dx_outer, stride_dx_inner, stride_dx_col,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ONE_BLOCK: tl.constexpr, INNER: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = (row < rows)[:, None]
    loaded = tl.minimum(row, rows - 1)
    dy_rows = dy_ptr + _row_offsets(loaded, inner, stride_dy_outer, stride_dy_inner, INNER)[:, None]
    y_rows = y_ptr + _row_offsets(loaded, inner, stride_y_outer, stride_y_inner, INNER)[:, None]
    dx_rows = dx_ptr + _row_offsets(row, inner, stride_dx_outer, stride_dx_inner, INNER)[:, None]
    cols = tl.arange(0, BLOCK_N)

    if ONE_BLOCK:
        col_mask = (cols < N)[None, :]
        y = tl.load(y_rows + cols[None, :] * stride_y_col, mask=col_mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_rows + cols[None, :] * stride_dy_col, mask=col_mask, other=0.0).to(tl.float32)
        dot = tl.sum(y * dy, axis=1)[:, None]
        tl.store(dx_rows + cols[None, :] * stride_dx_col, (y * (dy - dot)).to(dx_ptr.dtype.element_ty),
                 mask=row_mask & col_mask)
    else:
        # Pass 1: sum(dy * y) per lane, reduced once; pass 2 (last block first) writes dx.
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for start in range(0, N, BLOCK_N):
            col_mask = (start + cols < N)[None, :]
            y = tl.load(y_rows + (start + cols)[None, :] * stride_y_col, mask=col_mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_rows + (start + cols)[None, :] * stride_dy_col, mask=col_mask, other=0.0).to(tl.float32)
            acc += y * dy
        dot = tl.sum(acc, axis=1)[:, None]
        last = (N - 1) // BLOCK_N * BLOCK_N
        for done in range(0, N, BLOCK_N):
            start = last - done
            col_mask = (start + cols < N)[None, :]
            y = tl.load(y_rows + (start + cols)[None, :] * stride_y_col, mask=col_mask, other=0.0,
                        eviction_policy="evict_first").to(tl.float32)
            dy = tl.load(dy_rows + (start + cols)[None, :] * stride_dy_col, mask=col_mask, other=0.0,
                         eviction_policy="evict_first").to(tl.float32)
            tl.store(dx_rows + (start + cols)[None, :] * stride_dx_col, (y * (dy - dot)).to(dx_ptr.dtype.element_ty),
                     mask=row_mask & col_mask, eviction_policy="evict_first")


def as_rows3(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` as ``[outer, N, inner]`` around ``dim`` (normalised): a view where the dimensions
    before ``dim`` fold into one stride and those after it into another (every contiguous tensor),
    else a copy."""
    outer = math.prod(t.shape[:dim])
    inner = math.prod(t.shape[dim + 1:])
    return t.reshape(outer, t.shape[dim], inner)


def launch_tile(config: Config, n: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps)`` for rows of ``n``: the config's block narrowed to the row
    (at least 16), and no more warps than give each thread two elements of the tile."""
    block_m = config["BLOCK_M"]
    block_n = min(config["BLOCK_N"], max(next_power_of_2(n), 16))
    warps = min(config["num_warps"], max(block_m * block_n // 64, 1))
    return block_m, block_n, warps


def _call(kernel, tensors: tuple[torch.Tensor, ...], block: tuple[int, int, int]) -> KernelCall:
    """A launch of ``kernel`` over the ``[outer, N, inner]`` views ``tensors`` (inputs, then output)."""
    outer, n, inner = tensors[-1].shape
    rows = outer * inner
    block_m, block_n, warps = block
    strides = [s for t in tensors for s in (t.stride(0), t.stride(2), t.stride(1))]
    return KernelCall(
        kernel, (cdiv(rows, block_m),),
        (*tensors, rows, n, inner, *strides),
        {"BLOCK_M": block_m, "BLOCK_N": block_n, "ONE_BLOCK": n <= block_n, "INNER": inner > 1,
         "num_warps": warps},
    )


def plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    x, dim = args
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return LaunchPlan(calls=[], result=out)
    d = dim % x.dim()
    x3, out3 = as_rows3(x, d), as_rows3(out, d)
    call = _call(softmax_kernel, (x3, out3), launch_tile(config, x.shape[d]))
    return LaunchPlan(calls=[call], result=out)


def backward_config(config: Config, n: int) -> tuple[int, int, int]:
    """The backward's ``(BLOCK_M, BLOCK_N, num_warps)`` from the forward's config: its tile narrowed to
    MAX_BACKWARD_TILE elements (rows first; longer rows loop), at most ELEMENTS_PER_THREAD elements
    of each tile per thread."""
    block_m, block_n, warps = launch_tile(config, n)
    block_n = min(block_n, MAX_BACKWARD_TILE)
    block_m = max(min(block_m, MAX_BACKWARD_TILE // block_n), 1)
    warps = min(max(warps, block_m * block_n // (32 * ELEMENTS_PER_THREAD)), 16)
    return block_m, block_n, warps


def backward_plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    """The launch for ``dx`` from ``args = (dy, y, dim)``."""
    dy, y, dim = args
    dx = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    if dx.numel() == 0:
        return LaunchPlan(calls=[], result=dx)
    d = dim % y.dim()
    # dy comes from autograd in any layout (even expanded): a copy only where it does not fold.
    tensors = (as_rows3(dy, d), as_rows3(y, d), as_rows3(dx, d))
    return LaunchPlan(calls=[_call(softmax_backward_kernel, tensors, backward_config(config, y.shape[d]))], result=dx)


def softmax_reference(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax along ``dim`` computed in float32 (or wider) and returned in ``x``'s dtype."""
    compute = torch.promote_types(x.dtype, torch.float32)
    return torch.softmax(x.to(compute), dim).to(x.dtype)


def softmax_backward_reference(dy: torch.Tensor, y: torch.Tensor, dim: int) -> torch.Tensor:
    """``y * (dy - sum(dy * y, dim))`` in float32 (or wider), in ``y``'s dtype."""
    compute = torch.promote_types(y.dtype, torch.float32)
    yf, dyf = y.to(compute), dy.to(compute)
    return (yf * (dyf - (dyf * yf).sum(dim, keepdim=True))).to(y.dtype)


def loop_block(rows: int, cores: int) -> int:
    """The looped kernel's block for ``rows`` rows on ``cores`` cores: one row per program, so about
    ``rows / cores`` programs share a core, and together they should keep LOOP_ELEMENTS_PER_CORE
    elements in flight: the power of two at or below ``LOOP_ELEMENTS_PER_CORE * cores / rows``,
    within MIN_LOOP_BLOCK and MAX_LOOP_BLOCK (the smallest without a core count): on 132 SMs, 1024
    rows of 32768 take blocks of 4096, 256 rows of 131072 blocks of 16384 (larger blocks leave
    too few programs a core, smaller ones too few elements in flight)."""
    if not cores:
        return MIN_LOOP_BLOCK
    want = max(LOOP_ELEMENTS_PER_CORE * cores // max(rows, 1), 1)
    return min(max(prev_power_of_2(want), MIN_LOOP_BLOCK), MAX_LOOP_BLOCK)


def heuristic_config(rows: int, n: int, cores: int) -> Config:
    """The default config for ``rows`` rows of ``n`` elements on ``cores`` cores: rows up to
    MAX_ONE_BLOCK whole, several short rows per program while at least MIN_PROGRAMS programs remain;
    longer rows in blocks of :func:`loop_block`; about ELEMENTS_PER_THREAD elements per thread."""
    if n > MAX_ONE_BLOCK:
        block_n = loop_block(rows, cores)
        return {"BLOCK_M": 1, "BLOCK_N": block_n, "num_warps": min(block_n // (32 * ELEMENTS_PER_THREAD), 32)}
    block_n = max(next_power_of_2(n), 16)
    block_m = min(max(TILE // block_n, 1), max(rows // MIN_PROGRAMS, 1))
    warps = min(max(block_m * block_n // (32 * ELEMENTS_PER_THREAD), 1), 16)
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps}


def default_config(sig: Signature, profile: DeviceProfile) -> Config:
    """With ``dim=-1`` the signature holds the rows (rounded up to a power of two) and the row
    length. Another ``dim`` is a row the ``rows`` bucket does not keep: one row per program, as wide
    as MAX_ONE_BLOCK, which the plan narrows to the row (:func:`launch_tile`). On npu a looped
    block is no larger than the unified buffer holds (UB_BYTES_PER_LOOP_ELEMENT)."""
    if sig.scalar("dim") != -1:
        return {"BLOCK_M": 1, "BLOCK_N": MAX_ONE_BLOCK, "num_warps": 16}
    rows, n = sig.tensor("x").shape
    config = heuristic_config(rows, n, profile.cores if profile is not None else 0)
    if n > config["BLOCK_N"]:
        config["BLOCK_N"] = buffer_tile(profile, UB_BYTES_PER_LOOP_ELEMENT, config["BLOCK_N"])
    return config


def _elements_per_thread(c: Config) -> float:
    return c["BLOCK_M"] * c["BLOCK_N"] / (32 * c["num_warps"])


def space(profile: DeviceProfile) -> SearchSpace:
    """Rows per program, row block width and warps; rows longer than BLOCK_N take two passes. The
    backward derives its launch from the same config (:func:`backward_config`)."""
    return SearchSpace(
        [PowerOfTwo("BLOCK_M", 1, 128), PowerOfTwo("BLOCK_N", 16, 32768), num_warps(1, 2, 4, 8, 16, 32)],
        [
            Constraint("BLOCK_M * BLOCK_N / (32 * num_warps) >= 2 (every thread has at least two elements)",
                       lambda c: _elements_per_thread(c) >= 2),
            Constraint("BLOCK_M * BLOCK_N / (32 * num_warps) <= 32 (the tile fits in registers)",
                       lambda c: _elements_per_thread(c) <= 32),
        ],
    )


def check(op: Op, args: dict[str, Any]) -> None:
    x, dim = args["x"], args["dim"]
    if not -x.dim() <= dim < x.dim():
        raise InvalidInputError(op.name, "dim", f"is {dim} for x of shape {tuple(x.shape)}",
                                f"a dimension of x: {-x.dim()} to {x.dim() - 1}")


def example(sizes: dict[str, int], dtype: torch.dtype, device: torch.device,
            generator: torch.Generator) -> tuple:
    """Logits ``[tokens, vocab]`` spread as a language model's are (standard deviation 4)."""
    x = 4 * torch.randn(sizes["tokens"], sizes["vocab"], generator=generator)
    return (x.to(device=device, dtype=dtype), -1)


def cost(args: tuple, mode: str = "fwd") -> tuple[int, int]:
    """Forward: read x, write y; per element a maximum, a difference, an exponential, a sum and a
    product. Backward: read dy and y, write dx; a product, a sum, a difference and a product."""
    x = args[0]
    x_bytes = x.numel() * x.element_size()
    if mode == "bwd":
        return 3 * x_bytes, 4 * x.numel()
    return 2 * x_bytes, 5 * x.numel()


def torch_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """What a model runs in eager torch: ``torch.softmax`` (float32 math inside, output in x's dtype)."""
    return torch.softmax(x, dim)


OP = Op(
    name="softmax",
    args=(
        TensorArg("x", DTYPES, layouts=("contiguous", "rows", "strided"), bucket="rows"),
        ScalarArg("dim", (int,), default=-1, keyed=True),
    ),
    reference=softmax_reference,
    doc="exp(x - max) / sum(exp(x - max)) along dim; rows of any length",
    check=check,
    example=example,
    example_sizes={"tokens": 37, "vocab": 1000},
    example_paths={"looped rows": {"tokens": 4, "vocab": 40000}, "rows": {"tokens": 300}},
    cost=cost,
    baselines={"torch": lambda: torch_softmax},
)


def _gradients(backward, saved, grads, needs) -> dict:
    return {"x": backward(grads[0], saved.out, saved.dim)}


KERNEL = define_kernel(
    OP, plan,
    kernels=(softmax_kernel, softmax_backward_kernel),
    results=lambda x, dim: torch.empty(x.shape, dtype=x.dtype, device=x.device),
    default_config=default_config,
    space=space,
    backward=Backward(_gradients, saved=("out", "dim"), plan=backward_plan,
                      reference=softmax_backward_reference,
                      results=lambda dy, y, dim: torch.empty(y.shape, dtype=y.dtype, device=y.device),
                      renames={"x": "y"}, second_order=True),
    doc="BLOCK_M rows per program, whole in registers up to BLOCK_N, else an online pass and a "
        "normalising pass; backward of the same layout",
)
softmax = KERNEL.function
dlcore_ops, dlcore_implementations = KERNEL.dlcore_ops, KERNEL.dlcore_implementations
