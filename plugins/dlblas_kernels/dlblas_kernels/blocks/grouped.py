"""Grouped GEMMs over experts, and the alignment step that sorts (token, choice) slots by expert.

A mixture of experts sends each token ``t`` to ``k`` experts (``topk_ids[t, j]``; -1 drops the
choice). Its GEMMs run per expert on the rows routed there, so the slots ``n = t * k + j`` are
first sorted by expert on the device (:func:`align_calls`, three launches, no host sync):

1. :func:`expert_histogram_kernel`: per chunk of slots, how many go to each expert;
2. :func:`expert_offsets_kernel` (one program): each expert's count padded up to the GEMM's row
   block ``BLOCK_M``, the padded starts (an exclusive prefix sum: ``starts [E + 1]``, the last
   entry being the padded total), a cursor per (chunk, expert), the padding slots marked with the
   sentinel ``n_slots`` (``T * k``), and the row-block table: the expert of every row block, -1
   past the total;
3. :func:`expert_scatter_kernel`: each routed slot takes the next place of its expert (an atomic
   add on its chunk's cursor) in ``sorted_ids``; the routing weights copied to a flat float32
   ``[T * k]`` for the GEMMs' row scale.

The order of slots inside an expert is whatever the atomics give; every row of a GEMM tile is
computed alone, so the results do not depend on it. Ids outside ``[0, E)`` count as dropped.

The buffers are sized for the worst case, so that a launch's grid depends on shapes alone (the
plan replays): at most ``cdiv(T * k, BLOCK_M) + min(E, T * k)`` row blocks are used (every
expert that receives a slot adds at most one partly filled block); programs of the blocks past
the total see expert -1 and do nothing.

The GEMMs take their K loops and epilogues from :mod:`dlblas_kernels.blocks.gemm` (``dot_range``,
``dot_range_pair``, ``store_tile``):

- :func:`grouped_gemm_kernel`: ``c[row] = epilogue(a[row] @ b[e])`` for every row block of the
  sorted slots, ``e`` its expert: ``a``'s rows gathered by pointer (token ``sorted_id // k``, or
  the slot itself) or read in sorted order, ``c``'s rows scattered to the slots or written in
  sorted order; SwiGLU's gate and up from one pass over ``a`` (w13's halves), the routing weight
  as the row scale.
  With fp8 weights (DeepSeek-V3's 128x128 block scales) and 1x128-quantised rows of ``a``, each
  K step's product is scaled by its blocks' scales (``BLOCK_SCALED``); the gate/up GEMM can
  quantise its SwiGLU output per 1x128 in the epilogue (``QUANT_C``) for the down GEMM.
- :func:`expert_gemm_kernel`: ``c[e] = a[rows of e]^T @ b[rows of e]``, the reduction over the
  rows of one expert in sorted order (the weights' gradients).
- :func:`gather_rows_kernel`: a matrix's rows in sorted order (zeros for padding), for the
  reductions over an expert's rows, whose K loop takes regular strides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dlblas_kernels.blocks.fp8 import quantise, scale_of
from dlblas_kernels.blocks.gemm import SCALE_BLOCK, dot_range, dot_range_pair, epilogue, grouped_tile, store_tile
from dlcore.api import Config, KernelCall, cdiv, next_power_of_2

#: the most (chunk, expert) counts the offsets kernel holds at once
MAX_COUNTS = 16384
#: the fewest slots a histogram program counts
MIN_CHUNK = 256
#: row blocks the offsets kernel assigns per step
BLOCK_TABLE_STEP = 64
#: padding slots per expert the offsets kernel marks per step
PAD_STEP = 32


# --- alignment ---------------------------------------------------------------------------------------

@triton.jit
def _slot_experts(ids_ptr, slots, n_slots, topk, experts, stride_it, stride_ij):
    """The expert of each slot (-1 for slots past the end), and whether it is routed (in ``[0, E)``)."""
    in_range = slots < n_slots
    ids = tl.load(ids_ptr + (slots // topk) * stride_it + (slots % topk) * stride_ij, mask=in_range, other=-1)
    routed = in_range & (ids >= 0) & (ids < experts)
    return tl.where(routed, ids, 0).to(tl.int32), routed


@triton.jit
def expert_histogram_kernel(ids_ptr, hist_ptr, n_slots, topk, experts, stride_it, stride_ij,
                            CHUNK: tl.constexpr, EXPERTS_POW2: tl.constexpr):
    """``hist[c, e]``: the slots of chunk ``c`` routed to expert ``e`` (a full row of EXPERTS_POW2)."""
    chunk = tl.program_id(0)
    slots = chunk.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    ids, routed = _slot_experts(ids_ptr, slots, n_slots, topk, experts, stride_it, stride_ij)
    # unmasked (triton-ascend 3.2's adapter cannot parse a masked tt.histogram): the unrouted slots,
    # counted in bin 0 (their ids are 0), taken off it again
    bins = tl.arange(0, EXPERTS_POW2)
    unrouted = CHUNK - tl.sum(routed.to(tl.int32), axis=0)
    counts = tl.histogram(ids, EXPERTS_POW2) - tl.where(bins == 0, unrouted, 0)
    tl.store(hist_ptr + chunk * EXPERTS_POW2 + bins, counts)


@triton.jit
def expert_offsets_kernel(hist_ptr, cursor_ptr, starts_ptr, sorted_ptr, block_expert_ptr,
                          n_slots, experts, chunks, max_blocks,
                          BLOCK_M: tl.constexpr, CHUNKS_POW2: tl.constexpr, EXPERTS_POW2: tl.constexpr,
                          BLOCK_B: tl.constexpr, PAD_BLOCK: tl.constexpr):
    """One program: the padded starts, the chunk cursors, the padding sentinels, the row-block table."""
    c = tl.arange(0, CHUNKS_POW2)
    e = tl.arange(0, EXPERTS_POW2)
    mask = (c < chunks)[:, None] & (e < experts)[None, :]
    offsets = c[:, None] * EXPERTS_POW2 + e[None, :]
    hist = tl.load(hist_ptr + offsets, mask=mask, other=0)
    counts = tl.sum(hist, axis=0)
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    # Chunk c's first slot of expert e goes after the slots of e in the chunks before it.
    tl.store(cursor_ptr + offsets, starts[None, :] + tl.cumsum(hist, axis=0) - hist, mask=mask)
    tl.store(starts_ptr + e, starts, mask=e < experts)
    total = tl.sum(padded, axis=0)
    tl.store(starts_ptr + experts, total)

    # The places after an expert's slots, up to its padded end, hold the sentinel n_slots.
    sentinel = tl.full((EXPERTS_POW2, PAD_BLOCK), 0, tl.int32) + n_slots
    for r in tl.static_range(0, BLOCK_M, PAD_BLOCK):
        pos = (starts + counts)[:, None] + r + tl.arange(0, PAD_BLOCK)[None, :]
        tl.store(sorted_ptr + pos, sentinel, mask=(e < experts)[:, None] & (pos < ends[:, None]))

    # Row block b belongs to the first expert whose padded end passes it (empty experts end where
    # they start, and are passed over); blocks past the total to none (-1).
    end_blocks = ends // BLOCK_M
    used = total // BLOCK_M
    for b0 in range(0, max_blocks, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        owner = tl.sum((end_blocks[None, :] <= b[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(b < used, owner, -1), mask=b < max_blocks)


@triton.jit
def expert_scatter_kernel(ids_ptr, weights_ptr, cursor_ptr, sorted_ptr, flat_weights_ptr,
                          n_slots, topk, experts, stride_it, stride_ij, stride_wt, stride_wj,
                          CHUNK: tl.constexpr, EXPERTS_POW2: tl.constexpr):
    """Each routed slot of chunk ``c`` into the next place of its expert; the flat routing weights."""
    chunk = tl.program_id(0)
    slots = chunk.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    ids, routed = _slot_experts(ids_ptr, slots, n_slots, topk, experts, stride_it, stride_ij)
    in_range = slots < n_slots
    weights = tl.load(weights_ptr + (slots // topk) * stride_wt + (slots % topk) * stride_wj, mask=in_range)
    tl.store(flat_weights_ptr + slots, weights.to(tl.float32), mask=in_range)
    place = tl.atomic_add(cursor_ptr + chunk * EXPERTS_POW2 + ids, 1, mask=routed)
    tl.store(sorted_ptr + place, slots.to(tl.int32), mask=routed)


# --- the GEMMs ---------------------------------------------------------------------------------------

@triton.jit
def grouped_gemm_tile(
    a_ptr, b_ptr, c_ptr, pre_ptr, pre3_ptr, scale_ptr, sorted_ptr, block_expert_ptr,
    a_scale_ptr, b_scale_ptr, c_scale_ptr,
    n_slots, a_div, c_rows, N, K, num_blocks, b3_offset,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
    stride_sm, stride_sk, stride_te, stride_tn, stride_tk, stride_qm, stride_qk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, GATHER_A: tl.constexpr, SCATTER_C: tl.constexpr,
    HAS_SCALE: tl.constexpr, SWIGLU: tl.constexpr, STORE_PRE: tl.constexpr,
    BLOCK_SCALED: tl.constexpr, QUANT_C: tl.constexpr,
):
    """The program of :func:`grouped_gemm_kernel` and :func:`grouped_fp8_gemm_kernel`: one (row
    block, column block) tile per program, in the grouped order: the rows of one
    expert's block against ``b[e]`` (``[K, N]`` by its strides, ``b3`` ``b3_offset`` elements on).

    GATHER_A: ``a``'s row of each place is ``sorted_id // a_div`` (padding rows masked), else the
    place itself (``a`` in sorted order, padding rows zero). SCATTER_C: ``c``'s row is the slot
    (``c_rows`` = ``n_slots``: padding rows, holding the sentinel, fall past the store mask; the
    row scale indexed by slot), else the place (``c_rows`` rows).

    BLOCK_SCALED (fp8 ``a`` and ``b``, DeepSeek-V3's block scales): ``a_scale[row, kb]`` (strides
    ``stride_sm, stride_sk``) per 1x128 of ``a``'s rows, ``b_scale[e, nb, kb]`` (``stride_te,
    stride_tn, stride_tk``) per 128x128 block of ``b[e]``'s ``[N, K]`` rows (under SWIGLU ``b3``'s
    rows follow ``b``'s: the up half's blocks start at row ``N``); BLOCK_K and BLOCK_N divide 128
    and, under SWIGLU, N (a tile of each half lies in one block). QUANT_C: the output quantised
    to float8_e4m3fn in the epilogue, one scale per row and 128 columns (BLOCK_N = 128: the tile
    is the group) into ``c_scale[row, pid_n]`` (``stride_qm, stride_qk``)."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), num_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= 0:
        places = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        slots = tl.load(sorted_ptr + places).to(tl.int64)
        if GATHER_A:
            a_rows = slots // a_div
            mask_m = slots < n_slots
        else:
            a_rows = places
            mask_m = places >= 0
        if SCATTER_C:
            out_rows = slots
        else:
            out_rows = places
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        mask_n = offs_n < N
        # 64-bit: an expert's offset, and K steps times a K stride, may pass 2**31 elements.
        step_a = tl.cast(stride_ak, tl.int64)
        step_b = tl.cast(stride_bk, tl.int64)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * step_a
        b_ptrs = b_ptr + expert.to(tl.int64) * stride_be + offs_k[:, None] * step_b + offs_n[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if BLOCK_SCALED:
            a_scale_ptrs = a_scale_ptr + a_rows * stride_sm
            b_scales = b_scale_ptr + expert.to(tl.int64) * stride_te
            tile_scale = b_scales + (pid_n * BLOCK_N // SCALE_BLOCK) * stride_tn
            if SWIGLU:
                up_scale = b_scales + ((N + pid_n * BLOCK_N) // SCALE_BLOCK) * stride_tn
                acc, acc3 = dot_range_pair(acc, acc, a_ptrs, b_ptrs, b_ptrs + b3_offset, mask_m, mask_n, offs_k, 0,
                                           K, step_a, step_b, step_b, BLOCK_K, INPUT_PRECISION, a_scale_ptrs,
                                           tile_scale, up_scale, stride_sk, stride_tk, BLOCK_SCALED=True)
            else:
                acc = dot_range(acc, a_ptrs, b_ptrs, mask_m, mask_n, offs_k, 0, K, step_a, step_b, BLOCK_K,
                                INPUT_PRECISION, a_scale_ptrs, tile_scale, stride_sk, stride_tk, BLOCK_SCALED=True)
                acc3 = acc
        elif SWIGLU:
            acc, acc3 = dot_range_pair(acc, acc, a_ptrs, b_ptrs, b_ptrs + b3_offset, mask_m, mask_n, offs_k, 0, K,
                                       step_a, step_b, step_b, BLOCK_K, INPUT_PRECISION)
        else:
            acc = dot_range(acc, a_ptrs, b_ptrs, mask_m, mask_n, offs_k, 0, K, step_a, step_b,
                            BLOCK_K, INPUT_PRECISION)
            acc3 = acc
        if QUANT_C:
            out, _, _ = epilogue(acc, acc3, acc, out_rows, offs_n, c_rows, N, scale_ptr, scale_ptr, scale_ptr, 1, 0,
                                 False, HAS_SCALE, False, None, SWIGLU, False)
            mask_c = out_rows < c_rows
            mask = mask_c[:, None] & mask_n[None, :]
            row_scale = scale_of(tl.max(tl.where(mask, tl.abs(out), 0.0), axis=1))
            tl.store(c_ptr + out_rows[:, None] * stride_cm + offs_n[None, :] * stride_cn,
                     quantise(out, row_scale[:, None]), mask=mask)
            tl.store(c_scale_ptr + out_rows * stride_qm + pid_n * stride_qk, row_scale, mask=mask_c)
        else:
            store_tile(acc, acc3, out_rows, offs_n, c_rows, N, c_ptr, pre_ptr, pre3_ptr, c_ptr, stride_cm,
                       stride_cn, scale_ptr, scale_ptr, scale_ptr, 1, 0, False, HAS_SCALE, False, None, SWIGLU, False,
                       STORE_PRE, False)


@triton.jit
def grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, pre_ptr, pre3_ptr, scale_ptr, sorted_ptr, block_expert_ptr,
    n_slots, a_div, c_rows, N, K, num_blocks, b3_offset,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, GATHER_A: tl.constexpr, SCATTER_C: tl.constexpr,
    HAS_SCALE: tl.constexpr, SWIGLU: tl.constexpr, STORE_PRE: tl.constexpr,
):
    """``c[row] = epilogue(a[row] @ b[e])`` in 16- or 32-bit operands (:func:`grouped_gemm_tile`)."""
    grouped_gemm_tile(a_ptr, b_ptr, c_ptr, pre_ptr, pre3_ptr, scale_ptr, sorted_ptr, block_expert_ptr, None, None,
                      None, n_slots, a_div, c_rows, N, K, num_blocks, b3_offset, stride_am, stride_ak, stride_be,
                      stride_bk, stride_bn, stride_cm, stride_cn, 0, 0, 0, 0, 0, 0, 0, BLOCK_M, BLOCK_N, BLOCK_K,
                      GROUP_M, INPUT_PRECISION, GATHER_A, SCATTER_C, HAS_SCALE, SWIGLU, STORE_PRE, False, False)


@triton.jit
def grouped_fp8_gemm_kernel(
    a_ptr, b_ptr, c_ptr, scale_ptr, sorted_ptr, block_expert_ptr, a_scale_ptr, b_scale_ptr, c_scale_ptr,
    n_slots, a_div, c_rows, N, K, num_blocks, b3_offset,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
    stride_sm, stride_sk, stride_te, stride_tn, stride_tk, stride_qm, stride_qk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    GATHER_A: tl.constexpr, SCATTER_C: tl.constexpr, HAS_SCALE: tl.constexpr, SWIGLU: tl.constexpr,
    QUANT_C: tl.constexpr,
):
    """``c[row] = epilogue(a[row] @ b[e])`` on float8_e4m3fn ``a`` and ``b`` with block scales,
    the output optionally quantised (:func:`grouped_gemm_tile`'s BLOCK_SCALED and QUANT_C)."""
    grouped_gemm_tile(a_ptr, b_ptr, c_ptr, c_ptr, c_ptr, scale_ptr, sorted_ptr, block_expert_ptr, a_scale_ptr,
                      b_scale_ptr, c_scale_ptr, n_slots, a_div, c_rows, N, K, num_blocks, b3_offset, stride_am,
                      stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn, stride_sm, stride_sk,
                      stride_te, stride_tn, stride_tk, stride_qm, stride_qk, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                      "ieee", GATHER_A, SCATTER_C, HAS_SCALE, SWIGLU, False, True, QUANT_C)


@triton.jit
def expert_gemm_kernel(
    a_ptr, b_ptr, c_ptr, starts_ptr, M, N,
    stride_am, stride_ak, stride_bk, stride_bn, stride_ce, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """``c[e] = a @ b`` over the K range of expert ``e``'s places ``[starts[e], starts[e + 1])``
    (``a`` ``[M, places]``, ``b`` ``[places, N]`` by their strides; padding places hold zeros):
    programs ``e * tiles ... (e + 1) * tiles - 1`` make ``c[e]``'s tiles, in the grouped order.
    An expert without slots gets zeros."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    tiles = num_pid_m * num_pid_n
    expert = tl.program_id(0) // tiles
    pid_m, pid_n = grouped_tile(tl.program_id(0) % tiles, num_pid_m, num_pid_n, GROUP_M)
    k_start = tl.load(starts_ptr + expert)
    k_end = tl.load(starts_ptr + expert + 1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    stride_ak = tl.cast(stride_ak, tl.int64)
    stride_bk = tl.cast(stride_bk, tl.int64)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + (k_start + offs_k).to(tl.int64)[None, :] * stride_ak
    b_ptrs = b_ptr + (k_start + offs_k).to(tl.int64)[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = dot_range(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), a_ptrs, b_ptrs, offs_m < M, offs_n < N, offs_k,
                    k_start, k_end, stride_ak, stride_bk, BLOCK_K, INPUT_PRECISION)
    c_expert = c_ptr + expert.to(tl.int64) * stride_ce
    store_tile(acc, acc, offs_m, offs_n, M, N, c_expert, c_expert, c_expert, c_expert, stride_cm, stride_cn,
               c_expert, c_expert, c_expert, 0, 0, False, False, False, None, False, False, False, False)


@triton.jit
def gather_rows_kernel(x_ptr, out_ptr, sorted_ptr, starts_ptr, n_slots, a_div, experts, D,
                       stride_xm, stride_xd, stride_om,
                       BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    """``out[p] = x[sorted[p] // a_div]`` for the places below the padded total, zeros at padding."""
    total = tl.load(starts_ptr + experts)
    places = (tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)).to(tl.int64)
    live = places < total
    slots = tl.load(sorted_ptr + places, mask=live, other=n_slots).to(tl.int64)
    real = slots < n_slots
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = cols < D
    x = tl.load(x_ptr + (slots // a_div)[:, None] * stride_xm + cols[None, :] * stride_xd,
                mask=real[:, None] & mask_d[None, :], other=0.0)
    tl.store(out_ptr + places[:, None] * stride_om + cols[None, :], x, mask=live[:, None] & mask_d[None, :])


KERNELS = (expert_histogram_kernel, expert_offsets_kernel, expert_scatter_kernel, grouped_gemm_kernel,
           expert_gemm_kernel, gather_rows_kernel)
#: the kernels of fp8 weights (fp8 ``tl.dot``: sm_89 and later)
FP8_KERNELS = (grouped_fp8_gemm_kernel,)


# --- host side -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Alignment:
    """The slots sorted by expert (see the module doc); every tensor on the ids' device.

    :param sorted_ids: ``[places]`` int32: the slot at each place, ``n_slots`` at padding.
    :param block_expert: ``[max_blocks]`` int32: each row block's expert, -1 past the total.
    :param starts: ``[E + 1]`` int32: each expert's first place; the last entry the padded total.
    :param weights: ``[n_slots]`` float32: the routing weight of each slot.
    """

    sorted_ids: torch.Tensor
    block_expert: torch.Tensor
    starts: torch.Tensor
    weights: torch.Tensor
    n_slots: int
    topk: int
    experts: int
    block_m: int

    @property
    def max_blocks(self) -> int:
        return self.block_expert.shape[0]

    @property
    def places(self) -> int:
        return self.sorted_ids.shape[0]

    def scratch(self) -> tuple[torch.Tensor, ...]:
        return (self.sorted_ids, self.block_expert, self.starts, self.weights)


def max_blocks(n_slots: int, experts: int, block_m: int) -> int:
    """The most row blocks ``n_slots`` slots over ``experts`` take, padded per expert to ``block_m``."""
    return cdiv(n_slots, block_m) + min(experts, n_slots)


def align_calls(topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: int,
                block_m: int) -> tuple[list[KernelCall], Alignment, tuple[torch.Tensor, ...]]:
    """The launches sorting the slots of ``topk_ids [T, k]`` by expert, padded to ``block_m``
    (a power of two); the :class:`Alignment` they fill, and their other scratch."""
    tokens, topk = topk_ids.shape
    n_slots = tokens * topk
    device = topk_ids.device
    experts_pow2 = next_power_of_2(experts)
    chunk = max(MIN_CHUNK, next_power_of_2(cdiv(n_slots, max(1, MAX_COUNTS // experts_pow2))))
    chunks = cdiv(n_slots, chunk)
    blocks = max_blocks(n_slots, experts, block_m)
    int32 = {"dtype": torch.int32, "device": device}
    hist = torch.empty(chunks, experts_pow2, **int32)
    cursor = torch.empty(chunks, experts_pow2, **int32)
    found = Alignment(sorted_ids=torch.empty(blocks * block_m, **int32), block_expert=torch.empty(blocks, **int32),
                      starts=torch.empty(experts + 1, **int32),
                      weights=torch.empty(n_slots, dtype=torch.float32, device=device),
                      n_slots=n_slots, topk=topk, experts=experts, block_m=block_m)
    ids_strides = (topk_ids.stride(0), topk_ids.stride(1))
    warps = 8 if chunk * experts_pow2 >= 1 << 20 else 4
    calls = [
        KernelCall(expert_histogram_kernel, (chunks,), (topk_ids, hist, n_slots, topk, experts, *ids_strides),
                   {"CHUNK": chunk, "EXPERTS_POW2": experts_pow2, "num_warps": warps}),
        KernelCall(expert_offsets_kernel, (1,), (hist, cursor, found.starts, found.sorted_ids, found.block_expert,
                                                 n_slots, experts, chunks, blocks),
                   {"BLOCK_M": block_m, "CHUNKS_POW2": next_power_of_2(chunks), "EXPERTS_POW2": experts_pow2,
                    "BLOCK_B": BLOCK_TABLE_STEP, "PAD_BLOCK": min(PAD_STEP, block_m), "num_warps": 8}),
        KernelCall(expert_scatter_kernel, (chunks,), (
            topk_ids, topk_weights, cursor, found.sorted_ids, found.weights, n_slots, topk, experts, *ids_strides,
            topk_weights.stride(0), topk_weights.stride(1)),
            {"CHUNK": chunk, "EXPERTS_POW2": experts_pow2, "num_warps": 4}),
    ]
    return calls, found, (hist, cursor)


def grouped_call(align: Alignment, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, config: Config, *,
                 gather: bool, scatter: bool, a_div: int = 1, swiglu: bool = False, scale: bool = False,
                 pre: torch.Tensor | None = None, pre3: torch.Tensor | None = None,
                 input_precision: str = "ieee", block_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                 c_scale: torch.Tensor | None = None) -> KernelCall:
    """``c[row] = epilogue(a[row] @ b[e])`` over the row blocks of ``align``
    (:func:`grouped_gemm_kernel`).

    :param a: ``[rows, K]``: gathered (``gather``: row ``sorted_id // a_div``) or in sorted order.
    :param b: ``[E, N, K]`` (an expert's weight as nn.Linear keeps it), any strides; with ``swiglu``
        ``[E, 2N, K]``, the gate's rows then the up's.
    :param c: ``[n_slots, N]`` (``scatter``) or ``[places, N]``, unit column stride.
    :param config: ``BLOCK_N``, ``BLOCK_K``, ``GROUP_M``, ``num_warps``, ``num_stages``
        (``BLOCK_M`` is the alignment's).
    :param scale: the routing weight of each slot as the row scale (with ``scatter``).
    :param pre, pre3: with ``swiglu``: the gate and up pre-activations, ``c``'s strides.
    :param block_scales: ``(a_scale [rows, ceil(K/128)], b_scale [E, ceil(N/128), ceil(K/128)])``
        (``ceil(2N/128)`` blocks with ``swiglu``) for fp8 ``a`` and ``b`` (:func:`grouped_fp8_gemm_kernel`,
        no pre-activations): ``BLOCK_N`` and ``BLOCK_K`` must divide 128, and with ``swiglu`` ``BLOCK_N``
        must divide N.
    :param c_scale: ``[rows of c, ceil(N/128)]`` float32: ``c`` (float8_e4m3fn) quantised per 1x128
        in the epilogue (``BLOCK_N`` = 128), its scales here; with ``block_scales``.
    """
    n, k = c.shape[1], a.shape[1]
    block_n, block_k = config["BLOCK_N"], config["BLOCK_K"]
    if block_scales is not None and (SCALE_BLOCK.value % block_n or SCALE_BLOCK.value % block_k
                                     or (swiglu and n % block_n)):
        raise ValueError(f"block scales need BLOCK_N and BLOCK_K dividing {SCALE_BLOCK.value} (and BLOCK_N dividing "
                         f"N = {n} under SwiGLU), not {block_n} and {block_k}")
    if c_scale is not None and (block_n != SCALE_BLOCK.value or block_scales is None):
        raise ValueError(f"quantising c in the epilogue needs block scales and BLOCK_N = {SCALE_BLOCK.value}, "
                         f"not {block_n}")
    c_rows = align.n_slots if scatter else c.shape[0]
    tiles = align.max_blocks * cdiv(n, block_n)
    b3_offset = n * b.stride(1) if swiglu else 0
    tile = {"BLOCK_M": align.block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": config.get("GROUP_M", 8),
            "GATHER_A": gather, "SCATTER_C": scatter, "HAS_SCALE": scale, "SWIGLU": swiglu,
            "num_warps": config["num_warps"], "num_stages": config["num_stages"]}
    strides = (a.stride(0), a.stride(1), b.stride(0), b.stride(2), b.stride(1), c.stride(0), c.stride(1))
    if block_scales is None:
        return KernelCall(grouped_gemm_kernel, (tiles,), (
            a, b, c, c if pre is None else pre, c if pre3 is None else pre3, align.weights, align.sorted_ids,
            align.block_expert, align.n_slots, a_div, c_rows, n, k, align.max_blocks, b3_offset, *strides,
        ), {**tile, "INPUT_PRECISION": input_precision, "STORE_PRE": pre is not None})
    if pre is not None:
        raise ValueError("the fp8 GEMM stores no pre-activations")
    a_scale, b_scale = block_scales
    q_scale = c if c_scale is None else c_scale
    return KernelCall(grouped_fp8_gemm_kernel, (tiles,), (
        a, b, c, align.weights, align.sorted_ids, align.block_expert, a_scale, b_scale, q_scale, align.n_slots, a_div,
        c_rows, n, k, align.max_blocks, b3_offset, *strides, a_scale.stride(0), a_scale.stride(1), *b_scale.stride(),
        q_scale.stride(0), q_scale.stride(1),
    ), {**tile, "QUANT_C": c_scale is not None})


def expert_gemm_call(align: Alignment, a_t: torch.Tensor, b: torch.Tensor, c: torch.Tensor, config: Config,
                     input_precision: str = "ieee") -> KernelCall:
    """``c[e] = a_t[rows of e]^T @ b[rows of e]`` (:func:`expert_gemm_kernel`).

    :param a_t: ``[places, M]`` in sorted order (zeros at padding).
    :param b: ``[places, N]`` in sorted order.
    :param c: ``[E, M, N]``, any strides.
    """
    m, n = c.shape[1], c.shape[2]
    tiles = cdiv(m, config["BLOCK_M"]) * cdiv(n, config["BLOCK_N"])
    return KernelCall(expert_gemm_kernel, (align.experts * tiles,), (
        a_t, b, c, align.starts, m, n, a_t.stride(1), a_t.stride(0), b.stride(0), b.stride(1),
        c.stride(0), c.stride(1), c.stride(2),
    ), {"BLOCK_M": config["BLOCK_M"], "BLOCK_N": config["BLOCK_N"], "BLOCK_K": config["BLOCK_K"],
        "GROUP_M": config.get("GROUP_M", 8), "INPUT_PRECISION": input_precision,
        "num_warps": config["num_warps"], "num_stages": config["num_stages"]})


def gather_call(align: Alignment, x: torch.Tensor, out: torch.Tensor, a_div: int) -> KernelCall:
    """``out[p] = x[sorted_id // a_div]`` in sorted order, zeros at padding (:func:`gather_rows_kernel`)."""
    d = x.shape[1]
    block_d = min(next_power_of_2(max(d, 1)), 256)
    block_p = 16
    return KernelCall(gather_rows_kernel, (cdiv(align.places, block_p), cdiv(d, block_d)), (
        x, out, align.sorted_ids, align.starts, align.n_slots, a_div, align.experts, d,
        x.stride(0), x.stride(1), out.stride(0),
    ), {"BLOCK_P": block_p, "BLOCK_D": block_d, "num_warps": 4})
