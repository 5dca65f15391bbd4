from __future__ import annotations

import dlblas_kernels
import pytest
import torch
from dlblas_kernels.kernels.softmax import (
    KERNEL,
    OP,
    backward_plan,
    softmax,
    softmax_backward_reference,
    softmax_reference,
)
from gradients import check_backward

from dlcore import InvalidInputError
from dlcore.compiler.lowering import target_profile
from dlcore.declarations.signature import make_signature
from dlcore.errors import NoDoubleBackwardError
from dlcore.runtime.profile import device_profile
from dlcore.runtime.template import UNKNOWN_DEVICE
from dlcore.testing import assert_close, poison, randn, upcast

TRITON = KERNEL.implementation
# Rows longer than the block: the online pass and the normalising pass run.
LOOPING = {"BLOCK_M": 1, "BLOCK_N": 32, "num_warps": 1}


def logits(*shape, dtype, device, gen):
    """Spread as a language model's logits are: a few dominate each row."""
    return randn(*shape, dtype=dtype, device=device, generator=gen, scale=4.0)


def expected(x, dim=-1):
    return softmax_reference(*upcast(x), dim)


@pytest.mark.parametrize("lead, n", [((7,), 33), ((3, 5), 100), ((2,), 1000), ((), 65), ((4,), 1)])
def test_matches_reference(lead, n, dtype, device, gen, run):
    x = logits(*lead, n, dtype=dtype, device=device, gen=gen)
    out = run(OP, TRITON, (x, -1))
    assert out.shape == x.shape and out.is_contiguous()
    assert_close(out, expected(x), dtype)


@pytest.mark.parametrize("config", [
    LOOPING,
    {"BLOCK_M": 2, "BLOCK_N": 16, "num_warps": 1},  # two rows per program, a ragged last one
    {"BLOCK_M": 4, "BLOCK_N": 64, "num_warps": 2},
    {"BLOCK_M": 1, "BLOCK_N": 128, "num_warps": 1},  # the row in one block, exactly
], ids=lambda c: "{BLOCK_M}x{BLOCK_N}".format(**c))
@pytest.mark.parametrize("n", [100, 128])
def test_rows_longer_than_a_block(config, n, dtype, device, gen, run):
    x = logits(7, n, dtype=dtype, device=device, gen=gen)
    assert_close(run(OP, TRITON, (x, -1), config), expected(x), dtype)


@pytest.mark.parametrize("dim", [0, 1, 2, -2, -3])
@pytest.mark.parametrize("looping", [False, True])
def test_any_dim(dim, looping, dtype, device, gen, run):
    x = logits(5, 13, 6, dtype=dtype, device=device, gen=gen)
    out = run(OP, TRITON, (x, dim), LOOPING if looping else None)
    assert out.shape == x.shape and out.is_contiguous()
    assert_close(out, expected(x, dim), dtype)


def test_non_contiguous_rows(dtype, device, gen, run, relayout):
    x = logits(3, 5, 100, dtype=dtype, device=device, gen=gen)
    strided = relayout(x)
    assert not strided.is_contiguous()
    assert_close(run(OP, TRITON, (strided, -1)), expected(x), dtype)
    assert_close(run(OP, TRITON, (strided, -1), LOOPING), expected(x), dtype)


@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_layouts_that_do_not_fold(dim, dtype, device, gen, run):
    """A permutation interleaving the leading dimensions (the plan copies it) and a transposed
    matrix (rows of stride 1 along ``dim=0``, none copied)."""
    x = logits(4, 3, 20, dtype=dtype, device=device, gen=gen)
    permuted = x.permute(1, 0, 2)
    assert_close(run(OP, TRITON, (permuted, dim)), expected(permuted, dim), dtype)
    transposed = logits(40, 9, dtype=dtype, device=device, gen=gen).T
    assert_close(run(OP, TRITON, (transposed, dim % 2)), expected(transposed, dim % 2), dtype)


def test_minus_infinity(device, gen, run):
    """Masked logits: a row starting with -inf is exact in both layouts; a row of -inf alone is NaN
    as in torch; large values do not overflow."""
    x = logits(4, 100, dtype=torch.float32, device=device, gen=gen)
    x[0, :70] = -float("inf")
    x[1] = -float("inf")
    x[2, ::3] = -float("inf")
    x[3] *= 1000
    for config in (None, LOOPING):
        out = run(OP, TRITON, (x, -1), config)
        assert torch.isnan(out[1]).all()
        assert_close(out[[0, 2, 3]], expected(x[[0, 2, 3]]), torch.float32)


@pytest.mark.parametrize("config", [None, LOOPING, {"BLOCK_M": 2, "BLOCK_N": 16, "num_warps": 1},
                                    {"BLOCK_M": 4, "BLOCK_N": 128, "num_warps": 2}],
                         ids=["default", "looped", "looped-2-rows", "one-block-4-rows"])
@pytest.mark.parametrize("at", [5000.0, 30000.0, -30000.0])
def test_rows_far_from_zero(config, at, device, gen, run):
    """float32 scores far from zero keep float32's precision in every layout: the row maximum is
    subtracted before the scaling by log2(e) (scaling first rounds each score to its magnitude's
    precision: 3e-4 relative at 5000, 3e-3 at 30000); the looped kernel's first rescale of a row
    far below zero stays finite (it gave NaN)."""
    x = at + logits(9, 100, dtype=torch.float32, device=device, gen=gen)
    out, want = run(OP, TRITON, (x, -1), config), expected(x)
    assert_close(out, want, torch.float32)
    assert ((out - want) / want).abs().max() < 1e-5  # torch's own: about 1e-7


def test_public_function_runs_the_plan(device, gen, run):
    x = logits(3, 4, 20, dtype=torch.float16, device=device, gen=gen)
    assert dlblas_kernels.softmax is softmax
    assert torch.equal(softmax(x), run(OP, TRITON, (x, -1)))
    assert torch.equal(softmax(x, dim=1), run(OP, TRITON, (x, 1)))


def test_zero_rows_launch_nothing(device, no_launch):
    assert softmax(torch.empty(0, 33, device=device)).shape == (0, 33)
    assert softmax(torch.empty(4, 0, device=device), 0).shape == (4, 0)


def test_plan_on_meta_tensors_reads_no_data():
    x = torch.empty(6, 4, 100, device="meta", dtype=torch.bfloat16)
    config = {"BLOCK_M": 4, "BLOCK_N": 64, "num_warps": 2}
    plan = TRITON.plan((x, -1), config, device_profile(x.device))
    (call,) = plan.calls
    assert plan.result.shape == x.shape and plan.result.dtype == x.dtype
    assert call.grid == (6,) and call.kwargs == {"BLOCK_M": 4, "BLOCK_N": 64, "ONE_BLOCK": False, "INNER": False,
                                                  "num_warps": 2}
    # dim 1: 6 * 100 rows of 4 elements, (outer, inner) pairs; the block narrowed to the row
    (call,) = TRITON.plan((x, 1), config, device_profile(x.device)).calls
    assert call.grid == (150,) and call.args[2:5] == (600, 4, 100)
    assert call.kwargs == {"BLOCK_M": 4, "BLOCK_N": 16, "ONE_BLOCK": True, "INNER": True, "num_warps": 1}
    (call,) = backward_plan((x, x, -1), config, UNKNOWN_DEVICE).calls
    assert call.kernel.__name__ == "softmax_backward_kernel" and call.grid == (6,)


def test_default_configs():
    h200 = target_profile("cuda:90")

    def config(shape, dim=-1, profile=h200):
        return TRITON.default_config(make_signature(OP, (torch.empty(*shape, device="meta"), dim),
                                                    torch.device("meta")), profile)

    assert config((4096, 4096)) == {"BLOCK_M": 1, "BLOCK_N": 4096, "num_warps": 8}
    assert config((2048, 16384)) == {"BLOCK_M": 1, "BLOCK_N": 16384, "num_warps": 16}  # whole
    assert config((8192, 128)) == {"BLOCK_M": 8, "BLOCK_N": 128, "num_warps": 2}
    assert config((37, 1000)) == {"BLOCK_M": 1, "BLOCK_N": 1024, "num_warps": 2}
    # looped: blocks for about 32768 elements in flight per SM, as the H200 sweep found best
    assert config((1000, 32768)) == {"BLOCK_M": 1, "BLOCK_N": 4096, "num_warps": 8}
    assert config((256, 131072)) == {"BLOCK_M": 1, "BLOCK_N": 16384, "num_warps": 32}
    assert config((512, 131072))["BLOCK_N"] == 8192 and config((3, 131072))["BLOCK_N"] == 16384
    assert config((256, 131072), profile=None)["BLOCK_N"] == 4096  # no core count: the smallest block
    # npu: a looped block no larger than the unified buffer holds (16384 elements overflow a 910B's)
    assert config((4, 40000), profile=target_profile("npu:Ascend910B2"))["BLOCK_N"] == 8192
    assert config((4, 40000))["BLOCK_N"] == 16384
    # another dim: a generic config the plan narrows
    assert config((64, 8, 16), 1)["BLOCK_M"] == 1


@pytest.mark.parametrize("case", ["int32 x", "rank-0 x", "dim too large", "dim too small", "dim a float",
                                  "dim a bool"])
def test_bad_inputs_raise_before_launch(case, device, no_launch):
    x, dim = torch.randn(4, 32, device=device), -1
    if case == "int32 x":
        x = x.to(torch.int32)
    elif case == "rank-0 x":
        x = x[0, 0]
    elif case == "dim too large":
        dim = 2
    elif case == "dim too small":
        dim = -3
    elif case == "dim a float":
        dim = 1.0
    elif case == "dim a bool":
        dim = True
    with pytest.raises(InvalidInputError):
        softmax(x, dim)


# -- backward --------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape, dim", [((7, 33), -1), ((3, 5, 100), -1), ((65,), 0), ((5, 13, 6), 1),
                                        ((6, 9), 0)])
def test_backward_matches_reference(shape, dim, dtype, device, gen):
    x = logits(*shape, dtype=dtype, device=device, gen=gen)
    check_backward(lambda x: softmax(x, dim), lambda x: softmax_reference(x, dim), (x,), (0,), gen,
                   reduce_dim=shape[dim])


def test_backward_non_contiguous_input(dtype, device, gen, relayout):
    x = relayout(logits(3, 5, 100, dtype=dtype, device=device, gen=gen))
    check_backward(softmax, softmax_reference, (x,), (0,), gen, reduce_dim=100)


@pytest.mark.parametrize("config", [LOOPING, {"BLOCK_M": 2, "BLOCK_N": 16, "num_warps": 1},
                                    {"BLOCK_M": 4, "BLOCK_N": 128, "num_warps": 2}],
                         ids=lambda c: "{BLOCK_M}x{BLOCK_N}".format(**c))
@pytest.mark.parametrize("dim", [-1, 1])
def test_backward_plan_writes_every_output(config, dim, dtype, device, gen, launch, profile):
    y = softmax(logits(2, 5, 40, dtype=dtype, device=device, gen=gen), dim)
    dy = randn(*y.shape, dtype=dtype, device=device, generator=gen)
    dx = launch(backward_plan((dy, y, dim), config, profile))
    assert_close(dx, softmax_backward_reference(*upcast(dy, y), dim), dtype, reduce_dim=y.shape[dim])


def test_backward_of_a_broadcast_gradient(device, gen):
    """``y.sum().backward()`` hands the kernel an expanded gradient (stride 0 across rows)."""
    x = logits(4, 3, 40, dtype=torch.float32, device=device, gen=gen).requires_grad_()
    (softmax(x) * torch.arange(40.0, device=device)).sum().backward()
    x64 = x.detach().double().requires_grad_()
    (softmax_reference(x64) * torch.arange(40.0, device=device)).sum().backward()
    assert_close(x.grad, x64.grad, torch.float32, reduce_dim=40)


def test_custom_op_passes_opcheck(device, gen):
    x = logits(5, 24, dtype=torch.float32, device=device, gen=gen).requires_grad_()
    torch.library.opcheck(torch.ops.dlblas.softmax.default, (x, -1, 0, 0, 0))
    torch.library.opcheck(torch.ops.dlblas.softmax.default, (x, 0, 1, 16, 1))


def test_poisoned_output_is_overwritten(device, gen):
    x = logits(3, 70, dtype=torch.float16, device=device, gen=gen)
    plan = TRITON.plan((x, -1), LOOPING, device_profile(x.device))
    poison(plan.result)
    assert_close(plan.run(), expected(x), torch.float16)


COMPILE_SCRIPT = """
import importlib, json, torch
from triton.backends.compiler import GPUTarget
from dlcore.compiler.lowering import compile_call, target_profile

sm = importlib.import_module("dlblas_kernels.kernels.softmax")
found = {}
for dtype in (torch.bfloat16, torch.float32):
    x = torch.empty(64, 37, 300, device="meta", dtype=dtype)
    wide = torch.empty(4, 131072, device="meta", dtype=dtype)
    plans = {
        "one-block": sm.plan((x, -1), sm.heuristic_config(64 * 37, 300, 132), None),
        "looped": sm.plan((wide, -1), sm.heuristic_config(4, 131072, 132), None),
        "inner": sm.plan((x, 1), {"BLOCK_M": 1, "BLOCK_N": 16384, "num_warps": 16}, None),
        "backward": sm.backward_plan((x, x, -1), sm.heuristic_config(64 * 37, 300, 132), None),
        "backward-looped": sm.backward_plan((wide, wide, -1), sm.heuristic_config(4, 131072, 132), None),
        "backward-inner": sm.backward_plan((x, x, 0), {"BLOCK_M": 1, "BLOCK_N": 32, "num_warps": 1}, None),
    }
    for capability in (80, 90, 100):
        for name, plan in plans.items():
            (call,) = plan.calls
            kernel = compile_call(call, GPUTarget("cuda", capability, 32))
            found[f"{name}/{str(dtype)[6:]}/sm_{capability}"] = len(kernel.asm.get("cubin", b""))
print(json.dumps(found))
"""


@pytest.mark.slow
def test_every_variant_compiles_for_nvidia_targets():
    """One-block and looped rows, (outer, inner) rows, forward and backward, bf16 and fp32, each to
    a cubin for sm_80, sm_90 and sm_100."""
    from isolated import run_json

    found = run_json(COMPILE_SCRIPT, None, TRITON_INTERPRET="0")
    assert len(found) == 2 * 3 * 6 and all(size > 0 for size in found.values()), found


def test_second_order_gradients(dtype, device, gen):
    """Gradients of the gradients (create_graph=True, a loss nonlinear in y) match float64
    autograd through the reference; a third order raises NoDoubleBackwardError."""
    x = logits(5, 33, dtype=dtype, device=device, gen=gen)
    w, v = (randn(5, 33, dtype=dtype, device=device, generator=gen) for _ in range(2))

    def second(fn, x):
        x = x.detach().requires_grad_()
        y = fn(x)
        (dx,) = torch.autograd.grad((y * y * w.to(x.dtype)).sum(), x, create_graph=True)
        (ddx,) = torch.autograd.grad((dx * v.to(x.dtype)).sum(), x, create_graph=True)
        return dx, ddx

    got, want = second(softmax, x), second(softmax_reference, x.double())
    for g, ref in zip(got, want):
        assert_close(g, ref, dtype, reduce_dim=33)
    with pytest.raises(NoDoubleBackwardError, match="softmax: a third-order gradient"):
        got[1].sum().backward()
