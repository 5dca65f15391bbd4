"""fused_moe's grouped GEMMs through the copy engine, for few large experts (Mixtral's 8 of 14336):
the tile order and the persistent descriptor loop of the dense GEMM (:mod:`dlblas_kernels.blocks.gemm`)
over the row blocks of :func:`~dlblas_kernels.blocks.grouped.align_calls`.

The pointer kernels of :mod:`dlblas_kernels.blocks.grouped` gather each row block's tokens as they
load them, which the copy engine of sm_90 cannot do. Here the rows are gathered once into sorted
order (:func:`~dlblas_kernels.blocks.grouped.gather_call`, zeros at padding), and each GEMM reads
``a`` ``[places, K]`` and its expert's weight rows through tensor descriptors: the weights ``[E, R,
K]`` are one descriptor of ``E * R`` rows, an expert's column tile starting at row ``e * R + n``.
So a column tile must not run into the next expert's rows: ``N`` a multiple of ``BLOCK_N``
(:func:`fits`). Programs walk the (row block, column tile) units of the used row blocks (the
padded total read on the device: no host sync) in the grouped order.

- gate/up (SWIGLU): ``w13 [E, 2I, H]``, both halves per K step, ``silu(g) * u`` stored in sorted
  order through a descriptor (``act [places, I]``, the down GEMM's ``a``);
- down: ``w2 [E, H, I]``, the routing weight of each slot as the row scale, each row stored to
  its slot (``y [T * k, H]``, padding rows masked off), which the sum over choices reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dlblas_kernels.blocks.fp8 import quantise, scale_of
from dlblas_kernels.blocks.gemm import SCALE_BLOCK, TMA_ARCHS, block_scaled_dot, epilogue, grouped_tile
from dlblas_kernels.blocks.grouped import Alignment
from dlcore.api import Config, DeviceProfile, KernelCall, ensure_allocator


@triton.jit
def grouped_tma_gemm_kernel(
    a_ptr, b_ptr, c_ptr, scale_ptr, sorted_ptr, block_expert_ptr, starts_ptr, a_scale_ptr, b_scale_ptr, c_scale_ptr,
    n_slots, places, N, K, experts, b_rows, stride_am, stride_bn, stride_cm,
    stride_sm, stride_sk, stride_te, stride_tn, stride_tk, stride_qm, stride_qk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SWIGLU: tl.constexpr, SCATTER_C: tl.constexpr, HAS_SCALE: tl.constexpr, FLATTEN: tl.constexpr,
    BLOCK_SCALED: tl.constexpr, QUANT_C: tl.constexpr,
):
    """Persistent: ``c[row] = epilogue(a[place] @ b[e][n0:n0 + BLOCK_N].T)`` over the units of the
    used row blocks (see the module doc). ``a`` ``[places, K]`` in sorted order, unit K stride;
    ``b`` ``[experts * b_rows, K]``, unit K stride (under SWIGLU the up half ``N`` rows after the
    gate's); ``c`` ``[places, N]`` by place, or with SCATTER_C ``[n_slots, N]`` by slot.

    BLOCK_SCALED (float8_e4m3fn ``a`` and ``b``): each K step's product scaled by ``a_scale[place,
    kb]`` (``stride_sm, stride_sk``) and ``b_scale[e, nb, kb]`` (``stride_te, stride_tn,
    stride_tk``; the up half's blocks from row ``N``), BLOCK_K and BLOCK_N dividing 128. QUANT_C:
    the output quantised to float8_e4m3fn per row of the tile (BLOCK_N = 128, one group), its
    scales into ``c_scale[place, pid_n]`` (``stride_qm, stride_qk``)."""
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[places, K], strides=[stride_am, 1],
                                       block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[experts * b_rows, K], strides=[stride_bn, 1],
                                       block_shape=[BLOCK_N, BLOCK_K])
    if SWIGLU:
        # the up half through a descriptor of its own, N rows on (one load per descriptor and K step, as
        # the GEMM block's SwiGLU loop has it)
        b3_desc = tl.make_tensor_descriptor(b_ptr + N.to(tl.int64) * stride_bn, shape=[experts * b_rows - N, K],
                                            strides=[stride_bn, 1], block_shape=[BLOCK_N, BLOCK_K])
    if not SCATTER_C:
        c_desc = tl.make_tensor_descriptor(c_ptr, shape=[places, N], strides=[stride_cm, 1],
                                           block_shape=[BLOCK_M, BLOCK_N])
    num_pid_n = tl.cdiv(N, BLOCK_N)
    used = tl.load(starts_ptr + experts) // BLOCK_M
    k_steps = tl.cdiv(K, BLOCK_K)
    for unit in tl.range(tl.program_id(0), used * num_pid_n, tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = grouped_tile(unit, used, num_pid_n, GROUP_M)
        expert = tl.load(block_expert_ptr + pid_m)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        row_b = expert * b_rows + off_n
        offs_m = off_m + tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc3 = acc
        if BLOCK_SCALED:
            a_scales = a_scale_ptr + offs_m.to(tl.int64) * stride_sm
            b_scales = b_scale_ptr + expert.to(tl.int64) * stride_te
            gate_scale = b_scales + (off_n // SCALE_BLOCK) * stride_tn
            up_scale = b_scales + ((N + off_n) // SCALE_BLOCK) * stride_tn
        for ki in range(k_steps):
            off_k = ki * BLOCK_K
            a = a_desc.load([off_m, off_k])
            b = b_desc.load([row_b, off_k]).T
            if BLOCK_SCALED:
                acc = block_scaled_dot(acc, a, b, a_scales, gate_scale, offs_m < places, off_k, stride_sk, stride_tk,
                                       0, BLOCK_N)
            else:
                acc = tl.dot(a, b, acc)
            if SWIGLU:
                b3 = b3_desc.load([row_b, off_k]).T
                if BLOCK_SCALED:
                    acc3 = block_scaled_dot(acc3, a, b3, a_scales, up_scale, offs_m < places, off_k, stride_sk,
                                            stride_tk, 0, BLOCK_N)
                else:
                    acc3 = tl.dot(a, b3, acc3)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        slots = tl.load(sorted_ptr + offs_m).to(tl.int64)
        # the row scale read by slot; padding rows (slot n_slots) masked off to 0
        out, _, _ = epilogue(acc, acc3, acc, slots, offs_n, n_slots, N, scale_ptr, scale_ptr, scale_ptr, 1, 0,
                             False, HAS_SCALE, False, None, SWIGLU, False)
        if SCATTER_C:
            mask = (slots < n_slots)[:, None] & (offs_n < N)[None, :]
            tl.store(c_ptr + slots[:, None] * stride_cm + offs_n[None, :], out.to(c_ptr.dtype.element_ty), mask=mask)
        elif QUANT_C:
            # padding rows hold zeros (their rows of a are zeros): scale 1
            row_scale = scale_of(tl.max(tl.abs(out), axis=1))
            c_desc.store([off_m, off_n], quantise(out, row_scale[:, None]))
            tl.store(c_scale_ptr + offs_m.to(tl.int64) * stride_qm + pid_n * stride_qk, row_scale,
                     mask=offs_m < places)
        else:
            c_desc.store([off_m, off_n], out.to(c_desc.dtype))


KERNELS = (grouped_tma_gemm_kernel,)


def _rows_view(w: torch.Tensor) -> bool:
    """Whether ``w [E, R, K]`` is one ``[E * R, K]`` matrix of unit K stride and 16-byte rows."""
    e, r, _ = w.shape
    return (w.stride(2) == 1 and (w.stride(1) * w.element_size()) % 16 == 0 and w.data_ptr() % 16 == 0
            and (e == 1 or w.stride(0) == r * w.stride(1)))


def fits(profile: DeviceProfile | None, w13: torch.Tensor, w2: torch.Tensor, config: Config) -> bool:
    """Whether the descriptor path takes these weights and tiles: a persistent descriptor kernel on
    this device (sm_90, cores known), each expert's rows one matrix of unit K stride
    (:func:`_rows_view`), ``I`` and ``H`` multiples of the column tiles; 16-bit weights, or fp8
    ones with 128-column gate/up tiles (one quantisation group of the SwiGLU output), down tiles
    and K steps dividing 128 (one scale block each) and ``I`` a multiple of 128."""
    inter, hidden = w2.shape[2], w2.shape[1]
    if profile is None or profile.arch not in TMA_ARCHS or profile.cores <= 0:
        return False
    if not (_rows_view(w13) and _rows_view(w2) and inter % config["BLOCK_N"] == 0
            and hidden % config["DOWN_BLOCK_N"] == 0):
        return False
    if w13.element_size() == 1:
        block = SCALE_BLOCK.value
        return (config["BLOCK_N"] == block and inter % block == 0 and block % config["DOWN_BLOCK_N"] == 0
                and block % config["BLOCK_K"] == 0 and block % config["DOWN_BLOCK_K"] == 0)
    return w13.element_size() == 2


def grouped_tma_call(align: Alignment, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, tiles: Config,
                     programs: int, *, swiglu: bool, scatter: bool, scale: bool,
                     block_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                     c_scale: torch.Tensor | None = None) -> KernelCall:
    """``c = epilogue(a @ b[e].T)`` over the row blocks of ``align`` (:func:`grouped_tma_gemm_kernel`).

    :param a: ``[places, K]`` in sorted order (zeros at padding), unit K stride.
    :param b: ``[E, R, K]`` with ``R = 2N`` (``swiglu``: gate rows, then up rows) or ``N``.
    :param c: ``[places, N]`` (by place) or, with ``scatter``, ``[n_slots, N]`` (by slot); unit column stride.
    :param tiles: ``BLOCK_N``, ``BLOCK_K``, ``GROUP_M``, ``num_warps``, ``num_stages`` (``BLOCK_M`` the alignment's);
        optional ``FLATTEN`` (default 1: the K loop of each unit software-pipelined with the loop over units).
    :param programs: the persistent programs (the device's multiprocessors).
    :param scale: the routing weight of each slot as the row scale.
    :param block_scales: fp8 ``a`` and ``b``: ``(a_scale [places, ceil(K/128)], b_scale [E, ceil(R/128),
        ceil(K/128)])``, any strides.
    :param c_scale: ``c`` in float8_e4m3fn, by place: ``[places, N / 128]`` for its 1x128 scales.
    """
    ensure_allocator()
    n, k = c.shape[1], a.shape[1]
    b_rows = b.shape[1]
    units = (align.max_blocks * n) // tiles["BLOCK_N"]
    a_scale, b_scale = block_scales if block_scales is not None else (c, c)
    scale_strides = (a_scale.stride(0), a_scale.stride(1), *b_scale.stride()) if block_scales is not None else (0,) * 5
    q_strides = c_scale.stride() if c_scale is not None else (0, 0)
    return KernelCall(grouped_tma_gemm_kernel, (max(1, min(programs, units)),), (
        a, b, c, align.weights, align.sorted_ids, align.block_expert, align.starts, a_scale, b_scale,
        c_scale if c_scale is not None else c, align.n_slots, align.places, n, k, align.experts, b_rows,
        a.stride(0), b.stride(1), c.stride(0), *scale_strides, *q_strides,
    ), {"BLOCK_M": align.block_m, "BLOCK_N": tiles["BLOCK_N"], "BLOCK_K": tiles["BLOCK_K"],
        "GROUP_M": tiles.get("GROUP_M", 8), "SWIGLU": swiglu, "SCATTER_C": scatter, "HAS_SCALE": scale,
        "FLATTEN": bool(tiles.get("FLATTEN", 1)), "BLOCK_SCALED": block_scales is not None,
        "QUANT_C": c_scale is not None, "num_warps": tiles["num_warps"], "num_stages": tiles["num_stages"]})
