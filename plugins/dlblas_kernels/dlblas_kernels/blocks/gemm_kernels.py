"""The GEMM building block's Triton code: the tile order, the K loops (pointer and blockwise-scaled),
the epilogue and its store, and the three kernels (pointers, split-K reduce, persistent tensor
descriptors). :mod:`dlblas_kernels.blocks.gemm` describes them (its module doc) and turns operands
and a config into their launches; it re-exports every name here.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: the K extent (and b's N extent) one blockwise scale covers: DeepSeek-V3's 1x128 / 128x128 blocks
SCALE_BLOCK = tl.constexpr(128)


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
def block_scaled_dot(acc, a, b, a_scale_ptrs, b_scale_ptr, mask_m, k, stride_sk, stride_tk, stride_tn, n_left):
    """``acc + (a @ b) * a_scale[m, kb] * b_scale[n // 128, kb]`` for the K step at ``k`` (in block
    ``kb = k // 128``): the step's product summed on its own, then scaled and added in float32
    (DeepSeek-V3's fp8 recipe: the tensor cores' partial sums are promoted every K block).
    ``a_scale_ptrs``: the ``[BLOCK_M]`` row scales of K block 0 (``stride_sk`` apart per block);
    ``b_scale_ptr``: the scale of the tile's first column block at K block 0 (``stride_tk`` apart
    per K block, ``stride_tn`` per column block). A tile of 256 columns spans two column blocks:
    two scalar loads, the second masked off where fewer than ``n_left`` > 128 columns remain."""
    kb = k // SCALE_BLOCK
    a_scale = tl.load(a_scale_ptrs + kb * stride_sk, mask=mask_m, other=0.0)
    b_scale = tl.load(b_scale_ptr + kb * stride_tk)
    if b.shape[1] > SCALE_BLOCK:
        b_scale2 = tl.load(b_scale_ptr + stride_tn + kb * stride_tk, mask=n_left > SCALE_BLOCK, other=0.0)
        cols = tl.where(tl.arange(0, b.shape[1]) < SCALE_BLOCK, b_scale, b_scale2)
        return acc + tl.dot(a, b) * (a_scale[:, None] * cols[None, :])
    return acc + tl.dot(a, b) * (a_scale[:, None] * b_scale)


@triton.jit
def dot_range(acc, a_ptrs, b_ptrs, mask_m, mask_n, offs_k, k_start, k_end, stride_ak, stride_bk,
              BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
              a_scale_ptrs=None, b_scale_ptr=None, stride_sk=0, stride_tk=0, stride_tn=0, n_left=0,
              BLOCK_SCALED: tl.constexpr = False):
    """``acc`` plus the product of ``a``'s K range ``[k_start, k_end)`` with ``b``'s, loaded by pointers
    (``a_ptrs``: the ``[BLOCK_M, BLOCK_K]`` tile at ``k_start``, ``b_ptrs`` the ``[BLOCK_K, BLOCK_N]``
    one; the K strides 64-bit). Masked-off elements load as 0, so a ragged last slice adds nothing.
    BLOCK_SCALED: each step's product scaled by its K block's scales (:func:`block_scaled_dot`;
    BLOCK_K divides 128, so a step lies in one block; ``n_left`` columns from the tile's first)."""
    for k in range(k_start, k_end, BLOCK_K):
        mask_k = offs_k < k_end - k
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if BLOCK_SCALED:
            acc = block_scaled_dot(acc, a, b, a_scale_ptrs, b_scale_ptr, mask_m, k, stride_sk, stride_tk,
                                   stride_tn, n_left)
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
                        col_scale_ptr + (pid_n * BLOCK_N // SCALE_BLOCK) * stride_tn, stride_sk, stride_tk,
                        stride_tn, N - pid_n * BLOCK_N, True)
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
    128, so a step lies in one K block, and BLOCK_N divides 128 or is 256 (two column blocks)."""
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
                acc = block_scaled_dot(acc, a, b, a_scale_ptrs, b_scale_ptr, scale_m < M, off_k, stride_sk, stride_tk,
                                       stride_tn, N - off_n)
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
