"""The GEMM building block (dlblas_kernels.blocks.gemm) through its host entry points: the epilogues, the
three launch paths and the prefill ffn's SwiGLU pair (dlblas_kernels.blocks.swiglu_pair), against float64
references.

On a CPU the tensor-descriptor kernel runs in the interpreter under a profile that claims sm_90
(three cores, so each persistent program walks several tiles)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from dlblas_kernels.blocks import gemm, swiglu_pair

from dlcore.testing import assert_close, poison, randn

SMALL = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=1, num_stages=1)
ACT = {None: lambda z: z, "relu": torch.relu, "silu": F.silu, "gelu_tanh": lambda z: F.gelu(z, approximate="tanh")}


PATHS = ["pointers", "descriptors", "split-k pointers", "split-k descriptors", "warp-specialised descriptors"]


@pytest.fixture(params=PATHS)
def path(request, profile, device):
    """``(profile, config extras, kernel the GEMM runs)`` of one launch path."""
    descriptors = request.param.endswith("descriptors")
    if descriptors:
        profile = dataclasses.replace(profile, arch="sm_90", cores=3 if device == "cpu" else profile.cores)
    extra = {"TMA": int(descriptors), **({"SPLIT_K": 3} if request.param.startswith("split-k") else {}),
             **({"WARP_SPECIALIZE": 1} if request.param.startswith("warp") else {})}
    return profile, extra, "gemm_tma_kernel" if descriptors else "gemm_kernel"


def run(calls):
    for call in calls:
        call.launch()


def rows_scaled(a, b, scale):
    return (a.double() @ b.double()) * scale.double()[:, None]


@pytest.mark.parametrize("activation, k_major", [(None, False), ("relu", True), ("silu", False), ("gelu_tanh", True)],
                         ids=["b row-major", "relu, b = w.T", "silu, b row-major", "gelu_tanh, b = w.T"])
def test_epilogue(activation, k_major, path, dtype, device, gen):
    profile, extra, kernel = path
    m, n, k = 37, 40, 72  # no multiple of a tile; 16-byte aligned rows for the copy engine
    a = randn(m, k, dtype=dtype, device=device, generator=gen)
    w = randn(n, k, dtype=dtype, device=device, generator=gen, scale=1 / math.sqrt(k))
    b = w.T if k_major else w.T.contiguous()
    bias = randn(n, dtype=dtype, device=device, generator=gen)
    scale = randn(m, device=device, generator=gen).abs() + 0.5
    c = poison(torch.empty(m, n, dtype=dtype, device=device))
    calls, scratch = gemm.gemm_calls(a, b, c, {**SMALL, **extra}, profile,
                                     epilogue=gemm.Epilogue(bias=bias, activation=activation, row_scale=scale))
    assert calls[0].kernel.__name__ == kernel and len(scratch) == (1 if extra.get("SPLIT_K") else 0)
    run(calls)
    assert_close(c, ACT[activation](rows_scaled(a, b, scale) + bias.double()), dtype, reduce_dim=k)


@pytest.mark.parametrize("activation", gemm.ACTIVATIONS)
def test_activation_gradient(activation, path, device, gen):
    """``act_grad``: ``dc * act'(a @ b + bias)``, what a backward through the activation needs."""
    profile, extra, _ = path
    m, n, k = 21, 24, 40
    a, b = randn(m, k, device=device, generator=gen), randn(k, n, device=device, generator=gen, scale=0.2)
    bias, dc = randn(n, device=device, generator=gen), randn(m, n, device=device, generator=gen)
    c = poison(torch.empty(m, n, device=device))
    run(gemm.gemm_calls(a, b, c, {**SMALL, **extra}, profile,
                        epilogue=gemm.Epilogue(bias=bias, activation=activation, act_grad=dc))[0])
    z = (a.double() @ b.double() + bias.double()).requires_grad_()
    ACT[activation](z).backward(dc.double())
    assert_close(c, z.grad, torch.float32, reduce_dim=k)


@pytest.mark.parametrize("form", ["w1, w3", "w13"])
def test_swiglu(form, path, dtype, device, gen):
    """The prefill ffn's pair: ``silu(rstd * (a @ w1.T)) * (rstd * (a @ w3.T))`` and the two
    pre-activations, from separate weights or the two halves of one ``w13``."""
    profile, extra, kernel = path
    if extra.get("SPLIT_K"):
        extra = {**extra, "SPLIT_K": 1}  # both products share one program: swiglu_calls takes no split
    m, n, k = 37, 24, 56
    a = randn(m, k, dtype=dtype, device=device, generator=gen)
    w13 = randn(2 * n, k, dtype=dtype, device=device, generator=gen, scale=1 / math.sqrt(k))
    rstd = randn(m, device=device, generator=gen).abs() + 0.5
    out, gate, up = (poison(torch.empty(m, n, dtype=dtype, device=device)) for _ in range(3))
    w1, w3 = (None, None) if form == "w13" else (w13[:n].clone(), w13[n:].clone())
    calls = gemm.swiglu_calls(a, w1, w3, rstd, out, {**SMALL, **extra}, profile,
                              w13=w13 if form == "w13" else None, gate=gate, up=up)
    assert [c.kernel.__name__ for c in calls] == [kernel]
    run(calls)
    ref_gate, ref_up = rows_scaled(a, w13[:n].T, rstd), rows_scaled(a, w13[n:].T, rstd)
    assert_close(gate, ref_gate, dtype, reduce_dim=k)
    assert_close(up, ref_up, dtype, reduce_dim=k)
    assert_close(out, F.silu(ref_gate) * ref_up, dtype, reduce_dim=k)


def test_a_stored_transposed(path, dtype, device, gen):
    """``a`` with a unit M stride (``x.T`` of a row-major ``x``, what ``a^T @ dc`` of a backward
    passes): the descriptor kernel reads it through a transposed descriptor."""
    profile, extra, kernel = path
    m, n, k = 40, 24, 37
    a = randn(k, m, dtype=dtype, device=device, generator=gen).T
    b = randn(k, n, dtype=dtype, device=device, generator=gen, scale=1 / math.sqrt(k))
    c = poison(torch.empty(m, n, dtype=dtype, device=device))
    calls, _ = gemm.gemm_calls(a, b, c, {**SMALL, **extra}, profile)
    assert calls[0].kernel.__name__ == kernel
    run(calls)
    assert_close(c, a.double() @ b.double(), dtype, reduce_dim=k)


def test_swiglu_allocates_its_output(profile, device, gen):
    m, n, k = 9, 20, 32
    a, w1, w3 = (randn(*s, device=device, generator=gen) for s in ((m, k), (n, k), (n, k)))
    rstd = torch.ones(m, device=device)
    out = gemm.swiglu(a, w1, w3, rstd, SMALL, profile)
    assert_close(out, F.silu(a.double() @ w1.double().T) * (a.double() @ w3.double().T), torch.float32, reduce_dim=k)


def test_descriptor_path_only_where_the_copy_engine_can_go(profile, device):
    hopper = dataclasses.replace(profile, arch="sm_90", cores=132)
    a, b, c = (torch.empty(*s, dtype=torch.float16, device=device) for s in ((64, 64), (64, 32), (64, 32)))
    assert gemm.takes_tma(hopper, a, b, c) and gemm.takes_tma(hopper, a, b.T.contiguous().T, c)
    assert not gemm.takes_tma(profile if profile.arch != "sm_90" else dataclasses.replace(profile, arch="sm_80"),
                              a, b, c)
    assert not gemm.takes_tma(hopper, a[:, 1:], b[1:], c)  # a's base 2 bytes off
    odd = torch.empty(64, 36, dtype=torch.float16, device=device)[:, :33]
    assert not gemm.takes_tma(hopper, a, b, odd)  # 33 columns: a 66-byte row
    assert not gemm.takes_tma(hopper, a, b[:, ::2], c[:, :16])  # no unit stride in b
    calls, _ = gemm.gemm_calls(a, b, c, {**SMALL, "TMA": 0}, hopper)
    assert calls[0].kernel.__name__ == "gemm_kernel"


def test_warp_specialised_loop_flags():
    """WARP_SPECIALIZE turns the flattening off (Triton would drop the specialisation) and is dropped
    where pre-activations are stored (their staging buffers would overflow the shared memory)."""
    from dlcore.compiler.lowering import target_profile

    hopper = target_profile("cuda:90")
    config = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3, WARP_SPECIALIZE=1)
    a, w, c = (torch.empty(*s, device="meta", dtype=torch.bfloat16) for s in ((512, 256), (512, 256), (512, 512)))

    def flags(**epilogue):
        calls, _ = gemm.gemm_calls(a, w.T, c, config, hopper, epilogue=gemm.Epilogue(**epilogue))
        return calls[0].kwargs["WARP_SPECIALIZE"], calls[0].kwargs["FLATTEN"]

    assert flags() == (True, False)
    assert flags(activation="silu", pre=c) == (False, True)
    assert gemm.loop_flags({}) == {"FLATTEN": True, "WARP_SPECIALIZE": False}
    # 8-bit operands: never specialised (Triton 3.6's specialised fp8 loop computed wrong products)
    assert gemm.loop_flags(config, eight_bit=True) == {"FLATTEN": True, "WARP_SPECIALIZE": False}


@pytest.mark.parametrize("path", ["pointers", "descriptors"], indirect=True)
def test_accumulate_adds_the_product_to_c(path, dtype, device, gen):
    """``accumulate``: ``c += a @ b (+ bias)``, the sum over row chunks of a weight gradient; a
    transposed ``a`` (``dlogits.T``) as the weight gradient takes it."""
    profile, extra, kernel = path
    m, n, k = 40, 56, 24  # no multiple of a tile; 16-byte aligned rows of a.T and c for the copy engine
    a = randn(k, m, dtype=dtype, device=device, generator=gen).T
    b = randn(k, n, dtype=dtype, device=device, generator=gen)
    bias = randn(n, dtype=dtype, device=device, generator=gen)
    c = randn(m, n, dtype=dtype, device=device, generator=gen)
    before = c.double()
    calls, _ = gemm.gemm_calls(a, b, c, {**SMALL, **extra}, profile, epilogue=gemm.Epilogue(bias=bias, accumulate=True))
    assert calls[0].kernel.__name__ == kernel and calls[0].kwargs["ACCUMULATE"]
    run(calls)
    assert_close(c, before + a.double() @ b.double() + bias.double(), dtype, reduce_dim=k)
    with pytest.raises(ValueError, match="does not accumulate"):
        gemm.gemm_calls(a, b, c, {**SMALL, "SPLIT_K": 2}, profile, epilogue=gemm.Epilogue(accumulate=True))


def test_bad_epilogues_raise(profile, device):
    a, b, c = (torch.empty(*s, device=device) for s in ((8, 8), (8, 8), (8, 8)))
    with pytest.raises(ValueError, match="activation"):
        gemm.gemm_calls(a, b, c, SMALL, profile, epilogue=gemm.Epilogue(activation="tanh"))
    with pytest.raises(ValueError, match="split-K"):
        gemm.gemm_calls(a, b, c, {**SMALL, "SPLIT_K": 2}, profile, b3=b)


def test_descriptor_kernel_drops_stages_to_fit_its_epilogue():
    """A config tuned for the plain product (128x256 tiles, 3 stages: 208 KiB on sm_90) does not fit
    beside the act_grad tile of a backward (Triton asked 240 KiB of the H200's 227) or the old
    output of an accumulating product: the launch takes one stage less. The pointer kernel stages no
    output tile and keeps its config."""
    from dlcore.compiler.lowering import target_profile

    hopper = target_profile("cuda:90")
    config = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3)
    assert gemm.shared_memory_bytes(config) == (3 * 384 * 64 + 128 * 256) * 2 <= hopper.shared_memory_per_program
    assert gemm.shared_memory_bytes(config, act_grad=True) > hopper.shared_memory_per_program
    assert gemm.shared_memory_bytes({**config, "SPLIT_K": 2}) == (3 * 384 * 64) * 2 + 128 * 256 * 4
    a, w, c = (torch.empty(*s, device="meta", dtype=torch.bfloat16) for s in ((512, 256), (512, 256), (512, 512)))
    plain, _ = gemm.gemm_calls(a, w.T, c, config, hopper)
    backward, _ = gemm.gemm_calls(a, w.T, c, config, hopper, epilogue=gemm.Epilogue(activation="silu", act_grad=c))
    assert (plain[0].kwargs["num_stages"], backward[0].kwargs["num_stages"]) == (3, 2)
    # an accumulating product loads the old output the same way (3 stages asked 278 600 bytes on an H100)
    accumulate, _ = gemm.gemm_calls(a, w.T, c, config, hopper, epilogue=gemm.Epilogue(accumulate=True))
    assert accumulate[0].kwargs["num_stages"] == 2
    pointers, _ = gemm.gemm_calls(a, w.T, c, {**config, "TMA": 0}, hopper, epilogue=gemm.Epilogue(act_grad=c))
    assert pointers[0].kwargs["num_stages"] == 3


@pytest.mark.parametrize("order", ["w13", "w1 < w3", "w3 < w1"])
def test_swiglu_pair_tile(order, dtype, device, gen, profile):
    """:func:`swiglu_pair.swiglu_pair_calls`: the pair of weight tiles as one descriptor's two planes, one
    product per K step; the output and both pre-activations poisoned first, ragged in M, N and K."""
    hopper = dataclasses.replace(profile, arch="sm_90", cores=3 if device == "cpu" else profile.cores)
    m, n, k = 37, 24, 56
    a = randn(m, k, dtype=dtype, device=device, generator=gen)
    buf = randn(2 * n + 8, k, dtype=dtype, device=device, generator=gen, scale=1 / math.sqrt(k))
    pairs = {"w13": (buf[:n], buf[n:2 * n]), "w1 < w3": (buf[:n], buf[n + 8:]), "w3 < w1": (buf[n + 8:], buf[:n])}
    w1, w3 = pairs[order]
    rstd = randn(m, device=device, generator=gen).abs() + 0.5
    out, gate, up = (poison(torch.empty(m, n, dtype=dtype, device=device)) for _ in range(3))
    assert swiglu_pair.takes_swiglu_pair(hopper, a, w1, w3, out, gate, up)
    weights = dict(w13=buf[:2 * n]) if order == "w13" else dict(w1=w1, w3=w3)
    calls, scratch = swiglu_pair.swiglu_pair_calls(a, weights.get("w1"), weights.get("w3"), rstd, out, SMALL, hopper,
                                                   w13=weights.get("w13"), gate=gate, up=up)
    assert [c.kernel.__name__ for c in calls] == ["swiglu_pair_tma_kernel"] and scratch == ()
    run(calls)
    ref_gate, ref_up = rows_scaled(a, w1.T, rstd), rows_scaled(a, w3.T, rstd)
    assert_close(gate, ref_gate, dtype, reduce_dim=k)
    assert_close(up, ref_up, dtype, reduce_dim=k)
    assert_close(out, F.silu(ref_gate) * ref_up, dtype, reduce_dim=k)


@pytest.mark.parametrize("order", ["w13", "w3 < w1"])
@pytest.mark.parametrize("cores, split", [(5, 2), (11, 5)])
def test_swiglu_pair_tile_split_last_wave(order, cores, split, dtype, device, gen, profile):
    """The pair kernel's last, partial wave split over K (:func:`swiglu_pair.pair_tail`): 3 x 4 tiles on 5
    cores leave 2 for a third wave, split 2 ways (5 // 2); on 11 cores 1, split 5 ways (11 ways
    would make slices shorter than MIN_TAIL_STEPS). The counters zeroed as ffn's row kernel does,
    by a launch before. K of 21 steps, ragged: the slices uneven, the last short; the output and
    pre-activations poisoned first."""
    hopper = dataclasses.replace(profile, arch="sm_90", cores=cores)
    m, n, k = 37, 56, 16 * 20 + 8
    config = {**SMALL, "GROUP_M": 1}
    assert swiglu_pair.pair_tail(m, n, k, config, hopper) == split
    assert swiglu_pair.pair_tail(m, n, k, {**config, "TAIL": 0}, hopper) == 1
    a = randn(m, k, dtype=dtype, device=device, generator=gen)
    buf = randn(2 * n + 8, k, dtype=dtype, device=device, generator=gen, scale=1 / math.sqrt(k))
    w1, w3 = (buf[:n], buf[n:2 * n]) if order == "w13" else (buf[n + 8:], buf[:n])
    weights = dict(w13=buf[:2 * n]) if order == "w13" else dict(w1=w1, w3=w3)
    rstd = randn(m, device=device, generator=gen).abs() + 0.5
    out, gate, up = (poison(torch.empty(m, n, dtype=dtype, device=device)) for _ in range(3))
    assert swiglu_pair.takes_swiglu_pair(hopper, a, w1, w3, out, gate, up)
    calls, (part, count) = swiglu_pair.swiglu_pair_calls(a, weights.get("w1"), weights.get("w3"), rstd, out, config,
                                                         hopper, w13=weights.get("w13"), gate=gate, up=up)
    (call,) = calls
    assert call.kwargs["TAIL"] and call.grid == (cores,) and call.args[17] == split
    assert count.numel() == 12 % cores and part.numel() == count.numel() * split * 16 * 32
    count.fill_(0)
    poison(part)
    run(calls)
    ref_gate, ref_up = rows_scaled(a, w1.T, rstd), rows_scaled(a, w3.T, rstd)
    assert_close(gate, ref_gate, dtype, reduce_dim=k)
    assert_close(up, ref_up, dtype, reduce_dim=k)
    assert_close(out, F.silu(ref_gate) * ref_up, dtype, reduce_dim=k)
    assert count.tolist() == [split] * count.numel()  # every slice arrived once


def test_swiglu_pair_tile_only_where_the_copy_engine_can_go(profile, device):
    hopper = dataclasses.replace(profile, arch="sm_90", cores=4)
    a, w = torch.empty(32, 64, device=device), torch.empty(48, 64, device=device)
    out = torch.empty(32, 48, device=device)
    assert swiglu_pair.takes_swiglu_pair(hopper, a, w, w.clone(), out)
    assert not swiglu_pair.takes_swiglu_pair(dataclasses.replace(hopper, arch="sm_80"), a, w, w, out)
    assert not swiglu_pair.takes_swiglu_pair(hopper, a.T.contiguous().T, w, w, out)  # a column-major
    assert not swiglu_pair.takes_swiglu_pair(hopper, a, w.T.contiguous().T, w.T.contiguous().T, out)  # weights N-major
    other = torch.empty(48, 72, device=device)[:, :64]
    assert not swiglu_pair.takes_swiglu_pair(hopper, a, w, other, out)  # strides differ
    assert not swiglu_pair.takes_swiglu_pair(hopper, a, w, w, out, gate=out.T.contiguous().T, up=out)  # gate's strides
