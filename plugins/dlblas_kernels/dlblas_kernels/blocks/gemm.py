"""The GEMM building block: ``c = epilogue(a @ b)`` for every GEMM of dlblas-kernels.

One tile loop, written in two kernels (tensor descriptors, pointers), either of them split along
K, chosen per call from the config and the device profile:

- **tensor descriptors, persistent** (:func:`gemm_tma_kernel`): on Hopper (``profile.arch ==
  "sm_90"``) when every operand suits the bulk tensor copy engine (16-byte aligned base, unit
  inner stride, other strides multiples of 16 bytes; ``a`` and ``b`` either way round: an
  nn.Linear weight's ``w.T`` is read through a ``[N, K]`` descriptor, a transposed ``a`` through
  a ``[K, M]`` one). ``min(units, profile.cores)`` programs, each walking the output tiles
  ``pid, pid + programs, ...`` in the grouped order, the tiles loaded
  through descriptors built on the device (``tl.make_tensor_descriptor``, which asks Triton's
  allocator for 128 bytes of global memory per descriptor and program: dlcore's
  :func:`~dlcore.runtime.allocator.ensure_allocator` installs one backed by torch where none is
  set, before the plan and before every launch of such a kernel, whatever the thread).
  ``WARP_SPECIALIZE`` (a config's, default off) warp-specialises the persistent tile loop: Triton
  (3.6 and 3.9, sm_90) then gives the program a producer partition issuing the copies and two
  consumer warpgroups of 4 warps, each taking half of the tile's rows, so that one consumer's
  epilogue or block-scale arithmetic runs while the other's ``wgmma`` does (the ping-pong of
  FlashAttention-3 and DeepGEMM). Triton does so only for 4-warp programs whose tile loop is not
  flattened (with ``FLATTEN`` or 8 warps the cubin is the one without it, so a warp-specialised
  loop is never flattened), and fails to compile 64 x 256 tiles so
  (:func:`warp_specialize_constraints`). The descriptors
  are made in the kernel, not on the host, because a launch's arguments must stay plain tensors
  and numbers: dlcore's launch templates replay a launch with new tensors in the same slots,
  which a host-side descriptor (holding its tensor) would defeat.
- **pointers** (:func:`gemm_kernel`): everything else, the interpreter included (pre-Hopper chips,
  strides or alignments the copy engine cannot take): one program per output tile, masked loads
  of any strides, software-pipelined by Triton (``num_stages``).
- **split-K** (``SPLIT_K > 1``, either kernel): for few rows and a long K (decoding, a few
  hundred rows), where the output tiles alone are too few to keep every multiprocessor busy.
  Each of ``SPLIT_K`` work units per tile sums one K range into a float32 workspace
  ``[SPLIT_K, M, N]`` (a plan's scratch); :func:`splitk_reduce_kernel` adds the slices and
  applies the epilogue (deterministic: no atomics).

The heuristics that choose among them for ``matmul`` live in
:func:`dlblas_kernels.kernels.matmul.heuristic`; :func:`shared_memory_bytes` is what a config
takes of shared memory (the spaces' constraint), and the descriptor kernel drops pipeline stages
of a config that would not fit beside its epilogue.

The epilogue, selected by constexprs, runs in float32 on the accumulator before the one store:

    z   = acc * scale[m]  (HAS_SCALE)  * col_scale[n]  (HAS_COL_SCALE)  + bias[n]  (HAS_BIAS)
                                       float32 scales of any stride; stride 0: one for the tensor
    out = act(z)                       act in None, "relu", "silu", "gelu_tanh"
    out = silu(z) * z3                 SWIGLU: z3 from a second operand b3 accumulated alongside
    out = dc * act'(z)                 ACT_GRAD: the gradient through the activation (backward)
    c   = out cast to c's dtype; z (and z3) stored too when pre-activations are asked for
    c   = (c + out) cast to c's dtype instead, under ACCUMULATE (a sum over row chunks)

**fp8** (``fp8_gemm``, e4m3 operands): the same two kernels and loops with ``tl.dot`` on fp8
tiles (sm_89 and later; Hopper's ``wgmma`` takes 8-bit tiles K-major only, so the descriptor
kernel runs fp8 only for a row-major ``a`` and ``b = w.T`` of an nn.Linear weight, the pointer
kernel anything else). Per-tensor and per-row dequantisation scales are the epilogue's row and
column scales (a 0-dim scale read with stride 0). Blockwise scales (DeepSeek-V3: ``a_scale [M,
ceil(K/128)]`` per 1x128 of a row, ``b_scale [ceil(N/128), ceil(K/128)]`` per 128x128 block of
``b``; :class:`BlockScales`) are the loop's constexpr ``BLOCK_SCALED``: each K step's product is
summed on its own and added scaled by its block's scales (:func:`block_scaled_dot`), which needs
``BLOCK_K`` dividing 128 (a step inside one K block) and ``BLOCK_N`` dividing 128 (one b-scale per
tile: a scalar load per step rather than a vector of per-column ones); under split-K the slices
are scaled before the reduce. The row scales of a tile are one load per step: an M-major
``a_scale`` (what ``quantize_fp8`` gives) makes it coalesced. For non-fp8 calls the new
constexprs are off and the kernels compile as before (unused scale pointers and strides).

How the later GEMMs use it:

- **MoE** (grouped GEMM): the rows of ``a`` come sorted by expert; a table of (expert, row
  block) pairs replaces the grouped order's ``tile -> (pid_m, pid_n)`` map, ``b`` is offset by
  the expert's weight in the loop's first descriptor / pointer, and the routing weight of each
  row is the row scale. The persistent loop walks that table instead of the rectangle.

Host side, :func:`gemm_calls` turns operands, outputs, epilogue and a config into the
:class:`~dlcore.declarations.implementation.KernelCall` list (and the scratch tensors) of a
launch plan; :func:`swiglu_calls` / :func:`swiglu` are the prefill ffn's entry point (on sm_90 its
pair-tile kernel, :mod:`dlblas_kernels.blocks.swiglu_pair`, built on this module's loop pieces).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dlcore.api import Config, Constraint, DeviceProfile, KernelCall, LaunchPlan, cdiv, ensure_allocator

#: what ``activation`` may be
ACTIVATIONS = (None, "relu", "silu", "gelu_tanh")
#: the architectures whose programs take the tensor-descriptor (TMA) path
TMA_ARCHS = ("sm_90",)
#: row blocks per group of the grouped program order where a config names none
GROUP_M = 8
#: the copy engine's alignment of a base address and of every stride but the unit one, in bytes
TMA_ALIGNMENT = 16
#: the K extent (and b's N extent) one blockwise scale covers: DeepSeek-V3's 1x128 / 128x128 blocks
SCALE_BLOCK = tl.constexpr(128)
#: the fp8 formats ``tl.dot`` takes on the tensor cores (sm_89 and later)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


# --- device helpers ------------------------------------------------------------------------------

@triton.jit
def grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """The (row block, column block) of output tile number ``tile``: GROUP_M row blocks sweep the
    column blocks together, so the ``b`` tiles they share are read from L2 rather than memory."""
    tiles_per_group = GROUP_M * num_pid_n
    first_m = (tile // tiles_per_group) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % tiles_per_group) % group_m
    pid_n = (tile % tiles_per_group) // group_m
    return pid_m, pid_n


@triton.jit
def block_scaled_dot(acc, a, b, a_scale_ptrs, b_scale_ptr, mask_m, k, stride_sk, stride_tk):
    """``acc + (a @ b) * a_scale[m, kb] * b_scale[kb]`` for the K step at ``k`` (in block ``kb = k //
    128``): the step's product summed on its own, then scaled and added in float32 (DeepSeek-V3's
    fp8 recipe: the tensor cores' partial sums are promoted every K block). ``a_scale_ptrs``: the
    ``[BLOCK_M]`` row scales of K block 0 (``stride_sk`` apart per block); ``b_scale_ptr``: the
    tile's column block's scale of K block 0 (``stride_tk`` apart)."""
    kb = k // SCALE_BLOCK
    a_scale = tl.load(a_scale_ptrs + kb * stride_sk, mask=mask_m, other=0.0)
    b_scale = tl.load(b_scale_ptr + kb * stride_tk)
    return acc + tl.dot(a, b) * (a_scale[:, None] * b_scale)


@triton.jit
def dot_range(acc, a_ptrs, b_ptrs, mask_m, mask_n, offs_k, k_start, k_end, stride_ak, stride_bk,
              BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
              a_scale_ptrs=None, b_scale_ptr=None, stride_sk=0, stride_tk=0, BLOCK_SCALED: tl.constexpr = False):
    """``acc`` plus the product of ``a``'s K range ``[k_start, k_end)`` with ``b``'s, loaded by pointers
    (``a_ptrs``: the ``[BLOCK_M, BLOCK_K]`` tile at ``k_start``, ``b_ptrs`` the ``[BLOCK_K, BLOCK_N]``
    one; the K strides 64-bit). Masked-off elements load as 0, so a ragged last slice adds nothing.
    BLOCK_SCALED: each step's product scaled by its K block's scales (:func:`block_scaled_dot`;
    BLOCK_K divides 128, so a step lies in one block)."""
    for k in range(k_start, k_end, BLOCK_K):
        mask_k = offs_k < k_end - k
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if BLOCK_SCALED:
            acc = block_scaled_dot(acc, a, b, a_scale_ptrs, b_scale_ptr, mask_m, k, stride_sk, stride_tk)
        else:
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def dot_range_pair(acc, acc3, a_ptrs, b_ptrs, b3_ptrs, mask_m, mask_n, offs_k, k_start, k_end, stride_ak, stride_bk,
                   stride_b3k, BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                   a_scale_ptrs=None, b_scale_ptr=None, b3_scale_ptr=None, stride_sk=0, stride_tk=0,
                   BLOCK_SCALED: tl.constexpr = False):
    """:func:`dot_range` of two products sharing ``a`` (SwiGLU's gate and up): ``(acc + a @ b,
    acc3 + a @ b3)`` over ``[k_start, k_end)``, each ``a`` tile loaded once for both.
    BLOCK_SCALED: each step's products scaled by their K block's scales, as :func:`dot_range`
    does, the row scales loaded once for both; ``b_scale_ptr`` and ``b3_scale_ptr`` the scales of
    ``b``'s and ``b3``'s column blocks at K block 0 (``stride_tk`` apart), each tile of ``b`` and
    of ``b3`` lying in one column block."""
    for k in range(k_start, k_end, BLOCK_K):
        mask_k = offs_k < k_end - k
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if BLOCK_SCALED:
            kb = k // SCALE_BLOCK
            a_scale = tl.load(a_scale_ptrs + kb * stride_sk, mask=mask_m, other=0.0)[:, None]
            acc += tl.dot(a, b) * (a_scale * tl.load(b_scale_ptr + kb * stride_tk))
            b3 = tl.load(b3_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            acc3 += tl.dot(a, b3) * (a_scale * tl.load(b3_scale_ptr + kb * stride_tk))
        else:
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
            b3 = tl.load(b3_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            acc3 = tl.dot(a, b3, acc3, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
        b3_ptrs += BLOCK_K * stride_b3k
    return acc, acc3


@triton.jit
def activate(z, ACTIVATION: tl.constexpr):
    """``act(z)`` in float32. gelu_tanh: ``0.5 z (1 + tanh(u)) = z * sigmoid(2u)``,
    ``u = sqrt(2/pi) (z + 0.044715 z^3)``."""
    if ACTIVATION == "relu":
        z = tl.maximum(z, 0.0)
    elif ACTIVATION == "silu":
        z = z * tl.sigmoid(z)
    elif ACTIVATION == "gelu_tanh":
        z = z * tl.sigmoid(1.5957691216057308 * (z + 0.044715 * z * z * z))
    return z


@triton.jit
def activation_grad(z, ACTIVATION: tl.constexpr):
    """``act'(z)`` in float32 (1 without an activation)."""
    if ACTIVATION == "relu":
        d = tl.where(z > 0.0, 1.0, 0.0)
    elif ACTIVATION == "silu":
        s = tl.sigmoid(z)
        d = s * (1.0 + z * (1.0 - s))
    elif ACTIVATION == "gelu_tanh":
        s = tl.sigmoid(1.5957691216057308 * (z + 0.044715 * z * z * z))
        d = s + z * s * (1.0 - s) * 1.5957691216057308 * (1.0 + 0.134145 * z * z)
    else:
        d = tl.full(z.shape, 1.0, tl.float32)
    return d


@triton.jit
def epilogue(acc, acc3, dc, offs_m, offs_n, M, N, bias_ptr, scale_ptr, col_scale_ptr, stride_sm, stride_tn,
             HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_COL_SCALE: tl.constexpr, ACTIVATION: tl.constexpr,
             SWIGLU: tl.constexpr, ACT_GRAD: tl.constexpr):
    """``(out, z, z3)`` of a float32 tile (see the module doc); ``acc3`` and ``dc`` are read only
    under SWIGLU and ACT_GRAD (callers pass ``acc`` otherwise). The row scale of row ``m`` is at
    ``scale_ptr + m * stride_sm``, the column scale of column ``n`` at ``col_scale_ptr + n *
    stride_tn`` (a stride of 0: one scale for the whole tensor)."""
    z = acc
    z3 = acc3
    if HAS_SCALE:
        scale = tl.load(scale_ptr + offs_m * stride_sm, mask=offs_m < M, other=0.0).to(tl.float32)
        z = z * scale[:, None]
        if SWIGLU:
            z3 = z3 * scale[:, None]
    if HAS_COL_SCALE:
        col_scale = tl.load(col_scale_ptr + offs_n * stride_tn, mask=offs_n < N, other=0.0).to(tl.float32)
        z = z * col_scale[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        z = z + bias[None, :]
    if SWIGLU:
        out = z * tl.sigmoid(z) * z3
    elif ACT_GRAD:
        out = dc.to(tl.float32) * activation_grad(z, ACTIVATION)
    else:
        out = activate(z, ACTIVATION)
    return out, z, z3


@triton.jit
def store_tile(acc, acc3, offs_m, offs_n, M, N, c_ptr, pre_ptr, pre3_ptr, dc_ptr, stride_cm, stride_cn,
               bias_ptr, scale_ptr, col_scale_ptr, stride_sm, stride_tn,
               HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_COL_SCALE: tl.constexpr,
               ACTIVATION: tl.constexpr, SWIGLU: tl.constexpr, ACT_GRAD: tl.constexpr, STORE_PRE: tl.constexpr,
               ACCUMULATE: tl.constexpr):
    """The epilogue of one tile and its masked stores (``c``, ``pre``, ``pre3`` and ``dc`` share
    ``c``'s strides); ACCUMULATE: ``c``'s old value added to the result before the store."""
    offsets = offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    dc = acc
    if ACT_GRAD:
        dc = tl.load(dc_ptr + offsets, mask=mask, other=0.0)
    out, z, z3 = epilogue(acc, acc3, dc, offs_m, offs_n, M, N, bias_ptr, scale_ptr, col_scale_ptr, stride_sm,
                          stride_tn, HAS_BIAS, HAS_SCALE, HAS_COL_SCALE, ACTIVATION, SWIGLU, ACT_GRAD)
    if ACCUMULATE:
        out += tl.load(c_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptr + offsets, out.to(c_ptr.dtype.element_ty), mask=mask)
    if STORE_PRE:
        tl.store(pre_ptr + offsets, z.to(pre_ptr.dtype.element_ty), mask=mask)
        if SWIGLU:
            tl.store(pre3_ptr + offsets, z3.to(pre3_ptr.dtype.element_ty), mask=mask)


# --- the kernels ---------------------------------------------------------------------------------

@triton.jit
def gemm_kernel(
    a_ptr, b_ptr, b3_ptr, c_ptr, pre_ptr, pre3_ptr, dc_ptr, bias_ptr, scale_ptr, col_scale_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_b3k, stride_b3n, stride_cm, stride_cn,
    stride_sm, stride_sk, stride_tn, stride_tk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_COL_SCALE: tl.constexpr, BLOCK_SCALED: tl.constexpr,
    ACTIVATION: tl.constexpr, SWIGLU: tl.constexpr, ACT_GRAD: tl.constexpr, STORE_PRE: tl.constexpr,
    ACCUMULATE: tl.constexpr,
):
    """One output tile per program (axis 0), one K range per program (axis 1, SPLIT_K of them).
    With SPLIT_K > 1 ``c_ptr`` is the float32 workspace ``[SPLIT_K, M, N]`` and the epilogue is
    :func:`splitk_reduce_kernel`'s. The scales: see :func:`gemm_tma_kernel`."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    pid_k = tl.program_id(1)
    # K range of this program: whole BLOCK_K steps, the last range ragged.
    k_span = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_start = pid_k * k_span
    k_end = tl.minimum(K, k_start + k_span)

    # 64-bit offsets: row * row stride, column * column stride and the K step (BLOCK_K * a K
    # stride, e.g. the row count of a column-major a) may each pass 2**31 elements.
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    stride_ak = tl.cast(stride_ak, tl.int64)
    stride_bk = tl.cast(stride_bk, tl.int64)
    mask_m = offs_m < M
    mask_n = offs_n < N

    a_ptrs = a_ptr + offs_m[:, None] * stride_am + (k_start + offs_k)[None, :] * stride_ak
    b_ptrs = b_ptr + (k_start + offs_k)[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc3 = acc
    if SWIGLU:
        # Both accumulators in one loop: each a tile is loaded once for the two products.
        stride_b3k = tl.cast(stride_b3k, tl.int64)
        b3_ptrs = b3_ptr + (k_start + offs_k)[:, None] * stride_b3k + offs_n[None, :] * stride_b3n
        acc, acc3 = dot_range_pair(acc, acc3, a_ptrs, b_ptrs, b3_ptrs, mask_m, mask_n, offs_k, k_start, k_end,
                                   stride_ak, stride_bk, stride_b3k, BLOCK_K, INPUT_PRECISION)
    elif BLOCK_SCALED:
        acc = dot_range(acc, a_ptrs, b_ptrs, mask_m, mask_n, offs_k, k_start, k_end, stride_ak, stride_bk,
                        BLOCK_K, INPUT_PRECISION, scale_ptr + offs_m * stride_sm,
                        col_scale_ptr + (pid_n * BLOCK_N // SCALE_BLOCK) * stride_tn, stride_sk, stride_tk, True)
    else:
        acc = dot_range(acc, a_ptrs, b_ptrs, mask_m, mask_n, offs_k, k_start, k_end, stride_ak, stride_bk,
                        BLOCK_K, INPUT_PRECISION)

    if SPLIT_K > 1:
        offsets = pid_k.to(tl.int64) * M * N + offs_m[:, None] * N + offs_n[None, :]
        tl.store(c_ptr + offsets, acc, mask=mask_m[:, None] & mask_n[None, :])
    else:
        store_tile(acc, acc3, offs_m, offs_n, M, N, c_ptr, pre_ptr, pre3_ptr, dc_ptr, stride_cm, stride_cn,
                   bias_ptr, scale_ptr, col_scale_ptr, stride_sm, stride_tn, HAS_BIAS, HAS_SCALE, HAS_COL_SCALE,
                   ACTIVATION, SWIGLU, ACT_GRAD, STORE_PRE, ACCUMULATE)


@triton.jit
def splitk_reduce_kernel(
    ws_ptr, c_ptr, dc_ptr, bias_ptr, scale_ptr, col_scale_ptr,
    M, N, stride_cm, stride_cn, stride_sm, stride_tn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_COL_SCALE: tl.constexpr, ACTIVATION: tl.constexpr,
    ACT_GRAD: tl.constexpr,
):
    """The sum of the SPLIT_K float32 slices of ``ws [SPLIT_K, M, N]``, through the epilogue, into ``c``."""
    offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    ws_ptrs = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
    slice_size = tl.cast(M, tl.int64) * N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in tl.static_range(SPLIT_K):
        acc += tl.load(ws_ptrs, mask=mask, other=0.0)
        ws_ptrs += slice_size
    store_tile(acc, acc, offs_m, offs_n, M, N, c_ptr, c_ptr, c_ptr, dc_ptr, stride_cm, stride_cn,
               bias_ptr, scale_ptr, col_scale_ptr, stride_sm, stride_tn, HAS_BIAS, HAS_SCALE, HAS_COL_SCALE,
               ACTIVATION, False, ACT_GRAD, False, False)


@triton.jit
def gemm_tma_kernel(
    a_ptr, b_ptr, b3_ptr, c_ptr, pre_ptr, pre3_ptr, dc_ptr, bias_ptr, scale_ptr, col_scale_ptr,
    M, N, K,
    stride_a, stride_b, stride_b3, stride_cm, stride_sm, stride_sk, stride_tn, stride_tk,
    A_M_MAJOR: tl.constexpr, B_K_MAJOR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr, INPUT_PRECISION: tl.constexpr, FLATTEN: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_COL_SCALE: tl.constexpr, BLOCK_SCALED: tl.constexpr,
    ACTIVATION: tl.constexpr, SWIGLU: tl.constexpr, ACT_GRAD: tl.constexpr, STORE_PRE: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """Persistent: program ``pid`` computes work units ``pid, pid + programs, ...`` (an output
    tile, or with SPLIT_K > 1 one K range of one, summed into the float32 workspace ``c_ptr``
    ``[SPLIT_K, M, N]`` for :func:`splitk_reduce_kernel`); every operand tile moved by the copy
    engine through descriptors. ``a`` is ``[M, K]`` with unit K stride (``stride_a`` its M
    stride), or with unit M stride when A_M_MAJOR (``a.T`` stored row-major, ``stride_a`` its K
    stride: what ``a^T @ dc`` of a backward takes); ``b``
    (and ``b3``) is ``[N, K]`` with unit K stride when B_K_MAJOR (an nn.Linear weight; ``stride_b``
    its N stride), else ``[K, N]`` with unit N stride (``stride_b`` its K stride); ``c`` and the
    pre-activations ``[M, N]`` with unit N stride; ``dc`` has ``c``'s strides.

    The scales (float32): without BLOCK_SCALED, the epilogue's row scale ``scale_ptr[m *
    stride_sm]`` (HAS_SCALE) and column scale ``col_scale_ptr[n * stride_tn]`` (HAS_COL_SCALE), a
    stride of 0 for one scale of the whole tensor. BLOCK_SCALED: ``scale_ptr`` is ``a_scale [M,
    ceil(K/128)]`` (strides ``stride_sm, stride_sk``), ``col_scale_ptr`` is ``b_scale [ceil(N/128),
    ceil(K/128)]`` (``stride_tn, stride_tk``), applied to each K step in the loop; BLOCK_K divides
    128 and BLOCK_N divides 128, so a step and a tile lie in one block of each."""
    if A_M_MAJOR:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[K, M], strides=[stride_a, 1],
                                           block_shape=[BLOCK_K, BLOCK_M])
    else:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_a, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
    if B_K_MAJOR:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[stride_b, 1],
                                           block_shape=[BLOCK_N, BLOCK_K])
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[stride_b, 1],
                                           block_shape=[BLOCK_K, BLOCK_N])
    if SWIGLU:
        if B_K_MAJOR:
            b3_desc = tl.make_tensor_descriptor(b3_ptr, shape=[N, K], strides=[stride_b3, 1],
                                                block_shape=[BLOCK_N, BLOCK_K])
        else:
            b3_desc = tl.make_tensor_descriptor(b3_ptr, shape=[K, N], strides=[stride_b3, 1],
                                                block_shape=[BLOCK_K, BLOCK_N])
    if SPLIT_K == 1:
        c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[stride_cm, 1],
                                           block_shape=[BLOCK_M, BLOCK_N])
    if STORE_PRE:
        pre_desc = tl.make_tensor_descriptor(pre_ptr, shape=[M, N], strides=[stride_cm, 1],
                                             block_shape=[BLOCK_M, BLOCK_N])
        if SWIGLU:
            pre3_desc = tl.make_tensor_descriptor(pre3_ptr, shape=[M, N], strides=[stride_cm, 1],
                                                  block_shape=[BLOCK_M, BLOCK_N])

    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Each unit's K steps: whole BLOCK_K steps, the last unit of a tile ragged.
    k_steps = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    # The descriptors zero-fill out-of-bounds rows and columns (and K beyond K), so ragged edges
    # and a ragged last K step need no masks.
    for unit in tl.range(tl.program_id(0), num_pid_m * num_pid_n * SPLIT_K, tl.num_programs(0), flatten=FLATTEN,
                         warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = grouped_tile(unit // SPLIT_K, num_pid_m, num_pid_n, GROUP_M)
        split = unit % SPLIT_K
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc3 = acc
        if BLOCK_SCALED:
            scale_m = off_m + tl.arange(0, BLOCK_M)
            a_scale_ptrs = scale_ptr + scale_m.to(tl.int64) * stride_sm
            b_scale_ptr = col_scale_ptr + (off_n // SCALE_BLOCK) * stride_tn
        for ki in range(k_steps):
            off_k = (split * k_steps + ki) * BLOCK_K
            if A_M_MAJOR:
                a = a_desc.load([off_k, off_m]).T
            else:
                a = a_desc.load([off_m, off_k])
            if B_K_MAJOR:
                b = b_desc.load([off_n, off_k]).T
            else:
                b = b_desc.load([off_k, off_n])
            if BLOCK_SCALED:
                acc = block_scaled_dot(acc, a, b, a_scale_ptrs, b_scale_ptr, scale_m < M, off_k, stride_sk, stride_tk)
            else:
                acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
            if SWIGLU:
                if B_K_MAJOR:
                    b3 = b3_desc.load([off_n, off_k]).T
                else:
                    b3 = b3_desc.load([off_k, off_n])
                acc3 = tl.dot(a, b3, acc3, input_precision=INPUT_PRECISION)

        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        if SPLIT_K > 1:
            mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
            offsets = (split * M + offs_m).to(tl.int64)[:, None] * N + offs_n[None, :]
            tl.store(c_ptr + offsets, acc, mask=mask)
        else:
            dc = acc
            if ACT_GRAD:
                mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
                dc = tl.load(dc_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :], mask=mask,
                             other=0.0)
            out, z, z3 = epilogue(acc, acc3, dc, offs_m, offs_n, M, N, bias_ptr, scale_ptr, col_scale_ptr,
                                  stride_sm, stride_tn, HAS_BIAS, HAS_SCALE, HAS_COL_SCALE, ACTIVATION, SWIGLU,
                                  ACT_GRAD)
            if ACCUMULATE:
                out += c_desc.load([off_m, off_n]).to(tl.float32)
            c_desc.store([off_m, off_n], out.to(c_desc.dtype))
            if STORE_PRE:
                pre_desc.store([off_m, off_n], z.to(pre_desc.dtype))
                if SWIGLU:
                    pre3_desc.store([off_m, off_n], z3.to(pre3_desc.dtype))

KERNELS = (gemm_kernel, splitk_reduce_kernel, gemm_tma_kernel)


# --- host side -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Epilogue:
    """What :func:`gemm_calls` applies to the float32 tile before the store (see the module doc).

    :param bias: ``[N]``, added after the scales.
    :param activation: one of :data:`ACTIVATIONS`.
    :param row_scale: ``[M]`` float32 of any stride, multiplies row ``m`` of the product (and of
        ``b3``'s); 0-dim: one scale for every row (a per-tensor scale).
    :param col_scale: ``[N]`` float32 of any stride, multiplies column ``n`` (not with ``b3``); 0-dim:
        one for every column. With ``row_scale``, the dequantisation of per-row / per-tensor fp8.
    :param act_grad: ``dc [M, N]`` with the output's strides: the output is ``dc * act'(z)``.
    :param pre: ``[M, N]`` with the output's strides: receives ``z`` (the pre-activation).
    :param pre3: with ``pre``, under SwiGLU: receives ``z3``.
    :param accumulate: ``c`` receives its old value plus the result (added in float32; a sum over
        row chunks, such as a weight gradient); not under split-K.
    """

    bias: torch.Tensor | None = None
    activation: str | None = None
    row_scale: torch.Tensor | None = None
    col_scale: torch.Tensor | None = None
    act_grad: torch.Tensor | None = None
    pre: torch.Tensor | None = None
    pre3: torch.Tensor | None = None
    accumulate: bool = False


@dataclass(frozen=True)
class BlockScales:
    """DeepSeek-V3's blockwise dequantisation scales, float32 of any strides, applied to each K
    step's product inside the loop (see the module doc).

    :param a: ``[M, ceil(K/128)]``: one scale per 1x128 of a row of ``a``.
    :param b: ``[ceil(N/128), ceil(K/128)]``: one per 128x128 block of ``b`` (``b``'s columns by K).
    """

    a: torch.Tensor
    b: torch.Tensor


def _scale_stride(t: torch.Tensor | None) -> int:
    """The stride of a row or column scale: its own for a vector, 0 for a 0-dim (per-tensor) one."""
    return 0 if t is None or t.dim() == 0 else t.stride(0)


def tma_aligned(t: torch.Tensor) -> bool:
    """``t`` is 2-D with a unit inner stride, its base and outer stride 16-byte aligned."""
    size = t.element_size()
    return (t.dim() == 2 and t.stride(1) == 1 and t.data_ptr() % TMA_ALIGNMENT == 0
            and (t.stride(0) * size) % TMA_ALIGNMENT == 0)


def transposed(t: torch.Tensor) -> bool | None:
    """How the copy engine reads 2-D ``t``: False row by row, True as ``t.T`` row by row, None not at all."""
    if tma_aligned(t):
        return False
    return True if tma_aligned(t.T) else None


def takes_tma(profile: DeviceProfile, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
              b3: torch.Tensor | None = None, epilogue: Epilogue = Epilogue()) -> bool:
    """Whether the persistent tensor-descriptor kernel can run ``c = a @ b`` (and ``b3``) here:
    a Hopper profile with its core count, and operands the copy engine takes (``a``, ``b`` and
    ``b3`` either way round, ``b3`` as ``b``; ``c`` row-major; ``dc`` and the pre-activations with
    ``c``'s strides; fp8 ``a`` K-major and ``b`` given as ``w.T``)."""
    if profile.arch not in TMA_ARCHS or profile.cores <= 0:
        return False
    if transposed(a) is None or transposed(b) is None or not tma_aligned(c):
        return False
    if a.dtype in FP8_DTYPES and (transposed(a) or not transposed(b)):
        return False  # wgmma takes 8-bit operands K-major only: a row-major, b = w.T
    if b3 is not None and transposed(b3) != transposed(b):
        return False
    outputs = (epilogue.pre, epilogue.pre3, epilogue.act_grad)
    return all(t is None or (t.stride() == c.stride() and t.data_ptr() % TMA_ALIGNMENT == 0) for t in outputs)


def shared_memory_bytes(config: Config, element_size: int = 2, *, second_operand: bool = False,
                        act_grad: bool = False, out_element_size: int | None = None) -> int:
    """What one program of ``config`` takes of shared memory, as Triton 3.6 lays it out for sm_90
    (read off compiled kernels): the pipelined operand tiles (``element_size`` bytes an element),
    and for the descriptor kernel (``TMA``) the output tile staged for its store
    (``out_element_size``, default ``element_size``; float32 under split-K, where it also passes
    through shared memory) plus as much again for an ``act_grad`` tile (loaded by pointers and
    converted to the accumulator's layout; bounded from above)."""
    stages, block_m, block_n = config["num_stages"], config["BLOCK_M"], config["BLOCK_N"]
    loads = stages * (block_m + block_n * (2 if second_operand else 1)) * config["BLOCK_K"] * element_size
    if not config.get("TMA", 1):
        return loads
    if config.get("SPLIT_K", 1) > 1:
        return loads + block_m * block_n * 4
    return loads + block_m * block_n * (out_element_size or element_size) * (2 if act_grad else 1)


#: float32 accumulator values per thread a tile may take: above 128 the accumulator alone takes half
#: of a thread's 255 registers and the kernel spills; below 8 a warp has too little of the tile to work on
MAX_ACC_PER_THREAD = 128
MIN_ACC_PER_THREAD = 8


#: the consumer warpgroups of a warp-specialised descriptor-kernel program (Triton's split of the tile's rows)
WS_CONSUMERS = 2


def accumulator_per_thread(config: Config) -> float:
    """The float32 accumulator values each thread of a ``config`` program holds (under
    ``WARP_SPECIALIZE``, each of the :data:`WS_CONSUMERS` warpgroups holds its share of the tile)."""
    consumers = WS_CONSUMERS if config.get("WARP_SPECIALIZE", 0) else 1
    return config["BLOCK_M"] * config["BLOCK_N"] / (32 * config["num_warps"] * consumers)


def accumulator_constraints() -> list[Constraint]:
    """A GEMM space's bounds on :func:`accumulator_per_thread`."""
    return [
        Constraint(f"BLOCK_M * BLOCK_N / (32 * num_warps) <= {MAX_ACC_PER_THREAD} "
                   f"(the float32 accumulator fits in registers)",
                   lambda c: accumulator_per_thread(c) <= MAX_ACC_PER_THREAD),
        Constraint(f"BLOCK_M * BLOCK_N / (32 * num_warps) >= {MIN_ACC_PER_THREAD} "
                   f"(every warp has enough of the tile to work on)",
                   lambda c: accumulator_per_thread(c) >= MIN_ACC_PER_THREAD),
    ]


def kernel_constraints() -> list[Constraint]:
    """A GEMM space's rules for ``SPLIT_K`` and ``TMA`` (the kernel a config picks)."""
    return [
        Constraint("SPLIT_K == 1 or BLOCK_M <= 128 (split-K is for few rows)",
                   lambda c: c["SPLIT_K"] == 1 or c["BLOCK_M"] <= 128),
        Constraint("TMA == 0 or BLOCK_M >= 64 (the descriptor kernel's wgmma takes 64 rows a warpgroup)",
                   lambda c: c["TMA"] == 0 or c["BLOCK_M"] >= 64),
    ]


def warp_specialize_constraints(profile: DeviceProfile | None) -> list[Constraint]:
    """A space's rule for ``WARP_SPECIALIZE``: only where Triton specialises the loop (the
    descriptor kernel, so a profile of :data:`TMA_ARCHS` or none known; 4 warps; rows for two
    64-row consumer warpgroups: 64 x 256 tiles do not compile so), so that no config repeats
    another's cubin under another name."""
    if profile is not None and profile.arch not in TMA_ARCHS:
        return [Constraint(f"WARP_SPECIALIZE == 0 (only the descriptor kernel of {', '.join(TMA_ARCHS)} takes it)",
                           lambda c: not c.get("WARP_SPECIALIZE", 0))]
    return [
        Constraint("WARP_SPECIALIZE == 0 or (TMA == 1 and num_warps == 4 and BLOCK_M >= 128) (Triton "
                   "warp-specialises 4-warp descriptor-kernel programs, their rows split between two "
                   "64-row warpgroups)",
                   lambda c: not c.get("WARP_SPECIALIZE", 0) or (c["TMA"] == 1 and c["num_warps"] == 4
                                                                 and c["BLOCK_M"] >= 128)),
    ]


def fit_stages(config: Config, limit: int, footprint: Callable[[Config], int]) -> Config:
    """``config`` with one pipelining stage less at a time, down to 2, while ``footprint(config)``
    (the shared memory one program takes, e.g. :func:`shared_memory_bytes`) passes ``limit``
    (0: no bound). A new dict; ``config`` is not changed."""
    config = dict(config)
    while limit and config["num_stages"] > 2 and footprint(config) > limit:
        config["num_stages"] -= 1
    return config


def loop_flags(config: Config, store_pre: bool = False, eight_bit: bool = False) -> dict[str, bool]:
    """The descriptor kernel's ``FLATTEN`` and ``WARP_SPECIALIZE`` from ``config`` (defaults 1 and
    0): a warp-specialised loop is never flattened (Triton would drop the specialisation), never
    stores pre-activations (``store_pre``: a specialised program stages those stores apart, 64 KiB
    more shared memory at 128 x 128 than :func:`shared_memory_bytes` counts; 197 080 bytes in 2
    stages, 262 808 in 3), and never takes 8-bit operands (``eight_bit``: on sm_90 with Triton 3.6.0
    the specialised loop over fp8 tiles gives wrong products at the DeepSeek-V3 shapes of
    ``.ci/sweep_fp8_gemm.py``, where over bf16 tiles it is right; docs/performance.md, Other
    measurements)."""
    specialise = bool(config.get("WARP_SPECIALIZE", 0)) and not store_pre and not eight_bit
    return {"FLATTEN": bool(config.get("FLATTEN", 1)) and not specialise, "WARP_SPECIALIZE": specialise}


def gemm_calls(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, config: Config, profile: DeviceProfile,
               *, b3: torch.Tensor | None = None, epilogue: Epilogue = Epilogue(),
               block_scales: BlockScales | None = None,
               input_precision: str = "ieee") -> tuple[list[KernelCall], tuple]:
    """The launches of ``c = epilogue(a @ b [, a @ b3])`` and the scratch tensors they use.

    :param a: ``[M, K]``, any strides.
    :param b: ``[K, N]``, any strides (row-major, or ``w.T`` of an nn.Linear weight ``w [N, K]``).
    :param c: ``[M, N]``, written.
    :param config: ``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K``, ``num_warps``, ``num_stages``; optional
        ``GROUP_M`` (default :data:`GROUP_M`), ``SPLIT_K`` (default 1; above 1 the products go to a float32
        workspace and a reduce applies the epilogue: not with ``b3`` or pre-activations), ``TMA``
        (default 1: the persistent tensor-descriptor kernel where :func:`takes_tma`, else the
        pointer kernel), ``FLATTEN`` (default 1: the persistent loop's tile and K loops
        software-pipelined as one), ``WARP_SPECIALIZE`` (default 0: the descriptor kernel's tile
        loop warp-specialised, and then not flattened; not with pre-activations: :func:`loop_flags`).
    :param profile: the device's: its architecture picks the kernel, its cores the persistent grid.
    :param b3: a second ``[K, N]`` operand (SwiGLU: ``c = silu(z) * z3``, ``z3`` from ``a @ b3``).
    :param epilogue: see :class:`Epilogue`.
    :param block_scales: see :class:`BlockScales` (fp8 ``a`` and ``b``; not with ``b3`` or the
        epilogue's scales): ``BLOCK_K`` and ``BLOCK_N`` must divide 128.
    :param input_precision: ``tl.dot``'s for float32 operands: ``"ieee"`` (exact) or ``"tf32"``.
    """
    (m, k), n = a.shape, b.shape[1]
    e = epilogue
    if e.activation not in ACTIVATIONS:
        raise ValueError(f"activation {e.activation!r} is none of {ACTIVATIONS}")
    swiglu = b3 is not None
    split_k = config.get("SPLIT_K", 1)
    if split_k > 1 and (swiglu or e.pre is not None or e.accumulate):
        raise ValueError("split-K takes no second operand, stores no pre-activations and does not accumulate")
    block_m, block_n, block_k = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    if (e.col_scale is not None or block_scales is not None) and swiglu:
        raise ValueError("column and block scales take no second operand")
    if block_scales is not None:
        if e.row_scale is not None or e.col_scale is not None:
            raise ValueError("block scales replace the epilogue's row and column scales")
        if SCALE_BLOCK.value % block_k or SCALE_BLOCK.value % block_n:
            raise ValueError(f"block scales need BLOCK_K and BLOCK_N dividing {SCALE_BLOCK.value} (one scale of "
                             f"each operand per K step), not {block_k} and {block_n}")
    flags = {
        "HAS_BIAS": e.bias is not None, "HAS_SCALE": e.row_scale is not None,
        "HAS_COL_SCALE": e.col_scale is not None, "ACTIVATION": e.activation, "ACT_GRAD": e.act_grad is not None,
    }
    tile = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": config.get("GROUP_M", GROUP_M),
            "SPLIT_K": split_k, "INPUT_PRECISION": input_precision,
            "num_warps": config["num_warps"], "num_stages": config["num_stages"]}
    # Absent tensors: any pointer the constexprs keep the kernel from reading.
    row_scale, col_scale = (block_scales.a, block_scales.b) if block_scales is not None else (e.row_scale, e.col_scale)
    b3_, pre, pre3, dc, bias, scale, col = (t if t is not None else c for t in (b3, e.pre, e.pre3, e.act_grad, e.bias,
                                                                                row_scale, col_scale))
    # The scales' strides: (row, K block) of a's and (column or column block, K block) of b's.
    stride_sm, stride_tn = _scale_stride(row_scale), _scale_stride(col_scale)
    stride_sk, stride_tk = (block_scales.a.stride(1), block_scales.b.stride(1)) if block_scales is not None else (0, 0)
    scale_strides = (stride_sm, stride_sk, stride_tn, stride_tk)
    if split_k > 1:
        # The products alone into the workspace; the reduce runs the epilogue.
        target = torch.empty(split_k, m, n, dtype=torch.float32, device=c.device)
        gemm_flags = {"HAS_BIAS": False, "HAS_SCALE": False, "HAS_COL_SCALE": False, "ACTIVATION": None,
                      "ACT_GRAD": False, "SWIGLU": False, "STORE_PRE": False, "ACCUMULATE": False}
        scratch: tuple = (target,)
    else:
        target, gemm_flags, scratch = c, {**flags, "SWIGLU": swiglu, "STORE_PRE": e.pre is not None,
                                          "ACCUMULATE": e.accumulate}, ()
    gemm_flags["BLOCK_SCALED"] = block_scales is not None
    tiles = cdiv(m, block_m) * cdiv(n, block_n)
    if config.get("TMA", 1) and takes_tma(profile, a, b, c, b3, e):
        ensure_allocator()
        # A config tuned for the plain product may not fit beside an epilogue's tiles (the
        # backward's act_grad): one pipeline stage less at a time until it does.
        def footprint(tiles: Config) -> int:
            return shared_memory_bytes(tiles, a.element_size(), second_operand=swiglu, act_grad=e.act_grad is not None,
                                       out_element_size=c.element_size())

        tile["num_stages"] = fit_stages({**config, **tile}, profile.shared_memory_per_program, footprint)["num_stages"]
        a_m_major, b_k_major = bool(transposed(a)), bool(transposed(b))
        stride_a = a.stride(1) if a_m_major else a.stride(0)
        stride_b = b.stride(1) if b_k_major else b.stride(0)
        stride_b3 = (b3_.stride(1) if b_k_major else b3_.stride(0)) if swiglu else stride_b
        gemm = KernelCall(gemm_tma_kernel, (min(tiles * split_k, profile.cores),), (
            a, b, b3_, target, pre, pre3, dc, bias, scale, col, m, n, k, stride_a, stride_b, stride_b3, c.stride(0),
            *scale_strides,
        ), {"A_M_MAJOR": a_m_major, "B_K_MAJOR": b_k_major, **tile,
            **loop_flags(config, e.pre is not None, a.element_size() == 1), **gemm_flags})
    else:
        stride_cm, stride_cn = (n, 1) if split_k > 1 else (c.stride(0), c.stride(1))
        gemm = KernelCall(gemm_kernel, (tiles, split_k), (
            a, b, b3_, target, pre, pre3, dc, bias, scale, col, m, n, k, a.stride(0), a.stride(1),
            b.stride(0), b.stride(1), b3_.stride(0), b3_.stride(1), stride_cm, stride_cn, *scale_strides,
        ), {**tile, **gemm_flags})
    if split_k == 1:
        return [gemm], scratch
    reduce = KernelCall(splitk_reduce_kernel, (cdiv(m, block_m), cdiv(n, block_n)), (
        target, c, dc, bias, scale, col, m, n, c.stride(0), c.stride(1), stride_sm, stride_tn,
    ), {"BLOCK_M": block_m, "BLOCK_N": block_n, "SPLIT_K": split_k, **flags, "num_warps": 4})
    return [gemm, reduce], scratch


# --- the prefill ffn -----------------------------------------------------------------------------

def swiglu_calls(a: torch.Tensor, w1: torch.Tensor | None, w3: torch.Tensor | None, rstd: torch.Tensor | None,
                 out: torch.Tensor, config: Config, profile: DeviceProfile, *, w13: torch.Tensor | None = None,
                 gate: torch.Tensor | None = None, up: torch.Tensor | None = None) -> list[KernelCall]:
    """The launch of the prefill ffn's GEMM pair, one kernel:
    ``out = silu(rstd[:, None] * (a @ w1.T)) * (rstd[:, None] * (a @ w3.T))``.

    :param a: ``[M, K]`` (the rows already multiplied by the norm weight ``rms_w``; with ``rstd``
        None, already normalised too), any strides.
    :param w1: ``[N, K]`` (nn.Linear layout), any strides; None with ``w13``.
    :param w3: ``[N, K]``, like ``w1``; None with ``w13``.
    :param rstd: ``[M]`` float32, each row's ``rsqrt(mean(x**2) + eps)``; None where ``a`` is
        normalised already (no row scale).
    :param out: ``[M, N]``, written.
    :param config: see :func:`gemm_calls` (``SPLIT_K`` must be 1: both products share the program).
    :param w13: ``[2N, K]``: rows ``0..N-1`` are w1, ``N..2N-1`` w3 (the halves are views, no copy).
    :param gate: ``[M, N]`` with ``out``'s strides, optional: receives ``rstd * (a @ w1.T)`` (for
        the backward); ``up`` (with ``gate``) receives ``rstd * (a @ w3.T)``.
    """
    if w13 is not None:
        n = w13.shape[0] // 2
        w1, w3 = w13[:n], w13[n:]
    if (gate is None) != (up is None):
        raise ValueError("gate and up are stored together or not at all")
    calls, _ = gemm_calls(a, w1.T, out, {**config, "SPLIT_K": 1}, profile, b3=w3.T,
                          epilogue=Epilogue(row_scale=rstd, pre=gate, pre3=up))
    return calls


def swiglu(a: torch.Tensor, w1: torch.Tensor | None, w3: torch.Tensor | None, rstd: torch.Tensor,
           config: Config, profile: DeviceProfile, *, w13: torch.Tensor | None = None,
           preactivations: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run :func:`swiglu_calls` on a new ``out [M, N]`` in ``a``'s dtype; with ``preactivations``
    returns ``(out, gate, up)``."""
    n = (w13.shape[0] // 2) if w13 is not None else w1.shape[0]
    new = lambda: torch.empty(a.shape[0], n, dtype=a.dtype, device=a.device)  # noqa: E731
    out = new()
    gate, up = (new(), new()) if preactivations else (None, None)
    LaunchPlan(calls=swiglu_calls(a, w1, w3, rstd, out, config, profile, w13=w13, gate=gate, up=up),
               result=out).run()
    return (out, gate, up) if preactivations else out
