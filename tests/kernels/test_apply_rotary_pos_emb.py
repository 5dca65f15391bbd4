from __future__ import annotations

import dlblas_kernels
import pytest
import torch
from dlblas_kernels.apply_rotary_pos_emb import (
    OP,
    TRITON,
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_backward_reference,
    apply_rotary_pos_emb_reference,
    backward_plan,
    llama_cos_sin,
    torch_apply_rotary_pos_emb,
)
from gradients import check_backward

from dlcore import InvalidInputError
from dlcore.testing import assert_close, randn, upcast

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


@pytest.mark.parametrize("block_h, num_warps", [(1, 1), (2, 1), (4, 2), (64, 4)])
def test_configs(block_h, num_warps, dtype, device, gen, run):
    q, k, cos, sin = inputs((2,), 3, 5, 3, 12, dtype, device, gen)
    for interleaved in INTERLEAVED:
        out = run(OP, TRITON, (q, k, cos, sin, interleaved, False), {"BLOCK_H": block_h, "num_warps": num_warps})
        check(out, q, k, cos, sin, interleaved)


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
def test_backward_plan_writes_every_output(interleaved, dtype, device, gen, launch):
    dq, dk, cos, sin = inputs((2,), 5, 3, 2, 10, dtype, device, gen)
    out = launch(backward_plan((dq, dk, cos, sin, interleaved), {"BLOCK_H": 2, "num_warps": 1}))
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
    plan = TRITON.plan((q, k, cos, cos, False, False), {"BLOCK_H": 16, "num_warps": 4})
    assert plan.result[0].shape == q.shape and plan.result[1].shape == k.shape
    (call,) = plan.calls
    assert call.grid == (30, 2 + 1)  # 30 tokens; two blocks of q heads, one (of 8 heads) of k
    assert call.kwargs["BLOCK_D"] == 64 and call.args[4].stride() == (0, 128, 1)  # cos shared by the batch


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
