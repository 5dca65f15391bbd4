"""fused_rotary_and_fa: rotary position embedding of q and k inside flash attention, forward and backward.

    q' = q * cos_q + rotate(q) * sin_q          k' = k * cos + rotate(k) * sin
    out = softmax(scale * q' k'^T + mask) v                                          [B, Sq, Hq, D]

q ``[B, Sq, Hq, D]``, k and v ``[B, Sk, Hk, D]`` (BSHD, any strides; Hq a multiple of Hk, query head
``h`` reading kv head ``h // (Hq / Hk)``). The rotation is :mod:`apply_rotary_pos_emb`'s, with the same
tables: cos and sin ``[Sk, D]`` or ``[B, Sk, D]``, one row per key position, rotate-half pairs
``(i, i + D/2)`` or with ``interleaved`` pairs ``(2i, 2i + 1)``. Key ``j`` takes row ``j``; the queries
are the last Sq positions (bottom-right, as the causal mask), so query ``i`` takes row
``Sk - Sq + i``. With ``causal``, query ``i`` sees keys ``j <= i + Sk - Sq``; the queries that see no
key (``Sq > Sk``) have no row and need none (their output is 0); without ``causal``, ``Sq > Sk`` is
refused: those queries would precede the tables' first position. ``scale`` is ``softmax_scale`` or
``D ** -0.5``.

The forward is the attention block's (:func:`dlblas_kernels.blocks.attention.forward_calls` with
``rotary=(cos, sin, interleaved)``): each program rotates its q tile once after loading it and each
k tile as it streams through, so the rotated q and k never reach memory; that saves the composite's
rotary kernel, a read and a write of q and k (``apply_rotary_pos_emb`` then attention). It also
writes the log-sum-exp ``lse [B, Hq, Sq]`` (float32), which the backward needs and callers do not
see (:class:`~dlcore.runtime.template.Residuals`). The backward
(:func:`dlblas_kernels.blocks.attention_grad.rotary_backward_plan`) computes the attention gradients of the
rotated q' and k' and applies the transposed rotation to dq' and dk': ``dq = dq' * cos_q -
rotate(dq' * sin_q)`` (the rotation is linear, its gradient its transpose). It writes q' and k' to
scratch with :mod:`apply_rotary_pos_emb`'s kernel (q' from the tables' last Sq rows), runs
flash_attention_v2's backward on them and rotates dq' and dk' back with the same kernel: rotating
inside the backward's loops would rotate each streamed tile again for every block it meets.

cos and sin are tables, declared not differentiable (a training step does not ask for their
gradients); a learnt table that requires grad still gets its gradient, as the unfused composite's
does: ``dcos = sum(dk' * k) + sum(dq' * q)`` and ``dsin = sum(dk' * rotate(k)) + sum(dq' *
rotate(q))`` over the heads (and the batch for ``[Sk, D]`` tables), query ``i``'s terms in row
``Sk - Sq + i``: a reduction in torch of the backward's dq' and dk' (which its plan returns),
run only when asked for.

The baseline ``composite`` is what a model runs unfused: dlblas ``apply_rotary_pos_emb``, then
``F.scaled_dot_product_attention`` with the fastest backend that accepts the inputs (cuDNN, then
flash: on sm_90 cuDNN's forward and backward are the faster). It is also a candidate of the op
(:data:`dlblas_kernels.vendor.FUSED_ROTARY_AND_FA`, kind ``vendor``, on NVIDIA GPUs from sm_80), so
that ``get_op`` takes it where it measures faster than the fused kernel: cuDNN's attention runs
above what the Triton kernel reaches, and the rotary pass it adds costs a read and a write of q
and k, a small part of the attention's time from S 2048 on.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from dlblas_kernels.blocks import attention, attention_grad
from dlblas_kernels.blocks.rotary import rotary_kernel
from dlblas_kernels.kernels import flash_attention_v2
from dlblas_kernels.kernels.apply_rotary_pos_emb import apply_rotary_pos_emb, llama_cos_sin, rotate
from dlblas_kernels.kernels.flash_attention_v2 import scale_of, training_outputs
from dlcore.api import (
    Backward,
    Config,
    DeviceProfile,
    InvalidInputError,
    LaunchPlan,
    LoweringLimit,
    Op,
    Residuals,
    ScalarArg,
    SearchSpace,
    Signature,
    TensorArg,
    define_kernel,
)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ANY_LAYOUT = ("contiguous", "rows", "strided")
#: SDPA's backends for the composite, fastest first; the two last serve what the first two refuse
#: (the CPU; causal with Sq != Sk, whose ``causal_lower_right`` mask runs on the efficient kernel).
SDPA_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                 SDPBackend.MATH]


# -- reference ---------------------------------------------------------------------------------------


def query_rows(table: torch.Tensor, sq: int, sk: int) -> torch.Tensor:
    """The rows of a ``[..., Sk, D]`` table the ``sq`` queries take: ``Sk - Sq + i`` for query ``i``
    (the last Sq positions); with ``Sq > Sk`` the first ``Sq - Sk`` queries, which see no key, take
    row 0 (any row would do)."""
    if sq <= sk:
        return table[..., sk - sq:, :]
    rows = (torch.arange(sq, device=table.device) + sk - sq).clamp(min=0)
    return table.index_select(-2, rows)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """``x * cos + rotate(x) * sin`` (apply_rotary_pos_emb's math), x ``[B, S, H, D]`` and the tables
    ``[S, D]`` or ``[B, S, D]`` broadcast over the heads."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return x * cos + rotate(x, interleaved) * sin


def attention_formula(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(softmax(scale * q k^T + mask) v, lse)`` for BSHD q, k, v (k and v repeated over each group
    of query heads), lse ``[B, Hq, Sq]`` the natural log of each row's sum of exponentials; a row that
    sees no key gives zeros and ``lse = -inf``, and no NaN in its gradients."""
    sq, hq, sk, hk = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    k, v = (t.repeat_interleave(hq // hk, dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        scores = scores.masked_fill(j > i + sk - sq, float("-inf"))
    if sk == 0:
        return q.new_zeros(q.shape[:3] + v.shape[3:]), scores.new_full(scores.shape[:3], float("-inf"))
    # The row maximum, for stability only (the result does not depend on it): -inf where no key is seen.
    m = scores.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, 0)
    p = torch.exp(scores - m)
    total = p.sum(dim=-1, keepdim=True)
    out = torch.einsum("bhqk,bkhd->bqhd", p / torch.where(total > 0, total, 1), v)
    return out, (m + torch.log(total)).squeeze(-1)


def fused_rotary_and_fa_training_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                                           sin: torch.Tensor, causal: bool = False,
                                           softmax_scale: float | None = None,
                                           interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``: q and k rotated, then the attention formula, in float32 (or wider); out in q's
    dtype, lse float32 (float64 for float64 inputs)."""
    compute = torch.promote_types(q.dtype, torch.float32)
    sq, sk = q.shape[1], k.shape[1]
    c, s = cos.to(compute), sin.to(compute)
    q_rot = rotary(q.to(compute), query_rows(c, sq, sk), query_rows(s, sq, sk), interleaved)
    k_rot = rotary(k.to(compute), c, s, interleaved)
    out, lse = attention_formula(q_rot, k_rot, v.to(compute), causal, scale_of(q, softmax_scale))
    return out.to(q.dtype), lse


def fused_rotary_and_fa_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                                  sin: torch.Tensor, causal: bool = False, softmax_scale: float | None = None,
                                  interleaved: bool = False) -> torch.Tensor:
    """The output of :func:`fused_rotary_and_fa_training_reference`."""
    return fused_rotary_and_fa_training_reference(q, k, v, cos, sin, causal, softmax_scale, interleaved)[0]


# -- plans -------------------------------------------------------------------------------------------


def results(q: torch.Tensor, *_: Any) -> torch.Tensor:
    return training_outputs(q)[0]


def _forward(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    q, k, v, cos, sin, causal, softmax_scale, interleaved = args
    out, lse = training_outputs(q)
    calls = attention.forward_calls(q, k, v, out, lse, causal=causal, scale=scale_of(q, softmax_scale),
                                    config=config, profile=profile, rotary=(cos, sin, interleaved))
    return LaunchPlan(calls, (out, lse))


def plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    """The attention block's forward with the rotation applied to its q and k tiles; lse is scratch."""
    forward = _forward(args, config, profile)
    out, lse = forward.result
    return LaunchPlan(forward.calls, out, scratch=(lse,))


def training_plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    """:func:`plan` returning ``(out, lse)``: the custom op's body, whose autograd saves lse."""
    return _forward(args, config, profile)


# -- declaration -------------------------------------------------------------------------------------


def default_config(sig: Signature, profile: DeviceProfile | None) -> Config:
    """flash_attention_v2's blocks (:func:`~dlblas_kernels.kernels.flash_attention_v2.default_config`)
    fitted to the shared memory with the rotary tiles (:func:`dlblas_kernels.blocks.attention.fit`): at D
    128 in 16-bit, 128 x 128 blocks, 8 warps, 2 stages (k, cos, sin and v per stage, and the rotated
    k tile: 229 408 bytes of sm_90's 232 448)."""
    config = flash_attention_v2.default_config(sig, profile)
    _, _, _, d = sig.tensor("q").shape
    return attention.fit(config, d, sig.dtype.itemsize, profile, rotary=True)


def space(profile: DeviceProfile) -> SearchSpace:
    """flash_attention_v2's space without the warp-specialised loop, which the rotary kernel's loop
    does not compile to (:mod:`dlblas_kernels.blocks.attention`)."""
    return flash_attention_v2.space(profile)


def check(op: Op, args: dict[str, Any]) -> None:
    """flash_attention_v2's checks of q, k and v; an even D; tables of one row per key; Sq <= Sk
    unless causal (see the module doc)."""
    flash_attention_v2.check(op, args)
    q, k, cos, sin = args["q"], args["k"], args["cos"], args["sin"]
    b, sq, _, d = q.shape
    sk = k.shape[1]
    if d % 2:
        raise InvalidInputError(op.name, "q", f"has an odd head dimension (shape {tuple(q.shape)})",
                                "an even head dimension D: rotary embeddings rotate pairs of elements")
    tables = ((sk, d), (b, sk, d))
    if tuple(cos.shape) not in tables:
        raise InvalidInputError(op.name, "cos", f"has shape {tuple(cos.shape)}",
                                f"cos [Sk, D] = {tables[0]} or [B, Sk, D] = {tables[1]}: one row per key position")
    op.expect_shape("sin", sin, tuple(cos.shape), "the shape of cos")
    if sin.dtype != cos.dtype:
        raise InvalidInputError(op.name, "sin", f"has dtype {sin.dtype} but cos has {cos.dtype}",
                                "sin with the dtype of cos")
    if sq > sk and not args["causal"]:
        raise InvalidInputError(
            op.name, "q", f"has {sq} queries for {sk} keys without causal",
            "Sq <= Sk, or causal=True: the queries are the last Sq of the Sk positions the tables cover "
            "(under causal, the queries before the first key see no key and need no row)")


def example(sizes: dict[str, int], dtype: torch.dtype, device: torch.device,
            generator: torch.Generator) -> tuple:
    """Random ``q [batch, seq, heads, head_dim]``, ``k, v [batch, kv_seq, kv_heads, head_dim]``
    (``kv_seq`` 0: ``seq``) and LLaMA's cos and sin ``[kv_seq, head_dim]`` of positions
    ``0 .. kv_seq - 1``; ``causal`` and ``interleaved`` 0 or 1."""
    b, sq, d = sizes["batch"], sizes["seq"], sizes["head_dim"]
    sk = sizes["kv_seq"] or sq
    interleaved = bool(sizes["interleaved"])
    q = torch.randn(b, sq, sizes["heads"], d, generator=generator)
    k = torch.randn(b, sk, sizes["kv_heads"], d, generator=generator)
    v = torch.randn(b, sk, sizes["kv_heads"], d, generator=generator)
    cos, sin = llama_cos_sin(1, sk, d, dtype, device, interleaved)
    return (*(t.to(device=device, dtype=dtype) for t in (q, k, v)), cos[0], sin[0], bool(sizes["causal"]), None,
            interleaved)


def cost(args: tuple, mode: str = "fwd") -> tuple[int, int]:
    """Forward: read q, k, v, cos and sin, write out; attention's flops, ``4 * D`` per (query, key)
    pair the mask keeps per head (the rotation's few flops per element of q and k are not counted).
    Backward: read dout, q, k, v, cos, sin, out and lse, write dq, dk and dv; 2.5 times the flops
    (five products of the forward's two sizes)."""
    q, k, v, cos, sin, causal = args[:6]
    b, sq, hq, d = q.shape
    size = lambda *ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    flops = 4 * b * hq * d * flash_attention_v2.attended_pairs(sq, k.shape[1], causal)
    if mode == "bwd":
        lse = 4 * b * hq * sq
        return 2 * size(q, k, v) + size(cos, sin) + 2 * size(q) + lse, 5 * flops // 2
    return size(q, k, v, cos, sin) + size(q), flops


def composite(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              causal: bool = False, softmax_scale: float | None = None, interleaved: bool = False) -> torch.Tensor:
    """dlblas apply_rotary_pos_emb, then SDPA with the fastest backend that accepts the inputs."""
    sq, sk = q.shape[1], k.shape[1]
    if sq == sk:
        q_rot, k_rot = apply_rotary_pos_emb(q, k, cos, sin, interleaved)
    else:
        # q and k take different rows: each rotated alone, beside a tensor of no heads.
        no_heads = lambda t: t.new_empty(*t.shape[:2], 0, t.shape[3])  # noqa: E731
        q_rot = apply_rotary_pos_emb(q, no_heads(q), query_rows(cos, sq, sk), query_rows(sin, sq, sk), interleaved)[0]
        k_rot = apply_rotary_pos_emb(k, no_heads(k), cos, sin, interleaved)[0]
    with sdpa_kernel(SDPA_BACKENDS, set_priority=True):
        return flash_attention_v2.torch_attention(q_rot, k_rot, v, causal, softmax_scale)


OP = Op(
    name="fused_rotary_and_fa",
    args=(
        TensorArg("q", DTYPES, min_rank=4, max_rank=4, layouts=ANY_LAYOUT, bucket="sequence"),
        TensorArg("k", DTYPES, min_rank=4, max_rank=4, layouts=ANY_LAYOUT, same_dtype_as="q", bucket="sequence"),
        TensorArg("v", DTYPES, min_rank=4, max_rank=4, layouts=ANY_LAYOUT, same_dtype_as="q", bucket="sequence"),
        TensorArg("cos", DTYPES, min_rank=2, max_rank=3, layouts=ANY_LAYOUT, bucket="rows", differentiable=False),
        TensorArg("sin", DTYPES, min_rank=2, max_rank=3, layouts=ANY_LAYOUT, bucket="rows", differentiable=False),
        ScalarArg("causal", (bool,), default=False, keyed=True),
        ScalarArg("softmax_scale", (float, int, type(None)), default=None, finite=True),
        ScalarArg("interleaved", (bool,), default=False, keyed=True),
    ),
    reference=fused_rotary_and_fa_reference,
    doc="softmax(scale * rot(q) rot(k)^T + mask) v, rot(x) = x * cos + rotate(x) * sin; q [B, Sq, Hq, D], "
        "k, v [B, Sk, Hk, D], cos/sin [Sk, D] or [B, Sk, D], causal bottom-right",
    check=check,
    example=example,
    example_sizes={**flash_attention_v2.OP.example_sizes, "interleaved": 0},
    example_paths={"prefill": {"seq": 300},
                   "causal, heads of 256": {"seq": 300, "heads": 16, "kv_heads": 4, "head_dim": 256, "causal": 1}},
    cost=cost,
    baselines={"composite": lambda: composite},
)


def _head_sums(dy: torch.Tensor, x: torch.Tensor, rotated: bool, interleaved: bool,
               compute: torch.dtype) -> torch.Tensor:
    """``dy * x`` (``dy * rotate(x)`` when ``rotated``) in ``compute``, summed over the heads: ``[B, S, D]``."""
    x = x.to(compute)
    return (dy.to(compute) * (rotate(x, interleaved) if rotated else x)).sum(2)


def table_gradients(dq_rot: torch.Tensor, dk_rot: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                    interleaved: bool, wanted: tuple[bool, bool]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The ``wanted`` gradients of cos and sin from the gradients ``dq'``, ``dk'`` of the rotated q
    and k: per table row, ``dy * x`` (cos) and ``dy * rotate(x)`` (sin) summed over the heads, key
    ``j``'s terms in row ``j`` and query ``i``'s in row ``Sk - Sq + i``, then over the batch where
    the tables have none; in float32 (or wider), returned in cos's dtype. The first ``Sq - Sk``
    queries (``Sq > Sk``, causal) see no key: their dq' is 0 and they take no row."""
    compute = torch.promote_types(cos.dtype, torch.float32)
    sq, sk = q.shape[1], k.shape[1]
    grads = []
    for want, rotated in zip(wanted, (False, True)):
        if not want:
            grads.append(None)
            continue
        g, g_q = (_head_sums(dy, x, rotated, interleaved, compute) for dy, x in ((dk_rot, k), (dq_rot, q)))
        if sq <= sk:
            g[:, sk - sq:] += g_q
        else:
            g += g_q[:, sq - sk:]
        grads.append(g.sum_to_size(cos.shape).to(cos.dtype))
    return grads[0], grads[1]


def _gradients(backward, saved, grads, needs) -> dict:
    dq, dk, dv, dq_rot, dk_rot = backward(grads[0], saved.q, saved.k, saved.v, saved.cos, saved.sin, saved.out,
                                          saved.lse, saved.causal, saved.softmax_scale, saved.interleaved)
    got = {"q": dq, "k": dk, "v": dv}
    if needs["cos"] or needs["sin"]:
        got["cos"], got["sin"] = table_gradients(dq_rot, dk_rot, saved.q, saved.k, saved.cos, saved.interleaved,
                                                 (needs["cos"], needs["sin"]))
    return got


KERNEL = define_kernel(
    OP, plan,
    kernels=(*attention.FORWARD_KERNELS, *attention_grad.BACKWARD_KERNELS, rotary_kernel),
    results=results,
    default_config=default_config,
    space=space,
    backward=Backward(
        _gradients, saved=("q", "k", "v", "cos", "sin", "out", "lse", "causal", "softmax_scale", "interleaved"),
        plan=attention_grad.rotary_backward_plan, reference=attention_grad.rotary_backward_reference,
        results=attention_grad.rotary_backward_results,
        residuals=Residuals(("lse",), training_plan, training_outputs, fused_rotary_and_fa_training_reference)),
    doc="flash attention with q and k rotated in registers after loading (never written); backward: q and k "
        "rotated into scratch, the attention backward, dq and dk rotated back",
    limits=(LoweringLimit(
        "npu", ("attention_forward_kernel",), "hivm",
        "bishengir-compile 1.2 aborts in its tile-cube-vector-loop pass ('getIndexingMaps not implemented') on "
        "the interleaved rotation (interleaved=True: its tl.gather of lanes inside the mixed cube/vector loops); "
        "the half-split rotation (interleaved=False), the same kernel without rotation (flash_attention_v2) and "
        "tl.gather in small kernels (the backward's rotary_kernel) reach HIVM IR"),),
)
fused_rotary_and_fa = KERNEL.function
dlcore_ops, dlcore_implementations = KERNEL.dlcore_ops, KERNEL.dlcore_implementations
