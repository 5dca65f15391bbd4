from __future__ import annotations

import math

import dlblas_kernels
import pytest
import torch
from conftest import ON_GPU
from dlblas_kernels.kernels.apply_rotary_pos_emb import apply_rotary_pos_emb_reference
from dlblas_kernels.kernels.fused_rotary_and_fa import (
    KERNEL,
    OP,
    composite,
    fused_rotary_and_fa,
    fused_rotary_and_fa_reference,
    fused_rotary_and_fa_training_reference,
    training_plan,
)
from gradients import check_backward

from dlcore import InvalidInputError
from dlcore.declarations.signature import make_signature
from dlcore.runtime.template import device_profile
from dlcore.testing import assert_close, randn, tolerance, upcast

TRITON = KERNEL.implementation
INTERLEAVED = [False, True]


def inputs(b, sq, sk, hq, hk, d, dtype, device, gen, table_batch=False):
    """Random q, k, v, and cos and sin tables ``[Sk, D]`` (``[B, Sk, D]`` with ``table_batch``) of
    random angles, one per (row, column): rotations, as in a model, but without LLaMA's duplicated
    halves or its smooth rows, so that a wrong row or a wrong pairing shows."""
    q = randn(b, sq, hq, d, dtype=dtype, device=device, generator=gen)
    k = randn(b, sk, hk, d, dtype=dtype, device=device, generator=gen)
    v = randn(b, sk, hk, d, dtype=dtype, device=device, generator=gen)
    angles = torch.rand(*((b,) if table_batch else ()), sk, d, generator=gen, dtype=torch.float64) * 2 * math.pi
    return q, k, v, angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)


def check(out, args):
    q, k = args[0], args[1]
    assert out.shape == q.shape and out.is_contiguous()
    assert_close(out, fused_rotary_and_fa_reference(*upcast(*args)), q.dtype, reduce_dim=k.shape[1])


# -- the reference ---------------------------------------------------------------------------------


def softmax_attention(q, k, v, causal, scale):
    """softmax(scale q k^T) v for Sq == Sk, k and v repeated over the query heads of each group."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v), scores.logsumexp(-1)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("interleaved", INTERLEAVED, ids=["half", "interleaved"])
def test_reference_is_rotary_then_attention(causal, interleaved, gen):
    """apply_rotary_pos_emb's reference, then the plain softmax formula; with fewer queries, the last
    rows of the same computation (the queries are the last Sq positions)."""
    q, k, v, cos, sin = upcast(*inputs(2, 9, 9, 4, 2, 8, torch.float64, "cpu", gen, table_batch=True))
    q_rot, k_rot = apply_rotary_pos_emb_reference(q, k, cos, sin, interleaved)
    out, lse = softmax_attention(q_rot, k_rot, v, causal, 0.3)
    got, got_lse = fused_rotary_and_fa_training_reference(q, k, v, cos, sin, causal, 0.3, interleaved)
    torch.testing.assert_close(got, out)
    torch.testing.assert_close(got_lse, lse)
    last, last_lse = fused_rotary_and_fa_training_reference(q[:, 5:], k, v, cos, sin, causal, 0.3, interleaved)
    torch.testing.assert_close(last, out[:, 5:])
    torch.testing.assert_close(last_lse, lse[:, :, 5:])


def test_reference_rows_that_see_no_key_are_zero_without_nan(gen):
    q, k, v, cos, sin = (t.requires_grad_(i < 3) for i, t in
                         enumerate(upcast(*inputs(1, 7, 3, 2, 1, 8, torch.float64, "cpu", gen))))
    out, lse = fused_rotary_and_fa_training_reference(q, k, v, cos, sin, True)
    assert torch.equal(out[:, :4], torch.zeros_like(out[:, :4])) and bool((lse[:, :, :4] == float("-inf")).all())
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert not any(g.isnan().any() for g in grads) and not grads[0][:, :4].any()


def test_cost():
    q, k, v, cos, sin, *rest = OP.example({"batch": 2, "seq": 6, "kv_seq": 0, "heads": 4, "kv_heads": 2,
                                           "head_dim": 8, "causal": 1, "interleaved": 0}, torch.float16,
                                          torch.device("meta"), torch.Generator().manual_seed(0))
    args = (q, k, v, cos, sin, *rest)
    moved, flops = OP.cost(args)
    assert flops == 4 * 2 * 4 * 8 * 21  # 6 * 7 / 2 pairs under causal
    assert moved == 2 * (2 * q.numel() + 2 * k.numel() + 2 * cos.numel())
    moved_bwd, flops_bwd = OP.cost(args, mode="bwd")
    assert flops_bwd == 5 * flops // 2 and moved_bwd == moved + 2 * (q.numel() + 2 * k.numel()) + 2 * q.numel() \
        + 4 * 2 * 4 * 6


# -- the kernels -----------------------------------------------------------------------------------


# (B, Sq, Sk, Hq, Hk, D, tables [B, Sk, D]), causal: rows and keys not multiples of any block; fewer
# queries (the last 11 of 37 positions, D / 2 not a power of two); more queries than keys (causal).
SHAPES = [*(((2, 19, 19, 4, 2, 16, False), causal) for causal in (False, True)),
          *(((1, 11, 37, 3, 1, 24, True), causal) for causal in (False, True)),
          ((2, 5, 3, 2, 2, 8, False), True)]


@pytest.mark.parametrize("interleaved", INTERLEAVED, ids=["half", "interleaved"])
@pytest.mark.parametrize("shape, causal", SHAPES, ids=str)
def test_matches_reference(shape, causal, interleaved, dtype, device, gen, run):
    args = (*inputs(*shape[:6], dtype, device, gen, shape[6]), causal, None, interleaved)
    check(run(OP, TRITON, args), args)


def test_more_queries_than_keys_gives_zero_rows(device, gen, run):
    """Causal with Sq > Sk: the first Sq - Sk queries see no key (out 0, lse -inf, no NaN)."""
    args = (*inputs(1, 9, 4, 2, 1, 8, torch.float32, device, gen), True, 0.5, False)
    plan = training_plan(args, TRITON.default_config(make_signature(OP, args, args[0].device),
                                                     device_profile(args[0].device)), device_profile(args[0].device))
    for t in plan.result:
        t.fill_(float("nan"))
    out, lse = plan.run()
    ref_out, ref_lse = fused_rotary_and_fa_training_reference(*upcast(*args))
    assert_close(out, ref_out, torch.float32)
    assert not out[:, :5].any() and bool((lse[:, :, :5] == float("-inf")).all())
    torch.testing.assert_close(lse[:, :, 5:], ref_lse[:, :, 5:].float())


@pytest.mark.parametrize("layout", ["packed qkv", "heads first", "column step", "strided tables"])
def test_non_contiguous_inputs(layout, dtype, device, gen, run):
    q, k, v, cos, sin = inputs(2, 13, 13, 4, 2, 16, dtype, device, gen, table_batch=True)
    if layout == "packed qkv":  # slices of one [B, S, Hq + 2 Hk, D] projection
        qkv = torch.cat([q, k, v], dim=2)
        q, k, v = qkv[:, :, :4], qkv[:, :, 4:6], qkv[:, :, 6:]
    elif layout == "heads first":  # [B, H, S, D] storage seen as [B, S, H, D]
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    elif layout == "column step":  # every other element of wider heads: a D stride of 2
        q, k, v = (torch.stack([t, t], -1)[..., 0] for t in (q, k, v))
    else:
        cos, sin = (torch.stack([t, t], -1)[..., 0].transpose(0, 1).contiguous().transpose(0, 1) for t in (cos, sin))
    assert not all(t.is_contiguous() for t in (q, k, v, cos, sin))
    for interleaved in INTERLEAVED:
        args = (q, k, v, cos, sin, True, None, interleaved)
        check(run(OP, TRITON, args), args)


def gradient_terms(sq, sk, group, d):
    """The products behind a gradient element, for its tolerance: dq sums ``dS k`` over the Sk keys,
    dk and dv sum over the Sq queries of each of the group's heads, and each ``dS`` holds ``dout . v``
    (D products), rounded to the input dtype for the tensor cores as every flash backward does."""
    return d * max(sk, sq * group)


@pytest.mark.parametrize("interleaved", INTERLEAVED, ids=["half", "interleaved"])
@pytest.mark.parametrize("shape, causal", [
    *(((2, 13, 13, 4, 2, 16, False), causal) for causal in (False, True)),
    *(((1, 7, 20, 2, 1, 24, True), causal) for causal in (False, True)),
    ((1, 10, 6, 3, 3, 8, False), True),
], ids=str)
def test_backward_matches_reference(shape, causal, interleaved, dtype, device, gen):
    b, sq, sk, hq, hk, d, table_batch = shape
    args = (*inputs(b, sq, sk, hq, hk, d, dtype, device, gen, table_batch), causal, None, interleaved)
    check_backward(fused_rotary_and_fa, fused_rotary_and_fa_reference, args, (0, 1, 2), gen,
                   reduce_dim=gradient_terms(sq, sk, hq // hk, d))


def test_backward_non_contiguous_inputs(dtype, device, gen):
    q, k, v, cos, sin = inputs(2, 9, 9, 4, 2, 16, dtype, device, gen)
    qkv = torch.cat([q, k, v], dim=2)
    args = (qkv[:, :, :4], qkv[:, :, 4:6], qkv[:, :, 6:], cos, sin, True, 0.2, True)
    check_backward(fused_rotary_and_fa, fused_rotary_and_fa_reference, args, (0, 1, 2), gen,
                   reduce_dim=gradient_terms(9, 9, 2, 16))


@pytest.mark.parametrize("sq, sk", [(5, 7), (7, 4)])
def test_float64_custom_op_passes_gradcheck(sq, sk, gen):
    """float64 runs the references (the path torch.autograd.gradcheck takes): the forward's and the
    backward custom op's agree (the output only: lse is a residual callers never see)."""
    q, k, v, cos, sin = inputs(1, sq, sk, 2, 1, 8, torch.float64, "cpu", gen)
    op = torch.ops.dlblas.fused_rotary_and_fa.default
    ints = [0] * (len(op._schema.arguments) - len(OP.args))
    assert torch.autograd.gradcheck(lambda q, k, v: op(q, k, v, cos, sin, True, 0.4, True, *ints)[0],
                                    [t.requires_grad_() for t in (q, k, v)])


def test_opcheck(device, gen):
    """The custom op's schema, fake and autograd registration (inputs requiring grad: its backward too)."""
    q, k, v, cos, sin = inputs(1, 6, 9, 2, 1, 8, torch.float32, device, gen)
    op = torch.ops.dlblas.fused_rotary_and_fa.default
    ints = [0] * (len(op._schema.arguments) - len(OP.args))
    torch.library.opcheck(op, (*(t.requires_grad_() for t in (q, k, v)), cos, sin, True, None, False, *ints))


def test_compiles_without_graph_breaks(device, gen):
    """An attention layer's core under torch.compile(fullgraph=True): one node, gradients as eager."""
    torch._dynamo.reset()
    q, k, v, cos, sin = inputs(1, 6, 6, 2, 1, 8, torch.float32, device, gen)

    def layer(q, k, v):
        return fused_rotary_and_fa(q * 2, k, v, cos, sin, True).square().sum()

    eager = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled = [t.clone().requires_grad_() for t in (q, k, v)]
    layer(*eager).backward()
    out = torch.compile(layer, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")(*compiled)
    out.backward()
    torch.testing.assert_close(out, layer(q, k, v))
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a.grad, b.grad)


def test_public_function_runs_the_plan(device, gen, run):
    args = (*inputs(1, 6, 6, 2, 1, 8, torch.float16, device, gen), True, None, True)
    assert dlblas_kernels.fused_rotary_and_fa is fused_rotary_and_fa
    assert torch.equal(fused_rotary_and_fa(*args), run(OP, TRITON, args))


@pytest.mark.parametrize("sq, sk", [(7, 7), (4, 9)])
def test_composite_baseline_matches_reference(sq, sk, device, gen):
    for causal in (False, True):
        args = (*inputs(2, sq, sk, 4, 2, 8, torch.float32, device, gen), causal, None, causal)
        assert_close(composite(*args), fused_rotary_and_fa_reference(*upcast(*args)), torch.float32)


# -- validation ------------------------------------------------------------------------------------

BAD = {
    "odd head dim": ("q", lambda a: {**a, "q": a["q"][..., :7], "k": a["k"][..., :7], "v": a["v"][..., :7],
                                     "cos": a["cos"][..., :7], "sin": a["sin"][..., :7]}),
    "k batch": ("k", lambda a: {**a, "k": a["k"][:1], "v": a["v"][:1]}),
    "v shape": ("v", lambda a: {**a, "v": a["v"][:, :4]}),
    "heads": ("k", lambda a: {**a, "q": a["q"][:, :, :3]}),
    "cos rows": ("cos", lambda a: {**a, "cos": a["cos"][:4], "sin": a["sin"][:4]}),
    "cos head dim": ("cos", lambda a: {**a, "cos": a["cos"][:, :6]}),
    "cos batch": ("cos", lambda a: {**a, "cos": a["cos"].expand(3, -1, -1), "sin": a["sin"].expand(3, -1, -1)}),
    "sin shape": ("sin", lambda a: {**a, "sin": a["sin"].expand(2, -1, -1)}),
    "sin dtype": ("sin", lambda a: {**a, "sin": a["sin"].half()}),
    "cos rank": ("cos", lambda a: {**a, "cos": a["cos"][0]}),
    "v dtype": ("v", lambda a: {**a, "v": a["v"].half()}),
    "more queries without causal": ("q", lambda a: {**a, "q": torch.cat([a["q"], a["q"]], 1)}),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_inputs_name_the_argument(case, device, gen, no_launch):
    name, change = BAD[case]
    q, k, v, cos, sin = inputs(2, 5, 5, 4, 2, 8, torch.float32, device, gen)
    args = change({"q": q, "k": k, "v": v, "cos": cos, "sin": sin})
    with pytest.raises(InvalidInputError) as raised:
        fused_rotary_and_fa(**args)
    assert raised.value.arg == name


# -- GPU -------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="bfloat16 against a float32 reference needs a GPU")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_bfloat16_against_float32_on_gpu(causal, gen):
    """B 2, H 16, S 2048, D 128 in bfloat16 with LLaMA's tables, forward and backward, against the
    float32 reference on the same bfloat16 values: the error of the output and of each gradient at
    most that of the composite (apply_rotary_pos_emb, then SDPA, in bfloat16) plus a quarter of
    bfloat16's tolerance."""
    args = OP.example({"batch": 2, "seq": 2048, "kv_seq": 0, "heads": 16, "kv_heads": 16, "head_dim": 128,
                       "causal": int(causal), "interleaved": 0}, torch.bfloat16, torch.device("cuda"), gen)
    dout = randn(*args[0].shape, dtype=torch.bfloat16, device="cuda", generator=gen)

    def run(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in args[:3]]
        out = fn(*leaves, *(t.to(dtype) for t in args[3:5]), *args[5:])
        return (out, *torch.autograd.grad(out, leaves, dout.to(dtype)))

    ours = run(fused_rotary_and_fa, torch.bfloat16)
    theirs = run(composite, torch.bfloat16)
    expected = run(fused_rotary_and_fa_reference, torch.float32)
    atol, _ = tolerance(torch.bfloat16)
    for name, got, base, want in zip(("out", "dq", "dk", "dv"), ours, theirs, expected):
        assert got.dtype == torch.bfloat16 and not torch.isnan(got).any(), name
        error, baseline = (got.float() - want).abs().max().item(), (base.float() - want).abs().max().item()
        assert error <= baseline + atol / 4, f"{name}: error {error:.3g}, the composite's {baseline:.3g}"
