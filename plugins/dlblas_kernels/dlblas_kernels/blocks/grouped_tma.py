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

from dlblas_kernels.blocks.gemm import TMA_ARCHS, epilogue, grouped_tile
from dlblas_kernels.blocks.grouped import Alignment
from dlcore.api import Config, DeviceProfile, KernelCall, ensure_allocator


@triton.jit
def grouped_tma_gemm_kernel(
    a_ptr, b_ptr, c_ptr, scale_ptr, sorted_ptr, block_expert_ptr, starts_ptr,
    n_slots, places, N, K, experts, b_rows, stride_am, stride_bn, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SWIGLU: tl.constexpr, SCATTER_C: tl.constexpr, HAS_SCALE: tl.constexpr, FLATTEN: tl.constexpr,
):
    """Persistent: ``c[row] = epilogue(a[place] @ b[e][n0:n0 + BLOCK_N].T)`` over the units of the
    used row blocks (see the module doc). ``a`` ``[places, K]`` in sorted order, unit K stride;
    ``b`` ``[experts * b_rows, K]``, unit K stride (under SWIGLU the up half ``N`` rows after the
    gate's); ``c`` ``[places, N]`` by place, or with SCATTER_C ``[n_slots, N]`` by slot."""
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
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc3 = acc
        for ki in range(k_steps):
            off_k = ki * BLOCK_K
            a = a_desc.load([off_m, off_k])
            acc = tl.dot(a, b_desc.load([row_b, off_k]).T, acc)
            if SWIGLU:
                acc3 = tl.dot(a, b3_desc.load([row_b, off_k]).T, acc3)
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        slots = tl.load(sorted_ptr + offs_m).to(tl.int64)
        # the row scale read by slot; padding rows (slot n_slots) masked off to 0
        out, _, _ = epilogue(acc, acc3, acc, slots, offs_n, n_slots, N, scale_ptr, scale_ptr, scale_ptr, 1, 0,
                             False, HAS_SCALE, False, None, SWIGLU, False)
        if SCATTER_C:
            mask = (slots < n_slots)[:, None] & (offs_n < N)[None, :]
            tl.store(c_ptr + slots[:, None] * stride_cm + offs_n[None, :], out.to(c_ptr.dtype.element_ty), mask=mask)
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
    this device (sm_90, cores known), 16-bit weights of unit K stride, each expert's rows one
    matrix (:func:`_rows_view`), ``I`` and ``H`` multiples of the column tiles."""
    inter, hidden = w2.shape[2], w2.shape[1]
    return (profile is not None and profile.arch in TMA_ARCHS and profile.cores > 0 and w13.element_size() == 2
            and _rows_view(w13) and _rows_view(w2) and inter % config["BLOCK_N"] == 0
            and hidden % config["DOWN_BLOCK_N"] == 0)


def grouped_tma_call(align: Alignment, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, tiles: Config,
                     programs: int, *, swiglu: bool, scatter: bool, scale: bool) -> KernelCall:
    """``c = epilogue(a @ b[e].T)`` over the row blocks of ``align`` (:func:`grouped_tma_gemm_kernel`).

    :param a: ``[places, K]`` in sorted order (zeros at padding), unit K stride.
    :param b: ``[E, R, K]`` with ``R = 2N`` (``swiglu``: gate rows, then up rows) or ``N``.
    :param c: ``[places, N]`` (by place) or, with ``scatter``, ``[n_slots, N]`` (by slot); unit column stride.
    :param tiles: ``BLOCK_N``, ``BLOCK_K``, ``GROUP_M``, ``num_warps``, ``num_stages`` (``BLOCK_M`` the alignment's);
        optional ``FLATTEN`` (default 1: the K loop of each unit software-pipelined with the loop over units).
    :param programs: the persistent programs (the device's multiprocessors).
    :param scale: the routing weight of each slot as the row scale.
    """
    ensure_allocator()
    n, k = c.shape[1], a.shape[1]
    b_rows = b.shape[1]
    units = (align.max_blocks * n) // tiles["BLOCK_N"]
    return KernelCall(grouped_tma_gemm_kernel, (max(1, min(programs, units)),), (
        a, b, c, align.weights, align.sorted_ids, align.block_expert, align.starts, align.n_slots, align.places,
        n, k, align.experts, b_rows, a.stride(0), b.stride(1), c.stride(0),
    ), {"BLOCK_M": align.block_m, "BLOCK_N": tiles["BLOCK_N"], "BLOCK_K": tiles["BLOCK_K"],
        "GROUP_M": tiles.get("GROUP_M", 8), "SWIGLU": swiglu, "SCATTER_C": scatter, "HAS_SCALE": scale,
        "FLATTEN": bool(tiles.get("FLATTEN", 1)), "num_warps": tiles["num_warps"], "num_stages": tiles["num_stages"]})
