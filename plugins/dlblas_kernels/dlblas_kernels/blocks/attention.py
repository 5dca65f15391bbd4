"""The attention block, forward (prefill): flash attention 2 over ``[B, S, H, D]`` tensors.

    out[b, i, h] = sum_j softmax_j(scale * q[b, i, h] . k[b, j, g]) v[b, j, g]       g = h // (Hq / Hk)
    lse[b, h, i] = log sum_j exp(scale * q[b, i, h] . k[b, j, g])

over the keys ``j`` query ``i`` sees: all of them, or with ``causal`` those with
``j <= i + Sk - Sq`` (the mask aligned bottom-right, flash-attn 2.1's convention: decoding with a
KV cache is ``Sq = 1`` against ``Sk = n``). A row that sees no key (causal, ``Sq > Sk``) gets
``out = 0`` and ``lse = -inf``.

One program per block of ``BLOCK_M`` query rows of one (batch, head), walking the key blocks with
the online softmax (float32): a running row maximum ``m`` and sum ``l``, the accumulator rescaled by
``exp(m_old - m_new)`` whenever the maximum grows, divided by ``l`` once at the end. Scores are
kept in base 2: ``scale * log2(e)`` multiplies ``q . k`` in one fused multiply-add with the
maximum's subtraction, and ``exp2`` is the hardware's exponential; ``lse`` is converted back to the
natural log on the way out.

The key blocks come in two loops: first the blocks every row of the program sees whole (no mask at
all: no compare, no select), then the few the causal diagonal or the ragged end of the keys cuts
(masked). Blocks wholly above the diagonal are never loaded. Causal programs are ordered longest
first (the query blocks at the bottom see the most keys), so the short ones fill the tail of the
grid; non-causal programs sweep one head's query blocks together, which then share its K and V
tiles in L2.

Tiles are loaded through tensor descriptors (the copy engine, ``TMA``) on Hopper when every stride
suits it (unit D stride, 16-byte aligned base and strides), otherwise by masked pointer loads of
any strides (q, k and v sliced from a packed qkv projection, the interpreter, pre-Hopper chips).
``D`` need not be a power of two (96, 192): tiles are ``BLOCK_D = next_power_of_2(D)`` wide, the
extra columns masked (pointers) or zero-filled (descriptors), which adds nothing to ``q . k`` and
is never stored.

``ROTARY`` applies :mod:`apply_rotary_pos_emb <dlblas_kernels.kernels.apply_rotary_pos_emb>`'s
rotation to the q tile and to each k tile after loading (the rotated q and k never reach memory):
``x' = x * cos + rotate(x) * sin`` on the pairs of each head (rotate-half pairs ``(i, i + D/2)``,
interleaved pairs ``(2i, 2i + 1)``), query row ``i`` at position ``Sk - Sq + i`` and key ``j`` at
``j`` of the ``cos`` and ``sin`` tables (``[Sk, D]`` or ``[B, Sk, D]``, any strides). The tiles are
then held as their two pair halves ``(a, b)``, each ``D/2`` wide, and ``q . k = q_a . k_a + q_b . k_b``
is two products: the rotation needs no shuffle across the tile. The rotated tiles are rounded to
the input dtype before the products, as the unfused rotary kernel's output is. The q tile is
rotated once per program (pointer loads); the k tiles and their cos and sin rows come through
descriptors on Hopper as the plain kernel's do (a descriptor per pair half, or whole interleaved
rows split into their even and odd lanes), and are pipelined with v: each stage holds a k, cos,
sin and v tile, so the rotary kernel takes 2 stages of 128 x 128 blocks where the plain one takes 3
(:func:`shared_memory_bytes`).

``WARP_SPECIALIZE`` (a config's, default off; descriptor loads, no rotary) runs the key blocks in one
warp-specialised loop: Triton (3.6 and 3.9, sm_90, 4-warp programs of 128 query rows) gives the
program a producer partition issuing the copies and two consumer warpgroups of 64 query rows
each, so that one's softmax runs while the other's products do (FlashAttention-3's ping-pong).
Triton specialises one loop a kernel and no loop holding a branch (a second loop fails to compile,
a branch in the loop leaves it unspecialised), so that loop masks every block, the unmasked ones
included (a compare and a select per score), and the rotary kernel, whose loop does not compile
specialised, keeps its two loops. On sm_90 with Triton 3.6.0 the specialised program gives wrong
outputs at S 8192 (NaN, or a relative error of 0.19 under the causal mask) and no speed over the
plain loops, so flash_attention_v2's search space leaves it out (its ``space`` says what was
measured); the flag stays for sweeps on later Triton releases.

Precision: float16 / bfloat16 products on the tensor cores with float32 accumulation; float32
inputs exact (``input_precision="ieee"``), the path the interpreter tests take.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dlblas_kernels.blocks.attention_rotary import load_rows, pair_sources, rotated_pairs, rotated_tiles
from dlblas_kernels.blocks.gemm import TMA_ALIGNMENT, TMA_ARCHS, fit_stages
from dlblas_kernels.blocks.npu import on_npu
from dlcore.api import Config, DeviceProfile, KernelCall, cdiv, ensure_allocator, next_power_of_2

LOG2E = 1.4426950408889634
#: tl.dot's smallest reduction: narrower heads (and pair halves) are padded to it
MIN_DOT_K = 16


@triton.jit
def _attend(acc, l_i, m_i, q, q_b, start, end,
            k_src, k_src2, v_src, cos_src, cos_src2, sin_src, sin_src2, offs_m, offs_n, offs_d, p,
            SK, diagonal, qk_scale, kv_lo, kv_hi,
            stride_ks, stride_kd, stride_vs, stride_vd,
            stride_cos_s, stride_cos_d, stride_sin_s, stride_sin_d,
            HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
            MASKED: tl.constexpr, CAUSAL: tl.constexpr, ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr,
            TMA: tl.constexpr, INPUT_PRECISION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr = False,
            PADDED: tl.constexpr = False):
    """The online softmax over key blocks ``start, start + BLOCK_N, ... < end``: ``(acc, l, m)``
    updated, ``m`` in base 2. MASKED: scores of keys past SK (PADDED: of keys outside ``[kv_lo,
    kv_hi)``), and with CAUSAL of keys past the diagonal (key ``j`` > row ``i + diagonal``), are
    -inf; otherwise every score counts. With TMA
    the ``*_src`` are tensor descriptors (:func:`pair_sources` for the rotary ones: ``k_src2``,
    ``cos_src2``, ``sin_src2`` the second pair halves), otherwise base pointers. WARP_SPECIALIZE:
    the loop warp-specialised (a producer partition for the copies, two consumer warpgroups)."""
    d_mask = offs_d < HEAD_DIM
    for n in tl.range(start, end, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        n = tl.multiple_of(n, BLOCK_N)
        keys = n + offs_n
        if PADDED:
            key_mask = (keys >= kv_lo) & (keys < kv_hi)
        else:
            key_mask = keys < SK
        if ROTARY:
            if TMA:
                k_a, k_b = rotated_tiles(k_src, k_src2, cos_src, cos_src2, sin_src, sin_src2, n, n,
                                          BLOCK_N, BLOCK_P, INTERLEAVED)
            else:
                k_a, k_b = rotated_pairs(k_src, keys, key_mask, keys, cos_src, sin_src, p, stride_ks, stride_kd,
                                          stride_cos_s, stride_cos_d, stride_sin_s, stride_sin_d, HEAD_DIM,
                                          INTERLEAVED)
            s = tl.dot(q, tl.trans(k_a), input_precision=INPUT_PRECISION)
            s = tl.dot(q_b, tl.trans(k_b), s, input_precision=INPUT_PRECISION)
        else:
            if TMA:
                k = k_src.load([n, 0])
            else:
                k = load_rows(k_src, keys, key_mask, offs_d, d_mask, stride_ks, stride_kd)
            s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
        if MASKED:
            keep = key_mask[None, :]
            if CAUSAL:
                keep = keep & (keys[None, :] <= offs_m[:, None] + diagonal)
            s = tl.where(keep, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row with no key seen yet keeps m = -inf: subtract 0 instead, exp2(-inf) = 0.
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s - m_sub[:, None]
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            m_sub = m_new
            s = s * qk_scale - m_sub[:, None]
        prob = tl.math.exp2(s)
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(prob, 1)
        acc = acc * alpha[:, None]
        if TMA:
            v = v_src.load([n, 0])
        else:
            v = load_rows(v_src, keys, key_mask, offs_d, d_mask, stride_vs, stride_vd)
        acc = tl.dot(prob.to(v.dtype), v, acc, input_precision=INPUT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def key_bounds(kv_start_ptr, kv_end_ptr, b, SK, KV_START: tl.constexpr, KV_END: tl.constexpr):
    """Batch ``b``'s keys ``[lo, hi)`` under key padding, clamped to ``[0, SK]`` so that bounds out of
    range read nothing out of bounds; ``(0, SK)`` without it."""
    lo = 0
    hi = SK
    if KV_START:
        lo = tl.minimum(tl.maximum(tl.load(kv_start_ptr + b), 0), SK)
    if KV_END:
        hi = tl.maximum(tl.minimum(tl.load(kv_end_ptr + b), SK), 0)
    return lo, hi


@triton.jit
def attention_forward_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, cos_ptr, sin_ptr, kv_start_ptr, kv_end_ptr,
    SQ, SK, HQ, GROUP, qk_scale,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ob, stride_os, stride_oh,
    stride_cos_b, stride_cos_s, stride_cos_d,
    stride_sin_b, stride_sin_s, stride_sin_d,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr, CAUSAL: tl.constexpr, ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr,
    TMA: tl.constexpr, INPUT_PRECISION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    KV_START: tl.constexpr = False, KV_END: tl.constexpr = False,
):
    """``BLOCK_M`` query rows of one (batch, query head) per program, over a 1-D grid (see the
    module doc for the order). ``qk_scale`` is ``scale * log2(e)``; query head ``h`` reads kv head
    ``h // GROUP``; ``out`` has a unit D stride; ``lse`` is ``[B, HQ, SQ]`` contiguous. BLOCK_P is
    the width of a rotary pair half (ROTARY only). WARP_SPECIALIZE: one warp-specialised loop over
    every key block, each masked (see the module doc). KV_START, KV_END: batch ``b`` sees only
    the keys ``kv_start[b] <= j < kv_end[b]`` (int32 ``[B]``, contiguous; key padding)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(SQ, BLOCK_M)
    heads = tl.num_programs(0) // num_m
    if CAUSAL:
        # Longest first: the bottom query blocks of every head, then the next ones up.
        pid_m = num_m - 1 - pid // heads
        pid_bh = pid % heads
    else:
        pid_m = pid % num_m
        pid_bh = pid // num_m
    b = (pid_bh // HQ).to(tl.int64)
    h = pid_bh % HQ
    hk = (h // GROUP).to(tl.int64)
    h = h.to(tl.int64)
    m0 = pid_m * BLOCK_M
    q_base = q_ptr + b * stride_qb + h * stride_qh
    k_base = k_ptr + b * stride_kb + hk * stride_kh
    v_base = v_ptr + b * stride_vb + hk * stride_vh
    out_base = out_ptr + b * stride_ob + h * stride_oh

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    p = tl.arange(0, BLOCK_P)
    row_mask = offs_m < SQ
    diagonal = SK - SQ

    cos_base = cos_ptr + b * stride_cos_b
    sin_base = sin_ptr + b * stride_sin_b
    if ROTARY:
        q, q_b = rotated_pairs(q_base, offs_m, row_mask, offs_m + diagonal, cos_base, sin_base, p,
                                stride_qs, stride_qd, stride_cos_s, stride_cos_d, stride_sin_s, stride_sin_d,
                                HEAD_DIM, INTERLEAVED)
    else:
        q_b = 0
        if TMA:
            q_desc = tl.make_tensor_descriptor(q_base, shape=[SQ, HEAD_DIM], strides=[stride_qs, 1],
                                               block_shape=[BLOCK_M, BLOCK_D])
            q = q_desc.load([m0, 0])
        else:
            q = load_rows(q_base, offs_m, row_mask, offs_d, offs_d < HEAD_DIM, stride_qs, stride_qd)
    if TMA:
        if ROTARY:
            k_src, k_src2 = pair_sources(k_base, SK, stride_ks, HEAD_DIM, BLOCK_N, BLOCK_D, BLOCK_P, INTERLEAVED)
            cos_src, cos_src2 = pair_sources(cos_base, SK, stride_cos_s, HEAD_DIM, BLOCK_N, BLOCK_D, BLOCK_P,
                                              INTERLEAVED)
            sin_src, sin_src2 = pair_sources(sin_base, SK, stride_sin_s, HEAD_DIM, BLOCK_N, BLOCK_D, BLOCK_P,
                                              INTERLEAVED)
        else:
            k_src = tl.make_tensor_descriptor(k_base, shape=[SK, HEAD_DIM], strides=[stride_ks, 1],
                                              block_shape=[BLOCK_N, BLOCK_D])
            k_src2 = k_src
            cos_src, cos_src2, sin_src, sin_src2 = cos_base, cos_base, sin_base, sin_base
        v_src = tl.make_tensor_descriptor(v_base, shape=[SK, HEAD_DIM], strides=[stride_vs, 1],
                                          block_shape=[BLOCK_N, BLOCK_D])
    else:
        k_src, k_src2 = k_base, k_base
        cos_src, cos_src2, sin_src, sin_src2 = cos_base, cos_base, sin_base, sin_base
        v_src = v_base

    # Keys [0, full) are seen whole by every row of the block; [full, end) are cut by the causal
    # diagonal or by SK; beyond end no row sees any.
    if CAUSAL:
        end = tl.minimum(SK, tl.minimum(m0 + BLOCK_M, SQ) + diagonal)
        full = tl.maximum(tl.minimum(m0 + 1 + diagonal, SK), 0) // BLOCK_N * BLOCK_N
    else:
        end = SK
        full = SK // BLOCK_N * BLOCK_N

    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    # Key padding: batch b's keys are [lo, hi) (clamped to [0, SK]: out-of-range bounds read nothing
    # out of bounds). The blocks run [first, full_lo) masked (the one cut by lo), [full_lo, full_hi)
    # whole, [full_hi, end) masked (cut by hi, the diagonal or SK).
    lo, hi = key_bounds(kv_start_ptr, kv_end_ptr, b, SK, KV_START, KV_END)
    PADDED: tl.constexpr = KV_START or KV_END
    first = 0
    if PADDED:
        end = tl.minimum(end, hi)
        first = lo // BLOCK_N * BLOCK_N
        full_lo = tl.minimum(tl.cdiv(lo, BLOCK_N) * BLOCK_N, end)
        full = tl.maximum(tl.minimum(full, hi // BLOCK_N * BLOCK_N), full_lo)
    if WARP_SPECIALIZE:
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, q_b, first, end, k_src, k_src2, v_src, cos_src, cos_src2,
                                sin_src, sin_src2, offs_m, offs_n, offs_d, p, SK, diagonal, qk_scale, lo, hi,
                                stride_ks, stride_kd, stride_vs, stride_vd,
                                stride_cos_s, stride_cos_d, stride_sin_s, stride_sin_d,
                                HEAD_DIM, BLOCK_N, BLOCK_D, BLOCK_P, True, CAUSAL, ROTARY, INTERLEAVED, TMA,
                                INPUT_PRECISION, True, PADDED)
    else:
        if PADDED:
            acc, l_i, m_i = _attend(acc, l_i, m_i, q, q_b, first, full_lo, k_src, k_src2, v_src, cos_src, cos_src2,
                                    sin_src, sin_src2, offs_m, offs_n, offs_d, p, SK, diagonal, qk_scale, lo, hi,
                                    stride_ks, stride_kd, stride_vs, stride_vd,
                                    stride_cos_s, stride_cos_d, stride_sin_s, stride_sin_d,
                                    HEAD_DIM, BLOCK_N, BLOCK_D, BLOCK_P, True, CAUSAL, ROTARY, INTERLEAVED, TMA,
                                    INPUT_PRECISION, False, True)
            first = full_lo
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, q_b, first, full, k_src, k_src2, v_src, cos_src, cos_src2,
                                sin_src, sin_src2, offs_m, offs_n, offs_d, p, SK, diagonal, qk_scale, lo, hi,
                                stride_ks, stride_kd, stride_vs, stride_vd,
                                stride_cos_s, stride_cos_d, stride_sin_s, stride_sin_d,
                                HEAD_DIM, BLOCK_N, BLOCK_D, BLOCK_P, False, CAUSAL, ROTARY, INTERLEAVED, TMA,
                                INPUT_PRECISION, False, PADDED)
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, q_b, full, end, k_src, k_src2, v_src, cos_src, cos_src2,
                                sin_src, sin_src2, offs_m, offs_n, offs_d, p, SK, diagonal, qk_scale, lo, hi,
                                stride_ks, stride_kd, stride_vs, stride_vd,
                                stride_cos_s, stride_cos_d, stride_sin_s, stride_sin_d,
                                HEAD_DIM, BLOCK_N, BLOCK_D, BLOCK_P, True, CAUSAL, ROTARY, INTERLEAVED, TMA,
                                INPUT_PRECISION, False, PADDED)

    # Rows that saw no key: l = 0, acc = 0 -> out 0, lse -inf.
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc * (1.0 / l_safe)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) / 1.4426950408889634, float("-inf"))
    tl.store(lse_ptr + pid_bh.to(tl.int64) * SQ + offs_m, lse, mask=row_mask)
    if TMA:
        out_desc = tl.make_tensor_descriptor(out_base, shape=[SQ, HEAD_DIM], strides=[stride_os, 1],
                                             block_shape=[BLOCK_M, BLOCK_D])
        out_desc.store([m0, 0], out.to(out_desc.dtype))
    else:
        o_ptrs = out_base + offs_m[:, None] * stride_os + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & (offs_d < HEAD_DIM)[None, :])


FORWARD_KERNELS = (attention_forward_kernel,)


# --- host side -----------------------------------------------------------------------------------

def _descriptor_ready(t: torch.Tensor) -> bool:
    """The copy engine can read ``t [B, S, H, D]`` row by row: unit D stride, base and every other
    stride 16-byte aligned."""
    size = t.element_size()
    return (t.stride(3) == 1 and t.data_ptr() % TMA_ALIGNMENT == 0
            and all((s * size) % TMA_ALIGNMENT == 0 for s in t.stride()[:3]))


def takes_tma(profile: DeviceProfile, *tensors: torch.Tensor) -> bool:
    """Whether the descriptor loads serve these ``[B, S, H, D]`` tensors on this device."""
    return profile.arch in TMA_ARCHS and all(_descriptor_ready(t) for t in tensors)


def tables_take_tma(cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, *rotated: torch.Tensor) -> bool:
    """Whether the rotary path's descriptors serve these tables and the ``rotated`` tensors (q, k,
    already found descriptor-ready): the tables of unit D stride, 16-byte aligned base and strides;
    rotate-half, each second half's start 16-byte aligned too (its own descriptor); interleaved, the
    whole-row tile split into pair halves as wide as the pointer path's (``block_d(D) / 2`` the pair
    tile's width)."""
    head_dim = cos.shape[-1]
    if interleaved:
        halves = block_d(head_dim) // 2 == max(next_power_of_2(head_dim // 2), MIN_DOT_K)
    else:
        halves = all(head_dim // 2 * t.element_size() % TMA_ALIGNMENT == 0 for t in (cos, sin, *rotated))
    return halves and all(
        t.stride(-1) == 1 and t.data_ptr() % TMA_ALIGNMENT == 0
        and all((s * t.element_size()) % TMA_ALIGNMENT == 0 for s in table_strides(t)[:2]) for t in (cos, sin))


def table_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """A rotary table's ``[B, S, D]`` strides, ``[S, D]`` broadcast over the batch (stride 0)."""
    return (0, *t.stride()) if t.dim() == 2 else tuple(t.stride())


def block_d(head_dim: int) -> int:
    """The tile width of a head: the next power of two, at least tl.dot's smallest reduction."""
    return max(next_power_of_2(head_dim), MIN_DOT_K)


def shared_memory_bytes(config: Config, head_dim: int, element_size: int, rotary: bool = False) -> int:
    """What one program takes of shared memory, as Triton 3.6 lays it out for sm_90 (read off
    compiled kernels, to within the 1 KiB of barriers), tiles ``block_d(D)`` wide: the q tile, and
    per pipeline stage a k and a v tile. With ``rotary``: the rotated q tile, a k, cos, sin and v
    tile per stage but the last (the loop's loads are consumed in registers, one stage less
    buffered), and two k tiles for the rotated k the products read (BLOCK_M 128, D 128, bfloat16:
    BLOCK_N 128 with 2 stages 229 408 bytes, BLOCK_N 64 with 3 stages 196 656, pointer loads or
    descriptors alike). Warp-specialised (``WARP_SPECIALIZE``, plain only): a second q tile (BLOCK_M
    128, D 128: BLOCK_N 128 with 2 stages 197 024 bytes, 3 stages 262 680)."""
    if rotary:
        block = config["BLOCK_M"] + (4 * max(config["num_stages"] - 1, 1) + 2) * config["BLOCK_N"]
    else:
        block = config["BLOCK_M"] + 2 * config["num_stages"] * config["BLOCK_N"]
        if config.get("WARP_SPECIALIZE", 0):  # the q tile twice (D 64, 128, 256: 16, 32, 64 KiB more)
            block += config["BLOCK_M"]
    return block * block_d(head_dim) * element_size


def fit(config: Config, head_dim: int, element_size: int, profile: DeviceProfile | None,
        rotary: bool = False) -> Config:
    """``config`` fitted to the device's shared memory (:func:`shared_memory_bytes`) for heads of
    ``head_dim`` elements of ``element_size`` bytes: pipelining stages dropped down to 2, then the
    key block halved down to 16, then the query block (no bound where the profile knows none).
    A new dict."""
    shared = profile.shared_memory_per_program if profile is not None else 0

    def footprint(c: Config) -> int:
        return shared_memory_bytes(c, head_dim, element_size, rotary)

    config = fit_stages(config, shared, footprint)
    for block in ("BLOCK_N", "BLOCK_M"):
        while shared and config[block] > MIN_DOT_K and footprint(config) > shared:
            config[block] //= 2
    return config


#: On npu the forward's tiles live in the AI core's unified buffer: the largest (query, key) blocks
#: bishengir-compile 1.2 fits in the 192 KiB of the Ascend 910B (A2 and A3 parts alike), by the
#: head's tile width (at most): without and with the causal mask, plain or rotary alike (bfloat16,
#: lowered at 32 to 128 rows of each; 128 x 128 causal asked 297984 bytes at D 64 and 330752 at D
#: 128, a 128-row block 198144 at D 256, 295552 with rotary).
NPU_BLOCKS = ((128, (128, 128), (128, 64)), (256, (64, 64), (64, 32)))


def fit_npu(config: Config, head_dim: int, causal: bool, profile: DeviceProfile | None) -> Config:
    """``config``'s blocks no larger than :data:`NPU_BLOCKS` allows on an npu; elsewhere ``config``."""
    if not on_npu(profile):
        return config
    width = block_d(head_dim)
    for widest, plain, masked in NPU_BLOCKS:
        if width <= widest:
            rows, keys = masked if causal else plain
            return {**config, "BLOCK_M": min(config["BLOCK_M"], rows), "BLOCK_N": min(config["BLOCK_N"], keys)}
    return config


def forward_calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, *,
                  causal: bool, scale: float, config: Config, profile: DeviceProfile,
                  rotary: tuple | None = None, kv_start: torch.Tensor | None = None,
                  kv_end: torch.Tensor | None = None) -> list[KernelCall]:
    """Prefill forward: writes ``out [B, Sq, Hq, D]`` (unit D stride) and ``lse [B, Hq, Sq]``
    (float32, contiguous) from q ``[B, Sq, Hq, D]`` and k, v ``[B, Sk, Hk, D]`` of any strides.

    :param config: ``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages``; optional ``TMA`` (default
        1: descriptor loads where :func:`takes_tma`; 0: pointer loads always), ``WARP_SPECIALIZE``
        (default 0; taken with descriptor loads and no rotary, see the module doc). Fitted to the
        device's shared memory first (:func:`fit`: the rotary tiles take twice the pipeline's), on
        an npu to its unified buffer (:func:`fit_npu`).
    :param rotary: ``(cos, sin, interleaved)``: apply_rotary_pos_emb's rotation to the q and k tiles
        after loading (cos and sin ``[Sk, D]`` or ``[B, Sk, D]``, any strides; query ``i`` uses row
        ``Sk - Sq + i``, key ``j`` row ``j``).
    :param kv_start, kv_end: None, or int32 ``[B]`` (contiguous): batch ``b`` sees only the keys
        ``kv_start[b] <= j < kv_end[b]`` (key padding: left padding a ``kv_start``, right padding a
        ``kv_end``); rows that see no key get ``out = 0``, ``lse = -inf``.
    """
    batch, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    if batch * sq * hq == 0:
        return []
    config = fit_npu(fit(config, d, q.element_size(), profile, rotary is not None), d, causal, profile)
    block_m, block_n = config["BLOCK_M"], config["BLOCK_N"]
    if rotary is None:
        cos = sin = q
        cos_strides = sin_strides = (0, 0, 0)
        interleaved = False
    else:
        cos, sin, interleaved = rotary
        cos_strides, sin_strides = table_strides(cos), table_strides(sin)
    tma = bool(config.get("TMA", 1)) and takes_tma(profile, q, k, v, out)
    if rotary is not None:
        tma = tma and tables_take_tma(cos, sin, interleaved, q, k)
    specialise = tma and rotary is None and bool(config.get("WARP_SPECIALIZE", 0))
    if tma:
        ensure_allocator()
    precision = "ieee"
    return [KernelCall(
        attention_forward_kernel, (cdiv(sq, block_m) * batch * hq,),
        (q, k, v, out, lse, cos, sin, lse if kv_start is None else kv_start, lse if kv_end is None else kv_end,
         sq, sk, hq, hq // hk, float(scale) * LOG2E,
         *q.stride(), *k.stride(), *v.stride(), *out.stride()[:3], *cos_strides, *sin_strides),
        {"HEAD_DIM": d, "BLOCK_M": block_m, "BLOCK_N": block_n,
         "BLOCK_D": block_d(d), "BLOCK_P": max(next_power_of_2(d // 2), MIN_DOT_K),
         "CAUSAL": bool(causal), "ROTARY": rotary is not None, "INTERLEAVED": bool(interleaved), "TMA": tma,
         "INPUT_PRECISION": precision, "num_warps": config["num_warps"], "num_stages": config["num_stages"],
         "WARP_SPECIALIZE": specialise, "KV_START": kv_start is not None, "KV_END": kv_end is not None},
    )]
