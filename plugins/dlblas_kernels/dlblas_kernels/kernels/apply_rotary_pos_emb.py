"""apply_rotary_pos_emb: rotary position embedding of queries and keys, ``x * cos + rotate(x) * sin``.

q ``[..., S, Hq, D]`` and k ``[..., S, Hk, D]`` (Hk may differ from Hq), cos and sin ``[..., S, D]``
broadcast over the heads (and over leading dimensions they lack or hold as 1). ``rotate`` pairs
element ``a`` of each head with element ``b`` and gives ``(-x[b], x[a])`` at ``(a, b)``:

- rotate-half (default, LLaMA / NeoX): pairs ``(i, i + D/2)``; with ``cos = cat(f, f).cos()``;
- interleaved (GPT-J): pairs ``(2i, 2i + 1)``; with ``cos = f.repeat_interleave(2, -1).cos()``.

For each pair the forward is ``(a*cos_a - b*sin_a, b*cos_b + a*sin_b)``; the backward applies the
transposed rotation, ``(a*cos_a + b*sin_b, b*cos_b - a*sin_a)``, to the output gradients: one
kernel serves both. cos and sin are read per element, so any values work, not only the usual
duplicated halves.

Math in float32; outputs in q's dtype, written to new tensors, or into q and k with
``inplace=True``. The kernel, its layouts and its launch are the rotary block's
(:mod:`dlblas_kernels.blocks.rotary`), shared with the ops that rotate inside their own plans
(``partial_rotary_emb``, ``fused_rotary_and_fa``, the attention block).
"""

from __future__ import annotations

from typing import Any

import torch

from dlblas_kernels.blocks.rotary import check_token_layouts, config_for, rotary_calls, rotary_kernel
from dlcore.api import (
    Backward,
    Config,
    DeviceProfile,
    InvalidInputError,
    LaunchPlan,
    Op,
    PowerOfTwo,
    ScalarArg,
    SearchSpace,
    Signature,
    TensorArg,
    define_kernel,
    num_warps,
)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ANY_LAYOUT = ("contiguous", "rows", "strided")


# -- plans -----------------------------------------------------------------------------------------


def outputs(q: torch.Tensor, k: torch.Tensor, *_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape)


def plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    q, k, cos, sin, interleaved, inplace = args
    q_out, k_out = (q, k) if inplace else outputs(q, k)
    return LaunchPlan(rotary_calls(q, k, q_out, k_out, cos, sin, interleaved, False, config, profile), (q_out, k_out))


def backward_plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    """The launch for ``(dq, dk)`` from ``args = (dq_out, dk_out, cos, sin, interleaved)``."""
    dq_out, dk_out, cos, sin, interleaved = args
    dq, dk = outputs(dq_out, dk_out)
    return LaunchPlan(rotary_calls(dq_out, dk_out, dq, dk, cos, sin, interleaved, True, config, profile), (dq, dk))


# -- reference, op ---------------------------------------------------------------------------------


def rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """``rotate_half(x) = cat(-x2, x1)``, or with ``interleaved`` ``(-x[2i+1], x[2i])`` in each pair."""
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                   interleaved: bool = False,
                                   inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``x * cos + rotate(x) * sin`` for q and k in float32 (or wider), returned in their dtype."""
    compute = torch.promote_types(q.dtype, torch.float32)
    c, s = cos.to(compute).unsqueeze(-2), sin.to(compute).unsqueeze(-2)
    q_out, k_out = ((x.to(compute) * c + rotate(x.to(compute), interleaved) * s).to(x.dtype) for x in (q, k))
    if inplace:
        return q.copy_(q_out), k.copy_(k_out)
    return q_out, k_out


def apply_rotary_pos_emb_backward_reference(dq_out: torch.Tensor, dk_out: torch.Tensor, cos: torch.Tensor,
                                            sin: torch.Tensor,
                                            interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dq, dk)``: the transposed rotation, ``dy * cos - rotate(dy * sin)``, in float32 (or wider)."""
    compute = torch.promote_types(dq_out.dtype, torch.float32)
    c, s = cos.to(compute).unsqueeze(-2), sin.to(compute).unsqueeze(-2)
    return tuple((g.to(compute) * c - rotate(g.to(compute) * s, interleaved)).to(g.dtype) for g in (dq_out, dk_out))


def default_config(sig: Signature, profile: DeviceProfile) -> Config:
    """The rotary block's steps for the signature's shape (:func:`dlblas_kernels.blocks.rotary.config_for`)."""
    tokens, heads, d = sig.tensor("q").shape  # tokens rounded up to a power of two
    return config_for(tokens, heads, d)


def space(profile: DeviceProfile) -> SearchSpace:
    """(token, head) rows per step and warps."""
    return SearchSpace([PowerOfTwo("BLOCK_H", 1, 256), num_warps(1, 2, 4, 8, 16)])


def check(op: Op, args: dict[str, Any]) -> None:
    q, k, cos, sin = args["q"], args["k"], args["cos"], args["sin"]
    d = q.shape[-1]
    if d % 2:
        raise InvalidInputError(op.name, "q", f"has an odd head dimension (shape {tuple(q.shape)})",
                                "an even head dimension D: rotary embeddings rotate pairs of elements")
    op.expect_shape("k", k, (*q.shape[:-2], k.shape[-2], d), "[..., S, Hk, D] with q's leading dimensions and D")
    if cos.shape[-1] != d:
        raise InvalidInputError(op.name, "cos", f"has shape {tuple(cos.shape)}", f"cos [..., S, D] with D = {d}")
    op.expect_shape("sin", sin, tuple(cos.shape), "the shape of cos")
    if sin.dtype != cos.dtype:
        raise InvalidInputError(op.name, "sin", f"has dtype {sin.dtype} but cos has {cos.dtype}",
                                "sin with the dtype of cos")
    check_token_layouts(op, q, {"k": k}, {"cos": cos, "sin": sin})


def llama_cos_sin(batch: int, seq: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                  interleaved: bool = False, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[batch, seq, head_dim]`` of positions ``0 .. seq - 1``, as LLaMA computes them:
    ``cat(f, f)`` (``f.repeat_interleave(2)`` when ``interleaved``)."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    f = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    emb = f.repeat_interleave(2, dim=-1) if interleaved else torch.cat((f, f), dim=-1)
    emb = emb.expand(batch, seq, head_dim)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


def example(sizes: dict[str, int], dtype: torch.dtype, device: torch.device,
            generator: torch.Generator) -> tuple:
    """Random ``q [1, tokens, heads, head_dim]``, ``k [1, tokens, kv_heads, head_dim]`` and LLaMA's
    cos and sin of positions ``0 .. tokens - 1``."""
    tokens, d = sizes["tokens"], sizes["head_dim"]
    q = torch.randn(1, tokens, sizes["heads"], d, generator=generator)
    k = torch.randn(1, tokens, sizes["kv_heads"], d, generator=generator)
    cos, sin = llama_cos_sin(1, tokens, d, dtype, device)
    return q.to(device=device, dtype=dtype), k.to(device=device, dtype=dtype), cos, sin, False, False


def cost(args: tuple, mode: str = "fwd") -> tuple[int, int]:
    """Read q, k (or their output gradients), cos and sin, write q and k rotated (or dq and dk);
    per element two products and a sum, either way. cos and sin are tables: their gradients, which
    a model never asks for, are not counted."""
    q, k, cos, sin, *_ = args
    qk = q.numel() * q.element_size() + k.numel() * k.element_size()
    return 2 * qk + cos.numel() * cos.element_size() + sin.numel() * sin.element_size(), 3 * (q.numel() + k.numel())


def torch_apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                               interleaved: bool = False, inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """What a model runs in eager torch: transformers' ``apply_rotary_pos_emb`` (heads on dim -2)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    q_out = q * cos + rotate(q, interleaved) * sin
    k_out = k * cos + rotate(k, interleaved) * sin
    if inplace:
        return q.copy_(q_out), k.copy_(k_out)
    return q_out, k_out


def liger_apply_rotary_pos_emb():
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
    except ImportError:
        return None

    def run(q, k, cos, sin, interleaved=False, inplace=False):
        # Liger takes [B, H, S, D] views of [B, S, H, D] storage and rotates that storage in place,
        # as it does in a model; it knows rotate-half only.
        if interleaved or q.dim() != 4:
            raise NotImplementedError("liger's rope takes q [B, S, H, D] views and rotate-half only")
        out = LigerRopeFunction.apply(q.transpose(1, 2), k.transpose(1, 2), cos.reshape(-1, *cos.shape[-2:]),
                                      sin.reshape(-1, *sin.shape[-2:]))
        return out[0].transpose(1, 2), out[1].transpose(1, 2)

    return run


OP = Op(
    name="apply_rotary_pos_emb",
    args=(
        TensorArg("q", DTYPES, min_rank=3, layouts=ANY_LAYOUT, bucket="tokens"),
        TensorArg("k", DTYPES, min_rank=3, layouts=ANY_LAYOUT, same_dtype_as="q", bucket="tokens"),
        TensorArg("cos", DTYPES, min_rank=2, layouts=ANY_LAYOUT, bucket="rows", differentiable=False),
        TensorArg("sin", DTYPES, min_rank=2, layouts=ANY_LAYOUT, bucket="rows", differentiable=False),
        ScalarArg("interleaved", (bool,), default=False, keyed=True),
        ScalarArg("inplace", (bool,), default=False, writes=("q", "k")),
    ),
    reference=apply_rotary_pos_emb_reference,
    doc="(q * cos + rotate(q) * sin, k * cos + rotate(k) * sin), q/k [..., S, H, D], cos/sin [..., S, D]",
    check=check,
    example=example,
    example_sizes={"tokens": 37, "heads": 8, "kv_heads": 2, "head_dim": 64},
    cost=cost,
    baselines={"torch": lambda: torch_apply_rotary_pos_emb, "liger": liger_apply_rotary_pos_emb},
)


def _table_grads(pairs: list[tuple[torch.Tensor, torch.Tensor]], cos: torch.Tensor, interleaved: bool,
                 wanted: tuple[bool, bool]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The ``wanted`` gradients of cos and sin (rarely asked for, so in torch): for each (output
    gradient, input) pair, ``sum over heads of dy * x`` and ``of dy * rotate(x)``, reduced to cos's shape."""
    compute = torch.promote_types(cos.dtype, torch.float32)
    pairs = [(dy.to(compute), x.to(compute)) for dy, x in pairs]
    grads = []
    for want, rotated in zip(wanted, (False, True)):
        if not want:
            grads.append(None)
            continue
        g = sum((dy * (rotate(x, interleaved) if rotated else x)).sum(-2) for dy, x in pairs)
        grads.append(g.sum_to_size(cos.shape).to(cos.dtype))
    return grads[0], grads[1]


def _gradients(backward, saved, grads, needs) -> dict:
    dq_out, dk_out = grads
    got = {}
    if needs["q"] or needs["k"]:
        got["q"], got["k"] = backward(dq_out, dk_out, saved.cos, saved.sin, saved.interleaved)
    if needs["cos"] or needs["sin"]:
        got["cos"], got["sin"] = _table_grads([(dq_out, saved.q), (dk_out, saved.k)], saved.cos, saved.interleaved,
                                              (needs["cos"], needs["sin"]))
    return got


KERNEL = define_kernel(
    OP, plan,
    kernels=(rotary_kernel,),
    results=outputs,
    outputs=("q_out", "k_out"),
    inplace="inplace",
    default_config=default_config,
    space=space,
    # q and k are kept only for the gradients of cos and sin, which models do not ask for.
    backward=Backward(_gradients, saved=("cos", "sin", "interleaved"), saved_for={"cos": ("q", "k"), "sin": ("q", "k")},
                      plan=backward_plan, reference=apply_rotary_pos_emb_backward_reference,
                      results=outputs,
                      renames={"q": "dq_out", "k": "dk_out"}),
    doc="one program per block of tokens, all heads of q and k, cos and sin read once; the backward is the "
        "same kernel, rotation transposed",
)
apply_rotary_pos_emb = KERNEL.function
dlcore_ops, dlcore_implementations = KERNEL.dlcore_ops, KERNEL.dlcore_implementations
