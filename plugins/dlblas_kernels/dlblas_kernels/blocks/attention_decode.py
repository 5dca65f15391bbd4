"""The decode block of flash attention: a split-KV forward for few query rows ("flash decoding").

Decoding with a KV cache asks ``Sq = 1`` (or a few) query rows per head against ``Sk = n`` keys.
The prefill forward puts one block of query rows of one head in each program: with one row per
head that is ``B * Hq`` programs, each reading the whole K and V of its kv head, too few
programs to keep the GPU busy and, under GQA, each K and V element read ``Hq / Hk`` times. Here:

- **one program per (split, kv head, batch)** holds ALL the query rows of that kv head's group,
  ``Hq / Hk`` heads times ``Sq`` rows (row ``r`` is head ``hk * G + r // Sq``, query ``r % Sq``),
  padded to at least 16 rows so that ``tl.dot`` applies, and streams its share of the keys,
  ``[split * keys_per_split, (split + 1) * keys_per_split)``: every K and V element is read
  exactly once overall, which is all the work there is (at ``Sq * G`` rows the kernel does
  ``Sq * G`` multiply-adds per element read, far below the machine's balance point);
- the number of splits comes from ``Sk``, ``B * Hk`` and the device's cores
  (:func:`default_config`): enough programs to fill every multiprocessor, each split long
  enough to stream;
- each split writes its partial result normalised, ``o_s = sum_j p_j v_j / l_s``, in float32, and
  its log-sum-exp ``lse_s`` (natural log) into scratch; :func:`decode_combine_kernel` merges the
  splits by their lse::

      lse = log(sum_s exp(lse_s)),   out = sum_s exp(lse_s - lse) * o_s

  A lone split (``B * Hk`` alone fills the device, or a short ``Sk``) writes ``out`` and ``lse``
  directly: same kernel, the output's strides in place of the scratch's, no combine.

Masks: keys ``j >= Sk`` and, causal, the bottom-right mask (query ``i`` sees keys
``j <= i + Sk - Sq``). With key padding (``kv_start``, ``kv_end``) a split's keys are cut to
batch ``b``'s ``[kv_start[b], kv_end[b])``: padded keys are neither read nor counted. A row with
no visible key in a split gets ``o_s = 0``, ``lse_s = -inf``; a row with none at all gets
``out = 0``, ``lse = -inf``, never NaN. Math in float32 with base-2 exponentials (``log2(e)``
folded into the scale); ``out`` in q's dtype, ``lse`` float32 ``[B, Hq, Sq]``. q, k, v in BSHD
with any strides (no copy: a KV cache ``[B, Smax, Hk, D]`` sliced to ``[:, :Sk]`` is read in
place); ``D`` up to 256, ``BLOCK_D`` its next power of two with a mask on ``d`` (96, 192).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dlblas_kernels.blocks.attention import block_d as tile_width
from dlcore.api import Config, DeviceProfile, InvalidInputError, KernelCall, cdiv, next_power_of_2

OP = "flash_attention_v2"
#: the fewest rows tl.dot takes (the M of the query tile is padded up to it)
MIN_DOT_ROWS = 16
#: query rows of one kv head's group (``Sq * Hq / Hk``) up to which :func:`use_decode` takes this path
MAX_ROWS = 64
#: the widest head this block handles
MAX_HEAD_DIM = 256
#: caches from this many keys on take as many programs a multiprocessor as it holds at once; shorter
#: ones one a multiprocessor (the faster of the two on each side; docs/performance.md, flash_attention_v2)
LONG_CACHE = 32768
#: programs one multiprocessor holds at once where the profile gives no shared-memory size
PROGRAMS_PER_CORE = 2
#: float32 elements of one combine program's [splits, D] chunk
COMBINE_CHUNK_ELEMENTS = 8192
LOG2E = 1.4426950408889634


@triton.jit
def decode_split_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
    Sq, Sk, keys_per_split, qk_scale,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ob, stride_os, stride_oh, stride_osplit, stride_od,
    stride_lb, stride_lh, stride_ls, stride_lsplit,
    kv_start_ptr, kv_end_ptr,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    KV_START: tl.constexpr = False, KV_END: tl.constexpr = False,
):
    # Program (split, kv head hk, batch b): the GROUP * Sq query rows of kv head hk (row r: query
    # r % Sq of head hk * GROUP + r // Sq) against keys [split * keys_per_split, ...). o and lse:
    # the split's normalised partial output and natural-log lse at (b, query i, head h, split) by
    # the strides given (the scratch's, or out's and lse's with a zero split stride). KV_START,
    # KV_END: batch b sees only the keys kv_start[b] <= j < kv_end[b] (int32 [B], key padding).
    split = tl.program_id(0)
    hk = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    qi = rows % Sq
    h = hk * GROUP + rows // Sq
    mask_m = rows < GROUP * Sq
    d = tl.arange(0, BLOCK_D)
    own = mask_m[:, None] & (d < HEAD_DIM)[None, :]
    offs_n = tl.arange(0, BLOCK_N)

    q = tl.load(q_ptr + b * stride_qb + qi[:, None] * stride_qs + h[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=own, other=0.0)
    start = split.to(tl.int64) * keys_per_split
    end = tl.minimum(start + keys_per_split, Sk)
    if KV_START:
        start = tl.maximum(start, tl.load(kv_start_ptr + b).to(tl.int64))
    if KV_END:
        end = tl.minimum(end, tl.load(kv_end_ptr + b).to(tl.int64))
    # bottom-right causal: query i sees keys j <= i + Sk - Sq
    last_key = qi + (Sk - Sq)
    k_ptrs = k_ptr + b * stride_kb + hk * stride_kh + (start + offs_n)[:, None] * stride_ks + d[None, :] * stride_kd
    v_ptrs = v_ptr + b * stride_vb + hk * stride_vh + (start + offs_n)[:, None] * stride_vs + d[None, :] * stride_vd

    # online softmax in base 2: m the running row maximum of s = scale * log2(e) * q.k, l the sum
    # of 2^(s - m), acc the sum of 2^(s - m) v
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for n in range(start, end, BLOCK_N):
        keys = n + offs_n
        if HEAD_DIM == BLOCK_D:
            mask_kv = (keys < end)[:, None]
        else:
            mask_kv = (keys < end)[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_ptrs, mask=mask_kv, other=0.0, eviction_policy="evict_first")
        v = tl.load(v_ptrs, mask=mask_kv, other=0.0, eviction_policy="evict_first")
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        visible = (keys < end)[None, :]
        if CAUSAL:
            visible = visible & (keys[None, :] <= last_key[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # a row with nothing visible yet keeps m = -inf; exponentiate against 0 there (all terms 0)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
        k_ptrs += BLOCK_N * stride_ks
        v_ptrs += BLOCK_N * stride_vs

    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    # lse = ln(sum 2^s) = (m + log2 l) * ln 2: -inf for a row that saw no key
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    o_rows = b * stride_ob + qi * stride_os + h * stride_oh + split * stride_osplit
    tl.store(o_ptr + o_rows[:, None] + d[None, :] * stride_od, out.to(o_ptr.dtype.element_ty), mask=own)
    tl.store(lse_ptr + b * stride_lb + h * stride_lh + qi * stride_ls + split * stride_lsplit, lse, mask=mask_m)


@triton.jit
def decode_combine_kernel(
    o_part_ptr, lse_part_ptr, out_ptr, lse_ptr,
    Hq, Sq, splits,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_lb, stride_lh, stride_ls,
    HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per output row r = (b * Hq + h) * Sq + i: the scratch is contiguous,
    # o_part [B, Hq, Sq, splits, D] (float32, normalised per split) and lse_part [B, Hq, Sq, splits].
    # CHUNK splits at a time, merged online (m the running maximum lse): with CHUNK >= splits the
    # lse and o loads go out together, one trip to memory.
    r = tl.program_id(0).to(tl.int64)
    qi = r % Sq
    h = (r // Sq) % Hq
    b = r // (Sq * Hq)
    offs_c = tl.arange(0, CHUNK)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    m = float("-inf")
    total = 0.0
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for s0 in range(0, splits, CHUNK):
        mask_c = s0 + offs_c < splits
        lse_c = tl.load(lse_part_ptr + r * splits + s0 + offs_c, mask=mask_c, other=float("-inf"))
        o = tl.load(o_part_ptr + (r * splits + s0 + offs_c)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=mask_c[:, None] & mask_d[None, :], other=0.0)
        m_new = tl.maximum(m, tl.max(lse_c, axis=0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_ref)
        w = tl.exp(lse_c - m_ref)
        total = total * alpha + tl.sum(w, axis=0)
        acc = acc * alpha + tl.sum(w[:, None] * o, axis=0)
        m = m_new

    seen = total > 0.0
    out = acc / tl.where(seen, total, 1.0)
    lse = tl.where(seen, m + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    tl.store(out_ptr + b * stride_ob + qi * stride_os + h * stride_oh + offs_d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=mask_d)
    tl.store(lse_ptr + b * stride_lb + h * stride_lh + qi * stride_ls, lse)


DECODE_KERNELS = (decode_split_kernel, decode_combine_kernel)


def _rows(q: torch.Tensor, k: torch.Tensor) -> int:
    """Query rows of one kv head's group: ``Sq * Hq / Hk``."""
    return q.shape[1] * (q.shape[2] // k.shape[2])


def use_decode(q: torch.Tensor, k: torch.Tensor, profile: DeviceProfile) -> bool:
    """Whether the forward takes :func:`decode_calls`: when one kv head's query rows (``Sq * Hq /
    Hk``) fit one tile of at most :data:`MAX_ROWS` rows. Then this block reads K and V once (the
    prefill kernel once per query head, its 128-row tiles mostly padding), and its splits fill
    the device whatever ``B * Hq``; with ``B * Hk`` programs enough to fill it, it takes one split
    and is the prefill kernel with the heads of a group stacked."""
    return _rows(q, k) <= MAX_ROWS


def default_config(q: torch.Tensor, k: torch.Tensor, profile: DeviceProfile) -> Config:
    """The tiles and the split count for ``q`` against ``k`` (from a sweep: bf16, GQA 32/8, D 128,
    Sq 1, B 1 and 8, Sk 1024 to 65536; `.ci/profile_decode.py sweep`):

    - ``BLOCK_N`` 64 keys a step (32 for heads wider than 128: the same tile bytes),
      ``num_stages`` 3 within the program's shared memory, 4 warps;
    - ``SPLITS``: whole waves of programs, ``B * Hk * SPLITS`` a multiple of the cores: one program a
      multiprocessor, or from LONG_CACHE keys on as many as one holds at once (its pipeline buffers
      within its shared memory: 2 at these tiles). Fewer leave multiprocessors idle; a count between
      leaves some with two programs and some with one."""
    batch, sk, hk, d = k.shape
    block_d = tile_width(d)
    block_m = max(next_power_of_2(_rows(q, k)), MIN_DOT_ROWS)
    block_n = 64 if block_d <= 128 else 32
    stages = 3
    shared = profile.shared_memory_per_program
    tile_bytes = 2 * block_n * block_d * k.element_size()
    while stages > 1 and shared and stages * tile_bytes > shared:
        stages -= 1
    resident = max(1, shared // (stages * tile_bytes)) if shared else PROGRAMS_PER_CORE
    units = max(batch * hk, 1)  # no batch: nothing launches, any count will do
    splits = max(1, profile.cores * (resident if sk >= LONG_CACHE else 1) // units)
    return {"SPLITS": splits, "BLOCK_N": block_n, "num_warps": 8 if block_m * block_d >= 64 * 256 else 4,
            "num_stages": stages}


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise InvalidInputError(OP, "q", f"has shape {tuple(q.shape)} and k {tuple(k.shape)}",
                                "q [B, Sq, Hq, D] and k, v [B, Sk, Hk, D]")
    batch, sq, hq, d = q.shape
    if v.shape != k.shape or k.shape[0] != batch or k.shape[3] != d:
        raise InvalidInputError(OP, "k", f"has shape {tuple(k.shape)} and v {tuple(v.shape)}",
                                f"k and v of one shape [{batch}, Sk, Hk, {d}] against q {tuple(q.shape)}")
    if hq % k.shape[2]:
        raise InvalidInputError(OP, "k", f"has {k.shape[2]} heads against q's {hq}", "a number of kv heads dividing Hq")
    if d > MAX_HEAD_DIM:
        raise InvalidInputError(OP, "q", f"has head dimension {d}", f"head dimensions up to {MAX_HEAD_DIM}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise InvalidInputError(OP, "k", f"has dtype {k.dtype} and v {v.dtype}", f"q's dtype {q.dtype}")
    if out.shape != q.shape or out.dtype != q.dtype:
        raise InvalidInputError(OP, "out", f"has shape {tuple(out.shape)}, dtype {out.dtype}",
                                f"q's shape {tuple(q.shape)} and dtype {q.dtype}")
    if lse.shape != (batch, hq, sq) or lse.dtype != torch.float32:
        raise InvalidInputError(OP, "lse", f"has shape {tuple(lse.shape)}, dtype {lse.dtype}",
                                f"float32 [{batch}, {hq}, {sq}]")


def decode_calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, *,
                 causal: bool, scale: float, profile: DeviceProfile, rotary: tuple | None = None,
                 config: Config | None = None, kv_start: torch.Tensor | None = None,
                 kv_end: torch.Tensor | None = None) -> tuple[list[KernelCall], tuple[torch.Tensor, ...]]:
    """The launches that write ``out`` ``[B, Sq, Hq, D]`` (q's dtype) and ``lse`` ``[B, Hq, Sq]``
    (float32, natural log) of ``softmax(scale * q k^T) v`` (see the module doc), and the scratch
    tensors they use: the split kernel, then the combine kernel when there are several splits, with
    their float32 partial outputs and lse allocated here and returned as scratch (none for one split).

    The plan that takes these calls must declare that scratch (``LaunchPlan(scratch=...)``): a launch
    handed a tensor that is neither an input, a result nor declared scratch is not recorded, so every
    call of the bound op would plan and launch through the slow path again (host time that exceeds
    the kernels' own at short caches).
    ``config`` (keys of :func:`default_config`) replaces the heuristic one. ``rotary`` is not
    implemented here (the plan takes the prefill kernel for it). ``kv_start``, ``kv_end``: None or
    int32 ``[B]`` (contiguous), the keys each batch sees (key padding)."""
    if rotary is not None:
        raise NotImplementedError("attention_decode: rotary embeddings are applied by the prefill forward only")
    _check(q, k, v, out, lse)
    config = {**default_config(q, k, profile), **(config or {})}
    batch, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    block_n = config["BLOCK_N"]
    block_d = tile_width(d)
    # split lengths in whole key blocks: only the last split's last block is ragged
    keys_per_split = max(block_n, cdiv(cdiv(sk, config["SPLITS"]), block_n) * block_n)
    splits = max(1, cdiv(sk, keys_per_split))
    if splits == 1:
        o, part_lse = out, lse
        o_strides = (out.stride(0), out.stride(1), out.stride(2), 0, out.stride(3))
        l_strides = (lse.stride(0), lse.stride(1), lse.stride(2), 0)
        scratch: tuple[torch.Tensor, ...] = ()
    else:
        o = torch.empty((batch, hq, sq, splits, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, hq, sq, splits), dtype=torch.float32, device=q.device)
        scratch = (o, part_lse)
        o_strides = (o.stride(0), o.stride(2), o.stride(1), o.stride(3), o.stride(4))
        l_strides = (part_lse.stride(0), part_lse.stride(1), part_lse.stride(2), part_lse.stride(3))
    calls = [KernelCall(
        decode_split_kernel, (splits, hk, batch),
        (q, k, v, o, part_lse, sq, sk, keys_per_split, float(scale) * LOG2E,
         *q.stride(), *k.stride(), *v.stride(), *o_strides, *l_strides,
         lse if kv_start is None else kv_start, lse if kv_end is None else kv_end),
        {"GROUP": hq // hk, "HEAD_DIM": d, "CAUSAL": bool(causal),
         "KV_START": kv_start is not None, "KV_END": kv_end is not None,
         "BLOCK_M": max(next_power_of_2(_rows(q, k)), MIN_DOT_ROWS), "BLOCK_N": block_n, "BLOCK_D": block_d,
         "num_warps": config["num_warps"], "num_stages": config["num_stages"]},
    )]
    if splits > 1:
        calls.append(KernelCall(
            decode_combine_kernel, (batch * hq * sq,),
            (o, part_lse, out, lse, hq, sq, splits, *out.stride(), *lse.stride()),
            {"HEAD_DIM": d, "CHUNK": min(next_power_of_2(splits), max(1, COMBINE_CHUNK_ELEMENTS // block_d)),
             "BLOCK_D": block_d, "num_warps": 4},
        ))
    return calls, scratch

