"""fused_moe against its float64 loop over the experts: the alignment on its own, the forward at
small odd shapes (a token count no row block divides, experts that receive nothing, dropped
choices, strided inputs), the gradients, the composite candidate, bad inputs, and the cubins."""

from __future__ import annotations

import pytest
import torch
from conftest import ON_GPU
from dlblas_kernels import grouped, vendor
from dlblas_kernels.kernels.fused_moe import (
    KERNEL,
    OP,
    backward_plan,
    fused_moe,
    fused_moe_backward_reference,
    fused_moe_reference,
    fused_moe_training_reference,
    heuristic,
)
from gradients import check_backward
from isolated import run_json

from dlcore import InvalidInputError
from dlcore.declarations.implementation import LaunchPlan
from dlcore.testing import assert_close, poison, randn, upcast

TRITON = KERNEL.implementation
T, H, INTER, E, K = 13, 32, 48, 5, 2
EMPTY_EXPERT = 3

# Row blocks of 16 (two of the 26 slots' worth), several column tiles and K steps per GEMM.
SMALL = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=2,
             DOWN_BLOCK_N=16, DOWN_BLOCK_K=16, DOWN_WARPS=4, DOWN_STAGES=2)


def routing(tokens: int, experts: int, topk: int, device, gen, dropped: bool = True):
    """Distinct experts per token (as top-k gives them), EMPTY_EXPERT never chosen, about a sixth of
    the choices dropped (-1), weights in (0, 1)."""
    scores = torch.rand(tokens, experts, generator=gen)
    if experts > EMPTY_EXPERT:
        scores[:, EMPTY_EXPERT] = -1
    ids = scores.topk(topk, dim=-1).indices.to(torch.int32)
    if dropped:
        ids[torch.rand(tokens, topk, generator=gen) < 1 / 6] = -1
    weights = torch.rand(tokens, topk, generator=gen)
    return weights.to(device), ids.to(device)


def inputs(dtype, device, gen, tokens=T, hidden=H, inter=INTER, experts=E, topk=K):
    x = randn(tokens, hidden, dtype=dtype, device=device, generator=gen)
    w13 = randn(experts, 2 * inter, hidden, dtype=dtype, device=device, generator=gen, scale=hidden**-0.5)
    w2 = randn(experts, hidden, inter, dtype=dtype, device=device, generator=gen, scale=inter**-0.5)
    return (x, w13, w2, *routing(tokens, experts, topk, device, gen))


def check(out, args):
    expected = fused_moe_reference(*upcast(*args))
    assert_close(out, expected, args[0].dtype, reduce_dim=args[0].shape[1])


def test_alignment_places_every_slot_once_and_pads_each_expert(device, gen):
    _, ids = routing(T, E, K, device, gen)
    ids[0, 0] = E - 1  # an expert with a single slot
    block_m = 16
    calls, align, _ = grouped.align_calls(ids, torch.rand(T, K, device=device), E, block_m)
    for t in (align.sorted_ids, align.block_expert, align.starts):
        t.fill_(-7)
    LaunchPlan(calls=calls, result=None).run()
    sorted_ids, blocks, starts = (t.cpu().long() for t in (align.sorted_ids, align.block_expert, align.starts))
    flat = ids.reshape(-1).cpu().long()
    counts = torch.bincount(flat[flat >= 0], minlength=E)
    padded = (counts + block_m - 1) // block_m * block_m
    assert starts.tolist() == [0, *torch.cumsum(padded, 0).tolist()]
    total = int(starts[-1])
    used = sorted_ids[:total]
    real = used[used < T * K]
    assert sorted(real.tolist()) == (flat >= 0).nonzero().squeeze(1).tolist(), "every routed slot exactly once"
    assert (used[used >= T * K] == T * K).all() and (used == T * K).sum() == int((padded - counts).sum())
    for e in range(E):
        mine = used[starts[e]:starts[e + 1]]
        assert (flat[mine[mine < T * K]] == e).all(), f"expert {e} holds another expert's slot"
        assert (mine[: counts[e]] < T * K).all(), "padding after the real slots"
        assert (blocks[starts[e] // block_m: starts[e + 1] // block_m] == e).all()
    assert (blocks[total // block_m:] == -1).all() and blocks.numel() == grouped.max_blocks(T * K, E, block_m)
    assert counts[EMPTY_EXPERT] == 0 and starts[EMPTY_EXPERT] == starts[EMPTY_EXPERT + 1]


@pytest.mark.parametrize("config", [None, SMALL], ids=["default", "small tiles"])
def test_forward_matches_the_loop_over_experts(dtype, device, gen, run, config):
    args = inputs(dtype, device, gen)
    check(run(OP, TRITON, (*args, None, None), config), args)


def test_forward_takes_any_strides_and_int64_ids(device, gen, run):
    x, w13, w2, weights, ids = inputs(torch.float16, device, gen)
    wide = poison(torch.empty(T, 2 * H, dtype=x.dtype, device=device))[:, ::2]
    wide.copy_(x)
    args = (wide, w13.transpose(1, 2).contiguous().transpose(1, 2), w2.transpose(1, 2).contiguous().transpose(1, 2),
            weights.T.contiguous().T, ids.long().T.contiguous().T)
    check(run(OP, TRITON, (*args, None, None), SMALL), args)


def test_nothing_routed_and_decode(device, gen):
    args = inputs(torch.float32, device, gen, tokens=1, experts=4, topk=3)
    check(fused_moe(*args), args)
    x, w13, w2, weights, ids = args
    assert (fused_moe(x, w13, w2, weights, torch.full_like(ids, -1)) == 0).all()
    assert fused_moe(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, H)


def test_gradients_match_the_reference(dtype, device, gen):
    args = inputs(dtype, device, gen)
    check_backward(lambda *a: fused_moe(*a), fused_moe_reference, args, wrt=(0, 1, 2), gen=gen, reduce_dim=H)
    # The routing weights' gradient <dout @ w2[e], silu(g) * u> sums INTER products of the pre-activations
    # saved in the hidden dtype: against the formulas on those (rounded alike), in that dtype's tolerance.
    weights = args[3].detach().requires_grad_()
    dout = randn(T, H, dtype=dtype, device=device, generator=gen)
    fused_moe(*args[:3], weights, args[4]).backward(dout)
    _, gate, up = fused_moe_training_reference(*args)
    expected = fused_moe_backward_reference(*upcast(dout, *args[:4]), args[4], gate, up)[3]
    assert_close(weights.grad.to(dtype), expected, dtype, reduce_dim=INTER)


def test_backward_reference_is_the_derivative_of_the_reference(gen):
    args = upcast(*inputs(torch.float32, "cpu", gen))
    leaves = [a.detach().requires_grad_() for a in args[:4]]
    dout = torch.randn(T, H, generator=gen, dtype=torch.float64)
    fused_moe_reference(*leaves, args[4]).backward(dout)
    _, gate, up = fused_moe_training_reference(*args)
    written = fused_moe_backward_reference(dout, *args, gate, up)
    for leaf, grad in zip(leaves, written):
        torch.testing.assert_close(grad, leaf.grad)


def test_backward_plan_with_small_tiles(device, gen, launch):
    x, w13, w2, weights, ids = inputs(torch.float32, device, gen)
    _, gate, up = fused_moe_training_reference(*upcast(x, w13, w2, weights), ids)
    dout = randn(T, H, device=device, generator=gen)
    got = launch(backward_plan((dout, x, w13, w2, weights, ids, gate.float(), up.float()), SMALL, None))
    expected = fused_moe_backward_reference(*upcast(dout, x, w13, w2, weights), ids, gate, up)
    for a, b in zip(got, expected):
        assert_close(a, b, a.dtype, reduce_dim=H)


def test_composite_matches_the_reference(gen):
    args = inputs(torch.float32, "cpu", gen)
    check(vendor.fused_moe(*args), args)
    assert vendor.FUSED_MOE.op == "fused_moe" and vendor.FUSED_MOE.kind == "vendor"


def test_heuristic_rows_per_expert():
    assert heuristic(1, 256, 8, 2, None)["BLOCK_M"] == 16 and heuristic(1, 256, 8, 2, None)["BLOCK_K"] == 256
    assert heuristic(64, 8, 2, 2, None)["BLOCK_K"] == 128
    assert heuristic(4096, 8, 2, 2, None)["BLOCK_M"] == 128
    assert heuristic(4096, 8, 2, 4, None)["BLOCK_K"] == 32


def _bad(args, **changes):
    names = ("hidden", "w13", "w2", "topk_weights", "topk_ids", "w13_scale", "w2_scale")
    values = dict(zip(names, (*args, None, None)))
    values.update(changes)
    return tuple(values.values())


@pytest.mark.parametrize("change, named, says", [
    (lambda a: {"w13": a[1][:, :, :-1]}, "w13", "[E, 2I, H]"),
    (lambda a: {"w13": a[1][:, :-1]}, "w13", "odd number"),
    (lambda a: {"w2": a[2][:, :, :-2]}, "w2", "[E, H, I]"),
    (lambda a: {"w2": a[2][:-1]}, "w2", "[E, H, I]"),
    (lambda a: {"topk_weights": a[3][:, :1]}, "topk_weights", "[T, k]"),
    (lambda a: {"topk_ids": a[4][:-1]}, "topk_ids", "one row per token"),
    (lambda a: {"topk_ids": a[4] + E}, "topk_ids", "expert ids in [0, 5) or -1"),
    (lambda a: {"topk_ids": a[4] - 2}, "topk_ids", "or -1"),
    (lambda a: {"w13": a[1].half()}, "w13", "dtype of hidden"),
    (lambda a: {"w13": a[1].to(torch.float8_e4m3fn)}, "w13", "fp8 weights are not supported"),
    (lambda a: {"w13_scale": torch.ones(E, 1, 1)}, "w13_scale", "not supported by this version yet"),
    (lambda a: {"w2_scale": torch.ones(E, 1, 1)}, "w2_scale", "not supported by this version yet"),
    (lambda a: {"topk_ids": a[4].float()}, "topk_ids", "int32, int64"),
])
def test_bad_inputs_are_named(gen, no_launch, change, named, says):
    args = inputs(torch.float32, "cpu", gen)
    bad = _bad(args, **change(args))
    with pytest.raises(InvalidInputError, match=r"\[?" + named) as info:
        OP.validate(bad)
    assert info.value.arg == named and says in str(info.value)


@pytest.mark.skipif(not ON_GPU, reason="bfloat16 at a model's shape needs a GPU")
def test_deepseek_decode_shape_on_gpu(gen):
    args = inputs(torch.bfloat16, "cuda", gen, tokens=3, hidden=7168, inter=2048, experts=256, topk=8)
    check(fused_moe(*args), args)


CUBIN = """
import json, torch
from triton.backends.compiler import GPUTarget
from dlcore.compiler.lowering import compile_call, target_profile
from dlblas_kernels.kernels import fused_moe as moe

hopper = target_profile("cuda:90")

def e(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, device="meta", dtype=dtype)

found = {}
for tokens in (3, 4096):
    args = (e(tokens, 256), e(8, 384, 256), e(8, 256, 192), e(tokens, 2, dtype=torch.float32),
            e(tokens, 2, dtype=torch.int32), None, None)
    config = moe.heuristic(tokens, 8, 2, 2, hopper)
    out, gate, up = moe.training_outputs(*args)
    plans = [moe.training_plan(args, config, hopper),
             moe.backward_plan((out, *args[:5], gate, up), config, hopper)]
    for plan in plans:
        for call in plan.calls:
            kernel = compile_call(call, GPUTarget("cuda", 90, 32))
            found[f"{tokens}/{call.kernel.__name__}"] = len(kernel.asm.get("cubin", b""))
print(json.dumps(found))
"""


@pytest.mark.slow
def test_every_launch_compiles_for_sm90():
    found = run_json(CUBIN, None, TRITON_INTERPRET="0")
    kernels = {name.split("/")[1] for name in found}
    assert kernels == {k.__name__ for k in KERNEL.implementation.kernels}, sorted(found)
    assert all(size > 0 for size in found.values()), found
