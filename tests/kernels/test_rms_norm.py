from __future__ import annotations

import dlblas_kernels
import pytest
import torch
from dlblas_kernels.rms_norm import (
    OP,
    TRITON,
    backward_plan,
    rms_norm,
    rms_norm_backward_reference,
    rms_norm_reference,
)
from gradients import check_backward

from dlcore import InvalidInputError
from dlcore.signature import make_signature
from dlcore.testing import assert_close, randn, upcast


def inputs(lead, k, dtype, device, gen, w_dtype=None):
    x = randn(*lead, k, dtype=dtype, device=device, generator=gen)
    w = randn(k, dtype=w_dtype or dtype, device=device, generator=gen)
    return x, w


def expected(x, w, eps=1e-6):
    return rms_norm_reference(*upcast(x, w), eps)


@pytest.mark.parametrize("lead, k", [((7,), 33), ((3, 5), 100), ((2,), 1000), ((), 65), ((4,), 1)])
def test_matches_reference(lead, k, dtype, device, gen, run):
    x, w = inputs(lead, k, dtype, device, gen)
    out = run(OP, TRITON, (x, w, 1e-6))
    assert_close(out, expected(x, w), dtype)


def test_weight_in_another_dtype(device, gen, run):
    x, w = inputs((5,), 48, torch.float16, device, gen, w_dtype=torch.float32)
    assert_close(run(OP, TRITON, (x, w, 1e-6)), expected(x, w), torch.float16)


def test_non_contiguous_inputs(dtype, device, gen, run, relayout):
    x, w = inputs((3, 5), 100, dtype, device, gen)
    x_strided = relayout(x)
    w_strided = torch.stack([w, torch.full_like(w, float("nan"))], dim=1)[:, 0]
    assert not x_strided.is_contiguous() and w_strided.stride() == (2,)
    args = (x_strided, w_strided, 1e-6)
    assert_close(run(OP, TRITON, args), expected(x, w), dtype)
    assert_close(run(OP, TRITON, args, {"BLOCK_M": 2, "BLOCK_N": 32, "num_warps": 1}), expected(x, w), dtype)  # looping


def test_eps_is_applied(device, gen, run):
    x, w = inputs((4,), 40, torch.float32, device, gen)
    x = x * 0.05  # mean(x**2) ~ eps: a kernel that dropped eps would be far off
    assert_close(run(OP, TRITON, (x, w, 0.01)), expected(x, w, 0.01), torch.float32)


@pytest.mark.parametrize("block_m, block_n, num_warps", [(1, 16, 1), (2, 32, 2), (1, 64, 1), (4, 128, 4)])
def test_configs_agree(block_m, block_n, num_warps, dtype, device, gen, run):
    x, w = inputs((7,), 100, dtype, device, gen)
    args = (x, w, 1e-6)
    out = run(OP, TRITON, args, {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": num_warps})
    assert_close(out, expected(x, w), dtype)
    assert_close(out, run(OP, TRITON, args).double(), dtype)


def test_public_function_runs_the_plan(device, gen, run):
    x, w = inputs((3, 5), 100, torch.float16, device, gen)
    out = dlblas_kernels.rms_norm(x, w)
    assert dlblas_kernels.rms_norm is rms_norm
    assert torch.equal(out, run(OP, TRITON, (x, w, 1e-6)))
    assert torch.equal(rms_norm(x, w, eps=0.5), run(OP, TRITON, (x, w, 0.5)))


def test_zero_rows_launch_nothing(device, no_launch):
    x = torch.empty(0, 33, device=device)
    out = rms_norm(x, torch.ones(33, device=device))
    assert out.shape == (0, 33) and out.dtype == x.dtype


def test_plan_on_meta_tensors_reads_no_data():
    x, w = torch.empty(6, 4, 100, device="meta"), torch.empty(100, device="meta", dtype=torch.float16)
    plan = TRITON.plan((x, w, 1e-6), {"BLOCK_M": 4, "BLOCK_N": 64, "num_warps": 2})
    assert plan.result.device.type == "meta" and plan.result.shape == x.shape
    (call,) = plan.calls
    assert call.grid == (6,) and call.kwargs == {"BLOCK_M": 4, "BLOCK_N": 64, "ONE_BLOCK": False, "num_warps": 2}
    dx, dw = backward_plan((x, x, w, None, 1e-6), {"BLOCK_M": 4, "BLOCK_N": 64, "num_warps": 2}).result
    assert dx.shape == x.shape and dw.shape == w.shape and dw.dtype == torch.float16


def test_default_config_packs_short_rows():
    sig = make_signature(OP, (torch.empty(8192, 128, device="meta"), torch.empty(128, device="meta"), 1e-6),
                         torch.device("meta"))
    assert TRITON.default_config(sig, None) == {"BLOCK_M": 8, "BLOCK_N": 128, "num_warps": 2}
    sig = make_signature(OP, (torch.empty(3, 5000, device="meta"), torch.empty(5000, device="meta"), 1e-6),
                         torch.device("meta"))
    assert TRITON.default_config(sig, None) == {"BLOCK_M": 1, "BLOCK_N": 8192, "num_warps": 16}


# -- backward --------------------------------------------------------------------------------------


@pytest.mark.parametrize("lead, k", [((7,), 33), ((3, 5), 100), ((), 65), ((40,), 8)])
def test_backward_matches_reference(lead, k, dtype, device, gen):
    x, w = inputs(lead, k, dtype, device, gen)
    check_backward(rms_norm, rms_norm_reference, (x, w, 1e-6), (0, 1), gen, reduce_dim=max(k, x.numel() // k))


@pytest.mark.parametrize("config", [
    {"BLOCK_M": 4, "BLOCK_N": 128, "num_warps": 2},  # several rows per tile, ragged last tile
    {"BLOCK_M": 1, "BLOCK_N": 32, "num_warps": 1},  # rows longer than a block
    {"BLOCK_M": 2, "BLOCK_N": 16, "num_warps": 1},
], ids=lambda c: "{BLOCK_M}x{BLOCK_N}".format(**c))
def test_backward_plan_writes_every_output(config, dtype, device, gen, launch):
    x, w = inputs((3, 9), 100, dtype, device, gen)
    dy, dres = (randn(*x.shape, dtype=dtype, device=device, generator=gen) for _ in range(2))
    for extra in (None, dres):
        dx, dw = launch(backward_plan((dy, x, w, extra, 1e-6), config))
        ref_dx, ref_dw = rms_norm_backward_reference(*upcast(dy, x, w, extra), 1e-6)
        assert_close(dx, ref_dx, dtype, reduce_dim=100)
        assert_close(dw, ref_dw, dtype, reduce_dim=27)


def test_backward_non_contiguous_inputs(dtype, device, gen, relayout):
    x, w = inputs((3, 5), 100, dtype, device, gen)
    w_strided = torch.stack([w, torch.full_like(w, float("nan"))], dim=1)[:, 0]
    check_backward(rms_norm, rms_norm_reference, (relayout(x), w_strided, 1e-6), (0, 1), gen, reduce_dim=100)


def test_backward_weight_in_another_dtype(device, gen):
    x, w = inputs((5,), 48, torch.float16, device, gen, w_dtype=torch.float32)
    dx, dw = check_backward(rms_norm, rms_norm_reference, (x, w, 1e-6), (0, 1), gen, reduce_dim=48)
    assert dx.dtype == torch.float16 and dw.dtype == torch.float32


def test_backward_of_a_broadcast_gradient(device, gen):
    """``y.sum().backward()`` hands the kernel an expanded gradient (all strides 0)."""
    x, w = inputs((4, 3), 40, torch.float32, device, gen)
    x.requires_grad_()
    rms_norm(x, w).sum().backward()
    x64 = x.detach().double().requires_grad_()
    rms_norm_reference(x64, w.double()).sum().backward()
    assert_close(x.grad, x64.grad, torch.float32, reduce_dim=40)


def test_inference_records_no_graph(device, gen):
    x, w = inputs((3,), 40, torch.float32, device, gen)
    with torch.no_grad():
        assert rms_norm(x, w.requires_grad_()).grad_fn is None
    assert rms_norm(x, w.detach()).grad_fn is None
    assert rms_norm(x, w.requires_grad_()).grad_fn is not None


@pytest.mark.parametrize("case", ["int32 x", "int32 weight", "rank-0 x", "2-D weight", "weight size",
                                  "interleaved rows", "eps a tensor"])
def test_bad_inputs_raise_before_launch(case, device, no_launch):
    x, w, eps = torch.randn(4, 6, 32, device=device), torch.randn(32, device=device), 1e-6
    if case == "int32 x":
        x = x.to(torch.int32)
    elif case == "int32 weight":
        w = w.to(torch.int32)
    elif case == "rank-0 x":
        x = x[0, 0, 0]
    elif case == "2-D weight":
        w = w[None]
    elif case == "weight size":
        w = w[:31]
    elif case == "interleaved rows":
        x = x.transpose(0, 1)  # leading dims do not flatten into one stride
    elif case == "eps a tensor":
        eps = torch.tensor(1e-6)
    with pytest.raises(InvalidInputError):
        rms_norm(x, w, eps)
