"""The rotary block: the rotation of queries and keys by cos / sin tables, ``x * cos + rotate(x) * sin``
(or its transpose, what the gradients take), its layouts and its launch; the kernel of
:mod:`~dlblas_kernels.kernels.apply_rotary_pos_emb`, and the rotation the ops that rotate inside
their own plans take (``rotate_pairs`` in the attention block's and ``partial_rotary_emb``'s
kernels, :func:`rotation_calls` around flash attention's backward).

One launch, a 1-D grid: the first programs rotate q, the others k, each a block of tokens with every
head, loading those tokens' cos and sin once, ``BLOCK_H`` (token, head) rows per step (by default
one token per q program, its heads in steps of 16 with one warp, or all at once at few tokens;
several tokens per program for k, or for q when it has few heads, so that k's steps are as wide as
q's and its loads as wide),
reading each pair's two halves as two contiguous loads (or the whole interleaved head in one, split
into even and odd lanes). Every byte of q and k is read once and every output byte written once;
cos and sin are read twice (for q's programs and for k's), 2.5% more bytes than the minimum for
LLaMA-3-8B. Math in float32, outputs in the output tensors' dtype. :func:`rotary_calls` computes
strides in Python (no views on the host path).
Through :mod:`dlcore.language`, the heads a program loads in its loop over head steps are marked
for double buffering (triton-ascend then loads the next step while it rotates this one; upstream
Triton ignores the mark).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

import dlcore.language as dl
from dlblas_kernels.blocks.npu import buffer_tile
from dlcore.api import (
    Config,
    DeviceProfile,
    InvalidInputError,
    KernelCall,
    Op,
    cdiv,
    next_power_of_2,
)

# Elements a program rotates per step by default (BLOCK_T tokens of BLOCK_H heads of D), with one
# warp: 64 per thread, many loads in flight per thread (near the best of the whole space at
# thousands of tokens; docs/performance.md, apply_rotary_pos_emb).
TILE = 2048
# Elements each thread holds at least: more warps than that would only hold copies of a small tile.
MIN_PER_THREAD = 8
# At few tokens, a program per token in steps of TILE leaves the GPU idle between a program's steps:
# up to FEW_TOKENS a program takes all of q's heads in one step, up to SOME_TOKENS steps of 2 * TILE.
FEW_TOKENS = 64
SOME_TOKENS = 256
# Unified-buffer bytes a step takes per element of its tile on an npu (bishengir-compile 1.2, float16,
# Ascend910B2's 192 KiB): steps of 2048 elements lower; 4096 (64 rows of 64) need 427008 bytes.
UB_BYTES_PER_ELEMENT = 96


@triton.jit
def rotate_pairs(a, b, cos_a, cos_b, sin_a, sin_b, BACKWARD: tl.constexpr):
    """The rotation of pairs (a, b), or its transpose for the backward."""
    if BACKWARD:
        return a * cos_a + b * sin_b, b * cos_b - a * sin_a
    else:
        return a * cos_a - b * sin_a, b * cos_b + a * sin_b


@triton.jit
def _rotate_heads(
    x_rows, o_rows, token_mask, head0, H,
    stride_x_h, stride_x_d, stride_o_h, stride_o_d,
    cos_a, cos_b, sin_a, sin_b,
    HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
    INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr,
):
    # Heads head0 .. head0 + BLOCK_H of BLOCK_T tokens: x_rows and o_rows point at each token's first
    # head ([BLOCK_T, 1, 1]); cos_* and sin_* are [BLOCK_T, 1, BLOCK_P], broadcast over the heads.
    heads = head0 + tl.arange(0, BLOCK_H)[None, :, None]
    mask = token_mask & (heads < H)
    x_heads = x_rows + heads * stride_x_h
    o_heads = o_rows + heads * stride_o_h
    if INTERLEAVED:
        # Whole heads, each one contiguous load, split into the even (a) and odd (b) lanes.
        cols = tl.arange(0, 2 * BLOCK_P)[None, None, :]
        if 2 * BLOCK_P != HEAD_DIM:
            mask = mask & (cols < HEAD_DIM)
        x = tl.load(x_heads + cols * stride_x_d, mask=mask, other=0.0)
        dl.multibuffer(x, 2)
        a, b = tl.split(tl.reshape(x.to(tl.float32), (BLOCK_T, BLOCK_H, BLOCK_P, 2)))
        out_a, out_b = rotate_pairs(a, b, cos_a, cos_b, sin_a, sin_b, BACKWARD)
        out = tl.reshape(tl.join(out_a, out_b), (BLOCK_T, BLOCK_H, 2 * BLOCK_P))
        tl.store(o_heads + cols * stride_o_d, out.to(o_rows.dtype.element_ty), mask=mask)
    else:
        # The two halves of each head, each a contiguous load: pairs (p, p + D/2).
        p = tl.arange(0, BLOCK_P)[None, None, :]
        if BLOCK_P != HEAD_DIM // 2:
            mask = mask & (p < HEAD_DIM // 2)
        a = tl.load(x_heads + p * stride_x_d, mask=mask, other=0.0)
        dl.multibuffer(a, 2)
        a = a.to(tl.float32)
        b = tl.load(x_heads + (p + HEAD_DIM // 2) * stride_x_d, mask=mask, other=0.0)
        dl.multibuffer(b, 2)
        b = b.to(tl.float32)
        out_a, out_b = rotate_pairs(a, b, cos_a, cos_b, sin_a, sin_b, BACKWARD)
        tl.store(o_heads + p * stride_o_d, out_a.to(o_rows.dtype.element_ty), mask=mask)
        tl.store(o_heads + (p + HEAD_DIM // 2) * stride_o_d, out_b.to(o_rows.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_tokens(
    x_ptr, o_ptr, cos_ptr, sin_ptr, block, T, S, ROW0, H,
    stride_x_b, stride_x_s, stride_x_h, stride_x_d,
    stride_o_b, stride_o_s, stride_o_h, stride_o_d,
    stride_cos_b, stride_cos_s, stride_cos_d,
    stride_sin_b, stride_sin_s, stride_sin_d,
    HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
    INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr,
):
    # Tokens block * BLOCK_T .. (block + 1) * BLOCK_T of one tensor (q or k, T tokens in sequences of
    # S), every head, with the tokens' cos and sin loaded once: position s takes table row ROW0 + s
    # (row 0 where that is negative).
    tokens = block * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = (tokens < T)[:, None, None]
    # 64-bit offsets: batch * batch stride may pass 2**31 elements.
    b = (tokens // S).to(tl.int64)[:, None, None]
    s = (tokens % S).to(tl.int64)[:, None, None]
    row = tl.maximum(s + ROW0, 0)
    cos_t = cos_ptr + b * stride_cos_b + row * stride_cos_s
    sin_t = sin_ptr + b * stride_sin_b + row * stride_sin_s
    if INTERLEAVED:
        cols = tl.arange(0, 2 * BLOCK_P)[None, None, :]
        table_mask = token_mask & (cols < HEAD_DIM)
        c = tl.load(cos_t + cols * stride_cos_d, mask=table_mask, other=0.0).to(tl.float32)
        t = tl.load(sin_t + cols * stride_sin_d, mask=table_mask, other=0.0).to(tl.float32)
        cos_a, cos_b = tl.split(tl.reshape(c, (BLOCK_T, 1, BLOCK_P, 2)))
        sin_a, sin_b = tl.split(tl.reshape(t, (BLOCK_T, 1, BLOCK_P, 2)))
    else:
        p = tl.arange(0, BLOCK_P)[None, None, :]
        table_mask = token_mask & (p < HEAD_DIM // 2)
        cos_a = tl.load(cos_t + p * stride_cos_d, mask=table_mask, other=0.0).to(tl.float32)
        cos_b = tl.load(cos_t + (p + HEAD_DIM // 2) * stride_cos_d, mask=table_mask, other=0.0).to(tl.float32)
        sin_a = tl.load(sin_t + p * stride_sin_d, mask=table_mask, other=0.0).to(tl.float32)
        sin_b = tl.load(sin_t + (p + HEAD_DIM // 2) * stride_sin_d, mask=table_mask, other=0.0).to(tl.float32)

    x_rows = x_ptr + b * stride_x_b + s * stride_x_s
    o_rows = o_ptr + b * stride_o_b + s * stride_o_s
    for h0 in range(0, H, BLOCK_H):
        _rotate_heads(x_rows, o_rows, token_mask, h0, H, stride_x_h, stride_x_d, stride_o_h, stride_o_d,
                      cos_a, cos_b, sin_a, sin_b, HEAD_DIM, BLOCK_T, BLOCK_H, BLOCK_P, INTERLEAVED, BACKWARD)


@triton.jit
def rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr,
    TQ, SQ, ROW0_Q, TK, SK, HQ, HK, PROGRAMS_Q,
    stride_q_b, stride_q_s, stride_q_h, stride_q_d,
    stride_k_b, stride_k_s, stride_k_h, stride_k_d,
    stride_qo_b, stride_qo_s, stride_qo_h, stride_qo_d,
    stride_ko_b, stride_ko_s, stride_ko_h, stride_ko_d,
    stride_cos_b, stride_cos_s, stride_cos_d,
    stride_sin_b, stride_sin_s, stride_sin_d,
    HEAD_DIM: tl.constexpr, BLOCK_TQ: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_TK: tl.constexpr,
    BLOCK_HK: tl.constexpr, BLOCK_P: tl.constexpr, INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr,
):
    # Programs 0 .. PROGRAMS_Q rotate q, BLOCK_TQ tokens each; the others k, BLOCK_TK tokens each: each
    # tensor in steps of about the same number of (token, head) rows, however few heads k has. q's
    # positions take the table rows from ROW0_Q (fewer queries than keys: the last positions), k's
    # from row 0.
    pid = tl.program_id(0)
    if pid < PROGRAMS_Q:
        _rotate_tokens(q_ptr, q_out_ptr, cos_ptr, sin_ptr, pid, TQ, SQ, ROW0_Q, HQ,
                       stride_q_b, stride_q_s, stride_q_h, stride_q_d,
                       stride_qo_b, stride_qo_s, stride_qo_h, stride_qo_d,
                       stride_cos_b, stride_cos_s, stride_cos_d, stride_sin_b, stride_sin_s, stride_sin_d,
                       HEAD_DIM, BLOCK_TQ, BLOCK_HQ, BLOCK_P, INTERLEAVED, BACKWARD)
    else:
        _rotate_tokens(k_ptr, k_out_ptr, cos_ptr, sin_ptr, pid - PROGRAMS_Q, TK, SK, 0, HK,
                       stride_k_b, stride_k_s, stride_k_h, stride_k_d,
                       stride_ko_b, stride_ko_s, stride_ko_h, stride_ko_d,
                       stride_cos_b, stride_cos_s, stride_cos_d, stride_sin_b, stride_sin_s, stride_sin_d,
                       HEAD_DIM, BLOCK_TK, BLOCK_HK, BLOCK_P, INTERLEAVED, BACKWARD)


# -- layouts ---------------------------------------------------------------------------------------


def flat_stride(sizes: tuple[int, ...], strides: tuple[int, ...]) -> int | None:
    """The stride of dimensions ``sizes`` (with ``strides``) flattened into one, as ``view`` would
    flatten them; None when they do not flatten without a copy; 0 when they hold one element."""
    flat = step = None
    for size, stride in zip(reversed(sizes), reversed(strides)):
        if size == 1:
            continue
        if flat is None:
            flat = stride
        elif stride != step:
            return None
        step = stride * size
    return 0 if flat is None else flat


def bshd_strides(t: torch.Tensor) -> tuple[int, int, int, int] | None:
    """Strides of ``t [..., S, H, D]`` as ``[B, S, H, D]``, the leading dimensions flattened into B;
    None when they do not flatten without a copy."""
    strides = t.stride()
    batch = flat_stride(tuple(t.shape[:-3]), strides[:-3])
    return None if batch is None else (batch, *strides[-3:])


def bsd_strides(t: torch.Tensor, batch: tuple[int, ...]) -> tuple[int, int, int] | None:
    """Strides of cos or sin ``[..., S, D]``, broadcast to q's leading dimensions ``batch``, as
    ``[B, S, D]`` (stride 0 along what is broadcast); None when they do not broadcast or flatten."""
    lead, strides = tuple(t.shape[:-2]), t.stride()
    extra = len(lead) - len(batch)
    if extra > 0:
        if any(n != 1 for n in lead[:extra]):
            return None
        lead, strides = lead[extra:], strides[extra:]
    lead_strides = [0] * (len(batch) - len(lead))
    for size, stride, want in zip(lead, strides, batch[len(batch) - len(lead):]):
        if size != want and size != 1:
            return None
        lead_strides.append(stride if size == want else 0)
    flat = flat_stride(batch, tuple(lead_strides))
    return None if flat is None else (flat, *strides[-2:])


def check_token_layouts(op: Op, q: torch.Tensor, others: dict[str, torch.Tensor],
                        tables: dict[str, torch.Tensor]) -> None:
    """For rotary ops: the leading dimensions of q and ``others`` (``[..., S, H, D]``) flatten into
    one without a copy, and the cos / sin ``tables`` (``[..., S, D]``) broadcast over them."""
    batch, seq = tuple(q.shape[:-3]), q.shape[-3]
    for name, t in {"q": q, **others}.items():
        if t.numel() and bshd_strides(t) is None:
            raise InvalidInputError(
                op.name, name, f"has strides {tuple(t.stride())} for shape {tuple(t.shape)}",
                f"{name} whose dimensions before the sequence flatten without a copy",
                f"Call {name}.contiguous() first.",
            )
    for name, t in tables.items():
        if t.shape[-2] != seq:
            raise InvalidInputError(op.name, name, f"has shape {tuple(t.shape)}",
                                    f"{name} [..., S, D] with S = {seq}, the sequence length of q")
        if bsd_strides(t, batch) is None:
            raise InvalidInputError(
                op.name, name, f"has shape {tuple(t.shape)} and strides {tuple(t.stride())}",
                f"{name} whose leading dimensions broadcast to q's {batch} and flatten without a copy",
                f"Call {name}.contiguous(), or give it q's leading dimensions.",
            )


def token_layout(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int, int]]:
    """``t [..., S, H, D]`` and its ``[B, S, H, D]`` strides; copied first only when its leading
    dimensions do not flatten (gradients that autograd hands over may come in any layout)."""
    strides = bshd_strides(t)
    if strides is None:
        t = t.contiguous()
        strides = bshd_strides(t)
    return t, strides


# -- launches ---------------------------------------------------------------------------------------


def rotary_calls(q: torch.Tensor, k: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor, interleaved: bool, backward: bool, config: Config,
            profile: DeviceProfile | None) -> list[KernelCall]:
    """The launch that writes the rotation of ``q`` and ``k`` (``backward``: the transposed one) into
    ``q_out`` and ``k_out`` with ``config``'s steps (``BLOCK_H``, ``num_warps``)."""
    *batch, seq_q, hq, d = q.shape
    seq_k, hk = k.shape[-3], k.shape[-2]
    tokens_q, tokens_k = math.prod(batch) * seq_q, math.prod(batch) * seq_k
    if d == 0 or tokens_q * hq + tokens_k * hk == 0:
        return []
    q, q_strides = token_layout(q)
    k, k_strides = token_layout(k)
    batch = tuple(batch)
    block_p = next_power_of_2(d // 2)
    # BLOCK_H (token, head) rows per step for each tensor: its heads (up to BLOCK_H), and more tokens
    # per program when it has fewer heads than that; on an npu, no more than its unified buffer holds.
    rows = max(buffer_tile(profile, UB_BYTES_PER_ELEMENT, config["BLOCK_H"] * 2 * block_p) // (2 * block_p), 1)
    block_hq, block_tq = _step(rows, hq, tokens_q)
    block_hk, block_tk = _step(rows, hk, tokens_k)
    programs_q = cdiv(tokens_q, block_tq) if hq else 0
    programs_k = cdiv(tokens_k, block_tk) if hk else 0
    tile = max(block_tq * block_hq, block_tk * block_hk) * 2 * block_p
    warps = min(config["num_warps"], max(tile // (32 * MIN_PER_THREAD), 1))
    return [KernelCall(
        rotary_kernel, (programs_q + programs_k,),
        (q, k, q_out, k_out, cos, sin, tokens_q, seq_q, cos.shape[-2] - seq_q, tokens_k, seq_k, hq, hk, programs_q,
         *q_strides, *k_strides, *bshd_strides(q_out), *bshd_strides(k_out),
         *bsd_strides(cos, batch), *bsd_strides(sin, batch)),
        {"HEAD_DIM": d, "BLOCK_TQ": block_tq, "BLOCK_HQ": block_hq, "BLOCK_TK": block_tk, "BLOCK_HK": block_hk,
         "BLOCK_P": block_p, "INTERLEAVED": bool(interleaved), "BACKWARD": backward, "num_warps": warps},
    )]


def rotation_calls(q: torch.Tensor, k: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, interleaved: bool, profile: DeviceProfile,
                   backward: bool = False) -> list[KernelCall]:
    """The launch that writes the rotation of ``q [..., Sq, Hq, D]`` and ``k [..., Sk, Hk, D]`` into
    ``q_out`` and ``k_out`` (``backward``: the transposed rotation, what the gradients take), with
    apply_rotary_pos_emb's default steps (:func:`config_for`): for an op that rotates inside its
    own plan. The tables ``[..., Sk, D]`` have a row per key position; query ``i`` takes row
    ``Sk - Sq + i`` (row 0 where that is negative: a query before the first key, which sees none
    under a causal mask)."""
    tokens = math.prod(q.shape[:-2])
    config = config_for(tokens, q.shape[-2], q.shape[-1])
    return rotary_calls(q, k, q_out, k_out, cos, sin, interleaved, backward, config, profile)


def _step(rows: int, heads: int, tokens: int) -> tuple[int, int]:
    """(heads, tokens) per step of ``rows`` (token, head) rows for a tensor of ``heads`` heads."""
    block_h = min(rows, next_power_of_2(max(heads, 1)))
    return block_h, min(max(rows // block_h, 1), next_power_of_2(tokens))


def config_for(tokens: int, heads: int, d: int) -> Config:
    """apply_rotary_pos_emb's default config for ``tokens`` tokens (rounded up to a power of two) of ``heads`` q
    heads of ``d``: 16 rows of 128 per step (half a token of LLaMA-3-8B's q heads, two
    tokens of its k heads) and one warp, 64 elements per thread (see :data:`TILE`); with up to
    :data:`FEW_TOKENS` tokens all of q's heads in one step, up to :data:`SOME_TOKENS` steps of twice
    the tile, as many elements per thread with more warps."""
    tokens = next_power_of_2(max(tokens, 1))
    width = next_power_of_2(d)
    rows = TILE // width
    if tokens <= FEW_TOKENS:
        rows = max(rows, next_power_of_2(heads))
    elif tokens <= SOME_TOKENS:
        rows *= 2
    block_h = max(min(rows, 64), 1)
    return {"BLOCK_H": block_h, "num_warps": min(max(block_h * width // TILE, 1), 8)}
