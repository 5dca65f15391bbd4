"""fused_moe against its float64 loop over the experts: the alignment on its own, the forward at
small odd shapes (a token count no row block divides, experts that receive nothing, dropped
choices, strided inputs), the gradients, the composite candidate, bad inputs, and the cubins.

fp8 weights (128x128 block scales): against the float64 loop that quantises the activations per
1x128 as the kernels do, in the hidden dtype's tolerance, and against the loop on the dequantised
weights alone in fp8's. Triton's interpreter converts float32 to float8_e4m3fn wrongly (a round-up
into the next power of two is not carried into the exponent, subnormals are truncated; see
test_quantize_fp8.py): on the CPU the quantising reference converts with the interpreter's own
routine, and the dequantised-weight comparison is made by that reference with torch's conversion
(what the GPU computes); on a GPU the kernels meet both references themselves."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import ON_GPU
from dlblas_kernels import vendor
from dlblas_kernels.blocks import grouped, moe_tiles
from dlblas_kernels.kernels import fused_moe as moe
from dlblas_kernels.kernels.fused_moe import (
    KERNEL,
    OP,
    backward_plan,
    fused_moe,
    fused_moe_backward_reference,
    fused_moe_fp8_reference,
    fused_moe_reference,
    fused_moe_training_reference,
    heuristic,
    quantise_weight,
)
from gradients import check_backward
from isolated import run_json

from dlcore import InvalidInputError
from dlcore.declarations.implementation import LaunchPlan
from dlcore.testing import assert_close, poison, randn, tolerance, upcast

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


def only_used_experts(args):
    """``args`` with w13 and w2 cut to the experts some token chose, the ids renumbered: the same
    result, and a float64 reference at a model's shape (256 experts) within a GPU's memory."""
    hidden, w13, w2, weights, ids, *rest = args
    used = torch.unique(ids[ids >= 0])
    compact = torch.where(ids >= 0, torch.searchsorted(used, ids.clamp(min=0)), -1).to(ids.dtype)
    return (hidden, w13[used], w2[used], weights, compact, *rest)


def check(out, args):
    expected = fused_moe_reference(*upcast(*only_used_experts(args)))
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


# The copy engine's GEMMs (blocks/grouped_tma.py): column tiles dividing INTER (48) and H (32).
TMA = {**SMALL, "BLOCK_N": 16, "DOWN_BLOCK_N": 16, "TMA": 1}


def _hopper(profile, device):
    return dataclasses.replace(profile, arch="sm_90", cores=3 if device == "cpu" else profile.cores)


def _kernels(plan):
    return [call.kernel.__name__ for call in plan.calls]


@pytest.mark.parametrize("experts", [E, 1])
def test_forward_through_the_copy_engine(device, gen, profile, experts):
    """Rows gathered into expert order, both GEMMs through tensor descriptors over every expert's
    weight rows (an expert's tile ending where the next expert's rows begin), the down GEMM's rows
    stored by slot; an empty expert, dropped choices, and one expert alone."""
    dtype = torch.bfloat16 if ON_GPU else torch.float16
    args = inputs(dtype, device, gen, experts=experts, topk=min(K, experts))
    plan = moe.plan((*args, None, None), TMA, _hopper(profile, device))
    assert _kernels(plan).count("grouped_tma_gemm_kernel") == 2
    poison(plan.result)
    check(plan.run(), args)


def test_copy_engine_loops_flattened_unless_the_config_says_not(device, gen, profile):
    """A config's FLATTEN (default 1) reaches both copy-engine GEMMs; unflattened, the output is the same."""
    args = (*inputs(torch.float16, device, gen), None, None)
    for flatten, expected in ((None, True), (0, False)):
        config = TMA if flatten is None else {**TMA, "FLATTEN": flatten}
        plan = moe.plan(args, config, _hopper(profile, device))
        flags = [c.kwargs["FLATTEN"] for c in plan.calls if c.kernel.__name__ == "grouped_tma_gemm_kernel"]
        assert flags == [expected, expected]
        poison(plan.result)
        check(plan.run(), args[:5])


@pytest.mark.skipif(not ON_GPU, reason="Mixtral's width needs a GPU")
@pytest.mark.xfail(reason="the copy-engine GEMMs are wrong in some rows at Mixtral's 4096 tokens in some calls and "
                   "right in others on an H100 (moe_tiles.TMA_BY_DEFAULT): a pass shows no fix", strict=False)
def test_copy_engine_at_mixtral_size_on_gpu(gen, profile):
    args = inputs(torch.bfloat16, "cuda", gen, tokens=4096, hidden=4096, inter=14336, experts=8, topk=2)
    plan = moe.plan((*args, None, None), {**moe.heuristic(4096, 8, 2, 2, profile), "TMA": 1}, profile)
    assert "grouped_tma_gemm_kernel" in _kernels(plan)
    pointer = moe.plan((*args, None, None), moe.heuristic(4096, 8, 2, 2, profile), profile).run().float()
    torch.testing.assert_close(plan.run().float(), pointer, atol=0.05, rtol=0.05)


def test_the_copy_engine_path_declines_what_it_cannot_read(device, gen, profile):
    """Column tiles that do not divide I, float32 weights, a device without the persistent
    descriptor kernel, or a training plan: the pointer kernels."""
    hopper = _hopper(profile, device)
    args = (*inputs(torch.float16, device, gen), None, None)
    ampere = dataclasses.replace(profile, arch="sm_80")
    declined = [moe.plan(args, {**TMA, "BLOCK_N": 32}, hopper), moe.plan(args, TMA, ampere)]
    wide = (*inputs(torch.float32, device, gen), None, None)
    declined.append(moe.plan(wide, TMA, hopper))
    declined.append(moe.training_plan(args, TMA, hopper))
    for plan in declined:
        assert "grouped_tma_gemm_kernel" not in _kernels(plan)
    assert moe.heuristic(4096, 8, 2, 2, hopper)["TMA"] == int(moe_tiles.TMA_BY_DEFAULT)
    assert moe.heuristic(4096, 256, 8, 2, hopper)["TMA"] == 0 and moe.heuristic(64, 8, 2, 2, hopper)["TMA"] == 0


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


def test_composite_gradients_match_the_reference(gen):
    """The composite's loop of GEMMs (no torch._grouped_mm on a CPU) is differentiable: what
    `dlcore bench fused_moe --mode bwd` times it by."""
    args = inputs(torch.float32, "cpu", gen)
    check_backward(vendor.fused_moe, fused_moe_reference, args, wrt=(0, 1, 2, 3), gen=gen, reduce_dim=H)


def test_dequantised_takes_slices_of_experts(gen, monkeypatch):
    """Slice by slice (here one expert and a half's elements: slices of one expert) as whole."""
    _, w13, *_ = inputs(torch.float32, "cpu", gen)
    q, scale = quantise_weight(w13)
    whole = moe.dequantise_weight(q, scale, torch.float32).to(torch.float16)
    monkeypatch.setattr(moe, "DEQUANTISE_SLICE", w13[0].numel() * 3 // 2)
    sliced = moe.dequantised(q, scale, torch.float16)
    assert sliced.dtype == torch.float16 and torch.equal(sliced, whole)


def test_sixteen_bit_baseline_dequantises_once(gen):
    """The ``bf16`` baseline runs this library's 16-bit path on the fp8 weights dequantised by its
    ``prepare``, the same layer within fp8's error."""
    x, w13, w2, weights, ids = inputs(torch.float32, "cpu", gen)
    (q13, s13), (q2, s2) = quantise_weight(w13), quantise_weight(w2)
    baseline = OP.baselines["bf16"]()
    prepared = baseline.prepare((x, q13, q2, weights, ids, s13, s2))
    assert len(prepared) == 5 and prepared[1].dtype == torch.float32 and prepared[2].dtype == torch.float32
    assert_close(prepared[1], moe.dequantise_weight(q13, s13, torch.float64), torch.float32)
    assert_close(baseline(*prepared), fused_moe_reference(*upcast(*prepared[:4]), ids), torch.float32, reduce_dim=H)


def test_heuristic_rows_per_expert():
    assert heuristic(1, 256, 8, 2, None)["BLOCK_M"] == 16 and heuristic(1, 256, 8, 2, None)["BLOCK_K"] == 256
    assert heuristic(64, 8, 2, 2, None)["BLOCK_K"] == 128
    assert heuristic(4096, 8, 2, 2, None)["BLOCK_M"] == 128
    assert heuristic(4096, 8, 2, 4, None)["BLOCK_K"] == 32


def test_tiles_on_npu_fit_its_unified_buffer():
    """The prefill's 128-row blocks overflow an Ascend 910B's unified buffer in bishengir-compile
    (1712128 bits asked of 1572864): on npu the heuristic narrows them to what fits, the search space
    keeps only configs that fit, and the GPU's configs are untouched."""
    from dlcore.compiler.lowering import target_profile

    npu, hopper = target_profile("npu:Ascend910B2"), target_profile("cuda:90")
    buffer = npu.shared_memory_per_program
    gpu = heuristic(4096, 8, 2, 2, hopper)
    assert gpu["BLOCK_M"] == 128 and moe.overflows_unified_buffer(gpu, buffer)
    for tokens in (1, 37, 300, 4096, 16384):
        for size in (2, 4):
            config = heuristic(tokens, 8, 2, size, npu)
            assert not moe.overflows_unified_buffer(config, buffer), (tokens, size, config)
            assert config["BLOCK_M"] >= 16
    assert heuristic(4096, 8, 2, 2, npu) == {**gpu, "BLOCK_M": 64}
    assert heuristic(1, 256, 8, 2, npu)["BLOCK_K"] == 256  # decoding's 16-row blocks fit as they are
    # an overflowing config is narrowed, never widened, and stops at 16-row blocks of 32-wide K steps
    small = moe.fit_unified_buffer({**gpu, "BLOCK_K": 256, "DOWN_BLOCK_N": 256}, 16 * 32 * 48)
    assert (small["BLOCK_M"], small["BLOCK_K"]) == (16, 32) and not moe.overflows_unified_buffer(small, 16 * 32 * 48)
    space = moe.space(npu)
    assert "unified buffer" in space.is_valid(gpu) and space.is_valid(heuristic(4096, 8, 2, 2, npu)) is None
    assert moe.space(hopper).is_valid(gpu) is None


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
    (lambda a: {"w13_scale": torch.ones(E, 1, 1)}, "w13_scale", "only with float8_e4m3fn w13"),
    (lambda a: {"w2_scale": torch.ones(E, 1, 1)}, "w2_scale", "only with float8_e4m3fn w2"),
    (lambda a: {"topk_ids": a[4].float()}, "topk_ids", "int32, int64"),
])
def test_bad_inputs_are_named(gen, no_launch, change, named, says):
    args = inputs(torch.float32, "cpu", gen)
    bad = _bad(args, **change(args))
    with pytest.raises(InvalidInputError, match=r"\[?" + named) as info:
        OP.validate(bad)
    assert info.value.arg == named and says in str(info.value)


# --- fp8 weights ---------------------------------------------------------------------------------------

#: fp8's loose tolerance against the dequantised weights: the norm of the error over the norm of
#: the output (e4m3 rounds each activation by up to 2^-4 of its value)
FP8_REL_ERROR = 0.06
#: gate/up column tiles of 32 (run as 16: I = 144 is no multiple of 32) and K steps of 32; the
#: SwiGLU output stored in float32 and quantised by a launch of its own
FP8_SMALL = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=2,
                 DOWN_BLOCK_N=32, DOWN_BLOCK_K=64, DOWN_WARPS=4, DOWN_STAGES=2)
#: (H, I, config): I = 144 no multiple of 128 (the up half's tiles cross w13's scale blocks at
#: other columns than the gate's); I = 128 under the heuristic: 128-column tiles, the SwiGLU output
#: quantised in the gate/up GEMM's epilogue
FP8_CASES = {"staged": (160, 144, FP8_SMALL), "epilogue": (80, 128, None)}


def interpreted_cast(v: torch.Tensor) -> torch.Tensor:
    """float32 ``v`` to float8_e4m3fn as Triton's interpreter converts it (its own routine), or as
    torch does where that routine is not there."""
    try:
        import numpy as np
        import triton.language as tl
        from triton._C.libtriton import ir
        from triton.runtime.interpreter import _convert_float  # the interpreter's conversion; no public one
    except ImportError:
        return v.to(torch.float8_e4m3fn)
    bits = _convert_float(v.float().contiguous().numpy(), tl.float32, tl.float8e4nv, ir.ROUNDING_MODE.RTNE)
    return torch.from_numpy(np.ascontiguousarray(bits).astype(np.uint8).reshape(v.shape)).view(torch.float8_e4m3fn)


def fp8_inputs(dtype, device, gen, tokens=T, hidden=H, inter=INTER, experts=E, topk=K):
    x, w13, w2, weights, ids = inputs(torch.float32, "cpu", gen, tokens, hidden, inter, experts, topk)
    (w13, w13_scale), (w2, w2_scale) = quantise_weight(w13), quantise_weight(w2)
    return tuple(t.to(device) for t in (x.to(dtype), w13, w2, weights, ids, w13_scale, w2_scale))


def check_fp8(out, args):
    """``out`` against what the kernels compute (hidden dtype's tolerance) and against the
    dequantised weights (fp8's)."""
    dtype, h = args[0].dtype, args[0].shape[1]
    assert out.dtype == dtype and not torch.isnan(out).any(), "an element was never written"
    cpu = tuple(t.cpu() for t in args)
    plain = fused_moe_training_reference(*upcast(cpu[0]), *cpu[1:])[0]
    if ON_GPU:
        atol, rtol = tolerance(torch.bfloat16, h)
        torch.testing.assert_close(out.double().cpu(), fused_moe_fp8_reference(*upcast(cpu[0]), *cpu[1:]),
                                   atol=atol, rtol=rtol)
        quantised = out.double().cpu()
    else:
        assert_close(out, fused_moe_fp8_reference(*upcast(cpu[0]), *cpu[1:], cast=interpreted_cast), dtype,
                     reduce_dim=h)
        quantised = fused_moe_fp8_reference(*upcast(cpu[0]), *cpu[1:])
    error = (quantised - plain).norm() / plain.norm()
    assert error < FP8_REL_ERROR, f"{float(error):.3f} of the output's norm off the dequantised weights' result"


@pytest.mark.parametrize("case", FP8_CASES)
def test_fp8_forward(case, dtype, device, gen, run):
    h, inter, config = FP8_CASES[case]
    args = fp8_inputs(dtype, device, gen, hidden=h, inter=inter)
    check_fp8(run(OP, TRITON, args, config), args)


def test_fp8_forward_takes_any_strides_and_the_public_function(device, gen):
    x, w13, w2, weights, ids, w13_scale, w2_scale = fp8_inputs(torch.float16, device, gen, hidden=160, inter=144)
    wide = poison(torch.empty(T, 2 * 160, dtype=x.dtype, device=device))[:, ::2]
    wide.copy_(x)
    args = (wide, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, weights.T.contiguous().T, ids.long(),
            w13_scale.transpose(1, 2).contiguous().transpose(1, 2), w2_scale)
    check_fp8(fused_moe(*args), args)
    staged = [call.kernel.__name__ for call in moe.plan(args, FP8_SMALL, None).calls]
    assert staged.count("grouped_fp8_gemm_kernel") == 2 and staged.count("block_quantize_kernel") == 2
    assert "grouped_gemm_kernel" not in staged


#: the fp8 copy-engine path's tiles: 128-column gate/up tiles (the SwiGLU output's quantisation group),
#: 32-column down tiles (H = 160: one and a quarter scale blocks along K of the gate/up GEMM)
FP8_TMA = dict(FP8_SMALL, BLOCK_N=128, DOWN_BLOCK_N=32, TMA=1)


@pytest.mark.parametrize("experts", [E, 1])
def test_fp8_forward_through_the_copy_engine(device, gen, profile, experts):
    """fp8 weights through the copy engine: the quantised rows and their scales gathered, both
    GEMMs block-scaled through tensor descriptors, the SwiGLU output quantised by place in the
    gate/up epilogue; a K of 160 (a partial scale block), an empty expert, one expert alone."""
    args = fp8_inputs(torch.float16, device, gen, hidden=160, inter=256, experts=experts, topk=min(K, experts))
    plan = moe.plan(args, FP8_TMA, _hopper(profile, device))
    kernels = _kernels(plan)
    assert kernels.count("grouped_tma_gemm_kernel") == 2 and "grouped_fp8_gemm_kernel" not in kernels
    poison(plan.result)
    check_fp8(plan.run(), args)
    # tiles the path cannot take (64-column gate/up tiles: no quantisation group) fall back to the pointer kernels
    assert "grouped_tma_gemm_kernel" not in _kernels(moe.plan(args, {**FP8_TMA, "BLOCK_N": 64}, _hopper(profile,
                                                                                                        device)))


def test_fp8_nothing_routed(device, gen):
    x, w13, w2, weights, ids, w13_scale, w2_scale = fp8_inputs(torch.float32, device, gen, hidden=48, inter=32)
    assert (fused_moe(x, w13, w2, weights, torch.full_like(ids, -1), w13_scale, w2_scale) == 0).all()
    assert fused_moe(x[:0], w13, w2, weights[:0], ids[:0], w13_scale, w2_scale).shape == (0, 48)


def test_fp8_composite_dequantises(gen):
    args = fp8_inputs(torch.float32, "cpu", gen, hidden=160, inter=144)
    expected = fused_moe_training_reference(*upcast(args[0]), *args[1:])[0]
    assert_close(vendor.fused_moe(*args), expected, torch.float32, reduce_dim=160)


def test_fp8_heuristic_and_tiles():
    for tokens in (1, 64, 4096):
        config = heuristic(tokens, 8, 2, 1, None, fp8=True)
        assert config["BLOCK_N"] == 128 and config["BLOCK_K"] == 128 and config["DOWN_BLOCK_N"] <= 128
    assert heuristic(4096, 8, 2, 1, None, fp8=True)["BLOCK_M"] == 128
    # 16 warps for the gate/up GEMM from FP8_WIDE_ROWS rows an expert (Mixtral's 1024 at 4096 tokens), not below
    wide, narrow = heuristic(4096, 8, 2, 1, None, fp8=True), heuristic(4096, 256, 8, 1, None, fp8=True)
    assert (wide["num_warps"], wide["num_stages"], wide["DOWN_WARPS"]) == (16, 3, 8)
    assert (narrow["num_warps"], narrow["num_stages"]) == (8, 4)
    tiles = moe.fp8_tiles(heuristic(4096, 8, 2, 2, None), 144)  # the bf16 config's 256-column down tiles
    assert (tiles["BLOCK_N"], tiles["DOWN_BLOCK_N"], tiles["BLOCK_K"]) == (16, 128, 64)
    assert moe.fp8_tiles(heuristic(4096, 8, 2, 1, None, fp8=True), 14336)["BLOCK_N"] == 128


def _fp8_bad(gen):
    args = fp8_inputs(torch.float32, "cpu", gen, hidden=48, inter=32)
    x, w13, w2, weights, ids, w13_scale, w2_scale = args
    plain = inputs(torch.float32, "cpu", gen, hidden=48, inter=32)

    def bad(**changes):
        return _bad(args[:5], **{"w13_scale": w13_scale, "w2_scale": w2_scale, **changes})

    yield "w13_scale", bad(w13_scale=w13_scale[:, :, :0]), "[E, ceil(2I/128), ceil(H/128)]"
    yield "w2_scale", bad(w2_scale=w2_scale[:-1]), "[E, ceil(H/128), ceil(I/128)]"
    yield "w13_scale", bad(w13_scale=w13_scale.half()), "float32"
    yield "w2_scale", bad(w2_scale=w2_scale.double()), "float32"
    yield "w13_scale", bad(w13_scale=None), "is None but w13 is float8_e4m3fn"
    yield "w2_scale", bad(w2_scale=None), "is None but w2 is float8_e4m3fn"
    yield "w13_scale", _bad(plain, w13_scale=w13_scale), "only with float8_e4m3fn w13"
    yield "w13", bad(w13=w13.to(torch.float8_e5m2)), "float8_e4m3fn"
    yield "w2", bad(w2=w2.to(torch.float8_e5m2)), "float8_e4m3fn"
    yield "w2", bad(w2=plain[2], w2_scale=None), "both float8_e4m3fn"
    yield "w13", bad(hidden=x[:, :40], w13=w13[:, :, :40], w2=w2[:, :40]), "multiples of 16"
    yield "hidden", bad(hidden=x.clone().requires_grad_()), "forward only"


def test_fp8_bad_inputs_are_named(gen, no_launch):
    for named, bad, says in _fp8_bad(gen):
        with pytest.raises(InvalidInputError) as info:
            OP.validate(bad)
        assert info.value.arg == named and says in str(info.value), (named, says, str(info.value))


@pytest.mark.skipif(not ON_GPU, reason="bfloat16 at a model's shape needs a GPU")
@pytest.mark.parametrize("tokens", [3, 300])
def test_fp8_model_width_on_gpu(tokens, gen):
    """H 4096, I 1024 (Mixtral's width, fewer intermediate features): decoding's 16-row blocks, and
    75 rows per expert's 128-row blocks."""
    args = fp8_inputs(torch.bfloat16, "cuda", gen, tokens=tokens, hidden=4096, inter=1024, experts=8, topk=2)
    check_fp8(fused_moe(*args), args)


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

def routing(tokens):
    return e(tokens, 2, dtype=torch.float32), e(tokens, 2, dtype=torch.int32)

def plans():
    for tokens in (3, 4096):
        args = (e(tokens, 256), e(8, 384, 256), e(8, 256, 192), *routing(tokens), None, None)
        config = moe.heuristic(tokens, 8, 2, 2, hopper)
        out, gate, up = moe.training_outputs(*args)
        yield f"{tokens}", (80, 90), [moe.training_plan(args, config, hopper),
                                      moe.backward_plan((out, *args[:5], gate, up), config, hopper)]
        if tokens > 8:  # Mixtral-like prefill, I a multiple of the column tiles: the copy engine's GEMMs
            tma = (e(tokens, 256), e(8, 512, 256), e(8, 256, 256), *routing(tokens), None, None)
            yield f"{tokens} tma", (90,), [moe.plan(tma, {**config, "TMA": 1}, hopper)]
        # fp8: I = 256 (the SwiGLU output quantised in the epilogue), I = 208 (quantised by its own launch)
        for inter in (256, 208):
            fp8 = (e(tokens, 256), e(8, 2 * inter, 256, dtype=moe.FP8), e(8, 256, inter, dtype=moe.FP8),
                   *routing(tokens), e(8, -(-2 * inter // 128), 2, dtype=torch.float32),
                   e(8, 2, -(-inter // 128), dtype=torch.float32))
            yield f"{tokens} fp8 I {inter}", (80, 90, 100), [
                moe.plan(fp8, moe.heuristic(tokens, 8, 2, 1, hopper, fp8=True), hopper)]

found = {}
for name, capabilities, made in plans():
    for plan in made:
        for call in plan.calls:
            for capability in capabilities:
                try:
                    size = len(compile_call(call, GPUTarget("cuda", capability, 32)).asm.get("cubin", b""))
                except Exception:
                    size = -1
                found[f"{name}/{call.kernel.__name__}/sm_{capability}"] = size
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def compiled():
    return run_json(CUBIN, None, TRITON_INTERPRET="0")


@pytest.mark.slow
def test_every_launch_compiles_for_sm90(compiled):
    kernels = {name.split("/")[1] for name in compiled}
    assert kernels == {k.__name__ for k in KERNEL.implementation.kernels}, sorted(compiled)
    hopper = {name: size for name, size in compiled.items() if name.endswith("/sm_90")}
    assert all(size > 0 for size in hopper.values()), hopper


@pytest.mark.slow
def test_fp8_launches_compile_for_sm100_and_declare_sm80(compiled):
    fp8 = {name: size for name, size in compiled.items() if " fp8 " in name}
    blackwell = {name: size for name, size in fp8.items() if name.endswith("/sm_100")}
    assert blackwell and all(size > 0 for size in blackwell.values()), blackwell
    ampere = {name: size for name, size in fp8.items() if name.endswith("/sm_80")}
    for name, size in ampere.items():
        kernel = name.split("/")[1]
        declared = TRITON.limit("cuda", kernel, "80") is not None
        assert (size < 0) == declared, (name, size, declared)
    assert TRITON.limit("cuda", "grouped_fp8_gemm_kernel", "90") is None
    assert TRITON.limit("npu", "grouped_fp8_gemm_kernel") is not None
    assert TRITON.limit("cuda", "grouped_gemm_kernel", "80") is None
    bf16_ampere = {name: size for name, size in compiled.items() if name.endswith("/sm_80") and " fp8 " not in name}
    assert bf16_ampere and all(size > 0 for size in bf16_ampere.values()), bf16_ampere
