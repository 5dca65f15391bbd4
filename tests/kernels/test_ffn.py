from __future__ import annotations

import dataclasses
import math

import dlblas_kernels
import pytest
import torch
from conftest import ON_GPU
from dlblas_kernels.blocks import gemm, swiglu_pair
from dlblas_kernels.blocks.ffn_decode import TMA_DECODE_TILE, decode_columns, decode_splits, decode_tma
from dlblas_kernels.kernels.ffn import (
    KERNEL,
    OP,
    backward_gemm_config,
    backward_plan,
    default_config,
    ffn,
    ffn_reference,
    ffn_training_reference,
    input_grad_splits,
    training_plan,
    weight_grad_config,
)
from dlblas_kernels.kernels.ffn import plan as forward_plan
from gradients import check_backward
from isolated import run_json

from dlcore import InvalidInputError
from dlcore.declarations.device import DeviceProfile
from dlcore.declarations.signature import make_signature
from dlcore.runtime.profile import device_profile, first_device
from dlcore.runtime.template import UNKNOWN_DEVICE
from dlcore.testing import assert_close, poison, randn, strided_like, tolerance, upcast

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


# One row block (BLOCK_M >= rows): weight streaming; more rows: the row kernel and the GEMM.
DECODE = dict(BLOCK_M=64, BLOCK_N=16, BLOCK_K=32, GROUP_M=1, JOINT=1, num_warps=4, num_stages=2)
PREFILL = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=2, JOINT=1, num_warps=4, num_stages=2)


@pytest.mark.parametrize("lead, k, n", [
    ((7,), 33, 40),
    ((3, 5), 100, 24),
    ((2,), 1000, 17),
    ((), 64, 64),
    ((70,), 48, 130),
])
def test_matches_reference(lead, k, n, dtype, device, gen, run):
    args = inputs(lead, k, n, dtype, device, gen)
    check(run(OP, TRITON, (*args, 1e-6, None)), *args)


@pytest.mark.parametrize("path", ["decode", "prefill"])
@pytest.mark.parametrize("lead, k, n", [((17,), 45, 19), ((33,), 70, 33), ((2, 9), 37, 48)])
def test_both_paths(path, lead, k, n, dtype, device, gen, run, launches):
    args = inputs(lead, k, n, dtype, device, gen)
    check(run(OP, TRITON, (*args, 1e-6, None), DECODE if path == "decode" else PREFILL), *args)
    expected = ["ffn_decode_kernel"] if path == "decode" else ["rms_scale_kernel", "gemm_kernel"]
    assert [name for name, _ in launches] == expected


@pytest.mark.parametrize("splits, k, n", [(2, 100, 19), (3, 200, 33), (4, 70, 8)])
def test_decode_split_over_k(splits, k, n, dtype, device, gen, launch, launches):
    """The streaming kernel over K slices, their partial sums added by the finishing kernel: the
    output, and in the training plan the pre-activations, all poisoned first; odd K (a short
    last slice); both weight forms."""
    x, w1, w3, rms_w = inputs((5,), k, n, dtype, device, gen)
    config = {**DECODE, "SPLIT_K": splits}
    for weights in ((w1, w3, None), (None, None, torch.cat([w1, w3]))):
        args = (x, weights[0], weights[1], rms_w, 1e-6, weights[2])
        check(launch(TRITON.plan(args, config, device_profile(first_device(args)))), x, w1, w3, rms_w)
        got = launch(training_plan(args, config, UNKNOWN_DEVICE))
        for result, expected in zip(got, ffn_training_reference(*upcast(x, w1, w3, rms_w))):
            assert_close(result, expected, dtype, reduce_dim=k)
    names = [name for name, _ in launches]
    # the training plan writes xn by one more row launch
    assert names == ["ffn_decode_kernel", "ffn_decode_finish_kernel",
                     "ffn_decode_kernel", "ffn_decode_finish_kernel", "rms_scale_kernel"] * 2
    used = launches[0][1]["SPLIT_K"]
    assert 2 <= used <= splits


def test_decode_columns_spread_over_whole_waves():
    """On the H200 (132 SMs), at most 128 columns a program: N of at least a wave of column blocks
    spread evenly over whole waves (LLaMA-3-70B's 28672: 264 programs of 109, not 224 of 128;
    Qwen2.5-7B's 18944: 264 of 72, not 148 of 128); fewer blocks than cores (LLaMA-3-8B's 112,
    DeepSeek-V3's shared expert's 16), SPREAD=0 or no core count: blocks of 128; SPREAD=2 spreads
    fewer blocks than cores over one wave too."""
    config = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=4)
    assert decode_columns(28672, config, H200) == (109, 264)
    assert decode_columns(18944, config, H200) == (72, 264)
    assert decode_columns(132 * 128, config, H200) == (128, 132)
    assert decode_columns(14336, config, H200) == (128, 112)
    assert decode_columns(2048, config, H200) == (128, 16)
    assert decode_columns(28672, {**config, "SPREAD": 0}, H200) == (128, 224)
    assert decode_columns(14336, {**config, "SPREAD": 2}, H200) == (109, 132)  # below a wave too
    assert decode_columns(28672, {**config, "SPREAD": 2}, H200) == (109, 264)
    assert decode_columns(28672, config, UNKNOWN_DEVICE) == (128, 224)
    for n in range(1, 3000, 7):  # every column in exactly one program, none empty
        columns, programs = decode_columns(n, {**config, "BLOCK_N": 16}, H200)
        assert columns <= 16 and (programs - 1) * columns < n <= programs * columns


def test_decode_splits_fill_the_device():
    """On the H200 (132 SMs), 128 columns a program: DeepSeek-V3's shared expert (N 2048: 16 column
    blocks) streams in 8 K slices; Qwen2.5-7B's 18944 columns (148 blocks) spread over two whole
    waves (:func:`decode_columns`) in one, and in 8 when not spread (0.56 of two waves);
    LLaMA-3-8B's 14336 (112 blocks, 0.85 of a wave) and LLaMA-3-70B's 28672 in one; more than 16
    rows or no core count: one slice."""
    config = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=4)
    assert decode_splits(1, 2048, 7168, config, H200) == 8
    assert decode_splits(16, 2048, 7168, config, H200) == 8
    assert decode_splits(17, 2048, 7168, config, H200) == 1
    assert decode_splits(1, 14336, 4096, config, H200) == 1
    assert decode_splits(1, 28672, 8192, config, H200) == 1
    assert decode_splits(1, 18944, 3584, config, H200) == 1
    assert decode_splits(1, 18944, 3584, {**config, "SPREAD": 0}, H200) == 8
    assert decode_splits(16, 18944, 3584, {**config, "SPREAD": 0}, H200) == 7
    assert decode_splits(1, 2048, 512, config, H200) == 2  # slices of at least 4 K steps
    assert decode_splits(1, 2048, 7168, config, UNKNOWN_DEVICE) == 1
    assert decode_splits(1, 2048, 7168, {**config, "SPLIT_K": 3}, UNKNOWN_DEVICE) == 3


@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_w13_form(path, dtype, device, gen, run):
    x, w1, w3, rms_w = inputs((19,), 40, 21, dtype, device, gen)
    config = DECODE if path == "decode" else PREFILL
    w13 = torch.cat([w1, w3])
    out = run(OP, TRITON, (x, None, None, rms_w, 1e-6, w13), config)
    check(out, x, w1, w3, rms_w)
    # the same kernels on the same values: bit for bit the result of w1 and w3
    assert torch.equal(out, run(OP, TRITON, (x, w1, w3, rms_w, 1e-6, None), config))
    # stored transposed (column-major), as a view of a wider buffer would be
    w13_t = strided_like(w13, "transpose")
    check(run(OP, TRITON, (x, None, None, rms_w, 1e-6, w13_t), config), x, w1, w3, rms_w)
    assert torch.equal(ffn(x, None, None, rms_w, w13=w13), ffn(x, w1, w3, rms_w))


@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_training_plan_stores_the_preactivations(path, dtype, device, gen, launch):
    """What the custom op runs (autograd saves gate, up and xn): the output, both pre-activations
    and the normalised input, poisoned first, against the float64 reference; the public function
    returns the output alone."""
    x, w1, w3, rms_w = inputs((3, 7), 40, 21, dtype, device, gen)
    config = DECODE if path == "decode" else PREFILL
    for weights in ((w1, w3, None), (None, None, torch.cat([w1, w3]))):
        args = (x, weights[0], weights[1], rms_w, 1e-6, weights[2])
        got = launch(training_plan(args, config, UNKNOWN_DEVICE))
        for result, expected in zip(got, ffn_training_reference(*upcast(x, w1, w3, rms_w))):
            assert_close(result, expected, dtype, reduce_dim=40)
    leaf = x.detach().requires_grad_()
    assert isinstance(ffn(leaf, w1, w3, rms_w), torch.Tensor)
    assert len(torch.ops.dlblas.ffn(x, w1, w3, rms_w, 1e-6, None, *(config[k] for k in config))) == 4


def composite(x, w1, w3, rms_w, eps=1e-6):
    """The unfused MLP half in torch (autograd differentiates it): RMSNorm, two projections, SwiGLU."""
    xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * rms_w
    return torch.nn.functional.silu(xn @ w1.T) * (xn @ w3.T)


@pytest.mark.parametrize("lead, k, n", [((5,), 37, 19), ((3, 7), 24, 40), ((70,), 20, 12)])
def test_backward_matches_autograd(lead, k, n, dtype, device, gen):
    args = inputs(lead, k, n, dtype, device, gen)
    check_backward(ffn, composite, args, wrt=(0, 1, 2, 3), gen=gen, reduce_dim=backward_reduce_dim(dtype, k, n, lead))


def backward_reduce_dim(dtype, k, n, lead):
    """The tolerance's reduction length. In 16-bit dtypes the weight gradients ``dh.T @ xn`` sum
    products of two operands each rounded to the dtype (as autograd in that dtype rounds them), whose
    magnitudes reach a few units: their error is a few times a single product's (up to 0.0064 seen
    at 20 rows in float16, against 0.002 for one rounding): at least the tolerance of 1024 products."""
    longest = max(k, n, math.prod(lead))
    return longest if dtype == torch.float32 else max(longest, 1024)


def test_backward_of_w13(dtype, device, gen):
    x, w1, w3, rms_w = inputs((6,), 36, 17, dtype, device, gen)
    w13 = torch.cat([w1, w3])

    def fused(x, w13, rms_w):
        return ffn(x, None, None, rms_w, w13=w13)

    def reference(x, w13, rms_w):
        return composite(x, w13[:17], w13[17:], rms_w)

    check_backward(fused, reference, (x, w13, rms_w), wrt=(0, 1, 2), gen=gen,
                   reduce_dim=backward_reduce_dim(dtype, 36, 17, (6,)))


def test_backward_of_some_arguments(device, gen):
    x, w1, w3, rms_w = inputs((4,), 20, 9, torch.float32, device, gen)
    rms_w = rms_w.detach().requires_grad_()
    (grad,) = torch.autograd.grad(ffn(x, w1, w3, rms_w).sum(), rms_w)
    expected = torch.autograd.grad(composite(*upcast(x, w1, w3), rms_w.double()).sum(), rms_w)[0]
    assert_close(grad, expected, torch.float32, reduce_dim=20)


@pytest.mark.parametrize("config", [PREFILL, dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=16, GROUP_M=8, num_warps=4,
                                                   num_stages=1)], ids=["16x16x32", "32x32x16"])
def test_backward_plan_writes_every_output(config, device, gen, launch):
    # odd sizes with ragged tiles everywhere; the outputs poisoned before the launches
    x, w1, w3, rms_w = inputs((2, 17), 41, 23, torch.float32, device, gen)
    dout = randn(2, 17, 23, device=device, generator=gen)
    _, gate, up, xn = ffn_training_reference(x, w1, w3, rms_w)
    dx, dw13, drms_w = launch(backward_plan((dout, x, w1, w3, rms_w, 1e-6, None, gate, up, xn), config,
                                            UNKNOWN_DEVICE))
    leaves = [t.double().requires_grad_() for t in (x, w1, w3, rms_w)]
    grads = torch.autograd.grad(composite(*leaves), leaves, dout.double())
    for got, want in zip((dx, dw13[:23], dw13[23:], drms_w), grads):
        assert_close(got, want, torch.float32, reduce_dim=41)


@pytest.mark.parametrize("form", ["w1, w3", "w13"])
def test_backward_input_grad_split_over_the_reduction(form, device, gen, profile, launch, launches):
    """With few output tiles (3 rows, K 41: two 16 x 32 tiles) and a device of many cores, dxn's
    reduction over the 2N = 140 columns is sliced (two slices of 80 and 60 columns, the first
    straddling w1 and w3, ragged 16-column steps) and the float32 partial sums added by the
    split-K reduce: the gradients, poisoned first, against autograd through the float64
    composite, with w1, w3 and with w13."""
    config = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=8, num_warps=4, num_stages=1)
    x, w1, w3, rms_w = inputs((3,), 41, 70, torch.float32, device, gen)
    w13 = torch.cat([w1, w3]) if form == "w13" else None
    dout = randn(3, 70, device=device, generator=gen)
    _, gate, up, xn = ffn_training_reference(x, w1, w3, rms_w)
    many = dataclasses.replace(profile, arch="sm_80", cores=64)  # the pointer kernels, many cores
    assert input_grad_splits(3, 41, 70, backward_gemm_config(config), many) == 2  # slices of 4 steps or more
    args = (dout, x, *((None, None) if w13 is not None else (w1, w3)), rms_w, 1e-6, w13, gate, up, xn)
    plan = backward_plan(args, config, many)
    for t in plan.result:
        poison(t)
    dx, dw13, drms_w = launch(plan)
    leaves = [t.double().requires_grad_() for t in (x, w1, w3, rms_w)]
    grads = torch.autograd.grad(composite(*leaves), leaves, dout.double())
    for got, want in zip((dx, dw13[:70], dw13[70:], drms_w), grads):
        assert_close(got, want, torch.float32, reduce_dim=41)
    names = [name for name, _ in launches]
    assert "splitk_reduce_kernel" in names
    assert ("ffn_input_grad_kernel" in names) == (w13 is None)


def test_rms_weight_in_another_dtype(device, gen, run):
    args = inputs((9,), 40, 24, torch.float16, device, gen, rms_w_dtype=torch.float32)
    for config in (DECODE, PREFILL):
        check(run(OP, TRITON, (*args, 1e-6, None), config), *args)


def test_non_contiguous_inputs(dtype, device, gen, run, relayout):
    x, w1, w3, rms_w = inputs((3, 5), 100, 24, dtype, device, gen)
    x_strided = relayout(x)
    w1_t, w3_t = strided_like(w1, "transpose"), strided_like(w3, "transpose")
    assert w1_t.stride() == (1, 24) and not x_strided.is_contiguous()
    for config in (DECODE, PREFILL):
        check(run(OP, TRITON, (x_strided, w1_t, w3_t, relayout(rms_w), 1e-6, None), config), x, w1, w3, rms_w)


def test_eps_is_applied(device, gen, run):
    x, w1, w3, rms_w = inputs((4,), 40, 16, torch.float32, device, gen)
    x = x * 0.05  # mean(x**2) ~ eps: a kernel that dropped eps would be far off
    for config in (DECODE, PREFILL):
        check(run(OP, TRITON, (x, w1, w3, rms_w, 0.01, None), config), x, w1, w3, rms_w, eps=0.01)


@pytest.mark.parametrize("config", [
    dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=1, num_warps=1, num_stages=1),
    dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, GROUP_M=2, num_warps=2, num_stages=2),
    dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=2),
], ids=lambda c: "{BLOCK_M}x{BLOCK_N}x{BLOCK_K}-g{GROUP_M}".format(**c))
def test_configs(config, dtype, device, gen, run):
    # 3 row blocks of 16 with a ragged last one, so grouped orders with partial groups are covered.
    args = inputs((37,), 70, 50, dtype, device, gen)
    check(run(OP, TRITON, (*args, 1e-6, None), config), *args)


def hopper(profile, device):
    """The device's profile claiming sm_90 (the copy engine's kernels; on a CPU they run in the
    interpreter, three cores so each persistent program walks several tiles)."""
    return dataclasses.replace(profile, arch="sm_90", cores=3 if device == "cpu" else profile.cores)


def pair_weights(order, n, k, dtype, device, gen):
    """``(w1, w3, w13)``: one ``[2N + 8, K]`` buffer's rows as ``w13`` (``order`` "w13"), as w1 then
    w3 a few rows apart ("w1 < w3"), the other way round ("w3 < w1": the descriptor's planes swap),
    or as copies anywhere in memory ("copies")."""
    buf = randn(2 * n + 8, k, dtype=dtype, device=device, generator=gen, scale=1 / math.sqrt(k))
    if order == "w13":
        return None, None, buf[:2 * n]
    if order == "w1 < w3":
        return buf[:n], buf[n + 8:], None
    if order == "w3 < w1":
        return buf[n + 8:], buf[:n], None
    return buf[:n].clone(), buf[n:2 * n].clone(), None


PAIR_ORDERS = ["w13", "w1 < w3", "w3 < w1", "copies"]


@pytest.mark.parametrize("reach", ["one descriptor", "too far apart"])
@pytest.mark.parametrize("order", PAIR_ORDERS)
def test_pair_tile_kernel(order, reach, dtype, device, gen, profile, launch, launches, monkeypatch):
    """The prefill GEMM on sm_90: the pair-tile kernel (one product over w1's and w3's tiles read as
    the two planes of one descriptor), with every weight form and order, ragged tiles in M, N and K;
    weights the descriptor cannot span (here: any, with the limit lowered) take its two-accumulator
    loop. The forward and the training forward (pre-activations stored), all outputs poisoned."""
    if reach == "too far apart":
        monkeypatch.setattr(swiglu_pair, "PAIR_STRIDE_LIMIT", 16)
    m, k, n = 37, 72, 40  # 16-byte rows for the copy engine in float32 and float16
    x = randn(m, k, dtype=dtype, device=device, generator=gen)
    rms_w = (1 + randn(k, device=device, generator=gen, scale=0.2)).to(dtype)
    w1, w3, w13 = pair_weights(order, n, k, dtype, device, gen)
    r1, r3 = (w1, w3) if w13 is None else (w13[:n], w13[n:])
    args = (x, w1, w3, rms_w, 1e-6, w13)
    h = hopper(profile, device)
    check(launch(forward_plan(args, PREFILL, h)), x, r1, r3, rms_w)
    got = launch(training_plan(args, PREFILL, h))
    for result, expected in zip(got, ffn_training_reference(*upcast(x, r1, r3, rms_w))):
        assert_close(result, expected, dtype, reduce_dim=k)
    assert [name for name, _ in launches] == ["rms_scale_kernel", "swiglu_pair_tma_kernel"] * 2
    # JOINT=0: the GEMM block's two-accumulator descriptor kernel, the same values
    check(launch(forward_plan(args, {**PREFILL, "JOINT": 0}, h)), x, r1, r3, rms_w)
    assert launches[-1][0] == "gemm_tma_kernel"


@pytest.mark.parametrize("order", PAIR_ORDERS)
def test_pair_tile_split_last_wave(order, dtype, device, gen, profile, launch, launches):
    """The pair kernel's last wave split over K (swiglu_pair.pair_tail: 3 x 3 tiles on 4 cores leave one
    for a third wave, split 4 ways): its counters, poisoned in the plan's scratch, zeroed by the row
    kernel launched before; the forward and the training forward, all outputs poisoned."""
    if dtype == torch.float32:
        pytest.skip("float32 takes the same code; K slices of 16 keep the test small in 16-bit")
    m, k, n = 37, 16 * 16 + 8, 40
    x = randn(m, k, dtype=dtype, device=device, generator=gen)
    rms_w = (1 + randn(k, device=device, generator=gen, scale=0.2)).to(dtype)
    w1, w3, w13 = pair_weights(order, n, k, dtype, device, gen)
    r1, r3 = (w1, w3) if w13 is None else (w13[:n], w13[n:])
    args = (x, w1, w3, rms_w, 1e-6, w13)
    h = dataclasses.replace(hopper(profile, device), cores=4)
    config = {**PREFILL, "BLOCK_K": 16}
    plans = (forward_plan(args, config, h), training_plan(args, config, h))
    for plan in plans:
        rows, pair = plan.calls
        assert pair.kwargs["TAIL"] and pair.args[17] == 4 and rows.kwargs["ZERO"]
        count = plan.scratch[-1]
        assert count.dtype == torch.int32 and count.numel() == 1 and rows.args[4] is count
        count.fill_(-7)
    check(launch(plans[0]), x, r1, r3, rms_w)
    for result, expected in zip(launch(plans[1]), ffn_training_reference(*upcast(x, r1, r3, rms_w))):
        assert_close(result, expected, dtype, reduce_dim=k)
    assert [name for name, _ in launches] == ["rms_scale_kernel", "swiglu_pair_tma_kernel"] * 2


def test_pair_tile_backward(device, gen, profile, launch, launches):
    """Gradients from the pair-tile kernel's saved pre-activations (the training forward on sm_90)
    against autograd through the float64 composite; dxn by the descriptor kernel over both weights
    (its reduction over N = 24 ragged against K steps of 32)."""
    m, k, n = 21, 40, 24
    x, w1, w3, rms_w = inputs((m,), k, n, torch.float32, device, gen)
    h = hopper(profile, device)
    args = (x, w1, w3, rms_w, 1e-6, None)
    out, gate, up, xn = launch(training_plan(args, PREFILL, h))
    dout = randn(m, n, device=device, generator=gen)
    dx, dw13, drms_w = launch(backward_plan((dout, *args, gate, up, xn), PREFILL, h))
    assert "ffn_input_grad_tma_kernel" in [name for name, _ in launches]
    leaves = [t.double().requires_grad_() for t in (x, w1, w3, rms_w)]
    expected = composite(*leaves)
    assert_close(out, expected, torch.float32, reduce_dim=k)
    grads = torch.autograd.grad(expected, leaves, dout.double())
    for got, want in zip((dx, dw13[:n], dw13[n:], drms_w), grads):
        assert_close(got, want, torch.float32, reduce_dim=max(k, m))


def test_pair_tile_only_where_the_copy_engine_can_go(device, gen, profile, launches, run):
    """Weights stored transposed, or x's rows strided, keep the pointer kernel on sm_90."""
    x, w1, w3, rms_w = inputs((19,), 40, 24, torch.float32, device, gen)
    h = hopper(profile, device)
    w1_t, w3_t = strided_like(w1, "transpose"), strided_like(w3, "transpose")
    for args in ((x, w1_t, w3_t, rms_w, 1e-6, None), (x, w1, w3_t, rms_w, 1e-6, None)):
        check(forward_plan(args, PREFILL, h).run(), x, w1, w3, rms_w)
        assert launches[-1][0] != "swiglu_pair_tma_kernel"


def test_public_function_runs_the_plan(device, gen, run):
    args = inputs((3, 5), 100, 24, torch.float16, device, gen)
    assert dlblas_kernels.ffn is ffn
    assert torch.equal(dlblas_kernels.ffn(*args), run(OP, TRITON, (*args, 1e-6, None)))
    assert torch.equal(ffn(*args, eps=0.5), run(OP, TRITON, (*args, 0.5, None)))


def test_zero_rows_launch_nothing(device, no_launch):
    x = torch.empty(0, 3, 16, device=device)
    w = torch.ones(8, 16, device=device)
    out = ffn(x, w, w, torch.ones(16, device=device))
    assert out.shape == (0, 3, 8)


def test_plan_on_meta_tensors_reads_no_data():
    x = torch.empty(6, 40, 256, device="meta", dtype=torch.bfloat16)
    w = torch.empty(1000, 256, device="meta", dtype=torch.bfloat16)
    config = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
    plan = TRITON.plan((x, w, w, torch.empty(256, device="meta"), 1e-6, None), config, device_profile(x.device))
    assert plan.result.device.type == "meta" and plan.result.shape == (6, 40, 1000)
    scale, gemm = plan.calls
    assert scale.grid == (240,) and [t.shape for t in plan.scratch] == [(240, 256), (240,)]
    assert gemm.kernel.__name__ == "gemm_kernel" and gemm.grid == (4 * 8, 1)
    assert gemm.kwargs["num_stages"] == 3 and gemm.kwargs["BLOCK_K"] == 64
    # 240 rows in one row block: one weight-streaming launch over the columns, the rows padded to 256
    (stream,) = TRITON.plan((x, w, w, torch.empty(256, device="meta"), 1e-6, None), {**config, "BLOCK_M": 256},
                            device_profile(x.device)).calls
    assert stream.kernel.__name__ == "ffn_decode_kernel" and stream.grid == (8, 1) and stream.kwargs["BLOCK_M"] == 256


H200 = DeviceProfile(backend="cuda", vendor="NVIDIA", name="NVIDIA H200", arch="sm_90", cores=132,
                    shared_memory_per_program=232448, registers_per_core=65536, threads_per_core=2048, warp_size=32)
SMALL_SHARED = dataclasses.replace(H200, shared_memory_per_program=101376)


@pytest.mark.parametrize("tokens", [16, 128, 4096])
def test_weight_grad_takes_the_prefill_tile_at_every_row_count(tokens):
    """dw13 [2N, K] is as large at 16 tokens as at 4096: its GEMM takes the 128 x 256 prefill tile
    whatever the forward's few-row tile (the H200 measured 64 x 128 tiles 17% behind cuBLAS there),
    its stages fitted to the device; dxn keeps the forward config's tile."""
    x = torch.empty(tokens, 4096, device="meta", dtype=torch.bfloat16)
    w = torch.empty(14336, 4096, device="meta", dtype=torch.bfloat16)
    rms_w = torch.empty(4096, device="meta", dtype=torch.bfloat16)
    gate = torch.empty(tokens, 14336, device="meta", dtype=torch.bfloat16)
    config = default_config(make_signature(OP, (x, w, w, rms_w, 1e-6, None), x.device), H200)
    plan = backward_plan((gate, x, w, w, rms_w, 1e-6, None, gate, gate, x), config, H200)
    (dw,) = [c for c in plan.calls if c.kernel.__name__ == "gemm_tma_kernel" and c.args[3] is plan.result[1]]
    tile = tuple(dw.kwargs[key] for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps"))
    assert tile == (128, 256, 64, 8)
    assert gemm.shared_memory_bytes(dw.kwargs, 2) <= H200.shared_memory_per_program
    assert weight_grad_config(4, H200)["BLOCK_K"] == 32  # float32 operands: K slices half as wide


@pytest.mark.parametrize("tokens, path", [(1, "decode"), (64, "decode"), (65, "prefill"), (4096, "prefill")])
@pytest.mark.parametrize("profile", [H200, SMALL_SHARED], ids=["h200", "99KiB"])
def test_default_config_lies_in_the_space(tokens, path, profile):
    """The heuristic picks the path by the row count, and what it picks is a point of the space on
    the device (its tiles fit the shared memory: stages dropped on a smaller one)."""
    x = torch.empty(tokens, 4096, device="meta", dtype=torch.bfloat16)
    w13 = torch.empty(28672, 4096, device="meta", dtype=torch.bfloat16)
    args = (x, None, None, torch.empty(4096, device="meta", dtype=torch.bfloat16), 1e-6, w13)
    config = TRITON.default_config(make_signature(OP, args, x.device), profile)
    assert KERNEL.implementation.space(profile).is_valid(config) is None, config
    assert (tokens <= config["BLOCK_M"]) == (path == "decode")


@pytest.mark.parametrize("tokens, hidden, inter, block_n, block_k", [
    (128, 4096, 14336, 64, 128),  # 448 tiles of 64 columns fill the 132 multiprocessors
    (128, 7168, 2048, 32, 128),  # DeepSeek-V3's shared expert: 32 tiles of 128, 64 of 64, 128 of 32
    (100, 7168, 8192, 64, 128),
])
def test_few_rows_take_tiles_that_fill_the_device(tokens, hidden, inter, block_n, block_k):
    x = torch.empty(tokens, hidden, device="meta", dtype=torch.bfloat16)
    w = torch.empty(inter, hidden, device="meta", dtype=torch.bfloat16)
    args = (x, w, w, torch.empty(hidden, device="meta", dtype=torch.bfloat16), 1e-6, None)
    config = TRITON.default_config(make_signature(OP, args, x.device), H200)
    assert (config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]) == (64, block_n, block_k)
    assert TRITON.space(H200).is_valid(config) is None
    # a profile that knows no cores: 64 columns
    assert TRITON.default_config(make_signature(OP, args, x.device), UNKNOWN_DEVICE)["BLOCK_N"] == 64


BAD = {"int32 x": "x", "w1 dtype": "w1", "w3 dtype": "w3", "int32 rms_w": "rms_w", "rank-0 x": "x", "3-D w1": "w1",
       "w1 columns": "w1", "w3 shape": "w3", "rms_w size": "rms_w", "empty features": "x", "interleaved rows": "x",
       "no w1": "w1", "no w3": "w3", "w13 and w1": "w1", "w13 and w3": "w3", "w13 odd rows": "w13",
       "w13 columns": "w13", "w13 dtype": "w13", "3-D w13": "w13"}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_inputs_raise_before_launch(case, device, no_launch):
    x = torch.randn(4, 6, 32, device=device, dtype=torch.float16)
    w1 = torch.randn(16, 32, device=device, dtype=torch.float16)
    w3 = torch.randn(16, 32, device=device, dtype=torch.float16)
    rms_w = torch.randn(32, device=device)
    w13 = None
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
    elif case in ("no w1", "no w3"):
        w1, w3 = (None, w3) if case == "no w1" else (w1, None)
    elif case in ("w13 and w1", "w13 and w3"):
        w13 = torch.cat([w1, w3])
        w1, w3 = (w1, None) if case == "w13 and w1" else (None, w3)
    elif case.startswith("w13") or case == "3-D w13":
        w13 = {"w13 odd rows": torch.cat([w1, w3[:15]]), "w13 columns": torch.cat([w1, w3], dim=1),
               "w13 dtype": torch.cat([w1, w3]).float(), "3-D w13": torch.cat([w1, w3])[None]}[case]
        w1 = w3 = None
    with pytest.raises(InvalidInputError) as raised:
        ffn(x, w1, w3, rms_w, w13=w13)
    assert raised.value.arg == BAD[case], raised.value


# Forward (both paths, both weight forms) and backward plans on meta tensors, each launch compiled to a
# cubin in a fresh interpreter without TRITON_INTERPRET.
CUBIN_SCRIPT = """
import dataclasses, json, torch
from triton.backends.compiler import GPUTarget
from dlcore.compiler.lowering import compile_call, target_profile
from dlcore.runtime.template import UNKNOWN_DEVICE as profile
from dlblas_kernels.kernels import ffn

def e(*shape, dtype):
    return torch.empty(*shape, device="meta", dtype=dtype)

hopper = target_profile("cuda:90")
found = {}
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    x, w, w13, g = e(37, 256, dtype=dtype), e(96, 256, dtype=dtype), e(192, 256, dtype=dtype), e(256, dtype=dtype)
    dout = gate = up = e(37, 96, dtype=dtype)
    small = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=2)
    plans = {"decode": ffn.plan((x, w, w, g, 1e-6, None), {**small, "BLOCK_M": 64}, profile),
             "prefill": ffn.plan((x, None, None, g, 1e-6, w13), small, profile),
             "decode_training": ffn.training_plan((x, w, w, g, 1e-6, None), {**small, "BLOCK_M": 64}, profile),
             "decode_split": ffn.training_plan((x, w, w, g, 1e-6, None), {**small, "BLOCK_M": 64, "SPLIT_K": 2},
                                               profile),
             "prefill_training": ffn.training_plan((x, None, None, g, 1e-6, w13), small, profile),
             "backward": ffn.backward_plan((dout, x, w, w, g, 1e-6, None, gate, up, x), small, profile),
             "backward13": ffn.backward_plan((dout, x, None, None, g, 1e-6, w13, gate, up, x), small, profile),
             # the pair-tile kernel, planned for sm_90 (where it runs), compiled for every target
             "prefill_pair": ffn.plan((x, w, w, g, 1e-6, None), small, hopper),
             "prefill_pair_training": ffn.training_plan((x, None, None, g, 1e-6, w13), small, hopper),
             # the streaming kernel through tensor descriptors (TMA, sm_90), sliced over K
             "decode_tma": ffn.training_plan((x, None, None, g, 1e-6, w13),
                                             {**small, "BLOCK_M": 64, "TMA": 1, "SPLIT_K": 2}, hopper)}
    # the pair-tile kernel's last wave split over K (4 cores: 6 tiles leave 2, split 2 ways)
    plans["backward_tma"] = ffn.backward_plan((dout, x, w, w, g, 1e-6, None, gate, up, x), small, hopper)
    plans["prefill_pair_tail"] = ffn.training_plan((x, None, None, g, 1e-6, w13), {**small, "BLOCK_K": 16},
                                                   dataclasses.replace(hopper, cores=4))
    assert plans["decode_tma"].calls[0].kwargs["TMA"] and plans["prefill_pair_tail"].calls[1].kwargs["TAIL"]
    for name, plan in plans.items():
        for call in plan.calls:
            for capability in (80, 90, 100):
                kernel = compile_call(call, GPUTarget("cuda", capability, 32))
                key = f"{name}/{call.kernel.__name__}/{str(dtype)[6:]}/sm_{capability}"
                found[key] = len(kernel.asm.get("cubin", b""))
print(json.dumps(found))
"""


@pytest.mark.slow
def test_every_kernel_compiles_to_cubin():
    compiled = run_json(CUBIN_SCRIPT, None, TRITON_INTERPRET="0")
    norm = ["rms_norm_backward_kernel", "column_sum_kernel"]
    kernels = {"decode": ["ffn_decode_kernel"], "prefill": ["rms_scale_kernel", "gemm_kernel"],
               "decode_training": ["ffn_decode_kernel", "rms_scale_kernel"],
               "decode_split": ["ffn_decode_kernel", "ffn_decode_finish_kernel", "rms_scale_kernel"],
               "prefill_training": ["rms_scale_kernel", "gemm_kernel"],
               "backward": ["swiglu_backward_kernel", "ffn_input_grad_kernel", "gemm_kernel", *norm],
               "backward13": ["swiglu_backward_kernel", "gemm_kernel", *norm],
               "prefill_pair": ["rms_scale_kernel", "swiglu_pair_tma_kernel"],
               "prefill_pair_training": ["rms_scale_kernel", "swiglu_pair_tma_kernel"],
               "decode_tma": ["ffn_decode_kernel", "ffn_decode_finish_kernel", "rms_scale_kernel"],
               "prefill_pair_tail": ["rms_scale_kernel", "swiglu_pair_tma_kernel"],
               "backward_tma": ["swiglu_backward_kernel", "ffn_input_grad_tma_kernel", "gemm_tma_kernel", *norm]}
    expected = {f"{plan}/{kernel}/{dtype}/sm_{capability}" for plan, names in kernels.items() for kernel in names
                for dtype in ("bfloat16", "float16", "float32") for capability in (80, 90, 100)}
    assert set(compiled) == expected
    assert all(size > 0 for size in compiled.values()), compiled


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="bfloat16 against a float32 reference needs a GPU")
@pytest.mark.parametrize("tokens", [1, 16, 300])
def test_bfloat16_against_float32_on_gpu(tokens, gen):
    """A LLaMA-like shape in bfloat16 (1 and 16 tokens stream the weights, 300 take the GEMM),
    forward and backward (w13 form), against the float32 composite on the same bfloat16 values: the
    error of each output and gradient at most that of PyTorch's own bfloat16 composite (autograd
    rounding its intermediates to bfloat16 likewise), plus a quarter of bfloat16's tolerance."""
    k, n = 2048, 2816
    x, w1, w3, rms_w = inputs((tokens,), k, n, torch.bfloat16, "cuda", gen)
    w13 = torch.cat([w1, w3])
    dout = randn(tokens, n, dtype=torch.bfloat16, device="cuda", generator=gen)

    def run(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (x, w13, rms_w)]
        out = fn(*leaves)
        return (out, *torch.autograd.grad(out, leaves, dout.to(dtype)))

    ours = run(lambda x, w13, rms_w: ffn(x, None, None, rms_w, w13=w13), torch.bfloat16)
    torch_bf16 = run(lambda x, w13, rms_w: composite(x, w13[:n], w13[n:], rms_w), torch.bfloat16)
    expected = run(lambda x, w13, rms_w: composite(x, w13[:n], w13[n:], rms_w), torch.float32)
    atol, _ = tolerance(torch.bfloat16)
    for name, got, theirs, want in zip(("out", "dx", "dw13", "drms_w"), ours, torch_bf16, expected):
        assert got.dtype == torch.bfloat16 and not torch.isnan(got).any(), name
        error, baseline = ((got.float() - want).abs().max().item(), (theirs.float() - want).abs().max().item())
        assert error <= baseline + atol / 4, f"{name}: error {error:.3g}, torch's bfloat16 composite {baseline:.3g}"


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_through_tensor_descriptors(splits, dtype, device, gen, launch, launches):
    """The streaming kernel with TMA (sm_90): the weight tiles through descriptors whose shape ends
    at the program's last column and K slice; N spread over programs of fewer columns than the
    tile (7 programs on a 7-core device: the tile's last columns belong to the next program), a
    short last K slice, both weight forms, the training plan's pre-activations; all poisoned."""
    if dtype == torch.float32:
        pytest.skip("the copy engine path is declared for 16-bit weights; float32 takes the same code")
    k, n = 200, 100
    x, w1, w3, rms_w = inputs((5,), k, n, dtype, device, gen)
    profile = dataclasses.replace(H200, cores=7)
    config = {**DECODE, "BLOCK_N": 32, "TMA": 1, "SPREAD": 2, "SPLIT_K": splits}
    for weights in ((w1, w3, None), (None, None, torch.cat([w1, w3]))):
        args = (x, weights[0], weights[1], rms_w, 1e-6, weights[2])
        plan = training_plan(args, config, profile)
        stream = plan.calls[0]
        assert stream.kwargs["TMA"] and stream.grid[0] == 7 and stream.args[15] == 15  # 7 programs of 15 columns
        got = launch(plan)
        for result, expected in zip(got, ffn_training_reference(*upcast(x, w1, w3, rms_w))):
            assert_close(result, expected, dtype, reduce_dim=k)
    # a weight the copy engine cannot take (K stride 2) streams through pointers
    wide = randn(n, 2 * k, dtype=dtype, device=device, generator=gen)[:, ::2]
    stream = training_plan((x, wide, wide, rms_w, 1e-6, None), config, profile).calls[0]
    assert not stream.kwargs["TMA"]


def test_decode_takes_tensor_descriptors_where_measured_faster():
    """decode_tma on the H200 with the default config (TMA unset): LLaMA-3-8B's and -70B's programs
    (128 and 109 of 128 columns, unsliced) read through descriptors, K slices of 128 three deep;
    Qwen2.5-7B's 72 columns, sliced K, TMA=0, an sm_80 device, or a weight whose rows the copy
    engine cannot take keep the pointer loads; TMA=1 takes the config's own slice and depth."""

    config = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=1, JOINT=1, num_warps=4, num_stages=4)
    w = torch.empty(28672, 8192, device="meta", dtype=torch.bfloat16)
    assert TMA_DECODE_TILE == (128, 3)
    assert decode_tma(config, H200, w, w, 128, 1) == TMA_DECODE_TILE
    assert decode_tma(config, H200, w, w, 109, 1) == TMA_DECODE_TILE
    assert decode_tma(config, H200, w, w, 72, 1) is None
    assert decode_tma(config, H200, w, w, 128, 8) is None
    assert decode_tma({**config, "TMA": 0}, H200, w, w, 128, 1) is None
    assert decode_tma({**config, "TMA": 1}, H200, w, w, 72, 8) == (64, 4)
    assert decode_tma(config, dataclasses.replace(H200, arch="sm_80"), w, w, 128, 1) is None
    odd = torch.empty(100, 8190, device="meta", dtype=torch.bfloat16)[:, :8189]  # rows of 16380 bytes
    assert decode_tma(config, H200, odd, odd, 128, 1) is None
    # up to 16 rows (measured); 17 to 64 keep the pointers, as does a device with less shared memory
    assert decode_tma(config, H200, w, w, 128, 1, block_m=16) == TMA_DECODE_TILE
    assert decode_tma(config, H200, w, w, 128, 1, block_m=32) is None
    assert decode_tma(config, SMALL_SHARED, w, w, 128, 1) is None
    wide = torch.empty(28672, 8192, device="meta", dtype=torch.float32)
    assert decode_tma(config, H200, wide, wide, 128, 1) is None  # float32 weights: pointers
    # the plan: LLaMA-3-8B at 1 token through descriptors, at 48 tokens and Qwen2.5-7B through pointers
    for (rows, k, n), expected in (((1, 4096, 14336), (True, 128, 3)), ((48, 4096, 14336), (False, 64, 4)),
                                   ((1, 3584, 18944), (False, 64, 4))):
        x = torch.empty(rows, k, device="meta", dtype=torch.bfloat16)
        weight = torch.empty(n, k, device="meta", dtype=torch.bfloat16)
        (stream,) = forward_plan((x, weight, weight, torch.empty(k, device="meta"), 1e-6, None), config, H200).calls
        assert (stream.kwargs["TMA"], stream.kwargs["BLOCK_K"], stream.kwargs["num_stages"]) == expected
