from __future__ import annotations

import math

import dlblas_kernels
import pytest
import torch
from dlblas_kernels.kernels.ffn import KERNEL, OP, ffn, ffn_reference

from dlcore import InvalidInputError
from dlcore.testing import assert_close, randn, strided_like, upcast

TRITON = KERNEL.implementation


def inputs(lead, k, n, dtype, device, gen, rms_w_dtype=None):
    """Inputs of a LLaMA MLP's scale: unit-variance x, projections scaled so the outputs stay O(1),
    RMSNorm weights around 1 (where they start in training).

    Like an unfused rms_norm -> linear pipeline in x's dtype, the kernel rounds the GEMM input
    (x * rms_w) to x's dtype, and the rounding error of one projection is multiplied by the other:
    against the float64 reference the worst element sits at 0.2-0.4 of the flat per-dtype
    tolerance (seen over 300 seeds: up to about 0.8 for float16, 1.0 for bfloat16), and further out
    with widely spread rms_w.
    """
    x = randn(*lead, k, dtype=dtype, device=device, generator=gen)
    w1 = randn(n, k, dtype=dtype, device=device, generator=gen, scale=1 / math.sqrt(k))
    w3 = randn(n, k, dtype=dtype, device=device, generator=gen, scale=1 / math.sqrt(k))
    rms_w = (1 + randn(k, device=device, generator=gen, scale=0.2)).to(rms_w_dtype or dtype)
    return x, w1, w3, rms_w


def check(out, x, w1, w3, rms_w, eps=1e-6):
    assert out.shape == (*x.shape[:-1], w1.shape[0])
    assert_close(out, ffn_reference(*upcast(x, w1, w3, rms_w), eps), x.dtype, reduce_dim=x.shape[-1])


@pytest.mark.parametrize("lead, k, n", [
    ((7,), 33, 40),
    ((3, 5), 100, 24),
    ((2,), 1000, 17),
    ((), 64, 64),
    ((70,), 48, 130),
])
def test_matches_reference(lead, k, n, dtype, device, gen, run):
    args = inputs(lead, k, n, dtype, device, gen)
    check(run(OP, TRITON, (*args, 1e-6)), *args)


def test_rms_weight_in_another_dtype(device, gen, run):
    args = inputs((9,), 40, 24, torch.float16, device, gen, rms_w_dtype=torch.float32)
    check(run(OP, TRITON, (*args, 1e-6)), *args)


def test_non_contiguous_inputs(dtype, device, gen, run, relayout):
    x, w1, w3, rms_w = inputs((3, 5), 100, 24, dtype, device, gen)
    x_strided = relayout(x)
    w1_t, w3_t = strided_like(w1, "transpose"), strided_like(w3, "transpose")
    assert w1_t.stride() == (1, 24) and not x_strided.is_contiguous()
    check(run(OP, TRITON, (x_strided, w1_t, w3_t, relayout(rms_w), 1e-6)), x, w1, w3, rms_w)


def test_eps_is_applied(device, gen, run):
    x, w1, w3, rms_w = inputs((4,), 40, 16, torch.float32, device, gen)
    x = x * 0.05  # mean(x**2) ~ eps: a kernel that dropped eps would be far off
    check(run(OP, TRITON, (x, w1, w3, rms_w, 0.01)), x, w1, w3, rms_w, eps=0.01)


@pytest.mark.parametrize("config", [
    dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=1, num_warps=1, num_stages=1),
    dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, GROUP_M=2, num_warps=2, num_stages=2),
    dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=2),
], ids=lambda c: "{BLOCK_M}x{BLOCK_N}x{BLOCK_K}-g{GROUP_M}".format(**c))
def test_configs(config, dtype, device, gen, run):
    # 3 row blocks of 16 with a ragged last one, so grouped orders with partial groups are covered.
    args = inputs((37,), 70, 50, dtype, device, gen)
    check(run(OP, TRITON, (*args, 1e-6), config), *args)


def test_public_function_runs_the_plan(device, gen, run):
    args = inputs((3, 5), 100, 24, torch.float16, device, gen)
    assert dlblas_kernels.ffn is ffn
    assert torch.equal(dlblas_kernels.ffn(*args), run(OP, TRITON, (*args, 1e-6)))
    assert torch.equal(ffn(*args, eps=0.5), run(OP, TRITON, (*args, 0.5)))


def test_zero_rows_launch_nothing(device, no_launch):
    x = torch.empty(0, 3, 16, device=device)
    w = torch.ones(8, 16, device=device)
    out = ffn(x, w, w, torch.ones(16, device=device))
    assert out.shape == (0, 3, 8)


def test_plan_on_meta_tensors_reads_no_data():
    x = torch.empty(6, 40, 256, device="meta", dtype=torch.bfloat16)
    w = torch.empty(1000, 256, device="meta", dtype=torch.bfloat16)
    config = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
    plan = TRITON.plan((x, w, w, torch.empty(256, device="meta"), 1e-6), config)
    assert plan.result.device.type == "meta" and plan.result.shape == (6, 40, 1000)
    (call,) = plan.calls
    assert call.grid == (4 * 8,)
    assert call.kwargs["num_stages"] == 3 and call.kwargs["BLOCK_K"] == 64


BAD = ["int32 x", "w1 dtype", "w3 dtype", "int32 rms_w", "rank-0 x", "3-D w1", "w1 columns", "w3 shape",
       "rms_w size", "empty features", "interleaved rows"]


@pytest.mark.parametrize("case", BAD)
def test_bad_inputs_raise_before_launch(case, device, no_launch):
    x = torch.randn(4, 6, 32, device=device, dtype=torch.float16)
    w1 = torch.randn(16, 32, device=device, dtype=torch.float16)
    w3 = torch.randn(16, 32, device=device, dtype=torch.float16)
    rms_w = torch.randn(32, device=device)
    if case == "int32 x":
        x = x.to(torch.int32)
    elif case == "w1 dtype":
        w1 = w1.float()
    elif case == "w3 dtype":
        w3 = w3.to(torch.bfloat16)
    elif case == "int32 rms_w":
        rms_w = rms_w.to(torch.int32)
    elif case == "rank-0 x":
        x = x[0, 0, 0]
    elif case == "3-D w1":
        w1 = w1[None]
    elif case == "w1 columns":
        w1 = torch.randn(16, 33, device=device, dtype=torch.float16)
    elif case == "w3 shape":
        w3 = w3[:15]
    elif case == "rms_w size":
        rms_w = rms_w[:31]
    elif case == "empty features":
        x, w1, w3, rms_w = x[..., :0], w1[:, :0], w3[:, :0], rms_w[:0]
    elif case == "interleaved rows":
        x = x.transpose(0, 1)
    with pytest.raises(InvalidInputError):
        ffn(x, w1, w3, rms_w)
