from __future__ import annotations

import dlblas_kernels
import pytest
import torch
from dlblas_kernels.kernels.silu_and_mul import (
    KERNEL,
    OP,
    backward_plan,
    silu_and_mul,
    silu_and_mul_backward_reference,
    silu_and_mul_reference,
)
from gradients import check_backward

from dlcore import InvalidInputError
from dlcore.runtime.profile import device_profile
from dlcore.runtime.template import UNKNOWN_DEVICE
from dlcore.testing import assert_close, randn, upcast

TRITON = KERNEL.implementation


def expected(x):
    return silu_and_mul_reference(*upcast(x))


@pytest.mark.parametrize("lead, n", [((7,), 33), ((3, 5), 100), ((2,), 1000), ((), 50), ((4,), 1)])
def test_matches_reference(lead, n, dtype, device, gen, run):
    x = randn(*lead, 2 * n, dtype=dtype, device=device, generator=gen, scale=3.0)
    out = run(OP, TRITON, (x,))
    assert out.shape == (*lead, n)
    assert_close(out, expected(x), dtype)


def test_non_contiguous_input(dtype, device, gen, run, relayout):
    x = randn(3, 5, 2 * 100, dtype=dtype, device=device, generator=gen)
    x_strided = relayout(x)
    assert not x_strided.is_contiguous()
    assert_close(run(OP, TRITON, (x_strided,)), expected(x), dtype)


@pytest.mark.parametrize("block_n, num_warps", [(16, 1), (32, 1), (64, 2), (256, 4)])
def test_configs_agree(block_n, num_warps, dtype, device, gen, run):
    x = randn(3, 2 * 100, dtype=dtype, device=device, generator=gen)
    out = run(OP, TRITON, (x,), {"BLOCK_N": block_n, "num_warps": num_warps})
    assert_close(out, expected(x), dtype)
    assert torch.equal(out, run(OP, TRITON, (x,)))  # elementwise: identical whatever the blocks


def test_public_function_runs_the_plan(device, gen, run):
    x = randn(3, 5, 2 * 100, dtype=torch.float16, device=device, generator=gen)
    assert dlblas_kernels.silu_and_mul is silu_and_mul
    assert torch.equal(dlblas_kernels.silu_and_mul(x), run(OP, TRITON, (x,)))


def test_zero_rows_launch_nothing(device, no_launch):
    out = silu_and_mul(torch.empty(2, 0, 66, device=device))
    assert out.shape == (2, 0, 33)


def test_plan_on_meta_tensors_reads_no_data():
    x = torch.empty(6, 4, 2 * 100, device="meta", dtype=torch.bfloat16)
    plan = TRITON.plan((x,), {"BLOCK_N": 64, "num_warps": 2}, device_profile(x.device))
    assert plan.result.device.type == "meta" and plan.result.shape == (6, 4, 100)
    assert plan.result.dtype == torch.bfloat16
    (call,) = plan.calls
    assert call.grid == (24, 2)
    dx = backward_plan((plan.result, x), {"BLOCK_N": 64, "num_warps": 2}, UNKNOWN_DEVICE).result
    assert dx.shape == x.shape and dx.dtype == torch.bfloat16


@pytest.mark.parametrize("lead, n", [((7,), 33), ((3, 5), 100), ((), 50)])
def test_backward_matches_reference(lead, n, dtype, device, gen):
    x = randn(*lead, 2 * n, dtype=dtype, device=device, generator=gen, scale=3.0)
    check_backward(silu_and_mul, silu_and_mul_reference, (x,), (0,), gen)


@pytest.mark.parametrize("block_n, num_warps", [(16, 1), (64, 2)])
def test_backward_plan_writes_every_output(block_n, num_warps, dtype, device, gen, launch, relayout, profile):
    x = relayout(randn(3, 5, 2 * 100, dtype=dtype, device=device, generator=gen, scale=3.0))
    dy = randn(3, 5, 100, dtype=dtype, device=device, generator=gen)
    dx = launch(backward_plan((dy, x), {"BLOCK_N": block_n, "num_warps": num_warps}, profile))
    assert_close(dx, silu_and_mul_backward_reference(*upcast(dy, x)), dtype)


def test_backward_non_contiguous_input(dtype, device, gen, relayout):
    x = relayout(randn(3, 5, 2 * 100, dtype=dtype, device=device, generator=gen, scale=3.0))
    check_backward(silu_and_mul, silu_and_mul_reference, (x,), (0,), gen)


@pytest.mark.parametrize("case", ["int32 x", "rank-0 x", "odd last dim", "interleaved rows"])
def test_bad_inputs_raise_before_launch(case, device, no_launch):
    x = torch.randn(4, 6, 32, device=device)
    if case == "int32 x":
        x = x.to(torch.int32)
    elif case == "rank-0 x":
        x = x[0, 0, 0]
    elif case == "odd last dim":
        x = torch.randn(4, 6, 31, device=device)
    elif case == "interleaved rows":
        x = x.transpose(0, 1)
    with pytest.raises(InvalidInputError):
        silu_and_mul(x)
