"""The weight-streaming block of ffn: its forward for a few rows (decoding), one launch that reads
w1 and w3 once.

One program per group of columns of both weights (``BLOCK_N`` columns, fewer where N spreads evenly
over whole waves of the device's cores: :func:`decode_columns`) and, where the column groups leave
many cores idle, per K slice (:func:`decode_splits`), with every row of ``x`` in it (at most
``BLOCK_M``, padded to MIN_DOT_ROWS for ``tl.dot``). Each program computes the rows' sums of squares
and ``x * rms_w`` in its K loop from ``x`` (a few kilobytes, read from L2) and streams its slices of
``w1`` and ``w3`` once from memory (loads marked evict-first; on sm_90 through tensor descriptors
where that measured faster: :func:`decode_tma`). The epilogue scales both accumulators by the rows'
``rstd`` and applies SwiGLU (:func:`_swiglu_store`), storing the pre-activations too for a training
forward. With several K slices the float32 partial sums go to scratch and
:func:`ffn_decode_finish_kernel` adds them up in slice order (deterministic) and runs the epilogue.

:mod:`dlblas_kernels.kernels.ffn` (the op) takes this block where one row block holds every row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dlblas_kernels.blocks import gemm as gemm_block
from dlcore.api import Config, DeviceProfile, KernelCall, cdiv, ensure_allocator, next_power_of_2

# tl.dot's smallest row count: the weight-streaming kernel pads its row block to it.
MIN_DOT_ROWS = 16
# The streaming kernel's K slices (decode_splits): at most this many, each at least this many K
# steps long, and only up to this many rows (the slices' float32 partial sums are scratch).
MAX_DECODE_SPLITS, MIN_SLICE_STEPS, MAX_SPLIT_ROWS = 8, 4, 16
# ... and only when the unsliced column blocks keep less than this share of their waves' cores busy.
SPLIT_BELOW_FILL = 0.75
# The streaming kernel's (BLOCK_K, num_stages) through tensor descriptors (decode_tma), and the most
# rows (padded to tl.dot's 16) it takes them for: the rows the sweep measured (1 and 16).
TMA_DECODE_TILE, TMA_DECODE_ROWS = (128, 3), 16
# Elements of one program's tile in the kernel adding up the slices.
FINISH_TILE = 2048


@triton.jit
def ffn_decode_kernel(
    x_ptr, rms_w_ptr, w1_ptr, w3_ptr, out_ptr, gate_ptr, up_ptr, part_ptr, sum_sq_ptr,
    M, N, K, eps, w3_offset, k_per_split, columns,
    stride_xm, stride_xk,
    stride_rms_w,
    stride_w1n, stride_w1k,
    stride_w3n, stride_w3k,
    stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STORE_PRE: tl.constexpr,
    SPLIT_K: tl.constexpr, TMA: tl.constexpr = False,
):
    # Every row (M <= BLOCK_M) against `columns` (<= BLOCK_N) columns of w1 and w3 (w3's rows from
    # w3_offset elements on: w13's second half), over K slice program_id(1) of k_per_split
    # elements: each weight element is read once by one program. x is small and shared by all programs (L2); the
    # weights stream through. STORE_PRE: the pre-activations gate and up stored too (out's
    # strides), for the backward. With SPLIT_K > 1 the slice's float32 sums go to part
    # [SPLIT_K, 2, M, N] and its rows' sums of squares to sum_sq [SPLIT_K, M] (written by the
    # first column block), which ffn_decode_finish_kernel adds up. TMA: the weight tiles through
    # tensor descriptors whose shape ends at the program's last column and K slice, so the copy
    # engine fetches nothing past them (unit K strides, 16-byte aligned rows: decode_tma).
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M).to(tl.int64)
    offs_n = (pid_n * columns + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = (tl.arange(0, BLOCK_N) < columns) & (offs_n < N)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)

    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :] * stride_xk
    rms_w_ptrs = rms_w_ptr + (k_start + offs_k) * stride_rms_w
    # The w tiles in their own layout, [BLOCK_N, BLOCK_K]: contiguous along K for nn.Linear weights.
    w1_ptrs = w1_ptr + offs_n[:, None] * stride_w1n + (k_start + offs_k)[None, :] * stride_w1k
    w3_ptrs = w3_ptr + w3_offset + offs_n[:, None] * stride_w3n + (k_start + offs_k)[None, :] * stride_w3k
    if TMA:
        n_start = pid_n * columns
        n_end = tl.minimum(n_start + columns, N)
        w1_desc = tl.make_tensor_descriptor(w1_ptr, shape=[n_end, k_end], strides=[stride_w1n, 1],
                                            block_shape=[BLOCK_N, BLOCK_K])
        w3_desc = tl.make_tensor_descriptor(w3_ptr + w3_offset, shape=[n_end, k_end], strides=[stride_w3n, 1],
                                            block_shape=[BLOCK_N, BLOCK_K])

    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        mask_k = offs_k < k_end - k
        if TMA:
            w1 = w1_desc.load([n_start, k])
            w3 = w3_desc.load([n_start, k])
        else:
            w1 = tl.load(w1_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0, eviction_policy="evict_first")
            w3 = tl.load(w3_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0, eviction_policy="evict_first")
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        g = tl.load(rms_w_ptrs, mask=mask_k, other=0.0).to(tl.float32)
        xf = x.to(tl.float32)
        sum_sq += tl.sum(xf * xf, axis=1)
        a = (xf * g[None, :]).to(w1.dtype)
        acc1 = tl.dot(a, tl.trans(w1), acc1, input_precision="ieee")
        acc3 = tl.dot(a, tl.trans(w3), acc3, input_precision="ieee")
        x_ptrs += BLOCK_K * stride_xk
        rms_w_ptrs += BLOCK_K * stride_rms_w
        w1_ptrs += BLOCK_K * stride_w1k
        w3_ptrs += BLOCK_K * stride_w3k

    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        _swiglu_store(acc1, acc3, sum_sq, offs_m, offs_n, mask, K, eps, out_ptr, gate_ptr, up_ptr,
                      stride_om, stride_on, STORE_PRE)
    else:
        part = part_ptr + (pid_k * 2 * M + offs_m[:, None]) * N + offs_n[None, :]
        tl.store(part, acc1, mask=mask)
        tl.store(part + M * N, acc3, mask=mask)
        tl.store(sum_sq_ptr + pid_k * M + offs_m, sum_sq, mask=tl.where(pid_n == 0, mask_m, False))


@triton.jit
def _swiglu_store(acc1, acc3, sum_sq, offs_m, offs_n, mask, K, eps, out_ptr, gate_ptr, up_ptr,
                  stride_om, stride_on, STORE_PRE: tl.constexpr):
    # The rows' rstd from their sums of squares, the pre-activations scaled by it, SwiGLU, stored.
    rstd = tl.rsqrt(sum_sq / K + eps)
    gate = acc1 * rstd[:, None]
    up = acc3 * rstd[:, None]
    offsets = offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptr + offsets, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=mask)
    if STORE_PRE:
        tl.store(gate_ptr + offsets, gate.to(gate_ptr.dtype.element_ty), mask=mask)
        tl.store(up_ptr + offsets, up.to(up_ptr.dtype.element_ty), mask=mask)


@triton.jit
def ffn_decode_finish_kernel(
    part_ptr, sum_sq_ptr, out_ptr, gate_ptr, up_ptr,
    M, N, K, eps,
    stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STORE_PRE: tl.constexpr, SPLIT_K: tl.constexpr,
):
    # The split-K streaming kernel's slices added up in slice order (deterministic), then its epilogue.
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask_m = offs_m < M
    mask = mask_m[:, None] & (offs_n < N)[None, :]
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        part = part_ptr + (split * 2 * M + offs_m[:, None]) * N + offs_n[None, :]
        acc1 += tl.load(part, mask=mask, other=0.0)
        acc3 += tl.load(part + M * N, mask=mask, other=0.0)
        sum_sq += tl.load(sum_sq_ptr + split * M + offs_m, mask=mask_m, other=0.0)
    _swiglu_store(acc1, acc3, sum_sq, offs_m, offs_n, mask, K, eps, out_ptr, gate_ptr, up_ptr,
                  stride_om, stride_on, STORE_PRE)


def decode_columns(n: int, config: Config, profile: DeviceProfile | None) -> tuple[int, int]:
    """``(columns, programs)``: the columns of w1 and w3 each streaming program takes, and the
    programs over N. ``BLOCK_N`` columns each; with ``SPREAD`` (1 unless the config says 0) and a
    core count, at least a wave of column blocks (any number with ``SPREAD`` 2, an experiment for
    the sweep) rounded up to whole waves of the device's cores and N spread
    evenly over them: each program takes ``cdiv(N, programs) <= BLOCK_N`` columns, so every core
    streams about as many bytes as every other (LLaMA-3-70B's 28672 columns on 132 SMs:
    264 programs of 109 columns, where 224 blocks of 128 leave 40 SMs idle in the second wave).
    Fewer blocks than cores stay as they are: LLaMA-3-8B's 112 blocks of 128 columns (spreading them
    over 132 programs of 109 columns is not measured)."""
    block_n = config["BLOCK_N"]
    programs = cdiv(n, block_n)
    cores = profile.cores if profile is not None else 0
    spread = config.get("SPREAD", 1)
    if not spread or not cores or (programs < cores and spread < 2):
        return block_n, programs
    columns = cdiv(n, cdiv(programs, cores) * cores)
    return columns, cdiv(n, columns)


def decode_splits(m: int, n: int, k: int, config: Config, profile: DeviceProfile | None) -> int:
    """K slices of the streaming kernel. One where its programs (:func:`decode_columns`) fill their
    waves of the device's cores to at least SPLIT_BELOW_FILL, above MAX_SPLIT_ROWS rows, or with no
    core count; otherwise the count (at most MAX_DECODE_SPLITS, each slice at least MIN_SLICE_STEPS
    K steps long) whose programs fill their waves best, the float32 partial sums it writes and
    reads back counted against it (:func:`_split_cost`). ``config['SPLIT_K']`` (when set) decides
    instead.

    On 132 SMs with 128 columns a program, LLaMA-3-8B's 112 column blocks fill 0.85 of a wave and
    stream fastest unsliced; Qwen2.5-7B's 148 fill 0.56 of two and DeepSeek-V3's shared expert's 16
    a wave's eighth, both faster in 8 slices (docs/performance.md, ffn)."""
    if config.get("SPLIT_K"):
        return max(1, min(config["SPLIT_K"], cdiv(k, config["BLOCK_K"])))
    cores = profile.cores if profile is not None else 0
    programs = decode_columns(n, config, profile)[1]
    if not cores or m > MAX_SPLIT_ROWS or _filled(programs, cores) >= SPLIT_BELOW_FILL:
        return 1
    most = max(1, min(MAX_DECODE_SPLITS, k // (MIN_SLICE_STEPS * config["BLOCK_K"])))
    return min(range(1, most + 1), key=lambda s: (_split_cost(m, n, k, s, programs, cores), s))


def _filled(programs: int, cores: int) -> float:
    """The share of the cores' waves that ``programs`` (one a core) keep busy."""
    return programs / (cdiv(programs, cores) * cores)


def _split_cost(m: int, n: int, k: int, splits: int, programs: int, cores: int) -> float:
    """Bytes-equivalent of streaming w1 and w3 (bf16) in ``splits`` K slices: the weights over the
    share of the waves' cores that work, plus the partial sums' float32 write and read when sliced."""
    partials = 0 if splits == 1 else 2 * splits * (2 * m * n + m) * 4
    return 2 * n * k * 2 / _filled(programs * splits, cores) + partials


def decode_tma(config: Config, profile: DeviceProfile | None, w1: torch.Tensor, w3: torch.Tensor,
               columns: int, splits: int, block_m: int = MIN_DOT_ROWS) -> tuple[int, int] | None:
    """``(BLOCK_K, num_stages)`` of the streaming kernel reading the weights through tensor
    descriptors, or None for pointer loads. Only on a device whose copy engine takes them (sm_90),
    both weights (w13's halves: views) with unit K strides and 16-byte aligned rows and bases
    (:func:`dlblas_kernels.blocks.gemm.tma_aligned`). ``config['TMA']`` 0 never; 1 always there, with the
    config's K slice and depth; unset (the default and the space's configs), where each program's
    columns fill at least three quarters of its ``BLOCK_N`` rows of the descriptor's box and K is
    not sliced, with TMA_DECODE_TILE, for 16-bit weights and at most TMA_DECODE_ROWS rows (the rows measured; more
    keep the pointers, as float32 does) whose pipelined tiles (``block_m`` rows of x, both weights'
    ``BLOCK_N``) fit the device's shared memory at that depth. Programs whose columns fill less of
    the box (Qwen2.5-7B's 72 of 128) and K-sliced ones (DeepSeek-V3's shared expert) stream faster
    through pointers (docs/performance.md, ffn)."""
    wanted = config.get("TMA")
    if wanted == 0 or profile is None or profile.arch not in gemm_block.TMA_ARCHS:
        return None
    if not (gemm_block.tma_aligned(w1) and gemm_block.tma_aligned(w3)):
        return None
    size = w1.element_size()
    if wanted:
        return config["BLOCK_K"], config["num_stages"]
    if splits > 1 or 4 * columns < 3 * config["BLOCK_N"] or size > 2 or block_m > TMA_DECODE_ROWS:
        return None
    block_k, stages = TMA_DECODE_TILE
    shared = profile.shared_memory_per_program
    if shared and stages * (block_m + 2 * config["BLOCK_N"]) * block_k * size > shared:
        return None
    return TMA_DECODE_TILE


def decode_calls(x2: torch.Tensor, rms_w: torch.Tensor, w1: torch.Tensor | None, w3: torch.Tensor | None,
                 w13: torch.Tensor | None, out2: torch.Tensor, eps: float, config: Config,
                 profile: DeviceProfile | None, gate: torch.Tensor | None = None,
                 up: torch.Tensor | None = None) -> tuple[list[KernelCall], tuple]:
    """The weight-streaming launches: a program per group of columns (:func:`decode_columns`) and
    K slice (:func:`decode_splits`), every row in it; with several slices, their float32 partial sums
    (scratch, returned) added up by :func:`ffn_decode_finish_kernel`. ``w13`` is passed whole, w3
    being its rows from N on (an argument at offset zero: the launch replays). ``gate`` and ``up``
    (``out2``'s strides), when given, receive the pre-activations."""
    m, k = x2.shape
    n = out2.shape[1]
    v1, v3 = (w1, w3) if w13 is None else (w13[:n], w13[n:])
    if w13 is not None:
        w1 = w3 = w13
    w3_offset = n * w13.stride(0) if w13 is not None else 0
    columns, programs = decode_columns(n, config, profile)
    splits = decode_splits(m, n, k, config, profile)
    k_per_split = cdiv(cdiv(k, splits), config["BLOCK_K"]) * config["BLOCK_K"]
    splits = cdiv(k, k_per_split)
    scratch: tuple = ()
    part = sum_sq = out2
    if splits > 1:
        part = torch.empty((splits, 2, m, n), dtype=torch.float32, device=x2.device)
        sum_sq = torch.empty((splits, m), dtype=torch.float32, device=x2.device)
        scratch = (part, sum_sq)
    gate_out = out2 if gate is None else gate
    up_out = out2 if up is None else up
    block_k, stages = config["BLOCK_K"], config["num_stages"]
    block_m = max(next_power_of_2(m), MIN_DOT_ROWS)
    tma = decode_tma(config, profile, v1, v3, columns, splits, block_m)
    if tma is not None:
        block_k, stages = tma
        ensure_allocator()  # the descriptors' global scratch (plan.run launches through Triton)
    calls = [KernelCall(
        ffn_decode_kernel, (programs, splits),
        (x2, rms_w, w1, w3, out2, gate_out, up_out, part, sum_sq, m, n, k, float(eps), w3_offset, k_per_split, columns,
         x2.stride(0), x2.stride(1), rms_w.stride(0),
         w1.stride(0), w1.stride(1), w3.stride(0), w3.stride(1), out2.stride(0), out2.stride(1)),
        {"BLOCK_M": block_m, "BLOCK_N": config["BLOCK_N"],
         "BLOCK_K": block_k, "STORE_PRE": gate is not None, "SPLIT_K": splits, "TMA": tma is not None,
         "num_warps": config["num_warps"], "num_stages": stages},
    )]
    if splits > 1:
        finish_m = next_power_of_2(m)
        block_n = max(min(FINISH_TILE // finish_m, next_power_of_2(n)), 16)
        calls.append(KernelCall(
            ffn_decode_finish_kernel, (cdiv(n, block_n),),
            (part, sum_sq, out2, gate_out, up_out, m, n, k, float(eps), out2.stride(0), out2.stride(1)),
            {"BLOCK_M": finish_m, "BLOCK_N": block_n, "STORE_PRE": gate is not None, "SPLIT_K": splits,
             "num_warps": 4},
        ))
    return calls, scratch


DECODE_KERNELS = (ffn_decode_kernel, ffn_decode_finish_kernel)
