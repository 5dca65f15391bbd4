from __future__ import annotations

import importlib

import dlblas_kernels
import pytest
import torch
from dlblas_kernels.blocks.rotary import bsd_strides, bshd_strides, flat_stride, rotation_calls
from dlblas_kernels.kernels.apply_rotary_pos_emb import (
    KERNEL,
    OP,
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_backward_reference,
    apply_rotary_pos_emb_reference,
    backward_plan,
    llama_cos_sin,
    plan,
    torch_apply_rotary_pos_emb,
)
from gradients import check_backward

from dlcore import InvalidInputError
from dlcore.compiler.lowering import target_profile
from dlcore.declarations.signature import make_signature
from dlcore.runtime.profile import device_profile, first_device
from dlcore.testing import assert_close, poison, randn, upcast

TRITON = KERNEL.implementation

INTERLEAVED = [False, True]


def inputs(lead, s, hq, hk, d, dtype, device, gen, table_lead=None):
    """Random q, k and cos, sin tables (any values: the kernel must not assume duplicated halves)."""
    q = randn(*lead, s, hq, d, dtype=dtype, device=device, generator=gen)
    k = randn(*lead, s, hk, d, dtype=dtype, device=device, generator=gen)
    table_lead = lead if table_lead is None else table_lead
    cos = randn(*table_lead, s, d, dtype=dtype, device=device, generator=gen)
    sin = randn(*table_lead, s, d, dtype=dtype, device=device, generator=gen)
    return q, k, cos, sin


def check(result, q, k, cos, sin, interleaved):
    for out, ref in zip(result, apply_rotary_pos_emb_reference(*upcast(q, k, cos, sin), interleaved)):
        assert_close(out, ref, q.dtype)


@pytest.mark.parametrize("interleaved", INTERLEAVED, ids=["half", "interleaved"])
@pytest.mark.parametrize("lead, s, hq, hk, d, table_lead", [
    ((2,), 5, 3, 1, 8, None),
    ((), 7, 4, 2, 6, None),
    ((2, 3), 3, 2, 5, 2, (1, 1)),
    ((3,), 4, 8, 8, 20, ()),
], ids=str)
def test_matches_reference(lead, s, hq, hk, d, table_lead, interleaved, dtype, device, gen, run):
    q, k, cos, sin = inputs(lead, s, hq, hk, d, dtype, device, gen, table_lead)
    check(run(OP, TRITON, (q, k, cos, sin, interleaved, False)), q, k, cos, sin, interleaved)


@pytest.mark.parametrize("interleaved", INTERLEAVED, ids=["half", "interleaved"])
def test_llama_tables_match_eager_torch(interleaved, device, gen, run):
    q, k, _, _ = inputs((2,), 9, 4, 2, 16, torch.float32, device, gen)
    cos, sin = llama_cos_sin(2, 9, 16, torch.float32, torch.device(device), interleaved)
    out = run(OP, TRITON, (q, k, cos, sin, interleaved, False))
    for a, b in zip(out, torch_apply_rotary_pos_emb(q, k, cos, sin, interleaved)):
        assert_close(a, b.double(), torch.float32)


# Head steps that do not divide 5 q heads or 3 k heads; 2, 4 and 8 tokens per program (rows / 8 padded
# q heads), which do not divide the 7 tokens.
@pytest.mark.parametrize("block_h, num_warps", [(1, 1), (2, 1), (4, 2), (16, 1), (32, 2), (64, 4)])
def test_configs(block_h, num_warps, dtype, device, gen, run, launches):
    q, k, cos, sin = inputs((), 7, 5, 3, 12, dtype, device, gen)
    config = {"BLOCK_H": block_h, "num_warps": num_warps}
    for interleaved in INTERLEAVED:
        check(run(OP, TRITON, (q, k, cos, sin, interleaved, False), config), q, k, cos, sin, interleaved)
    assert launches[0][1]["BLOCK_TQ"] == max(block_h // 8, 1)  # 5 q heads padded to 8
    assert launches[0][1]["BLOCK_TK"] == min(max(block_h // 4, 1), 8)  # 3 k heads padded to 4; 7 tokens


@pytest.mark.parametrize("layout", ["fused qkv", "heads first", "strided tables"])
def test_non_contiguous_inputs(layout, dtype, device, gen, run):
    q, k, cos, sin = inputs((2,), 5, 4, 2, 8, dtype, device, gen)
    if layout == "fused qkv":  # slices of one [B, S, Hq + 2 Hk, D] projection
        qkv = torch.cat([q, k, k], dim=2)
        args = (qkv[:, :, :4], qkv[:, :, 4:6], cos, sin)
    elif layout == "heads first":  # [B, H, S, D] storage seen as [B, S, H, D]
        args = (q.transpose(1, 2).contiguous().transpose(1, 2), k.transpose(1, 2).contiguous().transpose(1, 2),
                cos, sin)
    else:
        args = (q, k, torch.stack([cos, cos], -1)[..., 0], torch.stack([sin, sin], -1)[..., 0])
    assert not all(t.is_contiguous() for t in args)
    for interleaved in INTERLEAVED:
        check(run(OP, TRITON, (*args, interleaved, False)), q, k, cos, sin, interleaved)


@pytest.mark.parametrize("interleaved", INTERLEAVED, ids=["half", "interleaved"])
def test_inplace_writes_into_q_and_k(interleaved, device, gen):
    q, k, cos, sin = inputs((2,), 5, 4, 2, 8, torch.float32, device, gen)
    qkv = torch.cat([q, k], dim=2)
    q_view, k_view = qkv[:, :, :4], qkv[:, :, 4:]
    q_out, k_out = apply_rotary_pos_emb(q_view, k_view, cos, sin, interleaved, inplace=True)
    assert q_out is q_view and k_out is k_view
    check((qkv[:, :, :4], qkv[:, :, 4:]), q, k, cos, sin, interleaved)


def test_inplace_with_autograd(device, gen):
    q, k, cos, sin = inputs((2,), 5, 4, 2, 8, torch.float32, device, gen)
    leaf_q, leaf_k = q.clone().requires_grad_(), k.clone().requires_grad_()
    q_in, k_in = leaf_q * 1, leaf_k * 1  # non-leaves may be overwritten under autograd
    q_out, k_out = apply_rotary_pos_emb(q_in, k_in, cos, sin, inplace=True)
    assert q_out is q_in
    (q_out.square().sum() + k_out.sum()).backward()
    q64, k64 = (t.double().requires_grad_() for t in (q, k))
    r_q, r_k = apply_rotary_pos_emb_reference(q64, k64, cos.double(), sin.double())
    (r_q.square().sum() + r_k.sum()).backward()
    assert_close(leaf_q.grad, q64.grad, torch.float32)
    assert_close(leaf_k.grad, k64.grad, torch.float32)


@pytest.mark.parametrize("interleaved", INTERLEAVED, ids=["half", "interleaved"])
@pytest.mark.parametrize("lead, s, hq, hk, d, table_lead", [((2,), 5, 3, 1, 8, None), ((2,), 3, 2, 4, 6, ())],
                         ids=str)
def test_backward_matches_reference(lead, s, hq, hk, d, table_lead, interleaved, dtype, device, gen):
    args = (*inputs(lead, s, hq, hk, d, dtype, device, gen, table_lead), interleaved)
    # cos and sin take gradients too (summed over heads and over the batch they are broadcast to).
    check_backward(apply_rotary_pos_emb, apply_rotary_pos_emb_reference, args, (0, 1, 2, 3), gen, reduce_dim=16)


def test_backward_non_contiguous_inputs(dtype, device, gen):
    q, k, cos, sin = inputs((2,), 5, 4, 2, 8, dtype, device, gen)
    qkv = torch.cat([q, k, k], dim=2)
    args = (qkv[:, :, :4], qkv[:, :, 4:6], cos, sin, True)
    check_backward(apply_rotary_pos_emb, apply_rotary_pos_emb_reference, args, (0, 1), gen)


@pytest.mark.parametrize("interleaved", INTERLEAVED, ids=["half", "interleaved"])
def test_backward_plan_writes_every_output(interleaved, dtype, device, gen, launch, profile):
    dq, dk, cos, sin = inputs((2,), 5, 3, 2, 10, dtype, device, gen)
    out = launch(backward_plan((dq, dk, cos, sin, interleaved), {"BLOCK_H": 8, "num_warps": 1}, profile))
    for a, b in zip(out, apply_rotary_pos_emb_backward_reference(*upcast(dq, dk, cos, sin), interleaved)):
        assert_close(a, b, dtype)


def test_public_function_runs_the_plan(device, gen, run):
    q, k, cos, sin = inputs((2,), 5, 3, 2, 8, torch.float16, device, gen)
    assert dlblas_kernels.apply_rotary_pos_emb is apply_rotary_pos_emb
    for a, b in zip(apply_rotary_pos_emb(q, k, cos, sin, True), run(OP, TRITON, (q, k, cos, sin, True, False))):
        assert torch.equal(a, b)


def test_zero_tokens_launch_nothing(device, no_launch):
    q, k, cos = torch.empty(2, 0, 4, 8, device=device), torch.empty(2, 0, 1, 8, device=device), torch.empty(0, 8)
    q_out, k_out = apply_rotary_pos_emb(q, k, cos.to(device), cos.to(device))
    assert q_out.shape == q.shape and k_out.shape == k.shape


def test_plan_on_meta_tensors_reads_no_data():
    q, k = torch.empty(3, 10, 32, 128, device="meta"), torch.empty(3, 10, 8, 128, device="meta")
    cos = torch.empty(10, 128, device="meta")
    plan = TRITON.plan((q, k, cos, cos, False, False), {"BLOCK_H": 16, "num_warps": 8}, device_profile(q.device))
    assert plan.result[0].shape == q.shape and plan.result[1].shape == k.shape
    (call,) = plan.calls
    # q: a token per program, its 32 heads in two steps of 16; k: 2 tokens of 8 heads per program
    assert call.grid == (30 + 15,)
    assert {k: call.kwargs[k] for k in ("BLOCK_TQ", "BLOCK_HQ", "BLOCK_TK", "BLOCK_HK", "BLOCK_P", "HEAD_DIM",
                                        "num_warps")} == {
        "BLOCK_TQ": 1, "BLOCK_HQ": 16, "BLOCK_TK": 2, "BLOCK_HK": 8, "BLOCK_P": 64, "HEAD_DIM": 128, "num_warps": 8}
    # q's tokens, sequence and first table row; k's tokens and sequence; heads; q's programs
    assert call.args[6:14] == (30, 10, 0, 30, 10, 32, 8, 30)
    assert call.args[30:33] == (0, 128, 1)  # cos shared by the batch: batch stride 0
    (call,) = TRITON.plan((q[:, :, :4], k[:, :, :2], cos, cos, False, False), {"BLOCK_H": 8, "num_warps": 8},
                          device_profile(q.device)).calls
    # 4 q heads: 2 tokens per program (15 programs); 2 k heads: 4 tokens per program (8 programs)
    assert call.grid == (15 + 8,) and (call.kwargs["BLOCK_TQ"], call.kwargs["BLOCK_TK"]) == (2, 4)
    assert call.kwargs["num_warps"] == 4  # 8 rows of 128: 8 elements per thread with 4 warps


def test_default_config_rotates_a_token_per_program_in_steps_of_one_warp():
    q, k = torch.empty(1, 4096, 32, 128, device="meta"), torch.empty(1, 4096, 8, 128, device="meta")
    cos = torch.empty(1, 4096, 128, device="meta")
    args = (q, k, cos, cos, False, False)
    config = TRITON.default_config(make_signature(OP, args, q.device), None)
    (call,) = TRITON.plan(args, config, device_profile(first_device(args))).calls
    assert call.grid == (4096 + 2048,)  # q: a token per program, in two steps of 16 heads; k: 2 tokens of 8 heads
    assert (call.kwargs["BLOCK_TQ"], call.kwargs["BLOCK_HQ"], call.kwargs["BLOCK_HK"], call.kwargs["BLOCK_TK"],
            call.kwargs["num_warps"]) == (1, 16, 8, 2, 1)
    assert TRITON.space().is_valid(config) is None


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("interleaved", INTERLEAVED, ids=["half", "interleaved"])
@pytest.mark.parametrize("sq", [5, 11, 9], ids=["Sq<Sk", "Sq>Sk", "Sq=Sk"])
def test_rotation_calls_rotate_queries_with_the_last_rows(sq, interleaved, backward, device, gen, profile):
    """rotation_calls (what fused_rotary_and_fa's backward launches): q [B, Sq] and k [B, Sk] (Sk 9)
    with tables of Sk rows, query i taking row Sk - Sq + i (row 0 where that is negative)."""
    q = randn(2, sq, 3, 10, device=device, generator=gen)
    k, _, cos, sin = inputs((2,), 9, 2, 0, 10, torch.float32, device, gen)
    q_out, k_out = poison(torch.empty_like(q)), poison(torch.empty_like(k))
    for call in rotation_calls(q, k, q_out, k_out, cos, sin, interleaved, profile, backward=backward):
        call.launch()
    rows = (torch.arange(sq, device=device) + 9 - sq).clamp(min=0)
    rotate = apply_rotary_pos_emb_backward_reference if backward else apply_rotary_pos_emb_reference
    q_want, _ = rotate(q, q, cos[:, rows], sin[:, rows], interleaved)
    _, k_want = rotate(k, k, cos, sin, interleaved)
    assert_close(q_out, q_want, torch.float32)
    assert_close(k_out, k_want, torch.float32)


def test_steps_fit_the_npu_unified_buffer():
    # 64 rows of 64 (fused_rotary_and_fa's backward at 74 tokens): 4096 elements a step, more than
    # bishengir-compile fits in the Ascend 910B's unified buffer; there, steps of 2048
    q, k = torch.empty(2, 37, 4, 64, device="meta"), torch.empty(2, 37, 2, 64, device="meta")
    cos = torch.empty(2, 37, 64, device="meta")
    steps = {}
    for target in ("npu:Ascend910B2", "cuda:90"):
        (call,) = plan((q, k, cos, cos, False, False), {"BLOCK_H": 64, "num_warps": 2}, target_profile(target)).calls
        kw = call.kwargs
        steps[target] = max(kw["BLOCK_TQ"] * kw["BLOCK_HQ"], kw["BLOCK_TK"] * kw["BLOCK_HK"]) * 2 * kw["BLOCK_P"]
    assert steps == {"npu:Ascend910B2": 2048, "cuda:90": 4096}


@pytest.mark.parametrize("tokens, heads, kv_heads, expected", [
    (1, 32, 8, (32, 2)), (64, 32, 8, (32, 2)), (16, 64, 8, (64, 4)), (3, 28, 4, (32, 2)),  # q's heads at once
    (200, 32, 8, (32, 2)), (256, 64, 8, (32, 2)),  # twice the tile
    (257, 32, 8, (16, 1)), (4096, 64, 8, (16, 1)),  # the tile, one warp
])
def test_default_config_widens_its_steps_at_few_tokens(tokens, heads, kv_heads, expected):
    q = torch.empty(1, tokens, heads, 128, device="meta")
    k, cos = torch.empty(1, tokens, kv_heads, 128, device="meta"), torch.empty(1, tokens, 128, device="meta")
    config = TRITON.default_config(make_signature(OP, (q, k, cos, cos, False, False), q.device), None)
    assert (config["BLOCK_H"], config["num_warps"]) == expected
    assert TRITON.space().is_valid(config) is None


@pytest.mark.parametrize("shape, strides", [
    ((2, 3), (3, 1)), ((2, 3), (1, 2)), ((1, 4), (100, 7)), ((4, 1), (5, 100)), ((2, 1, 3), (3, 9, 1)),
    ((2, 2), (0, 0)), ((3, 2), (2, 0)), ((), ()), ((1, 1), (3, 5)),
], ids=str)
def test_flat_stride_flattens_as_view_does(shape, strides):
    t = torch.empty(64).as_strided((*shape, 1, 1, 1), (*strides, 1, 1, 1))
    try:
        expected = t.view(-1, 1, 1, 1).stride(0) if t.numel() > 1 else 0
    except RuntimeError:
        expected = None
    assert flat_stride(shape, strides) == expected
    assert bshd_strides(t) == (None if expected is None else (expected, 1, 1, 1))


def test_table_strides_broadcast_over_the_batch():
    cos = torch.empty(5, 8)
    assert bsd_strides(cos, (2, 3)) == (0, 8, 1)
    assert bsd_strides(cos.expand(3, 5, 8), (2, 3)) == (0, 8, 1)
    # Broadcast over the batch's outer dimension only: [2, 3] would flatten only with a copy.
    assert bsd_strides(torch.empty(1, 3, 5, 8), (2, 3)) is None
    assert bsd_strides(torch.empty(2, 1, 5, 8), (2, 3)) is None
    assert bsd_strides(torch.empty(2, 3, 5, 8), (2, 3)) == (40, 8, 1)
    assert bsd_strides(torch.empty(4, 5, 8), (2, 3)) is None
    assert bsd_strides(torch.empty(1, 1, 5, 8), ()) == (0, 8, 1)


BAD = ["odd head dim", "k head dim", "k sequence", "cos head dim", "sin shape", "cos sequence", "cos batch",
       "sin dtype", "int32 q", "k dtype", "2-D q", "interleaved batch dims", "interleaved a string"]


@pytest.mark.parametrize("case", BAD)
def test_bad_inputs_raise_before_launch(case, device, no_launch):
    q, k = torch.randn(2, 3, 5, 4, 8, device=device), torch.randn(2, 3, 5, 2, 8, device=device)
    cos = sin = torch.randn(2, 3, 5, 8, device=device)
    interleaved = False
    if case == "odd head dim":
        q, k, cos, sin = q[..., :7], k[..., :7], cos[..., :7], sin[..., :7]
    elif case == "k head dim":
        k = k[..., :6]
    elif case == "k sequence":
        k = k[:, :, :4]
    elif case == "cos head dim":
        cos = cos[..., :6]
    elif case == "sin shape":
        sin = sin[:1]
    elif case == "cos sequence":
        cos, sin = cos[..., :4, :], sin[..., :4, :]
    elif case == "cos batch":
        cos, sin = cos[:, :2], sin[:, :2]
    elif case == "sin dtype":
        sin = sin.half()
    elif case == "int32 q":
        q = q.to(torch.int32)
    elif case == "k dtype":
        k = k.half()
    elif case == "2-D q":
        q = q[0, 0, 0]
    elif case == "interleaved batch dims":
        q, k = q.transpose(0, 1), k.transpose(0, 1)
        cos = sin = torch.randn(5, 8, device=device)
    elif case == "interleaved a string":
        interleaved = "yes"
    with pytest.raises(InvalidInputError):
        apply_rotary_pos_emb(q, k, cos, sin, interleaved)


@pytest.mark.parametrize("interleaved", INTERLEAVED, ids=["half", "interleaved"])
def test_backward_plan_takes_gradients_whose_batch_does_not_flatten(interleaved, device, gen, launch, profile):
    # [3, 2] storage seen as [2, 3]: the leading dimensions flatten only with a copy.
    dq = randn(3, 2, 4, 3, 8, device=device, generator=gen).transpose(0, 1)
    dk = randn(3, 2, 4, 1, 8, device=device, generator=gen).transpose(0, 1)
    cos, sin = (randn(4, 8, device=device, generator=gen) for _ in range(2))
    assert bshd_strides(dq) is None
    out = launch(backward_plan((dq, dk, cos, sin, interleaved), TRITON.default_config(
        make_signature(OP, (dq, dk, cos, sin, interleaved, False), dq.device), None), profile))
    for a, b in zip(out, apply_rotary_pos_emb_backward_reference(*upcast(dq, dk, cos, sin), interleaved)):
        assert_close(a, b, torch.float32)


def test_backward_leaves_the_tables_alone_unless_asked(monkeypatch, device, gen, launches):
    module = importlib.import_module("dlblas_kernels.kernels.apply_rotary_pos_emb")

    q, k, cos, sin = inputs((2,), 5, 4, 2, 8, torch.float32, device, gen)
    table_grads = []
    original = module._table_grads
    monkeypatch.setattr(module, "_table_grads", lambda *a: table_grads.append(a[-1]) or original(*a))
    leaf_q, leaf_k = q.clone().requires_grad_(), k.clone().requires_grad_()
    q_out, k_out = apply_rotary_pos_emb(leaf_q, leaf_k, cos, sin)
    torch.autograd.grad((q_out, k_out), (leaf_q, leaf_k), (torch.ones_like(q_out), torch.ones_like(k_out)))
    assert table_grads == [] and [name for name, _ in launches] == ["rotary_kernel", "rotary_kernel"]

    # Only sin: no kernel for dq and dk, and cos's gradient is not computed either.
    launches.clear()
    leaf_sin = sin.clone().requires_grad_()
    q_out, k_out = apply_rotary_pos_emb(q, k, cos, leaf_sin)
    grad_q, grad_k = randn(*q.shape, generator=gen).to(device), randn(*k.shape, generator=gen).to(device)
    (dsin,) = torch.autograd.grad((q_out, k_out), (leaf_sin,), (grad_q, grad_k))
    assert table_grads == [(False, True)] and [name for name, _ in launches] == ["rotary_kernel"]
    sin64 = sin.double().requires_grad_()
    ref = apply_rotary_pos_emb_reference(q.double(), k.double(), cos.double(), sin64)
    (expected,) = torch.autograd.grad(ref, (sin64,), (grad_q.double(), grad_k.double()))
    assert_close(dsin, expected, torch.float32, reduce_dim=8)


def test_only_q_and_k_are_declared_differentiable():
    assert [OP.args[i].name for i in OP.differentiable()] == ["q", "k"]
