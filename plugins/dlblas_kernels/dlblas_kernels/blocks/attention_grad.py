"""The backward of flash attention 2: ``dq``, ``dk`` and ``dv`` from the saved ``out`` and ``lse``.

Layout BSHD: q ``[B, Sq, Hq, D]``, k and v ``[B, Sk, Hk, D]`` (query head ``h`` reads kv head
``h // (Hq / Hk)``), any strides; ``lse [B, Hq, Sq]`` float32, the natural log of each row's
softmax denominator (``-inf`` for a row that sees no key). With ``S = scale * q k^T`` (causal:
bottom-right, query ``i`` sees keys ``j <= i + Sk - Sq``) and ``P = exp(S - lse)``::

    delta_i = sum_d dout_id * out_id - dlse_i     (dlse: the gradient of the returned lse, or 0)
    dP = dout v^T,   dS = P * (dP - delta)
    dv = P^T dout,   dk = scale * dS^T q,   dq = scale * dS k

(``lse`` feeds the output through ``P``: its gradient adds ``dlse_i * P_ij`` to ``dS_ij``, hence
``- dlse`` in delta.) Three launches:

- :func:`attention_bwd_preprocess_kernel`: per row, ``delta`` and ``lse * log2(e)`` (``+inf`` for
  a row without keys, so that ``P = exp2(s * scale * log2 e - lse2) = 0`` there and no NaN appears)
  into a float32 scratch ``[2, B, Hq, Sq]``;
- :func:`attention_dkdv_kernel`: one program per (batch, kv head, block of ``BLOCK_N`` keys) holds
  its k and v tiles and the float32 ``dk``, ``dv`` accumulators, and walks the query blocks of
  every query head of its GQA group, so a group's gradients are summed in registers (no atomics,
  deterministic). It works on the transposed scores ``S^T = k q^T`` (``[BLOCK_N, BLOCK_M]``), so
  that ``P^T`` and ``dS^T`` are the register operand of the products into ``dv`` and ``dk`` and the
  streamed q and dout tiles the shared-memory one. Causal: only query blocks at or below the
  diagonal are visited, the first ``ceil(BLOCK_N / BLOCK_M)`` of them masked;
- :func:`attention_dq_kernel`: one program per (batch, query head, block of ``BLOCK_M`` queries)
  holds q, dout and ``dq``, and walks the key blocks (causal: up to the diagonal, the blocks that
  cross it masked; otherwise the ragged last block masked). Programs start with the last query
  blocks, the longest under a causal mask.

Both recompute ``P`` in float32 from the saved lse, with ``log2(e)`` folded into the scale (one
multiply-add and an ``exp2`` per score); products accumulate in float32, ``P`` and ``dS`` are cast
to the input dtype for the tensor cores. Head dimensions that are not powers of two (96, 192) are
padded to the next one and masked. float32 inputs take exact (``ieee``) products.

Rotary (fused_rotary_and_fa, :func:`rotary_backward_plan`): q and k rotated into scratch by
:mod:`~dlblas_kernels.kernels.apply_rotary_pos_emb`'s kernel (query ``i`` with table row ``Sk - Sq +
i``, key ``j`` with row ``j``), the three launches above on them, and the gradients of the rotated
q and k taken back through the transposed rotation by the same kernel: O(S) memory traffic, where
rotating the tiles inside the loops rotates each streamed tile again for every block it meets. The
gradients of the rotated q and k are returned too: the tables' gradients reduce them.

The tile sizes come from :func:`backward_config`, a table per head dimension and mask from a
sweep on sm_90 (see :data:`HOPPER_TILES`; docs/performance.md, flash_attention_v2, has the block
against SDPA's flash and cuDNN backwards). It runs seven products per tile pair
where an atomic dq accumulation runs five (the dkdv and dq kernels each recompute P and dP):
the price of deterministic gradients without atomics.
"""

from __future__ import annotations

import math

import torch

from dlblas_kernels.blocks import gemm
from dlblas_kernels.blocks.attention import block_d as tile_width
from dlblas_kernels.blocks.attention_grad_kernels import (
    attention_bwd_preprocess_kernel,
    attention_dkdv_kernel,
    attention_dq_kernel,
)
from dlblas_kernels.blocks.npu import buffer_tile
from dlblas_kernels.blocks.rotary import rotation_calls
from dlcore.api import Config, DeviceProfile, KernelCall, LaunchPlan, cdiv, ensure_allocator

LOG2E = 1.4426950408889634
#: rows of the preprocess kernel's programs
PREPROCESS_ROWS = 64
#: on npu the preprocess's out and dout rows live in the unified buffer: bishengir-compile 1.2 asks
#: 12 bytes of it per element of the [rows, BLOCK_D] tile (196864 for 64 rows of 256 on the Ascend
#: 910B2, over its 196608); the budget per element leaves headroom
UB_BYTES_PER_PREPROCESS_ELEMENT = 16


def preprocess_rows(block_d: int, profile: DeviceProfile | None) -> int:
    """The preprocess kernel's rows per program: PREPROCESS_ROWS, on npu no more than the unified
    buffer holds at ``block_d`` columns (32 rows of heads of 256 on the Ascend 910B)."""
    return max(min(PREPROCESS_ROWS, buffer_tile(profile, UB_BYTES_PER_PREPROCESS_ELEMENT,
                                                PREPROCESS_ROWS * block_d) // block_d), 1)
#: per (head dimension up to the key, causal), the tiles of the two kernels on Hopper for 16-bit
#: inputs: dkdv (keys per program BLOCK_N, queries per step BLOCK_M, warps, stages), dq (queries per
#: program BLOCK_M, keys per step BLOCK_N, warps, stages): the fastest of
#: .ci/sweep_attention_backward.py for D 64 and 128 (docs/performance.md, flash_attention_v2). D 256
#: is not swept: the tiles whose sm_90 build spills least (dkdv 48 bytes of stack).
HOPPER_TILES = {
    (64, False): ((128, 32, 4, 3), (128, 64, 8, 3)),
    (64, True): ((128, 32, 4, 3), (64, 64, 4, 3)),
    (128, False): ((64, 32, 4, 3), (128, 64, 8, 3)),
    (128, True): ((128, 64, 8, 2), (128, 64, 8, 3)),
    (256, False): ((64, 32, 8, 2), (64, 32, 8, 2)),
    (256, True): ((64, 32, 8, 2), (64, 32, 8, 2)),
}
#: under Triton's interpreter: small tiles, so that small tests cross several blocks
INTERPRETER_TILES = ((32, 16, 4, 1), (32, 16, 4, 1))


#: the kernels (:mod:`dlblas_kernels.blocks.attention_grad_kernels`) the plans launch
BACKWARD_KERNELS = (attention_bwd_preprocess_kernel, attention_dkdv_kernel, attention_dq_kernel)


# --- host side -----------------------------------------------------------------------------------

def backward_config(q: torch.Tensor, causal: bool, profile: DeviceProfile) -> Config:
    """The tiles of the two kernels for ``q`` (its head dimension and dtype), with or without the
    causal mask, on ``profile``: :data:`HOPPER_TILES` on CUDA (pipeline stages dropped while a
    program would not fit the shared memory), halved blocks for float32 (twice the bytes per
    element), :data:`INTERPRETER_TILES` elsewhere; ``DKDV_TMA`` and ``DQ_TMA`` 1 (the streamed
    tiles through tensor descriptors, where the inputs allow) on Hopper."""
    d = tile_width(q.shape[-1])
    if profile.backend != "cuda":
        dkdv, dq = INTERPRETER_TILES
    else:
        dkdv, dq = HOPPER_TILES[min(key for key in (64, 128, 256) if key >= min(d, 256)), bool(causal)]
        if q.element_size() > 2:
            dkdv, dq = ((tile[0] // 2, tile[1] // 2, *tile[2:]) for tile in (dkdv, dq))
    config = {"DKDV_BLOCK_N": dkdv[0], "DKDV_BLOCK_M": dkdv[1], "DKDV_WARPS": dkdv[2], "DKDV_STAGES": dkdv[3],
              "DQ_BLOCK_M": dq[0], "DQ_BLOCK_N": dq[1], "DQ_WARPS": dq[2], "DQ_STAGES": dq[3],
              "DKDV_TMA": int(profile.arch in gemm.TMA_ARCHS), "DQ_TMA": int(profile.arch in gemm.TMA_ARCHS)}
    limit = profile.shared_memory_per_program
    for kind in ("DKDV", "DQ"):
        while limit and config[f"{kind}_STAGES"] > 1 and shared_memory_bytes(config, kind, d, q.element_size()) > limit:
            config[f"{kind}_STAGES"] -= 1
    return config


def shared_memory_bytes(config: Config, kind: str, block_d: int, element_size: int) -> int:
    """An upper estimate of what one program of ``kind`` (``"DKDV"`` or ``"DQ"``) takes of shared
    memory: its resident tiles (k, v or q, dout), the streamed tiles times the stages, and the
    float32 score tile converted for the second product."""
    resident = config[f"{kind}_BLOCK_N" if kind == "DKDV" else f"{kind}_BLOCK_M"]
    streamed = config[f"{kind}_BLOCK_M" if kind == "DKDV" else f"{kind}_BLOCK_N"]
    tiles = 2 * resident * block_d + 2 * config[f"{kind}_STAGES"] * streamed * block_d
    return tiles * element_size + resident * streamed * 4


def stats_scratch(q: torch.Tensor) -> torch.Tensor:
    """The float32 scratch ``[2, B, Hq, Sq]`` of :func:`backward_calls` (``lse * log2 e`` and delta)."""
    b, sq, hq, _ = q.shape
    return torch.empty(2, b, hq, sq, dtype=torch.float32, device=q.device)


def takes_tma(*tensors: torch.Tensor) -> bool:
    """Whether the copy engine can read the rows of every head of ``tensors`` (BSHD): unit stride
    along D, each head's base and the row stride 16-byte aligned."""
    return all(t.stride(3) == 1 and t.data_ptr() % gemm.TMA_ALIGNMENT == 0
               and all(stride * t.element_size() % gemm.TMA_ALIGNMENT == 0 for stride in t.stride()[:3])
               for t in tensors)


def backward_calls(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, dlse: torch.Tensor | None, dq: torch.Tensor, dk: torch.Tensor,
                   dv: torch.Tensor, *, causal: bool, scale: float, profile: DeviceProfile,
                   config: Config | None = None, stats: torch.Tensor | None = None,
                   kv_start: torch.Tensor | None = None, kv_end: torch.Tensor | None = None) -> list[KernelCall]:
    """The launches that write ``dq [B, Sq, Hq, D]``, ``dk`` and ``dv [B, Sk, Hk, D]`` (any strides,
    like every input; GQA groups summed in the kernel).

    :param dlse: None, or ``[B, Hq, Sq]`` float32: the gradient of the returned lse.
    :param config: the tiles (:func:`backward_config`'s keys); by default that heuristic. With
        ``DKDV_TMA`` (``DQ_TMA``) the kernel reads its streamed tiles (q and dout; k and v) through
        tensor descriptors where :func:`takes_tma` allows.
    :param stats: the float32 scratch of :func:`stats_scratch`; allocated here when None (a
        plan that replays passes its own and declares it as scratch).
    :param kv_start, kv_end: None, or int32 ``[B]`` (contiguous): the keys each batch saw in the
        forward (key padding); the others get zero ``dk`` and ``dv``.
    """
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    if config is None:
        config = backward_config(q, causal, profile)
    if stats is None:
        stats = stats_scratch(q)
    block_d = tile_width(d)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    flags = {"HEAD_DIM": d, "BLOCK_D": block_d, "CAUSAL": bool(causal), "INPUT_PRECISION": precision,
             "KV_START": kv_start is not None, "KV_END": kv_end is not None}
    bounds = (stats if kv_start is None else kv_start, stats if kv_end is None else kv_end)
    tma_dkdv = bool(config.get("DKDV_TMA", 0)) and takes_tma(q, dout)
    tma_dq = bool(config.get("DQ_TMA", 0)) and takes_tma(k, v)
    if (tma_dkdv or tma_dq) and q.device.type == "cuda":
        ensure_allocator()
    calls = []
    if b * hq * sq:
        rows = preprocess_rows(block_d, profile)
        calls.append(KernelCall(attention_bwd_preprocess_kernel, (cdiv(sq, rows), b * hq), (
            out, dout, lse, dlse if dlse is not None else lse, stats, sq, hq, stats[0].numel(),
            *out.stride(), *dout.stride(), *lse.stride(), *(dlse if dlse is not None else lse).stride(),
        ), {"HEAD_DIM": d, "BLOCK_D": block_d, "BLOCK_M": rows, "HAS_DLSE": dlse is not None,
            "num_warps": 4}))
    common = (sq, sk, hq, hk, stats[0].numel(), scale * LOG2E, scale, *q.stride(), *k.stride(), *v.stride(),
              *dout.stride())
    if b * hk * sk:
        calls.append(KernelCall(
            attention_dkdv_kernel, (cdiv(sk, config["DKDV_BLOCK_N"]), b * hk),
            (q, k, v, dout, stats, dk, dv, *bounds, *common, *dk.stride(), *dv.stride()),
            {**flags, "TMA": tma_dkdv, "BLOCK_M": config["DKDV_BLOCK_M"], "BLOCK_N": config["DKDV_BLOCK_N"],
             "num_warps": config["DKDV_WARPS"], "num_stages": config["DKDV_STAGES"]}))
    if b * hq * sq:
        calls.append(KernelCall(
            attention_dq_kernel, (cdiv(sq, config["DQ_BLOCK_M"]), b * hq),
            (q, k, v, dout, stats, dq, *bounds, *common, *dq.stride()),
            {**flags, "TMA": tma_dq, "BLOCK_M": config["DQ_BLOCK_M"], "BLOCK_N": config["DQ_BLOCK_N"],
             "num_warps": config["DQ_WARPS"], "num_stages": config["DQ_STAGES"]}))
    return calls


# --- for the op modules: reference, results, plan -------------------------------------------------

def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """``rotate(x)``: ``cat(-x2, x1)``, or with ``interleaved`` ``(-x[2i+1], x[2i])`` in each pair."""
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _tables(cos: torch.Tensor, sin: torch.Tensor, sq: int, compute: torch.dtype) -> tuple:
    """(cos, sin) of the keys and of the queries, ``[B or 1, S, 1, D]``: query ``i`` takes row
    ``Sk - Sq + i``; with ``Sq > Sk`` the first ``Sq - Sk`` queries, which see no key (their
    gradient is 0), take row 0."""
    c, s = (t.to(compute) if t.dim() == 3 else t.to(compute)[None] for t in (cos, sin))
    c, s = c[:, :, None], s[:, :, None]
    rows = (torch.arange(sq, device=c.device) + c.shape[1] - sq).clamp(min=0)
    return (c, s), (c.index_select(1, rows), s.index_select(1, rows))


def backward_reference(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, dlse: torch.Tensor | None, causal: bool,
                       softmax_scale: float | None, kv_start: torch.Tensor | None,
                       kv_end: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of flash attention in torch (the module doc's formulas, P from the saved
    lse; rows without keys give 0; keys outside ``[kv_start[b], kv_end[b])`` masked), in float32
    or wider, returned in the inputs' dtypes."""
    compute = torch.promote_types(q.dtype, torch.float32)
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    group = hq // hk
    scale = softmax_scale if softmax_scale is not None else d ** -0.5
    q_, k_, v_, do_, o_ = (t.to(compute) for t in (q, k, v, dout, out))
    k_, v_ = k_.repeat_interleave(group, dim=2), v_.repeat_interleave(group, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q_, k_) * scale
    lse_ = lse.to(compute)
    lse_ = torch.where(lse_ == -math.inf, math.inf, lse_)
    p = torch.exp(s - lse_[..., None])
    if causal:
        seen = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        p = torch.where(seen, p, 0.0)
    keys = torch.arange(sk, device=q.device)
    if kv_start is not None:
        p = torch.where((keys[None, :] >= kv_start.to(q.device, torch.int64)[:, None])[:, None, None, :], p, 0.0)
    if kv_end is not None:
        p = torch.where((keys[None, :] < kv_end.to(q.device, torch.int64)[:, None])[:, None, None, :], p, 0.0)
    delta = torch.einsum("bihd,bihd->bhi", do_, o_)
    if dlse is not None:
        delta = delta - dlse.to(compute)
    dp = torch.einsum("bihd,bjhd->bhij", do_, v_)
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("bhij,bjhd->bihd", ds, k_) * scale
    dk = (torch.einsum("bhij,bihd->bjhd", ds, q_) * scale).reshape(b, sk, hk, group, d).sum(3)
    dv = torch.einsum("bhij,bihd->bjhd", p, do_).reshape(b, sk, hk, group, d).sum(3)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def backward_results(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_) -> tuple:
    """``(dq, dk, dv)`` allocated, contiguous, in the shapes and dtypes of q, k and v."""
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _scale(q: torch.Tensor, softmax_scale: float | None) -> float:
    return softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5


def backward_plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    """The launches for ``(dq, dk, dv)`` from ``args`` as :func:`backward_reference` takes them;
    ``config`` (the forward's) is not used: the backward has tiles of its own."""
    dout, q, k, v, out, lse, dlse, causal, softmax_scale = args[:9]
    kv_start, kv_end = (*args[9:], None, None)[:2]  # trailing optional bounds may be left off
    dq, dk, dv = backward_results(dout, q, k, v)
    stats = stats_scratch(q)
    calls = backward_calls(dout, q, k, v, out, lse, dlse, dq, dk, dv, causal=causal,
                           scale=_scale(q, softmax_scale), profile=profile, stats=stats,
                           kv_start=kv_start, kv_end=kv_end)
    return LaunchPlan(calls, (dq, dk, dv), scratch=(stats,))


def rotary_backward_reference(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, causal: bool,
                              softmax_scale: float | None, interleaved: bool,
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dq', dk')`` of fused_rotary_and_fa in torch: the rotation applied to q and k
    (queries with the last ``Sq`` rows of the tables), :func:`backward_reference` on them, giving
    the gradients ``dq'`` and ``dk'`` of the rotated q and k, and those taken back through the
    transposed rotation. dq' and dk' (in q's and k's dtypes) are what the gradients of cos and sin
    reduce (fused_rotary_and_fa's formula)."""
    compute = torch.promote_types(q.dtype, torch.float32)
    (ck, sk_), (cq, sq_) = _tables(cos, sin, q.shape[1], compute)
    q_, k_ = q.to(compute), k.to(compute)
    q_rot = q_ * cq + _rotate_half(q_, interleaved) * sq_
    k_rot = k_ * ck + _rotate_half(k_, interleaved) * sk_
    dq_rot, dk_rot, dv = backward_reference(dout.to(compute), q_rot, k_rot, v.to(compute), out.to(compute), lse,
                                            None, causal, _scale(q, softmax_scale), None, None)
    dq = dq_rot * cq - _rotate_half(dq_rot * sq_, interleaved)
    dk = dk_rot * ck - _rotate_half(dk_rot * sk_, interleaved)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dq_rot.to(q.dtype), dk_rot.to(k.dtype)


def rotary_backward_results(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_) -> tuple:
    """``(dq, dk, dv, dq', dk')`` allocated, as :func:`backward_results` (dq' and dk' as dq and dk)."""
    return (*backward_results(dout, q, k, v), q.new_empty(q.shape), k.new_empty(k.shape))


def rotary_backward_plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    """The launches for ``(dq, dk, dv, dq', dk')`` from ``args`` as :func:`rotary_backward_reference`
    takes them: q and k rotated into scratch, :func:`backward_calls` on them, and dq', dk' taken
    back through the transposed rotation (the module doc); dq' and dk' are returned too, for the
    tables' gradients (no launch of their own: the plan writes them either way). Faster than
    rotating the tiles inside the backward's loops at every length measured (docs/performance.md,
    fused_rotary_and_fa)."""
    dout, q, k, v, cos, sin, out, lse, causal, softmax_scale, interleaved = args
    dq, dk, dv, dq_rot, dk_rot = rotary_backward_results(dout, q, k, v)
    q_rot, k_rot = q.new_empty(q.shape), k.new_empty(k.shape)
    stats = stats_scratch(q)
    calls = [*rotation_calls(q, k, q_rot, k_rot, cos, sin, interleaved, profile),
             *backward_calls(dout, q_rot, k_rot, v, out, lse, None, dq_rot, dk_rot, dv, causal=causal,
                             scale=_scale(q, softmax_scale), profile=profile, stats=stats),
             *rotation_calls(dq_rot, dk_rot, dq, dk, cos, sin, interleaved, profile, backward=True)]
    return LaunchPlan(calls, (dq, dk, dv, dq_rot, dk_rot), scratch=(q_rot, k_rot, stats))
