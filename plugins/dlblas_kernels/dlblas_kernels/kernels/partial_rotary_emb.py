"""partial_rotary_emb: the rotary step of DeepSeek-V2's multi-head latent attention (MLA).

Inputs: q ``[..., S, H, nope + rope]``, k_pe ``[..., S, 1, rope]``, kv ``[..., S, H, nope + v]``,
cos and sin ``[..., S, rope]`` (broadcast over leading dimensions they lack or hold as 1).
With ``r = rope`` and, for ``i < r/2``, the rope part ``x`` of a head read as interleaved pairs
``(x[2i], x[2i+1])`` and written half-split::

    rope(x)[i]       = x[2i]   * cos[i]       - x[2i+1] * sin[i]
    rope(x)[i + r/2] = x[2i+1] * cos[i + r/2] + x[2i]   * sin[i + r/2]

Outputs: ``q_out = cat(q[..., :nope], rope(q[..., nope:]))``, and ``out_kv [..., S, 2, H, nope + rope]``
with ``out_kv[..., 0, :, :] = cat(kv[..., :nope], rope(k_pe) broadcast over the heads)`` (the keys)
and ``out_kv[..., 1, :, :] = cat(kv[..., nope:], zeros)`` (the values, padded to the key width).

Forward grid: (tokens, head blocks); each program copies the nope parts, rotates its heads of q and
the token's k_pe (recomputed per head block: it is one head) and writes both halves of out_kv.
Backward grid: (tokens,); each program loops over all heads, so it can sum the key gradient over
the heads for ``dk_pe`` in registers; the rotation is transposed as in :mod:`apply_rotary_pos_emb`.
Math in float32; outputs in q's dtype. Through :mod:`dlcore.language`, the gradients the backward
loads in its loop over heads are marked for double buffering (triton-ascend then loads the next
heads while it computes these; upstream Triton ignores the mark).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

import dlcore.language as dl
from dlblas_kernels.blocks.rotary import bsd_strides, bshd_strides, check_token_layouts, rotate_pairs
from dlblas_kernels.kernels.apply_rotary_pos_emb import llama_cos_sin
from dlcore.api import (
    Backward,
    Config,
    DeviceProfile,
    InvalidInputError,
    KernelCall,
    LaunchPlan,
    Op,
    PowerOfTwo,
    ScalarArg,
    SearchSpace,
    Signature,
    TensorArg,
    cdiv,
    define_kernel,
    next_power_of_2,
    num_warps,
)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ANY_LAYOUT = ("contiguous", "rows", "strided")
# Heads a forward program takes by default (the plan caps it at the head count), and the elements
# of q each of its threads holds (8 warps for DeepSeek-V2's 128 heads: the best of the space's
# configs at thousands of tokens; docs/performance.md, partial_rotary_emb).
HEADS = 128
PER_THREAD = 128
# The backward loops over every head of a token and holds its key gradient sum: it steps over at most
# this many heads at a time, and at most half of them rounded up to a power of two (two steps a token
# from two heads on; the config's BLOCK_H, when smaller), with warps for about this many elements of each
# gradient per thread (the config's num_warps is the forward's; `.ci/sweep_partial_backward.py`
# sweeps both).
BACKWARD_HEADS = 32
BACKWARD_PER_THREAD = 32


@triton.jit
def partial_rotary_kernel(
    q_ptr, k_pe_ptr, kv_ptr, cos_ptr, sin_ptr, q_out_ptr, out_kv_ptr,
    S, H, NOPE: tl.constexpr, ROPE: tl.constexpr, V: tl.constexpr,
    stride_q_b, stride_q_s, stride_q_h, stride_q_d,
    stride_k_b, stride_k_s, stride_k_d,
    stride_kv_b, stride_kv_s, stride_kv_h, stride_kv_d,
    stride_cos_b, stride_cos_s, stride_cos_d,
    stride_sin_b, stride_sin_s, stride_sin_d,
    stride_qo_t, stride_qo_h,
    stride_okv_t, stride_okv_kv, stride_okv_h,
    BLOCK_H: tl.constexpr, BLOCK_NOPE: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    # 64-bit offsets: batch * batch stride may pass 2**31 elements.
    b = (token // S).to(tl.int64)
    s = (token % S).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = (heads < H)[:, None]
    half = ROPE // 2

    q_t = q_ptr + b * stride_q_b + s * stride_q_s + heads[:, None] * stride_q_h
    kv_t = kv_ptr + b * stride_kv_b + s * stride_kv_s + heads[:, None] * stride_kv_h
    qo_t = q_out_ptr + token.to(tl.int64) * stride_qo_t + heads[:, None] * stride_qo_h
    keys_t = out_kv_ptr + token.to(tl.int64) * stride_okv_t + heads[:, None] * stride_okv_h
    values_t = keys_t + stride_okv_kv
    cos_t = cos_ptr + b * stride_cos_b + s * stride_cos_s
    sin_t = sin_ptr + b * stride_sin_b + s * stride_sin_s

    # The nope parts: q's and the keys' copied, the values copied and padded with zeros.
    n = tl.arange(0, BLOCK_NOPE)
    mask = head_mask & (n < NOPE)[None, :]
    tl.store(qo_t + n[None, :], tl.load(q_t + n[None, :] * stride_q_d, mask=mask), mask=mask)
    tl.store(keys_t + n[None, :], tl.load(kv_t + n[None, :] * stride_kv_d, mask=mask), mask=mask)
    v = tl.arange(0, BLOCK_V)
    mask = head_mask & (v < V)[None, :]
    tl.store(values_t + v[None, :], tl.load(kv_t + (NOPE + v)[None, :] * stride_kv_d, mask=mask), mask=mask)
    pad = V + tl.arange(0, BLOCK_PAD)
    mask = head_mask & (pad < NOPE + ROPE)[None, :]
    tl.store(values_t + pad[None, :], tl.zeros((BLOCK_H, BLOCK_PAD), dtype=out_kv_ptr.dtype.element_ty), mask=mask)

    # cos and sin of the half-split output positions i and i + r/2.
    i = tl.arange(0, BLOCK_R // 2)
    i_mask = i < half
    cos_a = tl.load(cos_t + i * stride_cos_d, mask=i_mask, other=0.0).to(tl.float32)
    cos_b = tl.load(cos_t + (half + i) * stride_cos_d, mask=i_mask, other=0.0).to(tl.float32)
    sin_a = tl.load(sin_t + i * stride_sin_d, mask=i_mask, other=0.0).to(tl.float32)
    sin_b = tl.load(sin_t + (half + i) * stride_sin_d, mask=i_mask, other=0.0).to(tl.float32)

    # q's rope part: one contiguous load of each head's pairs, split into x[2i] and x[2i+1].
    r = tl.arange(0, BLOCK_R)
    mask = head_mask & (r < ROPE)[None, :]
    x = tl.load(q_t + (NOPE + r)[None, :] * stride_q_d, mask=mask, other=0.0).to(tl.float32)
    a, bb = tl.split(tl.reshape(x, (BLOCK_H, BLOCK_R // 2, 2)))
    out_a, out_b = rotate_pairs(a, bb, cos_a[None, :], cos_b[None, :], sin_a[None, :], sin_b[None, :], False)
    mask = head_mask & i_mask[None, :]
    tl.store(qo_t + (NOPE + i)[None, :], out_a.to(q_out_ptr.dtype.element_ty), mask=mask)
    tl.store(qo_t + (NOPE + half + i)[None, :], out_b.to(q_out_ptr.dtype.element_ty), mask=mask)

    # k_pe: one head, rotated the same way and broadcast over the heads of the keys.
    k = tl.load(k_pe_ptr + b * stride_k_b + s * stride_k_s + r * stride_k_d, mask=r < ROPE, other=0.0)
    ka, kb = tl.split(tl.reshape(k.to(tl.float32), (BLOCK_R // 2, 2)))
    k_a, k_b = rotate_pairs(ka, kb, cos_a, cos_b, sin_a, sin_b, False)
    k_a = tl.broadcast_to(k_a[None, :], (BLOCK_H, BLOCK_R // 2)).to(out_kv_ptr.dtype.element_ty)
    k_b = tl.broadcast_to(k_b[None, :], (BLOCK_H, BLOCK_R // 2)).to(out_kv_ptr.dtype.element_ty)
    tl.store(keys_t + (NOPE + i)[None, :], k_a, mask=mask)
    tl.store(keys_t + (NOPE + half + i)[None, :], k_b, mask=mask)


@triton.jit
def partial_rotary_backward_kernel(
    dqo_ptr, dokv_ptr, cos_ptr, sin_ptr, dq_ptr, dk_pe_ptr, dkv_ptr,
    S, H, NOPE: tl.constexpr, ROPE: tl.constexpr, V: tl.constexpr,
    stride_dqo_t, stride_dqo_h, stride_dqo_d,
    stride_dokv_t, stride_dokv_kv, stride_dokv_h, stride_dokv_d,
    stride_cos_b, stride_cos_s, stride_cos_d,
    stride_sin_b, stride_sin_s, stride_sin_d,
    stride_dq_t, stride_dq_h,
    stride_dk_t,
    stride_dkv_t, stride_dkv_h,
    BLOCK_H: tl.constexpr, BLOCK_NOPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
):
    token = tl.program_id(0)
    b = (token // S).to(tl.int64)
    s = (token % S).to(tl.int64)
    t = token.to(tl.int64)
    half = ROPE // 2
    cos_t = cos_ptr + b * stride_cos_b + s * stride_cos_s
    sin_t = sin_ptr + b * stride_sin_b + s * stride_sin_s
    i = tl.arange(0, BLOCK_R // 2)
    i_mask = i < half
    cos_a = tl.load(cos_t + i * stride_cos_d, mask=i_mask, other=0.0).to(tl.float32)
    cos_b = tl.load(cos_t + (half + i) * stride_cos_d, mask=i_mask, other=0.0).to(tl.float32)
    sin_a = tl.load(sin_t + i * stride_sin_d, mask=i_mask, other=0.0).to(tl.float32)
    sin_b = tl.load(sin_t + (half + i) * stride_sin_d, mask=i_mask, other=0.0).to(tl.float32)
    n = tl.arange(0, BLOCK_NOPE)
    v = tl.arange(0, BLOCK_V)
    r = tl.arange(0, BLOCK_R)

    # The key gradient's rope part, summed over the heads, in half-split order.
    dk_a = tl.zeros((BLOCK_H, BLOCK_R // 2), dtype=tl.float32)
    dk_b = tl.zeros((BLOCK_H, BLOCK_R // 2), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        head_mask = (heads < H)[:, None]
        dqo_t = dqo_ptr + t * stride_dqo_t + heads[:, None] * stride_dqo_h
        dkeys_t = dokv_ptr + t * stride_dokv_t + heads[:, None] * stride_dokv_h
        dvalues_t = dkeys_t + stride_dokv_kv
        dq_t = dq_ptr + t * stride_dq_t + heads[:, None] * stride_dq_h
        dkv_t = dkv_ptr + t * stride_dkv_t + heads[:, None] * stride_dkv_h

        mask = head_mask & (n < NOPE)[None, :]
        tl.store(dq_t + n[None, :], tl.load(dqo_t + n[None, :] * stride_dqo_d, mask=mask), mask=mask)
        tl.store(dkv_t + n[None, :], tl.load(dkeys_t + n[None, :] * stride_dokv_d, mask=mask), mask=mask)
        mask = head_mask & (v < V)[None, :]
        tl.store(dkv_t + (NOPE + v)[None, :], tl.load(dvalues_t + v[None, :] * stride_dokv_d, mask=mask), mask=mask)

        mask = head_mask & i_mask[None, :]
        d_a = tl.load(dqo_t + (NOPE + i)[None, :] * stride_dqo_d, mask=mask, other=0.0)
        dl.multibuffer(d_a, 2)
        d_a = d_a.to(tl.float32)
        d_b = tl.load(dqo_t + (NOPE + half + i)[None, :] * stride_dqo_d, mask=mask, other=0.0)
        dl.multibuffer(d_b, 2)
        d_b = d_b.to(tl.float32)
        g_a, g_b = rotate_pairs(d_a, d_b, cos_a[None, :], cos_b[None, :], sin_a[None, :], sin_b[None, :], True)
        g = tl.reshape(tl.join(g_a, g_b), (BLOCK_H, BLOCK_R))
        tl.store(dq_t + (NOPE + r)[None, :], g.to(dq_ptr.dtype.element_ty), mask=head_mask & (r < ROPE)[None, :])

        dk_a += tl.load(dkeys_t + (NOPE + i)[None, :] * stride_dokv_d, mask=mask, other=0.0).to(tl.float32)
        dk_b += tl.load(dkeys_t + (NOPE + half + i)[None, :] * stride_dokv_d, mask=mask, other=0.0).to(tl.float32)

    g_a, g_b = rotate_pairs(tl.sum(dk_a, axis=0), tl.sum(dk_b, axis=0), cos_a, cos_b, sin_a, sin_b, True)
    g = tl.reshape(tl.join(g_a, g_b), (BLOCK_R,))
    tl.store(dk_pe_ptr + t * stride_dk_t + r, g.to(dk_pe_ptr.dtype.element_ty), mask=r < ROPE)


# -- plans -----------------------------------------------------------------------------------------


def outputs(q: torch.Tensor, k_pe: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            nope_dim: int, rope_dim: int, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``q_out`` (q's shape) and ``out_kv [..., S, 2, H, nope + rope]``, contiguous, for the op's arguments."""
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    out_kv = torch.empty(*q.shape[:-2], 2, q.shape[-2], nope_dim + rope_dim, dtype=q.dtype, device=q.device)
    return q_out, out_kv


def _blocks(h: int, nope: int, rope: int, v: int, config: Config) -> dict[str, int]:
    return {
        "BLOCK_H": min(config["BLOCK_H"], next_power_of_2(h)),
        "BLOCK_NOPE": max(next_power_of_2(nope), 2),
        "BLOCK_R": max(next_power_of_2(rope), 2),
        "BLOCK_V": max(next_power_of_2(v), 2),
    }


def plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    q, k_pe, kv, cos, sin, nope, rope, v = args
    q_out, out_kv = outputs(*args)
    *batch, seq, h, width = q.shape
    tokens = math.prod(batch) * seq
    if q.numel() == 0:
        return LaunchPlan(calls=[], result=(q_out, out_kv))
    # Strides computed here, not through views: the inputs were validated to flatten.
    batch = tuple(batch)
    k_b, k_s, _, k_d = bshd_strides(k_pe)
    blocks = _blocks(h, nope, rope, v, config)
    call = KernelCall(
        partial_rotary_kernel, (tokens, cdiv(h, blocks["BLOCK_H"])),
        (q, k_pe, kv, cos, sin, q_out, out_kv, seq, h, nope, rope, v,
         *bshd_strides(q), k_b, k_s, k_d, *bshd_strides(kv), *bsd_strides(cos, batch), *bsd_strides(sin, batch),
         h * width, width, 2 * h * width, h * width, width),
        {**blocks, "BLOCK_PAD": max(next_power_of_2(nope + rope - v), 2), "num_warps": config["num_warps"]},
    )
    return LaunchPlan(calls=[call], result=(q_out, out_kv))


def backward_outputs(dq_out: torch.Tensor, dout_kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     k_pe: torch.Tensor, kv: torch.Tensor, *_: Any) -> tuple[torch.Tensor, ...]:
    """``(dq, dk_pe, dkv)`` for the backward's arguments: the shapes of q (dq_out's), k_pe and kv."""
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (dq_out, k_pe, kv))


def backward_plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    """The launch for ``(dq, dk_pe, dkv)`` from ``args = (dq_out, dout_kv, cos, sin, k_pe, kv, nope, rope, v)``
    (``k_pe`` and ``kv`` for their shapes only)."""
    dq_out, dout_kv, cos, sin, k_pe, kv, nope, rope, v = args
    dq, dk_pe, dkv = backward_outputs(*args)
    if dq.numel() == 0:
        return LaunchPlan(calls=[], result=(dq, dk_pe.zero_(), dkv))
    batch = tuple(dq.shape[:-3])
    seq, h = dq.shape[-3], dq.shape[-2]
    tokens = math.prod(batch) * seq
    # Gradients come from autograd in any layout (even expanded); reshape copies only when it must.
    dqo3 = dq_out.reshape(tokens, h, nope + rope)
    dokv4 = dout_kv.reshape(tokens, 2, h, nope + rope)
    step = min(config["BLOCK_H"], BACKWARD_HEADS, max(next_power_of_2(h) // 2, 1))
    blocks = _blocks(h, nope, rope, v, {**config, "BLOCK_H": step})
    warps = min(max(blocks["BLOCK_H"] * next_power_of_2(nope + rope) // (32 * BACKWARD_PER_THREAD), 1), 16)
    # dq, dk_pe and dkv are new contiguous tensors: [tokens, h, nope + rope], [tokens, rope], [tokens, h, nope + v].
    call = KernelCall(
        partial_rotary_backward_kernel, (tokens,),
        (dqo3, dokv4, cos, sin, dq, dk_pe, dkv, seq, h, nope, rope, v,
         *dqo3.stride(), *dokv4.stride(), *bsd_strides(cos, batch), *bsd_strides(sin, batch),
         h * (nope + rope), nope + rope, rope, h * (nope + v), nope + v),
        {**blocks, "num_warps": warps},
    )
    return LaunchPlan(calls=[call], result=(dq, dk_pe, dkv))


# -- reference, op ---------------------------------------------------------------------------------


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """``(x[0], x[2], ..., x[1], x[3], ...)``: the pairs' first elements, then their second."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V2's rope: de-interleave, then rotate-half with ``cos [..., r]`` (over heads on dim -2)."""
    x = _deinterleave(x)
    return x * cos.unsqueeze(-2) + _rotate_half(x) * sin.unsqueeze(-2)


def partial_rotary_emb_reference(q: torch.Tensor, k_pe: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor,
                                 sin: torch.Tensor, nope_dim: int, rope_dim: int,
                                 v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_out, out_kv)`` of the module docstring in float32 (or wider), returned in q's dtype."""
    compute = torch.promote_types(q.dtype, torch.float32)
    c, s = cos.to(compute), sin.to(compute)
    qf, kvf = q.to(compute), kv.to(compute)
    q_out = torch.cat((qf[..., :nope_dim], _rope(qf[..., nope_dim:], c, s)), dim=-1)
    k_rope = _rope(k_pe.to(compute), c, s).expand(*kv.shape[:-1], rope_dim)
    keys = torch.cat((kvf[..., :nope_dim], k_rope), dim=-1)
    values = torch.cat((kvf[..., nope_dim:], kvf.new_zeros(*kv.shape[:-1], nope_dim + rope_dim - v_dim)), dim=-1)
    return q_out.to(q.dtype), torch.stack((keys, values), dim=-3).to(q.dtype)


def _rope_backward(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The transpose of :func:`_rope`: the transposed rotation, then re-interleave."""
    g = dy * cos.unsqueeze(-2) - _rotate_half(dy * sin.unsqueeze(-2))
    return torch.stack(g.chunk(2, dim=-1), dim=-1).flatten(-2)


def partial_rotary_emb_backward_reference(dq_out: torch.Tensor, dout_kv: torch.Tensor, cos: torch.Tensor,
                                          sin: torch.Tensor, k_pe: torch.Tensor, kv: torch.Tensor, nope_dim: int,
                                          rope_dim: int, v_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk_pe, dkv)`` in float32 (or wider): the nope parts pass through, the rope parts get the
    transposed rope (the keys' summed over the heads first), the values' padding gets nothing.
    ``k_pe`` and ``kv``, the backward kernel's arguments for its outputs' shapes, are not read."""
    compute = torch.promote_types(dq_out.dtype, torch.float32)
    c, s = cos.to(compute), sin.to(compute)
    dqf, dkvf = dq_out.to(compute), dout_kv.to(compute)
    dq = torch.cat((dqf[..., :nope_dim], _rope_backward(dqf[..., nope_dim:], c, s)), dim=-1)
    dkeys, dvalues = dkvf.unbind(dim=-3)
    dk_pe = _rope_backward(dkeys[..., nope_dim:].sum(dim=-2, keepdim=True), c, s)
    dkv = torch.cat((dkeys[..., :nope_dim], dvalues[..., :v_dim]), dim=-1)
    return dq.to(dq_out.dtype), dk_pe.to(dq_out.dtype), dkv.to(dq_out.dtype)


def default_config(sig: Signature, profile: DeviceProfile) -> Config:
    """:data:`HEADS` heads per program, with the warps of a full block: with fewer heads (the plan
    caps BLOCK_H at the head count) each thread holds fewer elements, 16 for DeepSeek-V2-Lite's 16,
    which is what was measured. The head count is in the key (tuned configs are kept per head
    count), so a default that depends on it can come once measured."""
    width = next_power_of_2(sig.tensor("q").shape[-1])
    return {"BLOCK_H": HEADS, "num_warps": min(max(HEADS * width // (32 * PER_THREAD), 1), 8)}


def space(profile: DeviceProfile) -> SearchSpace:
    """Heads per program and warps."""
    return SearchSpace([PowerOfTwo("BLOCK_H", 1, 128), num_warps(1, 2, 4, 8, 16)])


def check(op: Op, args: dict[str, Any]) -> None:
    q, k_pe, kv, cos, sin = args["q"], args["k_pe"], args["kv"], args["cos"], args["sin"]
    nope, rope, v = args["nope_dim"], args["rope_dim"], args["v_dim"]
    if nope < 0 or v < 0 or rope < 2 or rope % 2:
        raise InvalidInputError(op.name, "nope_dim, rope_dim, v_dim", f"are {nope}, {rope}, {v}",
                                "nope_dim >= 0, v_dim >= 0 and an even rope_dim >= 2")
    if v > nope + rope:
        raise InvalidInputError(op.name, "v_dim", f"is {v} > nope_dim + rope_dim = {nope + rope}",
                                "v_dim <= nope_dim + rope_dim (values are padded to the key width)")
    op.expect_shape("q", q, (*q.shape[:-1], nope + rope), "[..., S, H, nope_dim + rope_dim]")
    lead, h = tuple(q.shape[:-2]), q.shape[-2]
    op.expect_shape("k_pe", k_pe, (*lead, 1, rope), "[..., S, 1, rope_dim] with q's leading dimensions")
    op.expect_shape("kv", kv, (*lead, h, nope + v), "[..., S, H, nope_dim + v_dim] with q's leading dimensions")
    if cos.shape[-1] != rope:
        raise InvalidInputError(op.name, "cos", f"has shape {tuple(cos.shape)}", f"cos [..., S, {rope}] (rope_dim)")
    op.expect_shape("sin", sin, tuple(cos.shape), "the shape of cos")
    if sin.dtype != cos.dtype:
        raise InvalidInputError(op.name, "sin", f"has dtype {sin.dtype} but cos has {cos.dtype}",
                                "sin with the dtype of cos")
    check_token_layouts(op, q, {"k_pe": k_pe, "kv": kv}, {"cos": cos, "sin": sin})


def example(sizes: dict[str, int], dtype: torch.dtype, device: torch.device,
            generator: torch.Generator) -> tuple:
    """DeepSeek-V2's shapes by default (nope 128, rope 64, v 128): random q, k_pe, kv for
    ``[1, tokens, heads]`` and the cos and sin of positions ``0 .. tokens - 1``."""
    tokens, h = sizes["tokens"], sizes["heads"]
    nope, rope, v = sizes["nope_dim"], sizes["rope_dim"], sizes["v_dim"]
    q = torch.randn(1, tokens, h, nope + rope, generator=generator)
    k_pe = torch.randn(1, tokens, 1, rope, generator=generator)
    kv = torch.randn(1, tokens, h, nope + v, generator=generator)
    cos, sin = llama_cos_sin(1, tokens, rope, dtype, device)
    return (*(t.to(device=device, dtype=dtype) for t in (q, k_pe, kv)), cos, sin, nope, rope, v)


def cost(args: tuple, mode: str = "fwd") -> tuple[int, int]:
    """Forward: read q, k_pe, kv, cos and sin, write q_out and out_kv (twice q's size).
    Backward: read the gradients of q_out and out_kv (but not of the values' padding), cos and sin,
    write dq, dk_pe and dkv. Three flops per rotated element (q's rope parts and k_pe, once); the
    backward also sums the keys' rope gradient over the heads. Gradients of cos and sin are not
    counted."""
    q, k_pe, kv, cos, sin, nope, rope, _ = args
    size = q.element_size()
    tables = (cos.numel() + sin.numel()) * cos.element_size()
    heads_rows = q.numel() // q.shape[-1]
    flops = 3 * (heads_rows * rope + k_pe.numel())
    if mode == "bwd":
        read = (2 * q.numel() + kv.numel() - heads_rows * nope) * size
        return read + tables + (q.numel() + k_pe.numel() + kv.numel()) * size, flops + heads_rows * rope
    read = (q.numel() + k_pe.numel() + kv.numel()) * size
    return read + tables + 3 * q.numel() * size, flops


def torch_partial_rotary_emb(q: torch.Tensor, k_pe: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor,
                             sin: torch.Tensor, nope_dim: int, rope_dim: int,
                             v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What a model runs in eager torch: DeepSeek-V2's attention code, in the input dtype."""
    q_nope, q_pe = q.split([nope_dim, rope_dim], dim=-1)
    k_nope, value = kv.split([nope_dim, v_dim], dim=-1)
    q_pe, k_pe = _rope(q_pe, cos, sin), _rope(k_pe, cos, sin)
    q_out = torch.cat((q_nope, q_pe), dim=-1)
    keys = torch.cat((k_nope, k_pe.expand(*k_nope.shape[:-1], rope_dim)), dim=-1)
    values = torch.nn.functional.pad(value, (0, nope_dim + rope_dim - v_dim))
    return q_out, torch.stack((keys, values), dim=-3)


OP = Op(
    name="partial_rotary_emb",
    args=(
        TensorArg("q", DTYPES, min_rank=3, layouts=ANY_LAYOUT, bucket="tokens"),
        TensorArg("k_pe", DTYPES, min_rank=3, layouts=ANY_LAYOUT, same_dtype_as="q", bucket="tokens"),
        TensorArg("kv", DTYPES, min_rank=3, layouts=ANY_LAYOUT, same_dtype_as="q", bucket="tokens"),
        TensorArg("cos", DTYPES, min_rank=2, layouts=ANY_LAYOUT, bucket="rows", differentiable=False),
        TensorArg("sin", DTYPES, min_rank=2, layouts=ANY_LAYOUT, bucket="rows", differentiable=False),
        ScalarArg("nope_dim", (int,), keyed=True),
        ScalarArg("rope_dim", (int,), keyed=True),
        ScalarArg("v_dim", (int,), keyed=True),
    ),
    reference=partial_rotary_emb_reference,
    doc="DeepSeek-V2 MLA rotary: (q with its rope part rotated, [keys, values] with rope(k_pe) and padding)",
    check=check,
    example=example,
    example_sizes={"tokens": 37, "heads": 4, "nope_dim": 128, "rope_dim": 64, "v_dim": 128},
    cost=cost,
    baselines={"torch": lambda: torch_partial_rotary_emb},
)


def _table_grads(dq_out: torch.Tensor, dout_kv: torch.Tensor, q: torch.Tensor, k_pe: torch.Tensor,
                 cos: torch.Tensor, nope: int,
                 wanted: tuple[bool, bool]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The ``wanted`` gradients of cos and sin (rarely asked for, so in torch): ``sum over heads of
    dy * x'`` and ``of dy * rotate_half(x')``, x' the de-interleaved rope inputs, reduced to cos's shape."""
    compute = torch.promote_types(cos.dtype, torch.float32)
    pairs = [(dq_out[..., nope:], q[..., nope:]), (dout_kv.select(-3, 0)[..., nope:], k_pe)]
    xs = [(dy.to(compute), _deinterleave(x.to(compute))) for dy, x in pairs]
    grads = []
    for want, rotated in zip(wanted, (False, True)):
        if not want:
            grads.append(None)
            continue
        g = sum((dy * (_rotate_half(x) if rotated else x)).sum(-2) for dy, x in xs)
        grads.append(g.sum_to_size(cos.shape).to(cos.dtype))
    return grads[0], grads[1]


def _gradients(backward, saved, grads, needs) -> dict:
    dq_out, dout_kv = grads
    dims = saved.nope_dim, saved.rope_dim, saved.v_dim
    got = {}
    if needs["q"] or needs["k_pe"] or needs["kv"]:
        got["q"], got["k_pe"], got["kv"] = backward(dq_out, dout_kv, saved.cos, saved.sin, saved.k_pe, saved.kv, *dims)
    if needs["cos"] or needs["sin"]:
        got["cos"], got["sin"] = _table_grads(dq_out, dout_kv, saved.q, saved.k_pe, saved.cos, saved.nope_dim,
                                              (needs["cos"], needs["sin"]))
    return got


KERNEL = define_kernel(
    OP, plan,
    kernels=(partial_rotary_kernel, partial_rotary_backward_kernel),
    results=outputs,
    outputs=("q_out", "out_kv"),
    default_config=default_config,
    space=space,
    # k_pe and kv give the gradients' shapes; q is kept only for the gradients of cos and sin, which
    # models do not ask for.
    backward=Backward(_gradients, saved=("cos", "sin", "k_pe", "kv", "nope_dim", "rope_dim", "v_dim"),
                      saved_for={"cos": ("q",), "sin": ("q",)}, plan=backward_plan,
                      reference=partial_rotary_emb_backward_reference,
                      results=backward_outputs,
                      renames={"q": "dq_out"}),
    doc="one program per (token, head block): nope copies, interleaved-in half-split-out rope, padded values; "
        "backward one program per token, dk_pe summed over heads in registers",
)
partial_rotary_emb = KERNEL.function
dlcore_ops, dlcore_implementations = KERNEL.dlcore_ops, KERNEL.dlcore_implementations
