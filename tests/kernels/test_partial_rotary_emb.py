from __future__ import annotations

import importlib

import dlblas_kernels
import pytest
import torch
from dlblas_kernels.kernels.partial_rotary_emb import (
    KERNEL,
    OP,
    backward_plan,
    partial_rotary_emb,
    partial_rotary_emb_backward_reference,
    partial_rotary_emb_reference,
    torch_partial_rotary_emb,
)
from gradients import check_backward

from dlcore import InvalidInputError
from dlcore.declarations.signature import make_signature
from dlcore.runtime.profile import device_profile, first_device
from dlcore.runtime.template import UNKNOWN_DEVICE
from dlcore.testing import assert_close, randn, upcast

TRITON = KERNEL.implementation

# (leading dims, S, H, nope, rope, v): DeepSeek-V2's proportions shrunk, odd sizes, no nope part,
# values as wide as the keys (no padding), values narrower than the nope part.
SHAPES = [
    ((2,), 3, 5, 16, 8, 16),
    ((), 4, 3, 0, 2, 1),
    ((2,), 2, 2, 6, 4, 10),
    ((1, 2), 3, 4, 12, 6, 5),
]


def inputs(lead, s, h, nope, rope, v, dtype, device, gen):
    q = randn(*lead, s, h, nope + rope, dtype=dtype, device=device, generator=gen)
    k_pe = randn(*lead, s, 1, rope, dtype=dtype, device=device, generator=gen)
    kv = randn(*lead, s, h, nope + v, dtype=dtype, device=device, generator=gen)
    cos = randn(*lead, s, rope, dtype=dtype, device=device, generator=gen)
    sin = randn(*lead, s, rope, dtype=dtype, device=device, generator=gen)
    return q, k_pe, kv, cos, sin, nope, rope, v


def check(result, args):
    q_out, out_kv = result
    q, _, kv, *_ = args
    nope, rope, v = args[5:]
    assert out_kv.shape == (*q.shape[:-2], 2, q.shape[-2], nope + rope)
    for out, ref in zip(result, partial_rotary_emb_reference(*upcast(*args))):
        assert_close(out, ref, q.dtype)
    # Copies are exact, and the values' padding is zero.
    assert torch.equal(q_out[..., :nope], q[..., :nope])
    assert torch.equal(out_kv[..., 1, :, :v], kv[..., nope:])
    assert not out_kv[..., 1, :, v:].any()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference(shape, dtype, device, gen, run):
    args = inputs(*shape, dtype, device, gen)
    check(run(OP, TRITON, args), args)


def test_matches_eager_deepseek_code(device, gen, run):
    args = inputs((2,), 5, 3, 16, 8, 16, torch.float32, device, gen)
    for a, b in zip(run(OP, TRITON, args), torch_partial_rotary_emb(*args)):
        assert_close(a, b.double(), torch.float32)


@pytest.mark.parametrize("block_h, num_warps", [(1, 1), (2, 1), (8, 2)])
def test_configs(block_h, num_warps, dtype, device, gen, run, launch, profile):
    args = inputs((2,), 3, 5, 16, 8, 12, dtype, device, gen)
    config = {"BLOCK_H": block_h, "num_warps": num_warps}
    check(run(OP, TRITON, args, config), args)
    grads = (randn(*args[0].shape, dtype=dtype, device=device, generator=gen),
             randn(2, 3, 2, 5, 24, dtype=dtype, device=device, generator=gen))
    backward_args = (*grads, args[3], args[4], args[1], args[2], *args[5:])
    out = launch(backward_plan(backward_args, config, profile))
    for a, b in zip(out, partial_rotary_emb_backward_reference(*upcast(*backward_args[:6]), *args[5:])):
        assert_close(a, b, dtype, reduce_dim=5)


def test_non_contiguous_inputs(dtype, device, gen, run):
    q, k_pe, kv, cos, sin, nope, rope, v = inputs((2,), 3, 4, 8, 4, 8, dtype, device, gen)
    # q and kv as slices of wider projections; cos shared by the batch; sin with a column stride of 2.
    q_wide = torch.cat([q, q], dim=-1)[..., : nope + rope]
    kv_heads_first = kv.transpose(1, 2).contiguous().transpose(1, 2)
    sin_strided = torch.stack([sin, sin], -1)[..., 0]
    cos_shared = cos[:1].expand(2, -1, -1)
    args = (q_wide, k_pe, kv_heads_first, cos_shared, sin_strided, nope, rope, v)
    check(run(OP, TRITON, args), args)
    check_backward(partial_rotary_emb, partial_rotary_emb_reference, args, (0, 1, 2), gen, reduce_dim=4)


@pytest.mark.parametrize("shape", SHAPES[:3], ids=str)
def test_backward_matches_reference(shape, dtype, device, gen):
    args = inputs(*shape, dtype, device, gen)
    # k_pe's gradient sums over the heads; cos and sin take gradients too.
    check_backward(partial_rotary_emb, partial_rotary_emb_reference, args, (0, 1, 2, 3, 4), gen, reduce_dim=16)


def test_public_function_runs_the_plan(device, gen, run):
    args = inputs((2,), 3, 5, 16, 8, 16, torch.float16, device, gen)
    assert dlblas_kernels.partial_rotary_emb is partial_rotary_emb
    for a, b in zip(partial_rotary_emb(*args), run(OP, TRITON, args)):
        assert torch.equal(a, b)


def test_zero_tokens_launch_nothing(device, no_launch):
    args = inputs((2,), 0, 4, 16, 8, 16, torch.float32, device, torch.Generator())
    q_out, out_kv = partial_rotary_emb(*args)
    assert q_out.shape == (2, 0, 4, 24) and out_kv.shape == (2, 0, 2, 4, 24)


def test_plan_on_meta_tensors_reads_no_data():
    args = inputs((2,), 7, 16, 128, 64, 128, torch.bfloat16, "meta", torch.Generator())
    plan = TRITON.plan(args, {"BLOCK_H": 4, "num_warps": 4}, device_profile(first_device(args)))
    q_out, out_kv = plan.result
    assert q_out.shape == (2, 7, 16, 192) and out_kv.shape == (2, 7, 2, 16, 192)
    (call,) = plan.calls
    assert call.grid == (14, 4)
    assert {k: call.kwargs[k] for k in ("BLOCK_NOPE", "BLOCK_R", "BLOCK_V", "BLOCK_PAD")} == {
        "BLOCK_NOPE": 128, "BLOCK_R": 64, "BLOCK_V": 128, "BLOCK_PAD": 64}


BAD = ["odd rope", "v too wide", "negative nope", "q width", "k_pe heads", "k_pe sequence", "kv heads", "kv width",
       "cos width", "sin shape", "kv dtype", "nope a float", "q leading dims interleaved"]


@pytest.mark.parametrize("case", BAD)
def test_bad_inputs_raise_before_launch(case, device, no_launch):
    q, k_pe, kv, cos, sin, nope, rope, v = inputs((2,), 3, 4, 8, 4, 8, torch.float32, device, torch.Generator())
    if case == "odd rope":
        q, k_pe, cos, sin, rope = q[..., :11], k_pe[..., :3], cos[..., :3], sin[..., :3], 3
    elif case == "v too wide":
        kv, v = torch.cat([kv, kv], -1), 16
    elif case == "negative nope":
        nope = -1
    elif case == "q width":
        q = q[..., :10]
    elif case == "k_pe heads":
        k_pe = k_pe.expand(2, 3, 4, 4)
    elif case == "k_pe sequence":
        k_pe = k_pe[:, :2]
    elif case == "kv heads":
        kv = kv[:, :, :3]
    elif case == "kv width":
        kv = kv[..., :15]
    elif case == "cos width":
        cos = cos[..., :2]
    elif case == "sin shape":
        sin = sin[:1]
    elif case == "kv dtype":
        kv = kv.half()
    elif case == "nope a float":
        nope = 8.0
    elif case == "q leading dims interleaved":
        q, k_pe, kv = (t.unsqueeze(0).expand(2, *t.shape).transpose(0, 1) for t in (q, k_pe, kv))
        cos = sin = cos[0]
    with pytest.raises(InvalidInputError):
        partial_rotary_emb(q, k_pe, kv, cos, sin, nope, rope, v)


def test_backward_leaves_the_tables_alone_unless_asked(monkeypatch, device, gen):
    module = importlib.import_module("dlblas_kernels.kernels.partial_rotary_emb")

    args = inputs((2,), 3, 4, 8, 4, 8, torch.float32, device, gen)
    monkeypatch.setattr(module, "_table_grads", lambda *a: pytest.fail("cos and sin gradients computed"))
    check_backward(partial_rotary_emb, partial_rotary_emb_reference, args, (0, 1, 2), gen, reduce_dim=4)
    assert [OP.args[i].name for i in OP.differentiable()] == ["q", "k_pe", "kv"]


def test_backward_of_one_table_alone(device, gen):
    args = inputs((2,), 3, 4, 8, 4, 8, torch.float32, device, gen)
    check_backward(partial_rotary_emb, partial_rotary_emb_reference, args, (3,), gen, reduce_dim=16)


@pytest.mark.slow
@pytest.mark.parametrize("heads, forward, backward", [(128, (128, 8), (32, 8)), (16, (16, 8), (8, 2))])
def test_default_launches_at_deepseek_sizes(heads, forward, backward):
    """DeepSeek-V2 (128 heads) and V2-Lite (16): the forward takes every head of a token with 8
    warps; the backward steps over at most 32 heads and half of V2-Lite's (two steps of 8, faster
    on the H200 than one of 16), with about 32 elements per thread."""
    args = inputs((1,), 4096, heads, 128, 64, 128, torch.bfloat16, "meta", torch.Generator())
    config = TRITON.default_config(make_signature(OP, args, args[0].device), None)
    (call,) = TRITON.plan(args, config, device_profile(first_device(args))).calls
    assert (call.kwargs["BLOCK_H"], call.kwargs["num_warps"]) == forward and call.grid == (4096, 1)
    q, k_pe, kv, cos, sin, nope, rope, v = args
    grads = (torch.empty(q.shape, dtype=q.dtype, device="meta"),
             torch.empty(1, 4096, 2, heads, 192, dtype=q.dtype, device="meta"))
    (call,) = backward_plan((*grads, cos, sin, k_pe, kv, nope, rope, v), config, UNKNOWN_DEVICE).calls
    assert (call.kwargs["BLOCK_H"], call.kwargs["num_warps"]) == backward and call.grid == (4096,)
    assert TRITON.space().is_valid(config) is None


def test_the_head_count_is_part_of_the_key():
    """DeepSeek-V2 at 512 tokens and V2-Lite at 4096 hold as many (token, head) rows: a config tuned
    for one must not be served to the other."""
    v2 = inputs((1,), 512, 128, 128, 64, 128, torch.bfloat16, "meta", torch.Generator())
    lite = inputs((1,), 4096, 16, 128, 64, 128, torch.bfloat16, "meta", torch.Generator())
    keys = [make_signature(OP, args, args[0].device) for args in (v2, lite)]
    assert keys[0].tensor("q").shape == (512, 128, 192) and keys[1].tensor("q").shape == (4096, 16, 192)
    assert keys[0].key() != keys[1].key()
