from __future__ import annotations

import sys

import dlblas_kernels
import pytest
import torch
from dlblas_kernels.kernels.add_rms_norm import KERNEL, OP, add_rms_norm, add_rms_norm_reference
from dlblas_kernels.kernels.rms_norm import rms_norm_reference
from gradients import check_backward

from dlcore import InvalidInputError
from dlcore.runtime.profile import device_profile
from dlcore.testing import assert_close, randn, upcast

TRITON = KERNEL.implementation

rms_norm_module = sys.modules["dlblas_kernels.kernels.rms_norm"]


def inputs(lead, k, dtype, device, gen):
    x = randn(*lead, k, dtype=dtype, device=device, generator=gen)
    w = randn(k, dtype=dtype, device=device, generator=gen)
    residual = randn(*lead, k, dtype=dtype, device=device, generator=gen, scale=4.0)
    return x, w, residual


def check(result, x, w, residual, eps=1e-6):
    y, h = result
    expected_y, expected_h = add_rms_norm_reference(*upcast(x, w, residual), eps)
    assert_close(h, expected_h, x.dtype)
    assert_close(y, expected_y, x.dtype)
    # residual_out is the sum rounded to x's dtype, and y normalises exactly that.
    assert torch.equal(h, (x.float() + residual.float()).to(x.dtype))
    assert_close(y, rms_norm_reference(*upcast(h, w), eps), x.dtype)


@pytest.mark.parametrize("lead, k", [((7,), 33), ((3, 5), 100), ((2,), 1000), ((), 65), ((4,), 1)])
def test_matches_reference(lead, k, dtype, device, gen, run):
    x, w, residual = inputs(lead, k, dtype, device, gen)
    check(run(OP, TRITON, (x, w, residual, 1e-6)), x, w, residual)


@pytest.mark.parametrize("config", [
    {"BLOCK_M": 4, "BLOCK_N": 128, "num_warps": 2},
    {"BLOCK_M": 1, "BLOCK_N": 32, "num_warps": 1},
    {"BLOCK_M": 2, "BLOCK_N": 16, "num_warps": 1},
], ids=lambda c: "{BLOCK_M}x{BLOCK_N}".format(**c))
def test_configs(config, dtype, device, gen, run):
    x, w, residual = inputs((7,), 100, dtype, device, gen)
    check(run(OP, TRITON, (x, w, residual, 1e-6), config), x, w, residual)


def test_non_contiguous_inputs(dtype, device, gen, run, relayout):
    x, w, residual = inputs((3, 5), 100, dtype, device, gen)
    args = (relayout(x), w, relayout(residual), 1e-6)
    assert not args[0].is_contiguous() and not args[2].is_contiguous()
    check(run(OP, TRITON, args), x, w, residual)
    check(run(OP, TRITON, args, {"BLOCK_M": 2, "BLOCK_N": 32, "num_warps": 1}), x, w, residual)


def test_eps_is_applied(device, gen, run):
    x, w, residual = inputs((4,), 40, torch.float32, device, gen)
    x, residual = x * 0.05, residual * 0.01
    check(run(OP, TRITON, (x, w, residual, 0.01)), x, w, residual, eps=0.01)


@pytest.mark.parametrize("lead, k", [((7,), 33), ((3, 5), 100), ((40,), 8)])
def test_backward_matches_reference(lead, k, dtype, device, gen):
    x, w, residual = inputs(lead, k, dtype, device, gen)
    dx, _, dresidual = check_backward(add_rms_norm, add_rms_norm_reference, (x, w, residual, 1e-6), (0, 1, 2), gen,
                                      reduce_dim=max(k, x.numel() // k))
    assert torch.equal(dx, dresidual)


@pytest.mark.parametrize("config", [
    {"BLOCK_M": 2, "BLOCK_N": 64, "num_warps": 1},  # rows in one block, dweight share in registers
    {"BLOCK_M": 1, "BLOCK_N": 16, "num_warps": 1},  # two passes, dweight share read back
], ids=["one-block", "two-pass"])
def test_backward_with_looping_programs(config, dtype, device, gen, monkeypatch):
    """Two programs over nine rows: each loops over several row blocks, adding residual_out's gradient."""
    monkeypatch.setattr(rms_norm_module, "backward_programs", lambda blocks, *_: min(blocks, 2))
    x, w, residual = inputs((9,), 40, dtype, device, gen)
    dx, _, dresidual = check_backward(lambda *a: TRITON.run(a, config), add_rms_norm_reference,
                                      (x, w, residual, 1e-6), (0, 1, 2), gen, reduce_dim=40)
    assert torch.equal(dx, dresidual)


def test_backward_non_contiguous_inputs(dtype, device, gen, relayout):
    x, w, residual = inputs((3, 5), 100, dtype, device, gen)
    check_backward(add_rms_norm, add_rms_norm_reference, (relayout(x), w, relayout(residual), 1e-6), (0, 1, 2), gen,
                   reduce_dim=100)


def test_backward_through_one_output(device, gen):
    """Only y is used: residual_out's gradient is zero, and the other way round."""
    x, w, residual = inputs((6,), 48, torch.float32, device, gen)
    for used in (0, 1):
        args = [t.detach().requires_grad_() for t in (x, w, residual)]
        add_rms_norm(*args)[used].square().sum().backward()
        args64 = [t.detach().double().requires_grad_() for t in (x, w, residual)]
        add_rms_norm_reference(*args64)[used].square().sum().backward()
        for a, a64 in zip(args, args64):
            expected = a64.grad if a64.grad is not None else torch.zeros_like(a64)  # weight, when y is unused
            assert_close(a.grad, expected, torch.float32, reduce_dim=48)


def test_public_function_runs_the_plan(device, gen, run):
    x, w, residual = inputs((3, 5), 100, torch.float16, device, gen)
    assert dlblas_kernels.add_rms_norm is add_rms_norm
    for a, b in zip(add_rms_norm(x, w, residual), run(OP, TRITON, (x, w, residual, 1e-6))):
        assert torch.equal(a, b)
    for a, b in zip(add_rms_norm(x, w, residual, eps=0.5), run(OP, TRITON, (x, w, residual, 0.5))):
        assert torch.equal(a, b)


def test_zero_rows_launch_nothing(device, no_launch):
    x = torch.empty(0, 33, device=device)
    y, h = add_rms_norm(x, torch.ones(33, device=device), x)
    assert y.shape == h.shape == (0, 33)


def test_plan_on_meta_tensors_reads_no_data():
    x, w = torch.empty(6, 4, 100, device="meta"), torch.empty(100, device="meta", dtype=torch.float16)
    plan = TRITON.plan((x, w, x, 1e-6), {"BLOCK_M": 2, "BLOCK_N": 64, "num_warps": 2}, device_profile(x.device))
    assert all(t.device.type == "meta" and t.shape == x.shape for t in plan.result)
    (call,) = plan.calls
    assert call.grid == (12,) and call.kwargs == {"BLOCK_M": 2, "BLOCK_N": 64, "ONE_BLOCK": False, "num_warps": 2}


@pytest.mark.parametrize("case", ["int32 x", "residual dtype", "residual shape", "weight size", "rank-0 x",
                                  "interleaved rows"])
def test_bad_inputs_raise_before_launch(case, device, no_launch):
    x, w = torch.randn(4, 6, 32, device=device), torch.randn(32, device=device)
    residual = torch.randn(4, 6, 32, device=device)
    if case == "int32 x":
        x = x.to(torch.int32)
    elif case == "residual dtype":
        residual = residual.half()
    elif case == "residual shape":
        residual = residual[:, :5]
    elif case == "weight size":
        w = w[:31]
    elif case == "rank-0 x":
        x, residual = x[0, 0, 0], residual[0, 0, 0]
    elif case == "interleaved rows":
        residual = residual.transpose(0, 1).contiguous().transpose(0, 1)
    with pytest.raises(InvalidInputError):
        add_rms_norm(x, w, residual)
