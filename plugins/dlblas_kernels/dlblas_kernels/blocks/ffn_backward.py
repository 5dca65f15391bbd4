"""ffn's backward launches but rms_norm's: ``dh = [dg | du]`` elementwise from the saved
pre-activations (:func:`swiglu_backward_kernel`), ``dxn = dh @ [w1; w3]`` (for separate weights
:func:`ffn_input_grad_kernel`, or on sm_90 :func:`ffn_input_grad_tma_kernel`, without a concatenated
copy) and ``dw13 = dh.T @ xn`` through the GEMM block, with their tiles. The formulas are
:mod:`dlblas_kernels.kernels.ffn`'s module doc.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dlblas_kernels.blocks import gemm as gemm_block
from dlblas_kernels.blocks.ffn_decode import MIN_SLICE_STEPS
from dlblas_kernels.blocks.ffn_prefill import PREFILL_TILE, fit_stages
from dlblas_kernels.blocks.gemm import dot_range, gemm_calls, grouped_tile
from dlcore.api import Config, DeviceProfile, KernelCall, cdiv, ensure_allocator, next_power_of_2

# Widest row slice of the SwiGLU backward's programs.
SWIGLU_BLOCK = 2048


@triton.jit
def swiglu_backward_kernel(
    gate_ptr, up_ptr, dout_ptr, dh_ptr,
    N,
    stride_gm, stride_gn, stride_um, stride_un, stride_dm, stride_dn, stride_hm,
    BLOCK_N: tl.constexpr,
):
    # One row slice per program: dh [M, 2N] = [d gate | d up] (unit column stride) from the saved
    # pre-activations gate and up and the output gradient dout, each [M, N].
    row = tl.program_id(0).to(tl.int64)  # 64-bit: row * row stride may pass 2**31
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    gate = tl.load(gate_ptr + row * stride_gm + cols * stride_gn, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_um + cols * stride_un, mask=mask, other=0.0).to(tl.float32)
    dout = tl.load(dout_ptr + row * stride_dm + cols * stride_dn, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(gate)
    dh_row = dh_ptr + row * stride_hm
    # d silu(g) / dg = s * (1 + g * (1 - s))
    tl.store(dh_row + cols, (dout * up * s * (1 + gate * (1 - s))).to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(dh_row + N + cols, (dout * gate * s).to(dh_ptr.dtype.element_ty), mask=mask)


@triton.jit
def ffn_input_grad_kernel(
    dh_ptr, w1_ptr, w3_ptr, out_ptr,
    M, K, N, k_per_split,
    stride_dm, stride_dn,
    stride_w1n, stride_w1k,
    stride_w3n, stride_w3k,
    stride_om, stride_ok, stride_osplit,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # out [M, K] = dh[:, :N] @ w1 + dh[:, N:] @ w3: one accumulator, the reduction over the N
    # columns of d gate against w1's rows, then over those of d up against w3's. BLOCK_N tiles
    # the output's K columns and BLOCK_K the reduction; the tile order and the K loop are the
    # GEMM block's. program_id(1) takes the reduction's slice [s * k_per_split, ...) of the 2N
    # columns (its part in w1, then its part in w3) and stores at out + s * stride_osplit (with
    # several slices: a float32 workspace [slices, M, K] the GEMM block's split-K reduce adds up).
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(K, BLOCK_N), GROUP_M)
    split = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_c = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_c = offs_c < K
    # 64-bit: the reduction step times a weight's row stride may pass 2**31 elements.
    stride_dn = tl.cast(stride_dn, tl.int64)
    stride_w1n = tl.cast(stride_w1n, tl.int64)
    stride_w3n = tl.cast(stride_w3n, tl.int64)
    start = split * k_per_split
    end = tl.minimum(start + k_per_split, 2 * N)
    lo1, hi1 = tl.minimum(start, N), tl.minimum(end, N)
    lo3, hi3 = tl.maximum(start, N) - N, tl.maximum(end, N) - N

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_ptrs = dh_ptr + offs_m[:, None] * stride_dm + (lo1 + offs_r)[None, :] * stride_dn
    b_ptrs = w1_ptr + (lo1 + offs_r)[:, None] * stride_w1n + offs_c[None, :] * stride_w1k
    acc = dot_range(acc, a_ptrs, b_ptrs, mask_m, mask_c, offs_r, lo1, hi1, stride_dn, stride_w1n, BLOCK_K, "ieee")
    a_ptrs = dh_ptr + offs_m[:, None] * stride_dm + (N + lo3 + offs_r)[None, :] * stride_dn
    b_ptrs = w3_ptr + (lo3 + offs_r)[:, None] * stride_w3n + offs_c[None, :] * stride_w3k
    acc = dot_range(acc, a_ptrs, b_ptrs, mask_m, mask_c, offs_r, lo3, hi3, stride_dn, stride_w3n, BLOCK_K, "ieee")

    out_ptrs = out_ptr + split.to(tl.int64) * stride_osplit + offs_m[:, None] * stride_om + offs_c[None, :] * stride_ok
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_c[None, :])


@triton.jit
def ffn_input_grad_tma_kernel(
    dh_ptr, w1_ptr, w3_ptr, out_ptr,
    M, K, N,
    stride_dm, stride_w1n, stride_w3n, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # ffn_input_grad_kernel's out [M, K] = dh[:, :N] @ w1 + dh[:, N:] @ w3, persistent, every tile
    # moved by the copy engine: dh's halves and the weights ([N, K], unit K strides) through
    # descriptors bounded at N, so a ragged last reduction step reads zeros, not the other half.
    d_desc = tl.make_tensor_descriptor(dh_ptr, shape=[M, N], strides=[stride_dm, 1], block_shape=[BLOCK_M, BLOCK_K])
    u_desc = tl.make_tensor_descriptor(dh_ptr + N, shape=[M, N], strides=[stride_dm, 1],
                                       block_shape=[BLOCK_M, BLOCK_K])
    w1_desc = tl.make_tensor_descriptor(w1_ptr, shape=[N, K], strides=[stride_w1n, 1], block_shape=[BLOCK_K, BLOCK_N])
    w3_desc = tl.make_tensor_descriptor(w3_ptr, shape=[N, K], strides=[stride_w3n, 1], block_shape=[BLOCK_K, BLOCK_N])
    c_desc = tl.make_tensor_descriptor(out_ptr, shape=[M, K], strides=[stride_om, 1], block_shape=[BLOCK_M, BLOCK_N])
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(K, BLOCK_N)
    steps = tl.cdiv(N, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0)):
        pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(steps):
            acc = tl.dot(d_desc.load([off_m, ki * BLOCK_K]), w1_desc.load([ki * BLOCK_K, off_n]), acc,
                         input_precision="ieee")
        for ki in range(steps):
            acc = tl.dot(u_desc.load([off_m, ki * BLOCK_K]), w3_desc.load([ki * BLOCK_K, off_n]), acc,
                         input_precision="ieee")
        c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


def backward_gemm_config(config: Config) -> Config:
    """The config of the backward's single-operand GEMMs: the forward's tile with both accumulators'
    columns in one (the default forward tile of 128 x 128 per weight is a 128 x 256 GEMM tile, the
    faster of the two for the backward's GEMMs)."""
    return {**config, "BLOCK_N": min(2 * config["BLOCK_N"], 256)}


def weight_grad_config(element_size: int, profile: DeviceProfile | None) -> Config:
    """The tile of ``dw13 = dh.T @ xn``, whatever the forward's: :data:`PREFILL_TILE`'s 128 x 256
    product (K slices of 32 for float32), its stages fitted to the device. Its output ``[2N, K]`` is
    as large at 16 tokens as at 16384 (only the reduction shrinks), so the few-row forward tiles,
    sized for a small output, do not serve it (``.ci/sweep_weight_grad.py`` compares them)."""
    config = backward_gemm_config(dict(PREFILL_TILE))
    if element_size > 2:
        config["BLOCK_K"] = 32
    return fit_stages(config, profile, element_size, operands=1)


def input_grad_splits(m: int, k: int, n: int, gemm: Config, profile: DeviceProfile | None) -> int:
    """Slices of the reduction over the 2N columns for ``dxn = dh @ [w1; w3]``: with few rows its
    output ``[M, K]`` has few tiles (LLaMA-3-8B at 16 tokens: 16 of 64 x 256 for 132 SMs, too few
    programs to stream the weights at the copy bandwidth), so as many slices as keep the tiles'
    programs within one wave of the device's cores, each at least MIN_SLICE_STEPS K steps long; one
    without a core count."""
    cores = profile.cores if profile is not None else 0
    tiles = cdiv(m, gemm["BLOCK_M"]) * cdiv(k, gemm["BLOCK_N"])
    if not cores or tiles * 2 > cores:
        return 1
    most = max(1, 2 * n // (MIN_SLICE_STEPS * gemm["BLOCK_K"]))
    return max(1, min(cores // tiles, most))


def input_grad_tma(dh: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, dxn: torch.Tensor, gemm: Config,
                   profile: DeviceProfile | None, splits: int) -> bool:
    """Whether :func:`ffn_input_grad_tma_kernel` computes ``dxn``: unsliced (``splits`` 1), ``gemm``'s
    ``TMA`` not 0, on a device whose copy engine takes the operands (sm_90, its core count known):
    dh, its second half, the weights and dxn as :func:`dlblas_kernels.blocks.gemm.tma_aligned` asks."""
    if (splits > 1 or not gemm.get("TMA", 1) or profile is None or profile.arch not in gemm_block.TMA_ARCHS
            or profile.cores <= 0):
        return False
    return all(gemm_block.tma_aligned(t) for t in (dh, dh[:, w1.shape[0]:], w1, w3, dxn))


def input_grad_calls(dh: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, dxn: torch.Tensor, gemm: Config,
                     splits: int, profile: DeviceProfile | None = None) -> tuple[list[KernelCall], tuple]:
    """``dxn = dh[:, :N] @ w1 + dh[:, N:] @ w3`` without concatenating the weights, over ``splits``
    slices of the reduction (float32 partial sums added up by the GEMM block's split-K reduce); on
    sm_90, unsliced, the persistent descriptor kernel (:func:`input_grad_tma`)."""
    (m, k), n = dxn.shape, w1.shape[0]
    if input_grad_tma(dh, w1, w3, dxn, gemm, profile, splits):
        ensure_allocator()
        size = dh.element_size()  # the pipelined tiles beside the output tile staged for its store
        stages = gemm_block.fit_stages({**gemm, "TMA": 1, "SPLIT_K": 1}, profile.shared_memory_per_program,
                                       lambda c: gemm_block.shared_memory_bytes(c, size))["num_stages"]
        tiles = cdiv(m, gemm["BLOCK_M"]) * cdiv(k, gemm["BLOCK_N"])
        return [KernelCall(ffn_input_grad_tma_kernel, (min(tiles, profile.cores),), (
            dh, w1, w3, dxn, m, k, n, dh.stride(0), w1.stride(0), w3.stride(0), dxn.stride(0),
        ), {"BLOCK_M": gemm["BLOCK_M"], "BLOCK_N": gemm["BLOCK_N"], "BLOCK_K": gemm["BLOCK_K"],
            "GROUP_M": gemm["GROUP_M"], "num_warps": gemm["num_warps"], "num_stages": stages})], ()
    k_per_split = cdiv(cdiv(2 * n, splits), gemm["BLOCK_K"]) * gemm["BLOCK_K"]
    splits = cdiv(2 * n, k_per_split)
    tile = {"BLOCK_M": gemm["BLOCK_M"], "BLOCK_N": gemm["BLOCK_N"], "BLOCK_K": gemm["BLOCK_K"],
            "GROUP_M": gemm["GROUP_M"], "num_warps": gemm["num_warps"], "num_stages": gemm["num_stages"]}
    grid = (cdiv(m, gemm["BLOCK_M"]) * cdiv(k, gemm["BLOCK_N"]), splits)
    common = (m, k, n, k_per_split, dh.stride(0), dh.stride(1), w1.stride(0), w1.stride(1), w3.stride(0), w3.stride(1))
    if splits == 1:
        return [KernelCall(ffn_input_grad_kernel, grid, (dh, w1, w3, dxn, *common, dxn.stride(0), dxn.stride(1), 0),
                           tile)], ()
    work = torch.empty(splits, m, k, dtype=torch.float32, device=dxn.device)
    block_m, block_n = 32, 128
    return [
        KernelCall(ffn_input_grad_kernel, grid, (dh, w1, w3, work, *common, k, 1, m * k), tile),
        KernelCall(gemm_block.splitk_reduce_kernel, (cdiv(m, block_m), cdiv(k, block_n)), (
            work, dxn, dxn, dxn, dxn, dxn, m, k, dxn.stride(0), dxn.stride(1), 0, 0,
        ), {"BLOCK_M": block_m, "BLOCK_N": block_n, "SPLIT_K": splits, "HAS_BIAS": False, "HAS_SCALE": False,
            "HAS_COL_SCALE": False, "ACTIVATION": None, "ACT_GRAD": False, "num_warps": 4}),
    ], (work,)


def gradient_calls(dout2: torch.Tensor, gate2: torch.Tensor, up2: torch.Tensor, xn2: torch.Tensor,
                   w1: torch.Tensor | None, w3: torch.Tensor | None, w13: torch.Tensor | None, dw13: torch.Tensor,
                   gemm: Config, profile: DeviceProfile) -> tuple[list[KernelCall], torch.Tensor, tuple]:
    """The launches for ``dh`` from the saved pre-activations (rows ``[M, N]``), ``dxn`` from ``dh``
    and both weights (``gemm``: the forward config's tile, both weights' columns in one) and
    ``dw13 = dh.T @ xn`` (:func:`weight_grad_config`'s tile); ``(calls, dxn, scratch)``."""
    m, n = gate2.shape
    k = xn2.shape[1]
    new = lambda *shape: torch.empty(shape, dtype=xn2.dtype, device=xn2.device)  # noqa: E731
    dh, dxn = new(m, 2 * n), new(m, k)
    block = min(next_power_of_2(n), SWIGLU_BLOCK)
    calls = [
        KernelCall(
            swiglu_backward_kernel, (m, cdiv(n, block)),
            (gate2, up2, dout2, dh, n, gate2.stride(0), gate2.stride(1), up2.stride(0), up2.stride(1),
             dout2.stride(0), dout2.stride(1), dh.stride(0)),
            {"BLOCK_N": block, "num_warps": min(max(block // 256, 1), 4)},
        ),
    ]
    splits = input_grad_splits(m, k, n, gemm, profile)
    if w13 is not None:
        calls_x, scratch_x = gemm_calls(dh, w13, dxn, {**gemm, "SPLIT_K": splits}, profile)
    else:
        calls_x, scratch_x = input_grad_calls(dh, w1, w3, dxn, gemm, splits, profile)
    calls_w, scratch_w = gemm_calls(dh.T, xn2, dw13, weight_grad_config(xn2.element_size(), profile), profile)
    return [*calls, *calls_x, *calls_w], dxn, (dh, dxn, *scratch_x, *scratch_w)
