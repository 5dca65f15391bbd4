from __future__ import annotations

import dataclasses
import math
import random

import dlblas_kernels
import pytest
import torch
from dlblas_kernels.kernels.matmul import KERNEL, OP, backward_plan, matmul, matmul_backward_reference, matmul_reference
from gradients import check_backward

import dlcore
from dlcore import InvalidInputError
from dlcore.compiler.lowering import target_profile
from dlcore.declarations.signature import make_signature, next_power_of_2
from dlcore.testing import assert_close, randn, strided_like, upcast

TRITON = KERNEL.implementation


def inputs(lead, k, n, dtype, device, gen):
    """Unit-variance ``a [*lead, K]`` and ``b [K, N]`` scaled by 1/sqrt(K), so the outputs stay O(1)."""
    a = randn(*lead, k, dtype=dtype, device=device, generator=gen)
    b = randn(k, n, dtype=dtype, device=device, generator=gen, scale=1 / math.sqrt(max(k, 1)))
    return a, b


def check(out, a, b):
    assert out.shape == (*a.shape[:-1], b.shape[1])
    assert_close(out, matmul_reference(*upcast(a, b)), a.dtype, reduce_dim=a.shape[-1])


@pytest.mark.parametrize("lead, k, n", [
    ((7, 33), 33, 40),
    ((3, 5, 100), 100, 24),
    ((2, 3, 4, 65), 65, 17),
    ((1, 1), 1, 1),
    ((70, 48), 48, 130),
    ((150, 200), 200, 3),
], ids=str)
def test_matches_reference(lead, k, n, dtype, device, gen, run):
    a, b = inputs(lead[:-1], k, n, dtype, device, gen)
    check(run(OP, TRITON, (a, b)), a, b)


def test_non_contiguous_a(dtype, device, gen, run, relayout):
    a, b = inputs((3, 5), 100, 24, dtype, device, gen)
    a_strided = relayout(a)
    assert not a_strided.is_contiguous()
    check(run(OP, TRITON, (a_strided, b)), a, b)


@pytest.mark.parametrize("how", ["transpose", "pad"])
def test_non_contiguous_b(how, dtype, device, gen, run):
    a, b = inputs((37,), 70, 50, dtype, device, gen)
    b_strided = strided_like(b, how)
    assert b_strided.stride() == ((1, 70) if how == "transpose" else (57, 1))
    check(run(OP, TRITON, (a, b_strided)), a, b)


def test_both_transposed_in_memory(device, gen, run):
    a, b = inputs((90,), 40, 70, torch.float32, device, gen)
    a_t = a.T.contiguous().T  # column-major a: a K stride of 90 rows
    check(run(OP, TRITON, (a_t, strided_like(b, "transpose"))), a, b)


def test_empty_k_gives_zeros(device, run):
    a, b = torch.empty(5, 0, device=device), torch.empty(0, 7, device=device)
    assert torch.equal(run(OP, TRITON, (a, b)), torch.zeros(5, 7, device=device))


def sampled_configs(count: int = 4) -> list[dict]:
    space = TRITON.space(target_profile("cuda:90"))  # as on the H100 / H200 the GPU suite runs on
    rng = random.Random(0)
    configs: list[dict] = []
    while len(configs) < count:
        config = space.sample(rng)
        if config not in configs:
            configs.append(config)
    return configs


@pytest.mark.parametrize("config", [
    *sampled_configs(),
    # Smaller than the space allows, so that 150 rows make 5 row blocks: full and partial groups.
    dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=2),
    dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=16, GROUP_M=8, num_warps=4, num_stages=2),
    dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=1, num_warps=1, num_stages=1),
], ids=lambda c: "{BLOCK_M}x{BLOCK_N}x{BLOCK_K}-g{GROUP_M}-w{num_warps}-s{num_stages}".format(**c))
def test_configs(config, dtype, device, gen, run):
    a, b = inputs((150,), 70, 90, dtype, device, gen)
    check(run(OP, TRITON, (a, b), config), a, b)


def test_sampled_configs_agree(device, gen, run):
    a, b = inputs((150,), 70, 90, torch.float32, device, gen)
    first, *others = (run(OP, TRITON, (a, b), c) for c in sampled_configs())
    for out in others:
        torch.testing.assert_close(out, first, atol=1e-5, rtol=1e-5)


def test_space_is_a_real_gemm_space():
    """On an H100 (its profile's shared memory: 227 KiB a block); without a device in view the
    shared memory bounds nothing."""
    h100 = target_profile("cuda:90")
    space = TRITON.space(h100)
    assert 200 <= space.size() <= 400
    assert TRITON.space().size() > space.size()
    for c in space.configs():
        assert space.is_valid(c) is None
        stage_bytes = (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * 2
        assert c["num_stages"] * stage_bytes <= h100.shared_memory_per_program <= 228 * 1024
        assert 16 <= c["BLOCK_M"] * c["BLOCK_N"] / (32 * c["num_warps"]) <= 128
        assert c["BLOCK_M"] * c["BLOCK_N"] <= 256 * 128
    too_big = dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4)
    assert "shared memory" in space.is_valid(too_big)
    assert TRITON.space().is_valid(too_big) is None
    # A chip with less shared memory (an A10's 99 KiB) narrows the space further.
    assert TRITON.space(dataclasses.replace(h100, shared_memory_per_program=99 * 1024)).size() < space.size()
    spills = dict(BLOCK_M=256, BLOCK_N=256, BLOCK_K=32, GROUP_M=8, num_warps=8, num_stages=2)
    assert "registers" in space.is_valid(spills)
    # Every parameter keeps more than one value: no axis of the landscape is constant.
    assert all(len({c[name] for c in space.configs()}) > 1 for name in space.names)


@pytest.mark.parametrize("rows", [1, 37, 64, 65, 16384])
@pytest.mark.parametrize("dtype_", [torch.float16, torch.float32])
def test_default_config_is_in_the_space(rows, dtype_):
    a = torch.empty(rows, 4096, device="meta", dtype=dtype_)
    b = torch.empty(4096, 1024, device="meta", dtype=dtype_)
    config = TRITON.default_config(make_signature(OP, (a, b), a.device), None)
    assert TRITON.space(target_profile("cuda:90")).is_valid(config) is None
    # A row block no taller than the rows (rounded up to a power of two), bar the space's minimum of 32.
    assert config["BLOCK_M"] == min(max(32, next_power_of_2(rows)), 128)


def test_public_function_runs_the_plan(device, gen, run):
    a, b = inputs((3, 5), 100, 24, torch.float16, device, gen)
    assert dlblas_kernels.matmul is matmul
    assert torch.equal(matmul(a, b), run(OP, TRITON, (a, b)))


def test_get_op_picks_the_triton_kernel(device, gen):
    a, b = inputs((9,), 48, 40, torch.float32, device, gen)
    op = dlcore.get_op("matmul", (a, b))
    assert op.impl.name == "triton"
    assert "fallback only" in op.selection.declined["reference"]
    assert torch.equal(op(a, b), matmul(a, b))


def test_example_cost_and_baseline(device):
    a, b = OP.example(OP.example_sizes, torch.float32, device, torch.Generator().manual_seed(0))
    m, k, n = OP.example_sizes["tokens"], OP.example_sizes["hidden"], OP.example_sizes["inter"]
    assert a.shape == (m, k) and b.shape == (k, n)
    assert OP.cost((a, b)) == ((m * k + k * n + m * n) * 4, 2 * m * n * k)
    lead = torch.empty(2, 3, k, dtype=torch.float16, device=device)
    assert OP.cost((lead, b.half())) == ((6 * k + k * n + 6 * n) * 2, 2 * 6 * n * k)
    assert OP.cost((a, b), mode="bwd") == ((2 * m * k + 2 * k * n + m * n) * 4, 4 * m * n * k)
    assert OP.baselines["torch"]() is torch.matmul
    check(matmul(a, b), a, b)


@pytest.mark.parametrize("lead, k, n, layout", [
    ((7, 33), 33, 40, None), ((3, 5, 100), 100, 24, None), ((150,), 70, 90, "transposed b"), ((9,), 48, 40, "padded a"),
])
def test_backward_matches_reference(lead, k, n, layout, dtype, device, gen):
    """``da = dc @ b^T`` and ``db = a^T @ dc`` through the custom op's autograd formula."""
    a, b = inputs(lead, k, n, dtype, device, gen)
    if layout == "transposed b":
        b = strided_like(b, "transpose")
    elif layout == "padded a":
        a = strided_like(a, "pad")
    check_backward(matmul, matmul_reference, (a, b), (0, 1), gen, reduce_dim=max(k, math.prod(lead)))


def test_backward_of_a_sum_takes_an_expanded_gradient(device, gen):
    a, b = inputs((2, 6), 20, 12, torch.float32, device, gen)
    a, b = a.requires_grad_(), b.requires_grad_()
    matmul(a, b).sum().backward()
    a64, b64 = (t.detach().double().requires_grad_() for t in (a, b))
    matmul_reference(a64, b64).sum().backward()
    assert_close(a.grad, a64.grad, torch.float32, reduce_dim=12)
    assert_close(b.grad, b64.grad, torch.float32, reduce_dim=12)


def test_backward_plan_writes_every_output(dtype, device, gen, launch, profile):
    a, b = inputs((37,), 40, 24, dtype, device, gen)
    dc = randn(37, 24, dtype=dtype, device=device, generator=gen)
    config = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=1, num_stages=1)
    da, db = launch(backward_plan((dc, a, b), config, profile))
    ref_da, ref_db = matmul_backward_reference(*upcast(dc, a, b))
    assert_close(da, ref_da, dtype, reduce_dim=24)
    assert_close(db, ref_db, dtype, reduce_dim=37)


def test_zero_rows_launch_nothing(device, no_launch):
    out = matmul(torch.empty(0, 3, 16, device=device), torch.ones(16, 8, device=device))
    assert out.shape == (0, 3, 8)


def test_plan_on_meta_tensors_reads_no_data():
    a = torch.empty(6, 40, 256, device="meta", dtype=torch.bfloat16)
    b = torch.empty(256, 1000, device="meta", dtype=torch.bfloat16)
    config = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
    plan = TRITON.plan((a, b), config)
    assert plan.result.device.type == "meta" and plan.result.shape == (6, 40, 1000)
    (call,) = plan.calls
    assert call.grid == (4 * 8,)
    assert call.kwargs["num_stages"] == 3 and call.kwargs["GROUP_M"] == 8


BAD = ["K mismatch", "int32 a", "int32 b", "b dtype", "rank-1 a", "3-D b", "1-D b", "interleaved rows"]


@pytest.mark.parametrize("case", BAD)
def test_bad_inputs_raise_before_launch(case, device, no_launch):
    a = torch.randn(4, 6, 32, device=device, dtype=torch.float16)
    b = torch.randn(32, 16, device=device, dtype=torch.float16)
    if case == "K mismatch":
        b = b[:31]
    elif case == "int32 a":
        a = a.to(torch.int32)
    elif case == "int32 b":
        b = b.to(torch.int32)
    elif case == "b dtype":
        b = b.float()
    elif case == "rank-1 a":
        a = a[0, 0]
    elif case == "3-D b":
        b = b[None]
    elif case == "1-D b":
        b = b[:, 0]
    elif case == "interleaved rows":
        a = a.transpose(0, 1)
    with pytest.raises(InvalidInputError):
        matmul(a, b)
    with pytest.raises(InvalidInputError):
        dlcore.get_op("matmul", (a, b))
