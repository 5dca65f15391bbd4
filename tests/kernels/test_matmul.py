from __future__ import annotations

import dataclasses
import math
import random

import dlblas_kernels
import pytest
import torch
from dlblas_kernels.kernels.matmul import (
    KERNEL,
    OP,
    backward_plan,
    heuristic,
    matmul,
    matmul_backward_reference,
    matmul_reference,
    plan,
    torch_matmul,
)
from gradients import check_backward

import dlcore
from dlcore import InvalidInputError
from dlcore.compiler.lowering import target_profile
from dlcore.declarations.signature import make_signature
from dlcore.runtime.profile import device_profile, first_device
from dlcore.testing import assert_close, randn, strided_like, upcast

TRITON = KERNEL.implementation
ACTIVATIONS = (None, "relu", "silu", "gelu_tanh")
SMALL = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=1, num_stages=1, SPLIT_K=1, TMA=1)


def inputs(lead, k, n, dtype, device, gen, layout="row-major"):
    """Unit-variance ``a [*lead, K]`` and ``b [K, N]`` scaled by 1/sqrt(K), so the outputs stay O(1);
    ``b`` row-major or ``w.T`` of a weight ``w [N, K]`` (the nn.Linear layout)."""
    a = randn(*lead, k, dtype=dtype, device=device, generator=gen)
    scale = 1 / math.sqrt(max(k, 1))
    if layout == "w.T":
        return a, randn(n, k, dtype=dtype, device=device, generator=gen, scale=scale).T
    return a, randn(k, n, dtype=dtype, device=device, generator=gen, scale=scale)


def bound(a, b, bias=None, activation=None, allow_tf32=False):
    return (a, b, bias, activation, allow_tf32)


def check(out, a, b, bias=None, activation=None):
    assert out.shape == (*a.shape[:-1], b.shape[1])
    assert_close(out, matmul_reference(*upcast(a, b, bias), activation), a.dtype, reduce_dim=a.shape[-1])


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
    check(run(OP, TRITON, bound(a, b)), a, b)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("layout", ["row-major", "w.T"])
def test_bias_and_activation(activation, layout, dtype, device, gen, run):
    """Batched a, odd sizes, each activation, both b layouts, a bias."""
    a, b = inputs((2, 19), 37, 29, dtype, device, gen, layout)
    bias = randn(29, dtype=dtype, device=device, generator=gen)
    check(run(OP, TRITON, bound(a, b, bias, activation)), a, b, bias, activation)


# The launch paths of the GEMM block under matmul's plan: on a CPU the descriptor kernel runs in the
# interpreter under a profile that claims sm_90 (3 cores: each persistent program walks several tiles).
PATHS = {"pointers": (False, 1), "descriptors": (True, 1), "split-K pointers": (False, 3),
         "split-K descriptors": (True, 3)}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout", ["row-major", "w.T"])
def test_launch_paths(path, layout, dtype, device, gen, launch, profile):
    descriptors, split = PATHS[path]
    hopper = dataclasses.replace(profile, arch="sm_90", cores=3 if device == "cpu" else profile.cores)
    a, b = inputs((2, 23), 40, 56, dtype, device, gen, layout)  # 16-byte rows: the copy engine takes them
    bias = randn(56, dtype=dtype, device=device, generator=gen)
    config = {**SMALL, "TMA": int(descriptors), "SPLIT_K": split}
    found = plan(bound(a, b, bias, "silu"), config, hopper)
    names = [c.kernel.__name__ for c in found.calls]
    assert names == ["gemm_tma_kernel" if descriptors else "gemm_kernel"] + (["splitk_reduce_kernel"] if split > 1
                                                                              else [])
    assert len(found.scratch) == (split > 1)
    check(launch(found), a, b, bias, "silu")


def test_non_contiguous_a(dtype, device, gen, run, relayout):
    a, b = inputs((3, 5), 100, 24, dtype, device, gen)
    a_strided = relayout(a)
    assert not a_strided.is_contiguous()
    check(run(OP, TRITON, bound(a_strided, b)), a, b)


@pytest.mark.parametrize("how", ["transpose", "pad"])
def test_non_contiguous_b(how, dtype, device, gen, run):
    a, b = inputs((37,), 70, 50, dtype, device, gen)
    b_strided = strided_like(b, how)
    assert b_strided.stride() == ((1, 70) if how == "transpose" else (57, 1))
    check(run(OP, TRITON, bound(a, b_strided)), a, b)


def test_both_transposed_in_memory(device, gen, run):
    a, b = inputs((90,), 40, 70, torch.float32, device, gen)
    a_t = a.T.contiguous().T  # column-major a: a K stride of 90 rows
    check(run(OP, TRITON, bound(a_t, strided_like(b, "transpose"))), a, b)


def test_empty_k_gives_the_activated_bias(device, run):
    a, b = torch.empty(5, 0, device=device), torch.empty(0, 7, device=device)
    assert torch.equal(run(OP, TRITON, bound(a, b)), torch.zeros(5, 7, device=device))
    bias = torch.linspace(-1, 1, 7, device=device)
    assert torch.equal(run(OP, TRITON, bound(a, b, bias, "relu")), torch.relu(bias).expand(5, 7))


def test_allow_tf32(device, gen, run):
    """float32 with tf32 products: within tf32's error (~3e-4 relative); 16-bit inputs ignore it."""
    a, b = inputs((45,), 64, 33, torch.float32, device, gen)
    out = run(OP, TRITON, bound(a, b, None, None, True))
    ref = matmul_reference(*upcast(a, b))
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-3
    half = a.half(), b.half()
    torch.testing.assert_close(run(OP, TRITON, bound(*half, None, None, True)), run(OP, TRITON, bound(*half)))


def sampled_configs(count: int = 3) -> list[dict]:
    space = TRITON.space(target_profile("cuda:90"))  # as on the H100 / H200 the GPU suite runs on
    rng = random.Random(0)
    configs: list[dict] = []
    while len(configs) < count:
        config = space.sample(rng)
        if config not in configs and config["BLOCK_M"] * config["BLOCK_N"] <= 128 * 128:
            configs.append(config)
    return configs


@pytest.mark.parametrize("config", [
    *sampled_configs(),
    # Smaller than the space allows, so that 150 rows make 5 row blocks: full and partial groups.
    dict(SMALL, BLOCK_M=32, GROUP_M=2, SPLIT_K=2),
    dict(SMALL, BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2),
], ids=lambda c: "{BLOCK_M}x{BLOCK_N}x{BLOCK_K}-w{num_warps}-s{num_stages}-k{SPLIT_K}-t{TMA}".format(**c))
def test_configs(config, dtype, device, gen, run):
    a, b = inputs((150,), 70, 90, dtype, device, gen)
    check(run(OP, TRITON, bound(a, b), config), a, b)


def test_space_is_a_real_gemm_space():
    """On an H100 / H200 (its profile's shared memory: 227 KiB a block); without a device in view
    the shared memory bounds nothing."""
    h100 = target_profile("cuda:90")
    space = TRITON.space(h100)
    assert 1000 <= space.size() <= 2000
    assert TRITON.space().size() > space.size()
    for c in space.configs():
        staged = c["BLOCK_M"] * c["BLOCK_N"] if c["TMA"] and c["SPLIT_K"] == 1 else 0
        assert (c["num_stages"] * (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] + staged) * 2 <= 232448
        consumers = 2 if c["WARP_SPECIALIZE"] else 1  # each warp-specialised consumer holds half the tile
        assert 8 <= c["BLOCK_M"] * c["BLOCK_N"] / (32 * c["num_warps"] * consumers) <= 128
        assert c["TMA"] == 0 or c["BLOCK_M"] >= 64
        assert not c["WARP_SPECIALIZE"] or (c["TMA"], c["num_warps"], c["BLOCK_M"] >= 128) == (1, 4, True)
    too_big = dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=4, SPLIT_K=1, TMA=0,
                   WARP_SPECIALIZE=0)
    assert "shared memory" in space.is_valid(too_big)
    assert TRITON.space().is_valid(too_big) is None
    assert TRITON.space(dataclasses.replace(h100, shared_memory_per_program=99 * 1024)).size() < space.size()
    assert "registers" in space.is_valid(dict(too_big, BLOCK_N=256, BLOCK_K=32, num_stages=3))
    assert "split-K" in space.is_valid(dict(too_big, BLOCK_K=32, num_stages=3, SPLIT_K=2))
    assert all(len({c[name] for c in space.configs()}) > 1 for name in space.names)


PRESETS = [(14336, 4096), (4096, 14336), (28672, 8192), (8192, 28672), (18944, 3584), (3584, 18944), (2048, 7168),
           (7168, 2048)]


@pytest.mark.parametrize("rows", [1, 16, 37, 64, 65, 128, 1024, 4096, 16384])
@pytest.mark.parametrize("dtype_", [torch.float16, torch.float32])
def test_default_config_is_in_the_space(rows, dtype_):
    h100 = target_profile("cuda:90")
    space = TRITON.space(h100)
    for n, k in PRESETS:
        a = torch.empty(rows, k, device="meta", dtype=dtype_)
        b = torch.empty(n, k, device="meta", dtype=dtype_).T
        sig = make_signature(OP, bound(a, b), a.device)
        for profile in (h100, target_profile("cuda:80"), None):
            config = TRITON.default_config(sig, profile)
            assert space.is_valid(config) is None, (n, k, config)
            if rows <= 64:  # decoding: row blocks of the rows, weight streaming without descriptors
                assert config["BLOCK_M"] == max(16, 2 ** math.ceil(math.log2(rows))) and config["TMA"] == 0


def test_heuristic_by_regime():
    """The H200 bench's choices (.ci/sweep_gemm.py bench)."""
    h100 = target_profile("cuda:90")
    # a few hundred rows: most work units within one wave, the larger tile on a tie
    picked = {(n, k): heuristic(128, n, k, h100) for n, k in PRESETS}
    assert [(c["BLOCK_M"], c["BLOCK_N"], c["SPLIT_K"], c["TMA"]) for c in picked.values()] == [
        (128, 128, 1, 1), (128, 64, 2, 1), (128, 256, 1, 1), (128, 128, 2, 1), (128, 128, 1, 1), (128, 64, 2, 1),
        (64, 64, 2, 1), (64, 128, 1, 0)]
    for c in picked.values():
        assert TRITON.space(h100).is_valid(c) is None
    # decoding with long rows of b: K steps of 256
    assert heuristic(1, 28672, 8192, h100)["BLOCK_K"] == 256
    # decoding: split-K where the column tiles fill under half the multiprocessors
    assert heuristic(1, 14336, 4096, h100)["SPLIT_K"] == 1
    assert heuristic(1, 4096, 14336, h100)["SPLIT_K"] == 4
    assert heuristic(16, 4096, 14336, None)["SPLIT_K"] == 1  # no cores known: no split
    # many rows on sm_90: the persistent descriptor kernel with its widest tile
    big = heuristic(16384, 14336, 4096, h100)
    assert (big["TMA"], big["BLOCK_M"], big["BLOCK_N"]) == (1, 128, 256)
    assert heuristic(16384, 14336, 4096, h100, element_size=4)["BLOCK_K"] == 32
    assert heuristic(16384, 14336, 4096, target_profile("cuda:80"))["TMA"] == 0


def test_public_function_runs_the_plan(device, gen, run):
    a, b = inputs((3, 5), 100, 24, torch.float16, device, gen)
    bias = randn(24, dtype=torch.float16, device=device, generator=gen)
    assert dlblas_kernels.matmul is matmul
    assert torch.equal(matmul(a, b), run(OP, TRITON, bound(a, b)))
    assert torch.equal(matmul(a, b, bias, activation="gelu_tanh"), run(OP, TRITON, bound(a, b, bias, "gelu_tanh")))


def test_get_op_picks_the_triton_kernel(device, gen):
    a, b = inputs((9,), 48, 40, torch.float32, device, gen)
    op = dlcore.get_op("matmul", (a, b))
    assert op.impl.name == "triton"
    assert "fallback only" in op.selection.declined["reference"]
    assert torch.equal(op(a, b), matmul(a, b))
    bias = randn(40, device=device, generator=gen)
    op = dlcore.get_op("matmul", (a, b), {"bias": bias, "activation": "silu"})
    assert torch.equal(op(a, b, bias=bias, activation="silu"), matmul(a, b, bias, "silu"))


def test_example_cost_and_baseline(device):
    a, b, bias, activation, tf32 = OP.example(OP.example_sizes, torch.float32, device,
                                              torch.Generator().manual_seed(0))
    m, k, n = OP.example_sizes["tokens"], OP.example_sizes["hidden"], OP.example_sizes["inter"]
    assert a.shape == (m, k) and b.shape == (k, n) and b.stride() == (1, k)  # an nn.Linear weight's w.T
    assert (bias, activation, tf32) == (None, None, False)
    assert OP.cost((a, b, None, None)) == ((m * k + k * n + m * n) * 4, 2 * m * n * k)
    lead = torch.empty(2, 3, k, dtype=torch.float16, device=device)
    assert OP.cost((lead, b.half(), None, None)) == ((6 * k + k * n + 6 * n) * 2, 2 * 6 * n * k)
    assert OP.cost((a, b, None, None), mode="bwd") == ((2 * m * k + 2 * k * n + m * n) * 4, 4 * m * n * k)
    assert OP.cost((a, b, a[0, :n], "relu"), mode="bwd")[1] == 6 * m * n * k
    assert OP.baselines["torch"]() is torch_matmul
    bias = torch.ones(n, device=device)
    torch.testing.assert_close(torch_matmul(a, b, bias, "relu"), torch.relu(a @ b + 1))
    check(matmul(a, b), a, b)


@pytest.mark.parametrize("lead, k, n, layout, with_bias, activation", [
    ((7, 33), 33, 40, "row-major", False, None),
    ((3, 5, 21), 21, 24, "w.T", True, "gelu_tanh"),
    ((50,), 70, 30, "w.T", True, "silu"),
    ((9,), 48, 40, "padded a", True, "relu"),
], ids=str)
def test_backward_matches_reference(lead, k, n, layout, with_bias, activation, dtype, device, gen):
    """``da``, ``db`` and ``dbias`` through the activation, by the custom op's autograd formula.
    With an activation, ``dz = dc * act'(z)`` is rounded to the input dtype before the two products
    (as eager autograd of a 16-bit model rounds it): a looser bound than the float64 reference's."""
    a, b = inputs(lead, k, n, dtype, device, gen, "w.T" if layout == "w.T" else "row-major")
    if layout == "padded a":
        a = strided_like(a, "pad")
    bias = randn(n, dtype=dtype, device=device, generator=gen) if with_bias else None
    grads = check_backward(lambda a, b, bias: matmul(a, b, bias, activation),
                           lambda a, b, bias: matmul_reference(a, b, bias, activation),
                           (a, b, bias), (0, 1, 2) if with_bias else (0, 1), gen,
                           reduce_dim=max(k, math.prod(lead)) * (16 if activation and dtype != torch.float32 else 1))
    if layout == "w.T":
        assert grads[1].stride() == b.stride()  # db in b's layout: the weight's gradient is row-major


def test_backward_of_a_sum_takes_an_expanded_gradient(device, gen):
    a, b = inputs((2, 6), 20, 12, torch.float32, device, gen)
    bias = randn(12, device=device, generator=gen)
    a, b, bias = (t.requires_grad_() for t in (a, b, bias))
    matmul(a, b, bias, "relu").sum().backward()
    a64, b64, bias64 = (t.detach().double().requires_grad_() for t in (a, b, bias))
    matmul_reference(a64, b64, bias64, "relu").sum().backward()
    for t, t64 in ((a, a64), (b, b64), (bias, bias64)):
        assert_close(t.grad, t64.grad, torch.float32, reduce_dim=12)


@pytest.mark.parametrize("activation", [None, "gelu_tanh"])
@pytest.mark.parametrize("path", PATHS)
def test_backward_plan_writes_every_output(path, activation, dtype, device, gen, launch, profile):
    """The backward plan's outputs poisoned first, on each launch path (the forward config's
    split-K and descriptors for the recomputed pre-activation; da and db take their own)."""
    descriptors, split = PATHS[path]
    if descriptors:
        profile = dataclasses.replace(profile, arch="sm_90", cores=3 if device == "cpu" else profile.cores)
    a, b = inputs((37,), 40, 24, dtype, device, gen, "w.T")
    bias = randn(24, dtype=dtype, device=device, generator=gen)
    dc = randn(37, 24, dtype=dtype, device=device, generator=gen)
    args = (dc, a, b, bias, activation, False)
    da, db, dbias = launch(backward_plan(args, {**SMALL, "TMA": int(descriptors), "SPLIT_K": split}, profile))
    ref = matmul_backward_reference(*upcast(*args))
    rounded = activation is not None and dtype != torch.float32  # dz in the input dtype, as above
    for got, expected in zip((da, db, dbias), ref):
        assert_close(got, expected, dtype, reduce_dim=37 * (16 if rounded else 1))


def test_zero_rows_launch_nothing(device, no_launch):
    out = matmul(torch.empty(0, 3, 16, device=device), torch.ones(16, 8, device=device))
    assert out.shape == (0, 3, 8)


def test_plan_on_meta_tensors_reads_no_data():
    a = torch.empty(6, 40, 256, device="meta", dtype=torch.bfloat16)
    b = torch.empty(1000, 256, device="meta", dtype=torch.bfloat16).T
    config = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3, SPLIT_K=1, TMA=0)
    found = TRITON.plan(bound(a, b), config, device_profile(first_device(bound(a, b))))
    assert found.result.device.type == "meta" and found.result.shape == (6, 40, 1000)
    (call,) = found.calls
    assert call.grid == (4 * 8, 1)
    assert call.kwargs["num_stages"] == 3 and call.kwargs["GROUP_M"] == 8


BAD = ["K mismatch", "int32 a", "int32 b", "b dtype", "rank-1 a", "3-D b", "1-D b", "interleaved rows",
       "bias shape", "bias dtype", "strided bias", "expanded bias", "activation"]


@pytest.mark.parametrize("case", BAD)
def test_bad_inputs_raise_before_launch(case, device, no_launch):
    a = torch.randn(4, 6, 32, device=device, dtype=torch.float16)
    b = torch.randn(32, 16, device=device, dtype=torch.float16)
    bias, activation = None, None
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
    elif case == "bias shape":
        bias = torch.randn(15, device=device, dtype=torch.float16)
    elif case == "bias dtype":
        bias = torch.randn(16, device=device)
    elif case == "strided bias":  # the epilogue reads the bias at unit stride
        bias = torch.randn(32, device=device, dtype=torch.float16)[::2]
    elif case == "expanded bias":
        bias = torch.ones(1, device=device, dtype=torch.float16).expand(16)
    elif case == "activation":
        activation = "tanh"
    with pytest.raises(InvalidInputError):
        matmul(a, b, bias, activation)
    with pytest.raises(InvalidInputError):
        dlcore.get_op("matmul", (a, b), {"bias": bias, "activation": activation})


# -- on the GPU: bfloat16 at the LLM presets against a float32 reference ----------------------------------


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected).norm() / expected.norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(1, 4096, 14336), (16, 2048, 7168), (128, 14336, 4096), (4096, 4096, 14336),
                                     (1024, 7168, 2048)], ids=str)
def test_bfloat16_presets_forward_and_backward(m, n, k):
    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    a = torch.randn(m, k, device="cuda", generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(n, k, device="cuda", generator=gen) / math.sqrt(k)).bfloat16().requires_grad_()
    bias = torch.randn(n, device="cuda", generator=gen).bfloat16().requires_grad_()
    out = matmul(a, w.T, bias, "silu")
    dc = torch.randn(m, n, device="cuda", generator=gen).bfloat16()
    out.backward(dc)
    a32, w32, bias32 = (t.detach().float().requires_grad_() for t in (a, w, bias))
    ref = torch.nn.functional.silu(a32 @ w32.T + bias32)
    ref.backward(dc.float())
    assert relative_error(out, ref) < 1e-2
    for got, expected in ((a.grad, a32.grad), (w.grad, w32.grad), (bias.grad, bias32.grad)):
        assert relative_error(got, expected) < 1e-2, (got.shape, relative_error(got, expected))
