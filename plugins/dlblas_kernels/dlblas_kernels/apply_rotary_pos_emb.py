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

The kernel's grid is (tokens, head blocks of q, then of k): each program loads the token's cos and
sin once and rotates ``BLOCK_H`` heads, reading each pair's two halves (or the whole interleaved
head, split into even and odd lanes) contiguously. Math in float32; outputs in q's dtype, written to
new tensors, or into q and k with ``inplace=True``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from dlcore import InvalidInputError, hookimpl
from dlcore.device import DeviceProfile
from dlcore.implementation import Config, KernelCall, LaunchPlan
from dlcore.op import Op, ScalarArg, TensorArg
from dlcore.signature import Signature, make_signature, next_power_of_2
from dlcore.torch_ops import CustomOpTritonImplementation, call, config_from_ints, config_ints
from dlcore.tuning.space import PowerOfTwo, SearchSpace, num_warps

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ANY_LAYOUT = ("contiguous", "rows", "strided")
CONFIG_KEYS = ("BLOCK_H", "num_warps")
# Elements of q or k a program aims to rotate (BLOCK_H heads of D).
TILE = 2048


@triton.jit
def rotate_pairs(a, b, cos_a, cos_b, sin_a, sin_b, BACKWARD: tl.constexpr):
    """The rotation of pairs (a, b), or its transpose for the backward."""
    if BACKWARD:
        return a * cos_a + b * sin_b, b * cos_b - a * sin_a
    else:
        return a * cos_a - b * sin_a, b * cos_b + a * sin_b


@triton.jit
def _rotate_heads(
    x_ptr, o_ptr, cos_ptr, sin_ptr,
    H, D, head0,
    stride_x_h, stride_x_d, stride_o_h, stride_o_d, stride_cos_d, stride_sin_d,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr,
):
    # Heads head0 .. head0 + BLOCK_H of one token; x_ptr, o_ptr, cos_ptr, sin_ptr point at that token.
    heads = head0 + tl.arange(0, BLOCK_H)
    x_heads = x_ptr + heads[:, None] * stride_x_h
    o_heads = o_ptr + heads[:, None] * stride_o_h
    cols = tl.arange(0, BLOCK_D)
    if INTERLEAVED:
        # The whole head in one contiguous load, split into its even (a) and odd (b) lanes.
        mask = (heads < H)[:, None] & (cols < D)[None, :]
        x = tl.load(x_heads + cols[None, :] * stride_x_d, mask=mask, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + cols * stride_cos_d, mask=cols < D, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + cols * stride_sin_d, mask=cols < D, other=0.0).to(tl.float32)
        a, b = tl.split(tl.reshape(x, (BLOCK_H, BLOCK_D // 2, 2)))
        cos_a, cos_b = tl.split(tl.reshape(c, (BLOCK_D // 2, 2)))
        sin_a, sin_b = tl.split(tl.reshape(s, (BLOCK_D // 2, 2)))
        out_a, out_b = rotate_pairs(a, b, cos_a[None, :], cos_b[None, :], sin_a[None, :], sin_b[None, :], BACKWARD)
        out = tl.reshape(tl.join(out_a, out_b), (BLOCK_H, BLOCK_D))
        tl.store(o_heads + cols[None, :] * stride_o_d, out.to(o_ptr.dtype.element_ty), mask=mask)
    else:
        # The two halves of each head, each a contiguous load.
        half = D // 2
        mask = (heads < H)[:, None] & (cols < half)[None, :]
        a = tl.load(x_heads + cols[None, :] * stride_x_d, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(x_heads + (half + cols)[None, :] * stride_x_d, mask=mask, other=0.0).to(tl.float32)
        cos_a = tl.load(cos_ptr + cols * stride_cos_d, mask=cols < half, other=0.0).to(tl.float32)
        cos_b = tl.load(cos_ptr + (half + cols) * stride_cos_d, mask=cols < half, other=0.0).to(tl.float32)
        sin_a = tl.load(sin_ptr + cols * stride_sin_d, mask=cols < half, other=0.0).to(tl.float32)
        sin_b = tl.load(sin_ptr + (half + cols) * stride_sin_d, mask=cols < half, other=0.0).to(tl.float32)
        out_a, out_b = rotate_pairs(a, b, cos_a[None, :], cos_b[None, :], sin_a[None, :], sin_b[None, :], BACKWARD)
        tl.store(o_heads + cols[None, :] * stride_o_d, out_a.to(o_ptr.dtype.element_ty), mask=mask)
        tl.store(o_heads + (half + cols)[None, :] * stride_o_d, out_b.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr,
    S, HQ, HK, D, Q_BLOCKS,
    stride_q_b, stride_q_s, stride_q_h, stride_q_d,
    stride_k_b, stride_k_s, stride_k_h, stride_k_d,
    stride_qo_b, stride_qo_s, stride_qo_h, stride_qo_d,
    stride_ko_b, stride_ko_s, stride_ko_h, stride_ko_d,
    stride_cos_b, stride_cos_s, stride_cos_d,
    stride_sin_b, stride_sin_s, stride_sin_d,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr,
):
    # Program (token, j): head block j of q for j < Q_BLOCKS, else head block j - Q_BLOCKS of k.
    token = tl.program_id(0)
    # 64-bit offsets: batch * batch stride may pass 2**31 elements.
    b = (token // S).to(tl.int64)
    s = (token % S).to(tl.int64)
    cos_t = cos_ptr + b * stride_cos_b + s * stride_cos_s
    sin_t = sin_ptr + b * stride_sin_b + s * stride_sin_s
    j = tl.program_id(1)
    if j < Q_BLOCKS:
        _rotate_heads(q_ptr + b * stride_q_b + s * stride_q_s, q_out_ptr + b * stride_qo_b + s * stride_qo_s,
                      cos_t, sin_t, HQ, D, j * BLOCK_H,
                      stride_q_h, stride_q_d, stride_qo_h, stride_qo_d, stride_cos_d, stride_sin_d,
                      BLOCK_H, BLOCK_D, INTERLEAVED, BACKWARD)
    else:
        _rotate_heads(k_ptr + b * stride_k_b + s * stride_k_s, k_out_ptr + b * stride_ko_b + s * stride_ko_s,
                      cos_t, sin_t, HK, D, (j - Q_BLOCKS) * BLOCK_H,
                      stride_k_h, stride_k_d, stride_ko_h, stride_ko_d, stride_cos_d, stride_sin_d,
                      BLOCK_H, BLOCK_D, INTERLEAVED, BACKWARD)


# -- layouts ---------------------------------------------------------------------------------------


def as_bshd(t: torch.Tensor) -> torch.Tensor:
    """``t [..., S, H, D]`` as a ``[B, S, H, D]`` view, the leading dimensions flattened into B."""
    return t.view(math.prod(t.shape[:-3]), *t.shape[-3:])


def as_bsd(t: torch.Tensor, batch: tuple[int, ...]) -> torch.Tensor:
    """cos or sin ``[..., S, D]``, broadcast to the leading dimensions ``batch`` of q, as a
    ``[B, S, D]`` view (stride 0 along B when it is shared by the whole batch)."""
    return t.expand(*batch, *t.shape[-2:]).view(math.prod(batch), *t.shape[-2:])


def check_token_layouts(op: Op, q: torch.Tensor, others: dict[str, torch.Tensor],
                        tables: dict[str, torch.Tensor]) -> None:
    """For rotary ops: the leading dimensions of q and ``others`` (``[..., S, H, D]``) flatten into
    one without a copy, and the cos / sin ``tables`` (``[..., S, D]``) broadcast over them."""
    batch, seq = tuple(q.shape[:-3]), q.shape[-3]
    for name, t in {"q": q, **others}.items():
        try:
            as_bshd(t)
        except RuntimeError:
            raise InvalidInputError(
                op.name, name, f"has strides {tuple(t.stride())} for shape {tuple(t.shape)}",
                f"{name} whose dimensions before the sequence flatten without a copy",
                f"Call {name}.contiguous() first.",
            ) from None
    for name, t in tables.items():
        if t.shape[-2] != seq:
            raise InvalidInputError(op.name, name, f"has shape {tuple(t.shape)}",
                                    f"{name} [..., S, D] with S = {seq}, the sequence length of q")
        try:
            as_bsd(t, batch)
        except RuntimeError:
            raise InvalidInputError(
                op.name, name, f"has shape {tuple(t.shape)} and strides {tuple(t.stride())}",
                f"{name} whose leading dimensions broadcast to q's {batch} and flatten without a copy",
                f"Call {name}.contiguous(), or give it q's leading dimensions.",
            ) from None


# -- plans -----------------------------------------------------------------------------------------


def _launch(q: torch.Tensor, k: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor, interleaved: bool, backward: bool, config: Config) -> list[KernelCall]:
    if q.numel() + k.numel() == 0:
        return []
    q4, k4, qo4, ko4 = as_bshd(q), as_bshd(k), as_bshd(q_out), as_bshd(k_out)
    batch = tuple(q.shape[:-3])
    cos3, sin3 = as_bsd(cos, batch), as_bsd(sin, batch)
    tokens, seq, hq, d = q4.shape
    tokens *= seq
    hk = k4.shape[2]
    block_h = min(config["BLOCK_H"], next_power_of_2(max(hq, hk)))
    block_d = max(next_power_of_2(d if interleaved else d // 2), 2)
    q_blocks, k_blocks = triton.cdiv(hq, block_h), triton.cdiv(hk, block_h)
    if tokens == 0 or q_blocks + k_blocks == 0:
        return []
    return [KernelCall(
        rotary_kernel, (tokens, q_blocks + k_blocks),
        (q4, k4, qo4, ko4, cos3, sin3, seq, hq, hk, d, q_blocks,
         *q4.stride(), *k4.stride(), *qo4.stride(), *ko4.stride(), *cos3.stride(), *sin3.stride()),
        {"BLOCK_H": block_h, "BLOCK_D": block_d, "INTERLEAVED": bool(interleaved), "BACKWARD": backward,
         "num_warps": config["num_warps"]},
    )]


def outputs(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty(k.shape, dtype=k.dtype, device=k.device))


def plan(args: tuple, config: Config) -> LaunchPlan:
    q, k, cos, sin, interleaved, inplace = args
    q_out, k_out = (q, k) if inplace else outputs(q, k)
    return LaunchPlan(_launch(q, k, q_out, k_out, cos, sin, interleaved, False, config), (q_out, k_out))


def backward_plan(args: tuple, config: Config) -> LaunchPlan:
    """The launch for ``(dq, dk)`` from ``args = (dq_out, dk_out, cos, sin, interleaved)``."""
    dq_out, dk_out, cos, sin, interleaved = args
    dq, dk = outputs(dq_out, dk_out)
    return LaunchPlan(_launch(dq_out, dk_out, dq, dk, cos, sin, interleaved, True, config), (dq, dk))


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


def default_config(sig: Signature, profile: DeviceProfile | None) -> Config:
    d = sig.tensor("q").shape[-1]
    block_h = max(min(TILE // next_power_of_2(d), 16), 1)
    # About 8 elements per thread (the plan caps BLOCK_H at the head count).
    return {"BLOCK_H": block_h, "num_warps": min(max(block_h * next_power_of_2(d) // 256, 1), 8)}


def space() -> SearchSpace:
    """Heads per program and warps."""
    return SearchSpace([PowerOfTwo("BLOCK_H", 1, 64), num_warps(1, 2, 4, 8)])


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
        TensorArg("q", DTYPES, min_rank=3, layouts=ANY_LAYOUT, bucket="rows"),
        TensorArg("k", DTYPES, min_rank=3, layouts=ANY_LAYOUT, same_dtype_as="q", bucket="rows"),
        TensorArg("cos", DTYPES, min_rank=2, layouts=ANY_LAYOUT, bucket="rows"),
        TensorArg("sin", DTYPES, min_rank=2, layouts=ANY_LAYOUT, bucket="rows"),
        ScalarArg("interleaved", (bool,), default=False, keyed=True),
        ScalarArg("inplace", (bool,), default=False),
    ),
    reference=apply_rotary_pos_emb_reference,
    doc="(q * cos + rotate(q) * sin, k * cos + rotate(k) * sin), q/k [..., S, H, D], cos/sin [..., S, D]",
    check=check,
    example=example,
    example_sizes={"tokens": 37, "heads": 8, "kv_heads": 2, "head_dim": 64},
    cost=cost,
    baselines={"torch": lambda: torch_apply_rotary_pos_emb, "liger": liger_apply_rotary_pos_emb},
)


# -- PyTorch custom ops ----------------------------------------------------------------------------


def _config(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, values: tuple[int, ...]) -> Config:
    def default() -> Config:
        return default_config(make_signature(OP, (q, k, cos, cos, False, False), q.device), None)

    return config_from_ints(CONFIG_KEYS, values, default)


@torch.library.custom_op("dlblas::apply_rotary_pos_emb", mutates_args=())
def apply_rotary_pos_emb_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            interleaved: bool, block_h: int, num_warps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rotary_pos_emb`` (functional) with the launch config as trailing ints (all zero: the
    default). float64 inputs take the torch reference (the path ``torch.autograd.gradcheck`` runs)."""
    if q.dtype == torch.float64:
        return apply_rotary_pos_emb_reference(q, k, cos, sin, interleaved)
    config = _config(q, k, cos, (block_h, num_warps))
    return plan((q, k, cos, sin, interleaved, False), config).run()


@apply_rotary_pos_emb_op.register_fake
def _apply_rotary_pos_emb_fake(q, k, cos, sin, interleaved, block_h, num_warps):
    if q.dtype != torch.float64:
        OP.validate((q, k, cos, sin, interleaved, False))
    return outputs(q, k)


@torch.library.custom_op("dlblas::apply_rotary_pos_emb_backward", mutates_args=())
def apply_rotary_pos_emb_backward_op(dq_out: torch.Tensor, dk_out: torch.Tensor, cos: torch.Tensor,
                                     sin: torch.Tensor, interleaved: bool, block_h: int,
                                     num_warps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dq, dk)`` of ``apply_rotary_pos_emb`` for the output gradients."""
    if dq_out.dtype == torch.float64:
        return apply_rotary_pos_emb_backward_reference(dq_out, dk_out, cos, sin, interleaved)
    config = _config(dq_out, dk_out, cos, (block_h, num_warps))
    return backward_plan((dq_out, dk_out, cos, sin, interleaved), config).run()


@apply_rotary_pos_emb_backward_op.register_fake
def _apply_rotary_pos_emb_backward_fake(dq_out, dk_out, cos, sin, interleaved, block_h, num_warps):
    return outputs(dq_out, dk_out)


def _table_grads(pairs: list[tuple[torch.Tensor, torch.Tensor]], cos: torch.Tensor,
                 interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of cos and sin (rarely wanted, so in torch): for each (output gradient, input) pair,
    ``sum over heads of dy * x`` and ``of dy * rotate(x)``, reduced to cos's shape."""
    compute = torch.promote_types(cos.dtype, torch.float32)
    dcos = sum((dy.to(compute) * x.to(compute)).sum(-2) for dy, x in pairs)
    dsin = sum((dy.to(compute) * rotate(x.to(compute), interleaved)).sum(-2) for dy, x in pairs)
    return dcos.sum_to_size(cos.shape).to(cos.dtype), dsin.sum_to_size(cos.shape).to(cos.dtype)


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, cos, sin, interleaved, *config = inputs
    ctx.tables_need_grad = any(ctx.needs_input_grad[2:4])
    ctx.save_for_backward(cos, sin, *((q, k) if ctx.tables_need_grad else ()))
    ctx.interleaved, ctx.config = interleaved, config


def _backward(ctx: Any, dq_out: torch.Tensor, dk_out: torch.Tensor) -> tuple:
    cos, sin, *qk = ctx.saved_tensors
    dq, dk = torch.ops.dlblas.apply_rotary_pos_emb_backward(dq_out, dk_out, cos, sin, ctx.interleaved, *ctx.config)
    dcos = dsin = None
    if ctx.tables_need_grad:
        dcos, dsin = _table_grads([(dq_out, qk[0]), (dk_out, qk[1])], cos, ctx.interleaved)
    return dq, dk, dcos, dsin, None, None, None


apply_rotary_pos_emb_op.register_autograd(_backward, setup_context=_setup_context)


def custom_op(args: tuple, config: Config | None) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, cos, sin, interleaved, inplace = args
    q_out, k_out = torch.ops.dlblas.apply_rotary_pos_emb(q, k, cos, sin, bool(interleaved),
                                                         *config_ints(config, CONFIG_KEYS))
    if inplace:
        # Autograd records the copies; under torch.compile they become input mutations.
        return q.copy_(q_out), k.copy_(k_out)
    return q_out, k_out


TRITON = CustomOpTritonImplementation(
    "apply_rotary_pos_emb", "triton",
    plan=plan,
    kernels=(rotary_kernel,),
    default_config=default_config,
    space=space,
    custom_op=custom_op,
    dtypes=DTYPES,
    doc="one program per (token, block of q or k heads); the backward is the same kernel, rotation transposed",
)


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         interleaved: bool = False, inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q ``[..., S, Hq, D]`` and k ``[..., S, Hk, D]`` with cos and sin
    ``[..., S, D]``: ``(q_out, k_out)``, new tensors or (``inplace``) q and k themselves.
    Differentiable in q, k, cos and sin, and one node under ``torch.compile``."""
    return call(OP, TRITON, (q, k, cos, sin, interleaved, inplace))


@hookimpl
def dlcore_ops() -> list[Op]:
    return [OP]


@hookimpl
def dlcore_implementations() -> list[CustomOpTritonImplementation]:
    return [TRITON]
