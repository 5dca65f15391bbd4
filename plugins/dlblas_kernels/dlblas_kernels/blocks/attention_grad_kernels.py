"""attention_grad's kernels: the preprocess (``delta``, each query row's ``rowsum(out * dout)``), the
dk/dv kernel (a program per block of keys, the queries in steps) and the dq kernel (a program per
block of queries, the keys in steps), each loading its rows by pointer or through tensor
descriptors. What they compute is :mod:`dlblas_kernels.blocks.attention_grad`'s module doc, which
plans their launches.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dlblas_kernels.blocks.attention import key_bounds


@triton.jit
def attention_bwd_preprocess_kernel(
    out_ptr, do_ptr, lse_ptr, dlse_ptr, stats_ptr,
    SQ, HQ, STATS,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_dob, stride_dos, stride_doh, stride_dod,
    stride_lb, stride_lh, stride_ls,
    stride_dlb, stride_dlh, stride_dls,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, HAS_DLSE: tl.constexpr,
):
    """Rows ``BLOCK_M`` of one (batch, head): ``stats[0] = lse * log2(e)`` (``+inf`` where lse is
    ``-inf``) and ``stats[1] = delta = rowsum(dout * out) - dlse``, ``stats`` ``[2, B, Hq, Sq]``
    float32 (``STATS`` elements apart)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    bh = tl.program_id(1)
    b = (bh // HQ).to(tl.int64)
    h = bh % HQ
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < SQ
    mask = mask_m[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows = offs_m.to(tl.int64)[:, None]
    o = tl.load(out_ptr + b * stride_ob + h * stride_oh + rows * stride_os + offs_d[None, :] * stride_od,
                mask=mask, other=0.0)
    do = tl.load(do_ptr + b * stride_dob + h * stride_doh + rows * stride_dos + offs_d[None, :] * stride_dod,
                 mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    if HAS_DLSE:
        delta -= tl.load(dlse_ptr + b * stride_dlb + h * stride_dlh + offs_m * stride_dls, mask=mask_m,
                         other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + offs_m * stride_ls, mask=mask_m, other=0.0)
    lse2 = tl.where(lse == -float("inf"), float("inf"), lse * 1.4426950408889634)
    stats = stats_ptr + bh.to(tl.int64) * SQ + offs_m
    tl.store(stats, lse2, mask=mask_m)
    tl.store(stats + STATS, delta, mask=mask_m)


@triton.jit
def _rows_source(base, n_rows, stride_s, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                 TMA: tl.constexpr):
    """What :func:`_load_rows` reads ``[n_rows, HEAD_DIM]`` rows from (row ``r`` at ``base + r *
    stride_s``): with TMA a tensor descriptor of ``[BLOCK_R, BLOCK_D]`` blocks (the copy engine
    fills what lies past the end with zeros), else ``base`` itself."""
    if TMA:
        source = tl.make_tensor_descriptor(base, shape=[n_rows, HEAD_DIM], strides=[stride_s, 1],
                                           block_shape=[BLOCK_R, BLOCK_D])
    else:
        source = base
    return source


@triton.jit
def _load_rows(source, row, n_rows, offs_r, offs_d, mask_d, stride_s, stride_d, TMA: tl.constexpr):
    """Rows ``row + offs_r`` (``[BLOCK_R, BLOCK_D]``) of a ``[n_rows, HEAD_DIM]`` matrix, zeros past
    its end (``source`` from :func:`_rows_source`)."""
    if TMA:
        tile = source.load([row, 0])
    else:
        mask = (row + offs_r < n_rows)[:, None] & mask_d[None, :]
        # 64-bit row offset: row * stride may pass 2**31 elements.
        ptrs = source + tl.cast(row, tl.int64) * stride_s + offs_r[:, None] * stride_s + offs_d[None, :] * stride_d
        tile = tl.load(ptrs, mask=mask, other=0.0)
    return tile


@triton.jit
def _dkdv_steps(
    dk, dv, k, v, q_src, do_src, lse2_ptr, delta_ptr,
    start, steps, SQ, SK, qk_scale, offs_n, offs_d, mask_d, key_seen,
    stride_qs, stride_qd, stride_dos, stride_dod,
    BLOCK_M: tl.constexpr, MASK: tl.constexpr, INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr,
    PADDED: tl.constexpr = False,
):
    """``steps`` query blocks of one head from row ``start``, added into ``dk`` and ``dv`` (unscaled
    ``dS^T q`` and ``P^T dout``); MASK applies the causal mask, PADDED the key padding (``key_seen``,
    ``[BLOCK_N]``: which of the program's keys its batch sees). ``q_src``, ``do_src``: the head's
    rows (:func:`_rows_source`); ``lse2_ptr``, ``delta_ptr``: its stats."""
    offs_r = tl.arange(0, BLOCK_M)
    off = SK - SQ
    for i in range(steps):
        row = start + i * BLOCK_M
        offs_m = row + offs_r
        q = _load_rows(q_src, row, SQ, offs_r, offs_d, mask_d, stride_qs, stride_qd, TMA)
        # Rows past the end (and rows without keys) have lse2 = +inf: P = 0 there.
        lse2 = tl.load(lse2_ptr + offs_m, mask=offs_m < SQ, other=float("inf"))
        s_t = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION)
        p_t = tl.math.exp2(s_t * qk_scale - lse2[None, :])
        if MASK:
            p_t = tl.where(offs_n[:, None] <= offs_m[None, :] + off, p_t, 0.0)
        if PADDED:
            p_t = tl.where(key_seen[:, None], p_t, 0.0)
        do = _load_rows(do_src, row, SQ, offs_r, offs_d, mask_d, stride_dos, stride_dod, TMA)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=INPUT_PRECISION)
        delta = tl.load(delta_ptr + offs_m, mask=offs_m < SQ, other=0.0)
        dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=INPUT_PRECISION)
    return dk, dv


@triton.jit
def attention_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, stats_ptr, dk_ptr, dv_ptr, kv_start_ptr, kv_end_ptr,
    SQ, SK, HQ, HK, STATS, qk_scale, scale,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_dob, stride_dos, stride_doh, stride_dod,
    stride_dkb, stride_dks, stride_dkh, stride_dkd,
    stride_dvb, stride_dvs, stride_dvh, stride_dvd,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr,
    KV_START: tl.constexpr = False, KV_END: tl.constexpr = False,
):
    """``dk`` and ``dv`` of keys ``BLOCK_N * program_id(0) ...`` of kv head ``program_id(1) % HK``
    of batch ``program_id(1) // HK``, over every query head of the group (``qk_scale`` is
    ``scale * log2(e)``). TMA: q and dout tiles through tensor descriptors. KV_START, KV_END: the
    batch sees only keys ``kv_start[b] <= j < kv_end[b]``; the others get zero gradients, and a
    block with none seen walks no query."""
    n0 = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    b = (bh // HK).to(tl.int64)
    hk = bh % HK
    group = HQ // HK
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    offs_r = tl.arange(0, BLOCK_N)
    v = _load_rows(v_ptr + b * stride_vb + hk * stride_vh, n0, SK, offs_r, offs_d, mask_d, stride_vs, stride_vd, False)

    # Causal: query i sees key j when j <= i + SK - SQ. The queries from m_lo see part of the
    # block; from m_mid = m_lo + masked * BLOCK_M on they see all of it.
    if CAUSAL:
        m_lo = tl.minimum(tl.maximum(n0 - (SK - SQ), 0), SQ)
        masked_end = tl.minimum(tl.maximum(n0 + BLOCK_N - 1 - (SK - SQ), m_lo), SQ)
        masked = tl.cdiv(masked_end - m_lo, BLOCK_M)
    else:
        m_lo = n0 * 0
        masked = 0
    m_mid = m_lo + masked * BLOCK_M
    unmasked = tl.cdiv(tl.maximum(SQ - m_mid, 0), BLOCK_M)
    PADDED: tl.constexpr = KV_START or KV_END
    key_seen = offs_n < SK
    if KV_START:
        key_seen = key_seen & (offs_n >= tl.load(kv_start_ptr + b))
    if KV_END:
        key_seen = key_seen & (offs_n < tl.load(kv_end_ptr + b))
    if PADDED:
        any_seen = tl.max(key_seen.to(tl.int32), 0) > 0
        masked = tl.where(any_seen, masked, 0)
        unmasked = tl.where(any_seen, unmasked, 0)

    k = _load_rows(k_ptr + b * stride_kb + hk * stride_kh, n0, SK, offs_r, offs_d, mask_d, stride_ks, stride_kd, False)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for g in range(group):
        h = hk * group + g
        q_src = _rows_source(q_ptr + b * stride_qb + h * stride_qh, SQ, stride_qs, HEAD_DIM, BLOCK_M, BLOCK_D, TMA)
        do_src = _rows_source(do_ptr + b * stride_dob + h * stride_doh, SQ, stride_dos, HEAD_DIM, BLOCK_M, BLOCK_D,
                              TMA)
        lse2_ptr = stats_ptr + (b * HQ + h) * SQ
        if CAUSAL:
            dk, dv = _dkdv_steps(dk, dv, k, v, q_src, do_src, lse2_ptr, lse2_ptr + STATS,
                                 m_lo, masked, SQ, SK, qk_scale, offs_n, offs_d, mask_d, key_seen,
                                 stride_qs, stride_qd, stride_dos, stride_dod, BLOCK_M, True, INPUT_PRECISION, TMA,
                                 PADDED)
        dk, dv = _dkdv_steps(dk, dv, k, v, q_src, do_src, lse2_ptr, lse2_ptr + STATS,
                             m_mid, unmasked, SQ, SK, qk_scale, offs_n, offs_d, mask_d, key_seen,
                             stride_qs, stride_qd, stride_dos, stride_dod, BLOCK_M, False, INPUT_PRECISION, TMA,
                             PADDED)

    dk *= scale
    rows = offs_n.to(tl.int64)[:, None]
    mask_n = (offs_n < SK)[:, None] & mask_d[None, :]
    tl.store(dk_ptr + b * stride_dkb + hk * stride_dkh + rows * stride_dks + offs_d[None, :] * stride_dkd,
             dk.to(dk_ptr.dtype.element_ty), mask=mask_n)
    tl.store(dv_ptr + b * stride_dvb + hk * stride_dvh + rows * stride_dvs + offs_d[None, :] * stride_dvd,
             dv.to(dv_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _dq_steps(
    dq, q, do, lse2, delta, k_src, v_src,
    start, steps, SQ, SK, qk_scale, offs_m, offs_d, mask_d, kv_lo, kv_hi,
    stride_ks, stride_kd, stride_vs, stride_vd,
    BLOCK_N: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    TMA: tl.constexpr, PADDED: tl.constexpr = False,
):
    """``steps`` key blocks from key ``start``, added into ``dq`` (unscaled ``dS k``); MASK applies
    the causal mask (CAUSAL) or the end of the keys; PADDED, the keys outside ``[kv_lo, kv_hi)``
    too. ``k_src``, ``v_src``: the kv head's rows (:func:`_rows_source`)."""
    offs_r = tl.arange(0, BLOCK_N)
    off = SK - SQ
    for i in range(steps):
        col = start + i * BLOCK_N
        offs_n = col + offs_r
        k = _load_rows(k_src, col, SK, offs_r, offs_d, mask_d, stride_ks, stride_kd, TMA)
        v = _load_rows(v_src, col, SK, offs_r, offs_d, mask_d, stride_vs, stride_vd, TMA)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
        p = tl.math.exp2(s * qk_scale - lse2[:, None])
        if MASK:
            if CAUSAL:
                p = tl.where(offs_n[None, :] <= offs_m[:, None] + off, p, 0.0)
            else:
                p = tl.where((offs_n < SK)[None, :], p, 0.0)
        if PADDED:
            p = tl.where(((offs_n >= kv_lo) & (offs_n < kv_hi))[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=INPUT_PRECISION)
    return dq


@triton.jit
def attention_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, stats_ptr, dq_ptr, kv_start_ptr, kv_end_ptr,
    SQ, SK, HQ, HK, STATS, qk_scale, scale,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_dob, stride_dos, stride_doh, stride_dod,
    stride_dqb, stride_dqs, stride_dqh, stride_dqd,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr,
    KV_START: tl.constexpr = False, KV_END: tl.constexpr = False,
):
    """``dq`` of one block of ``BLOCK_M`` queries of head ``program_id(1) % HQ`` of batch
    ``program_id(1) // HQ``; program 0 takes the last block. TMA: k and v tiles through tensor
    descriptors. KV_START, KV_END: the batch sees only keys ``kv_start[b] <= j < kv_end[b]``: the
    key blocks from the one holding ``kv_start[b]`` to ``kv_end[b]``, all masked."""
    m0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    bh = tl.program_id(1)
    b = (bh // HQ).to(tl.int64)
    h = bh % HQ
    hk = h // (HQ // HK)
    offs_r = tl.arange(0, BLOCK_M)
    offs_m = m0 + offs_r
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q_base = q_ptr + b * stride_qb + h * stride_qh
    do = _load_rows(do_ptr + b * stride_dob + h * stride_doh, m0, SQ, offs_r, offs_d, mask_d, stride_dos, stride_dod,
                    False)
    stats = stats_ptr + bh.to(tl.int64) * SQ + offs_m
    lse2 = tl.load(stats, mask=offs_m < SQ, other=float("inf"))
    delta = tl.load(stats + STATS, mask=offs_m < SQ, other=0.0)

    # Keys below `full * BLOCK_N` are seen by every row of the block; the blocks up to `masked_end`
    # are masked (the causal diagonal, or the ragged end of the keys).
    if CAUSAL:
        full = tl.minimum(tl.maximum(m0 + (SK - SQ) + 1, 0), SK) // BLOCK_N
        masked_end = tl.minimum(tl.maximum(m0 + BLOCK_M + (SK - SQ), 0), SK)
    else:
        full = SK // BLOCK_N
        masked_end = SK
    masked = tl.cdiv(tl.maximum(masked_end - full * BLOCK_N, 0), BLOCK_N)
    lo, hi = key_bounds(kv_start_ptr, kv_end_ptr, b, SK, KV_START, KV_END)
    PADDED: tl.constexpr = KV_START or KV_END
    if PADDED:
        # One masked walk over the key blocks from lo's to min(masked_end, hi).
        full = lo // BLOCK_N
        masked = tl.cdiv(tl.maximum(tl.minimum(masked_end, hi) - full * BLOCK_N, 0), BLOCK_N)
    k_src = _rows_source(k_ptr + b * stride_kb + hk * stride_kh, SK, stride_ks, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
    v_src = _rows_source(v_ptr + b * stride_vb + hk * stride_vh, SK, stride_vs, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
    q = _load_rows(q_base, m0, SQ, offs_r, offs_d, mask_d, stride_qs, stride_qd, False)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if not PADDED:
        dq = _dq_steps(dq, q, do, lse2, delta, k_src, v_src, 0, full, SQ, SK, qk_scale,
                       offs_m, offs_d, mask_d, lo, hi, stride_ks, stride_kd, stride_vs, stride_vd,
                       BLOCK_N, False, CAUSAL, INPUT_PRECISION, TMA)
    dq = _dq_steps(dq, q, do, lse2, delta, k_src, v_src, full * BLOCK_N, masked, SQ, SK,
                   qk_scale, offs_m, offs_d, mask_d, lo, hi, stride_ks, stride_kd, stride_vs, stride_vd,
                   BLOCK_N, True, CAUSAL, INPUT_PRECISION, TMA, PADDED)

    dq *= scale
    rows = offs_m.to(tl.int64)[:, None]
    tl.store(dq_ptr + b * stride_dqb + h * stride_dqh + rows * stride_dqs + offs_d[None, :] * stride_dqd,
             dq.to(dq_ptr.dtype.element_ty), mask=(offs_m < SQ)[:, None] & mask_d[None, :])
