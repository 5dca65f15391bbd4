"""fp8_gemm against the float64 product of its dequantised operands: every granularity on every
launch path of the GEMM block, odd shapes (M, N, K no multiples of 128), non-contiguous ``a``,
scales in either layout, each output dtype; every bad input named; the heuristic, the
torch._scaled_mm candidate's declines, and the sm_80 limit ``dlcore ops`` shows.

On a CPU the kernels run in the interpreter (its fp8 ``tl.dot`` is exact; bfloat16 only reaches
the store's cast, which it gets right); the descriptor kernel under a profile claiming sm_90."""

from __future__ import annotations

import argparse
import dataclasses
import math
import re

import pytest
import torch
from conftest import ON_GPU
from dlblas_kernels import fp8_gemm, vendor
from dlblas_kernels.blocks import fp8_scales, gemm
from dlblas_kernels.kernels import fp8_gemm as F
from dlblas_kernels.kernels.quantize_fp8 import quantize_fp8_reference

import dlcore
from dlcore.cli.inventory import run_ops
from dlcore.declarations.signature import make_signature
from dlcore.errors import InvalidInputError
from dlcore.runtime.profile import device_profile
from dlcore.testing import assert_close, poison, tolerance

# Interpreter-sized tiles; the descriptor kernel's persistent programs walk several tiles each.
SMALL = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, GROUP_M=2, num_warps=4, num_stages=2)
QUANT = {"block": ("block", "block_128x128"), "row": ("row", "row"), "tensor": ("tensor", "tensor")}
M, N, K = 37, 152, 272  # 152 bf16 / fp32 columns: 16-byte rows for the copy engine; K: 3 K blocks, the last of 16


def operands(gen, granularity, m=M, n=N, k=K, device="cpu"):
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / math.sqrt(k)
    a, a_scale = quantize_fp8_reference(x, QUANT[granularity][0])
    b, b_scale = quantize_fp8_reference(w, QUANT[granularity][1])
    return tuple(t.to(device) for t in (a, b, a_scale, b_scale))


def padded_rows(a):
    """``a`` as a view of a wider buffer: its rows 32 bytes further apart than K."""
    wide = torch.zeros(a.shape[0], a.shape[1] + 32, dtype=a.dtype, device=a.device)
    wide[:, :a.shape[1]] = a
    return wide[:, :a.shape[1]]


def reference(a, b, a_scale, b_scale):
    return F.fp8_gemm_reference(a, b, a_scale, b_scale, torch.float64)


def assert_product(out, expected, k):
    """``out`` against the float64 product within its dtype's tolerance; on a GPU within bfloat16's
    for any output dtype: Hopper's wgmma sums fp8 products with about 14 significant bits (what
    cuBLAS calls fast accumulation)."""
    if not ON_GPU:
        assert_close(out, expected, out.dtype, reduce_dim=k)
        return
    assert not torch.isnan(out).any(), "output holds NaN: an element was never written"
    atol, rtol = tolerance(torch.bfloat16, k)
    torch.testing.assert_close(out.double().cpu(), expected.double().cpu(), atol=atol, rtol=rtol)


@pytest.fixture(params=["pointers", "descriptors", "split-k pointers", "split-k descriptors",
                        "warp-specialised descriptors"])
def path(request, profile, device):
    descriptors = request.param.endswith("descriptors")
    if descriptors:
        profile = dataclasses.replace(profile, arch="sm_90", cores=3 if device == "cpu" else profile.cores)
    extra = {"TMA": int(descriptors), "SPLIT_K": 2 if request.param.startswith("split-k") else 1}
    if request.param.startswith("warp-specialised"):
        extra["WARP_SPECIALIZE"] = 1
    return profile, extra, "gemm_tma_kernel" if descriptors else "gemm_kernel"


def run_plan(args, config, profile):
    plan = F.plan(args, config, profile)
    poison(plan.result)
    return plan, plan.run()


@pytest.mark.parametrize("granularity", ["block", "row", "tensor"])
def test_granularity_on_every_path(granularity, path, device, gen):
    profile, extra, kernel = path
    a, b, a_scale, b_scale = operands(gen, granularity, device=device)
    plan, out = run_plan((a, b, a_scale, b_scale, torch.float32), {**SMALL, **extra}, profile)
    assert plan.calls[0].kernel.__name__ == kernel
    assert plan.calls[0].kwargs["BLOCK_SCALED"] == (granularity == "block")
    if kernel == "gemm_tma_kernel":  # never warp-specialised, even when the config asks (gemm.loop_flags)
        flags = plan.calls[0].kwargs
        assert (flags["WARP_SPECIALIZE"], flags["FLATTEN"]) == (False, True)
    assert_product(out, reference(a, b, a_scale, b_scale), K)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("granularity", ["block", "tensor"])
def test_output_dtypes(out_dtype, granularity, device, gen):
    """Through the public function (the heuristic config for the device)."""
    args = operands(gen, granularity, device=device)
    out = fp8_gemm(*args, out_dtype=out_dtype)
    assert out.dtype == out_dtype and out.shape == (M, N)
    assert_product(out, reference(*args), K)


@pytest.mark.parametrize("layout", ["padded rows", "transposed"])
def test_non_contiguous_a_and_m_major_scales(layout, profile, device, gen):
    """``a`` in a wider buffer, or stored M-major (the descriptor kernel takes fp8 only K-major: the
    pointer kernel runs it); ``a_scale`` M-major, as quantize_fp8 lays it out."""
    a, b, a_scale, b_scale = operands(gen, "block", device=device)
    if layout == "padded rows":
        a = padded_rows(a)
    else:
        a = a.T.contiguous().T
    a_scale = a_scale.T.contiguous().T
    hopper = dataclasses.replace(profile, arch="sm_90", cores=3 if device == "cpu" else profile.cores)
    plan, out = run_plan((a, b, a_scale, b_scale, torch.float32), SMALL, hopper)
    assert plan.calls[0].kernel.__name__ == ("gemm_tma_kernel" if layout == "padded rows" else "gemm_kernel")
    assert_product(out, reference(a, b, a_scale, b_scale), K)


def test_get_op_and_ragged_shapes(device, gen):
    """Through ``get_op``; N = 1 and a K of one block (per-row and block then mean the same), and a
    tile wider than N."""
    for m, n, k in ((5, 1, 16), (3, 130, 48)):
        args = operands(gen, "block", m=m, n=n, k=k, device=device)
        out = dlcore.get_op("fp8_gemm", (*args, torch.float32))(*args, torch.float32)
        assert_product(out, reference(*args), k)


def test_empty(device):
    a = torch.empty(0, 32, dtype=F.FP8, device=device)
    b = torch.empty(4, 32, dtype=F.FP8, device=device)
    out = fp8_gemm(a, b, torch.ones((), device=device), torch.ones((), device=device))
    assert out.shape == (0, 4) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("tma", [0, 1])
def test_block_scales_in_tiles_of_two_column_blocks(tma, profile, device, gen):
    """Under block scales a tile of 256 columns spans two column blocks: both b-scales applied,
    the second masked off in a last tile of 128 columns or fewer (N 300: 256 + 44)."""
    if tma:
        profile = dataclasses.replace(profile, arch="sm_90", cores=3 if device == "cpu" else profile.cores)
    args = operands(gen, "block", n=300, device=device)
    plan, out = run_plan((*args, torch.float32), {**SMALL, "BLOCK_N": 256, "TMA": tma}, profile)
    assert plan.calls[0].kwargs["BLOCK_N"] == 256
    assert_product(out, reference(*args), K)


GLUON_TILE = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, TMA=1, SPLIT_K=1, OCCUPANCY=1, GLUON=1)


@pytest.mark.parametrize("m, n, k, unroll, layout", [
    (M, N, K, 4, "contiguous"),  # 3 K blocks: the tail alone; N 152: one full tile and a partial one
    (300, 256, 7 * 128, 4, "padded rows"),  # one unrolled step and 3 tail blocks; a's rows 32 bytes apart
    (129, 384, 6 * 128 + 16, 2, "contiguous"),  # 3 steps of 2 and a partial last block
])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_gluon_block_scaled(m, n, k, unroll, layout, out_dtype, profile, device, gen):
    """GLUON 1 under block scales: on a GPU of sm_90 the Gluon kernel (one product in flight while the
    last is scaled) against the float64 product, output poisoned; in the interpreter, which has no
    Gluon, the plan runs the GEMM block's descriptor kernel with the same tiles."""
    a, b, a_scale, b_scale = operands(gen, "block", m=m, n=n, k=k, device=device)
    if layout == "padded rows":
        a = padded_rows(a)
    hopper = dataclasses.replace(profile, arch="sm_90", cores=3 if device == "cpu" else profile.cores)
    config = {**GLUON_TILE, "num_stages": 3, "UNROLL": unroll}
    plan, out = run_plan((a, b, a_scale, b_scale, out_dtype), config, hopper)
    gluon = ON_GPU and profile.arch == "sm_90"
    assert plan.calls[0].kernel.__name__ == ("block_scaled_wgmma_kernel" if gluon else "gemm_tma_kernel")
    if gluon:
        assert plan.calls[0].kwargs["UNROLL"] == unroll and plan.calls[0].grid[0] <= profile.cores
    assert_product(out, reference(a, b, a_scale, b_scale), k)


def test_gluon_only_in_hopper_spaces_and_its_tile(profile):
    """GLUON is a choice of sm_90's space alone, and only with the Gluon kernel's tile, warps and stages."""
    hopper = dataclasses.replace(profile, arch="sm_90", cores=132, shared_memory_per_program=227 * 1024,
                                 registers_per_core=65536)
    config = {**GLUON_TILE, "num_stages": 4, "WARP_SPECIALIZE": 0}
    assert F.space(hopper).is_valid(config) is None
    for bad in ({"BLOCK_N": 256, "num_stages": 3}, {"BLOCK_M": 64}, {"num_warps": 4}, {"SPLIT_K": 2}, {"TMA": 0},
                {"num_stages": 6}, {"OCCUPANCY": 2}):
        assert "GLUON" in F.space(hopper).is_valid({**config, **bad})
    assert any(c["GLUON"] for c in F.space(hopper).configs())
    ampere = dataclasses.replace(hopper, arch="sm_80")
    assert F.space(ampere).is_valid(config) is not None
    assert not any(c["GLUON"] for c in F.space(ampere).configs())


def test_block_scales_refuse_tiles_across_blocks(profile, gen):
    """The GEMM block refuses K steps or tiles that straddle scale blocks, and epilogue scales
    beside block scales."""
    a, b, a_scale, b_scale = operands(gen, "block")
    c = torch.empty(M, N)
    scales = gemm.BlockScales(a_scale, b_scale)
    for bad in ({"BLOCK_K": 96}, {"BLOCK_N": 192}):
        with pytest.raises(ValueError, match="BLOCK_K dividing 128 .* BLOCK_N dividing it or of 256"):
            gemm.gemm_calls(a, b.T, c, {**SMALL, **bad}, profile, block_scales=scales)
    with pytest.raises(ValueError, match="replace the epilogue"):
        gemm.gemm_calls(a, b.T, c, SMALL, profile, block_scales=scales, epilogue=gemm.Epilogue(row_scale=a_scale[:, 0]))


def _bad(gen):
    a, b, a_scale, b_scale = operands(gen, "block", m=8, n=40, k=256)
    row = operands(gen, "row", m=8, n=40, k=256)
    yield "a", (a.to(torch.float8_e5m2), b.to(torch.float8_e5m2), a_scale, b_scale), "float8_e5m2"
    yield "b", (a, b.to(torch.float8_e5m2), a_scale, b_scale), "float8_e5m2"
    yield "a", (a[:, :200], b[:, :200], a_scale, b_scale), "multiple of 16"
    yield "b", (a, b[:, :128], a_scale, b_scale), "shape"
    yield "a_scale", (a, b, torch.ones(8, 3), b_scale), re.escape("a_scale and b_scale of shapes (8, 2) and (1, 2)")
    yield "b_scale", (a, b, a_scale, b_scale[:, :1]), re.escape("(1, 2)")
    yield "b_scale", (a, b, row[2], torch.ones(())), "per row"
    yield "a_scale", (a, b, a_scale.half(), b_scale), "float16"
    yield "a", (a[None], b, a_scale, b_scale), "dimensions"


def test_bad_inputs_are_named(gen):
    for arg, args, text in _bad(gen):
        with pytest.raises(InvalidInputError, match=text) as found:
            fp8_gemm(*args)
        assert found.value.arg == arg, (arg, found.value)
    a, b, a_scale, b_scale = operands(gen, "tensor", m=8, n=40, k=64)
    with pytest.raises(InvalidInputError) as found:
        fp8_gemm(a, b, a_scale, b_scale, out_dtype=torch.float64)
    assert found.value.arg == "out_dtype"


def test_heuristic(profile):
    hopper = dataclasses.replace(profile, arch="sm_90", cores=132)
    tile = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "TMA")

    def chosen(m, n, k, granularity, where=hopper):
        return tuple(F.heuristic(m, n, k, granularity, where)[key] for key in tile)

    assert chosen(4096, 7168, 16384, F.Granularity.BLOCK) == (128, 128, 128, 1, 1)
    assert chosen(4096, 7168, 16384, F.Granularity.TENSOR) == (128, 256, 128, 1, 1)
    assert chosen(4096, 2112, 7168, F.Granularity.ROW) == (128, 128, 128, 1, 1)
    assert chosen(128, 2112, 7168, F.Granularity.BLOCK) == (64, 128, 128, 2, 1)
    assert chosen(128, 7168, 16384, F.Granularity.BLOCK) == (64, 128, 128, 1, 1)
    assert chosen(4096, 7168, 16384, F.Granularity.BLOCK, dataclasses.replace(hopper, arch="sm_80"))[-1] == 0
    shared = hopper.shared_memory_per_program or 232448
    for m in (128, 4096):
        for granularity in F.Granularity:
            assert F.space(hopper).is_valid(F.heuristic(m, 7168, 7168, granularity, hopper)) is None
            assert gemm.shared_memory_bytes(F.heuristic(m, 7168, 7168, granularity, hopper), 1, out_element_size=2
                                            ) <= shared


def test_space_never_warp_specialises(profile):
    """No config of the space warp-specialises, on sm_90 or elsewhere: Triton 3.6's specialised
    fp8 loop gives wrong products on the H200 (fp8_gemm.space), and a config that asks for it
    says why it is not valid."""
    for arch in ("sm_90", "sm_80"):
        space = F.space(dataclasses.replace(profile, arch=arch, cores=132))
        configs = list(space.configs())
        assert configs and not any(c["WARP_SPECIALIZE"] for c in configs)
        assert "WARP_SPECIALIZE" in space.is_valid(dict(configs[0], WARP_SPECIALIZE=1))


def test_occupancy_two_only_where_two_programs_fit(profile, gen):
    """OCCUPANCY 2 is in the space only where two programs' shared memory and registers fit one
    sm_90 multiprocessor, and it doubles the persistent grid (not past the tiles)."""
    hopper = dataclasses.replace(profile, arch="sm_90", cores=132, shared_memory_per_program=227 * 1024,
                                 registers_per_core=65536)
    space = F.space(hopper)
    base = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "SPLIT_K": 1,
            "TMA": 1, "WARP_SPECIALIZE": 0, "OCCUPANCY": 2, "GLUON": 0}
    assert space.is_valid(base) is None
    assert space.is_valid({**base, "num_stages": 4}) is None  # 2 x (112 + 1) KiB of 228
    assert "OCCUPANCY" in space.is_valid({**base, "num_stages": 5})  # 2 x 136 KiB of shared memory
    assert "OCCUPANCY" in space.is_valid({**base, "BLOCK_M": 128, "num_warps": 8})  # 2 x 256 threads x 176 registers
    assert "OCCUPANCY" in space.is_valid({**base, "TMA": 0})
    assert any(c["OCCUPANCY"] == 2 for c in space.configs())
    for m, programs in ((4096, 2 * 132), (128, 2 * 8)):
        a, b, sa, sb = operands(gen, "block", m=m, n=1024, k=256)
        grid = F.plan((a, b, sa, sb, torch.bfloat16), base, hopper).calls[0].grid
        assert grid == (programs,)


def test_scaled_mm_candidate_declines(profile, gen, monkeypatch):
    hopper = dataclasses.replace(profile, backend="cuda", vendor="nvidia", arch="sm_90", cores=132)
    ampere = dataclasses.replace(hopper, arch="sm_80")
    blackwell = dataclasses.replace(hopper, arch="sm_100")

    def declines(granularity, out_dtype=torch.bfloat16, where=hopper, m=8, n=48, k=256):
        args = (*operands(gen, granularity, m=m, n=n, k=k), out_dtype)
        sig = dataclasses.replace(make_signature(F.OP, args, torch.device("cpu")), device_type="cuda")
        return vendor.FP8_GEMM.supports(sig, where)

    assert declines("tensor") is None and declines("tensor", torch.float32) is None and declines("row") is None
    monkeypatch.setattr(vendor, "_cuda_version", lambda: (12, 8))
    assert "from CUDA 12.9" in declines("block")
    monkeypatch.setattr(vendor, "_cuda_version", lambda: (13, 0))
    assert declines("block", k=512) is None and declines("block", k=2048) is None
    assert "multiple of 4" in declines("block", k=896)
    assert "bfloat16" in declines("block", torch.float32, k=512)
    assert "sm_90 only" in declines("block", where=blackwell, k=512)
    assert "bfloat16" in declines("row", torch.float16)
    assert "sm_89" in declines("tensor", where=ampere)
    assert "multiples of 16" in declines("tensor", n=40)


def test_blockwise_scales_keep_values_and_take_cublas_layouts(gen):
    """cuBLASLt's block-scale layouts: a_scale M-major, b.T's scales K-major; values unchanged,
    quantize_fp8's M-major a_scale and a row-major b_scale not copied."""
    for m, kb, nb in ((36, 4, 2), (64, 56, 17), (8, 12, 1)):
        m_major = torch.rand(kb, m, generator=gen).T
        b_scale = torch.rand(nb, kb, generator=gen)
        for a_scale in (m_major, m_major.contiguous()):
            sa, sb = vendor.blockwise_scales(a_scale, b_scale)
            assert torch.equal(sa, a_scale) and torch.equal(sb, b_scale.T)
            assert sa.stride() == (1, m) and sb.stride() == (1, kb)
        assert sa.data_ptr() != m_major.data_ptr()
        kept_a, kept_b = vendor.blockwise_scales(m_major, b_scale)
        assert kept_a.data_ptr() == m_major.data_ptr() and kept_b.data_ptr() == b_scale.data_ptr()


def test_blockwise_rows_padded_to_four(gen, monkeypatch):
    """Rows of a not a multiple of 4: a padded with zero rows and a_scale with ones, the scales
    handed over M-major, the product cut back to M rows."""
    a, b, a_scale, b_scale = operands(gen, "block", m=37, n=256, k=512)
    seen = {}

    def scaled_mm(x, y, scale_a, scale_b, out_dtype):
        seen.update(x=x, scale_a=scale_a, scale_b=scale_b)
        return torch.zeros(x.shape[0], y.shape[1], dtype=out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    assert vendor.fp8_gemm(a, b, a_scale, b_scale).shape == (37, 256)
    x, scale_a = seen["x"], seen["scale_a"]
    assert x.shape == (40, 512) and torch.equal(x[:37].view(torch.uint8), a.view(torch.uint8))
    assert not x[37:].view(torch.uint8).any()
    assert scale_a.stride() == (1, 40) and torch.equal(scale_a[:37], a_scale) and (scale_a[37:] == 1).all()
    assert torch.equal(seen["scale_b"], b_scale.T)


@pytest.mark.parametrize("m", [1, 37, 300])
@pytest.mark.parametrize("granularity", ["block", "row", "tensor"])
def test_signature_granularity_is_the_tensors(granularity, m, gen):
    """The signature's rule (rows bucketed) names what the tensors' rule names, and None for
    scales of neither shape."""
    a, b, a_scale, b_scale = operands(gen, granularity, m=m)
    sig = make_signature(F.OP, (a, b, a_scale, b_scale, torch.bfloat16), torch.device("cpu"))
    found = fp8_scales.signature_granularity(sig)
    assert found is fp8_scales.granularity(a_scale, b_scale, m, N, K) is fp8_scales.Granularity(granularity)
    wrong = torch.ones(*b_scale.shape[:-1], b_scale.shape[-1] + 1) if b_scale.dim() else torch.ones(2)
    sig = make_signature(F.OP, (a, b, a_scale, wrong, torch.bfloat16), torch.device("cpu"))
    assert fp8_scales.signature_granularity(sig) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch._scaled_mm needs a GPU from sm_89")
@pytest.mark.parametrize("granularity,m,n,k", [("row", 64, 256, 512), ("tensor", 64, 256, 512),
                                                ("block", 64, 256, 512), ("block", 37, 272, 1536),
                                                ("block", 300, 2112, 2048), ("block", 300, 2112, 896)])
def test_scaled_mm_candidate(granularity, m, n, k, gen):
    args = operands(gen, granularity, m=m, n=n, k=k, device="cuda")
    profile = device_profile(torch.device("cuda"))
    sig = make_signature(F.OP, (*args, torch.bfloat16), torch.device("cuda"))
    reason = vendor.FP8_GEMM.supports(sig, profile)
    if reason is not None:
        pytest.skip(reason)
    out = vendor.fp8_gemm(*args)
    assert_close(out, reference(*args).to(torch.bfloat16), torch.bfloat16, reduce_dim=k)


def test_dequantise_baseline(gen):
    args = operands(gen, "block", m=9, n=130, k=160)
    assert_close(F.dequant_gemm(*args), reference(*args), torch.bfloat16, reduce_dim=160)


def test_bf16_and_per_tensor_cublas_baselines(gen):
    """The bench's ``bf16`` and ``scaled_mm_tensor`` columns: each prepared once (dequantised to
    bfloat16; quantised again per tensor), then the product of what was prepared."""
    args = (*operands(gen, "block", m=9, n=130, k=160), torch.bfloat16)
    bf16 = F.bf16_inputs(args)
    assert bf16[0].dtype == bf16[1].dtype == torch.bfloat16
    assert_close(F.bf16_gemm(*bf16), reference(*args[:4]), torch.bfloat16, reduce_dim=160)
    tensor = F.per_tensor_inputs(args)
    assert tensor[0].dtype == F.FP8 and tensor[2].dim() == tensor[3].dim() == 0
    assert_close(F.scaled_mm_tensor(*tensor), reference(*tensor[:4]), torch.bfloat16, reduce_dim=160)
    assert set(F.OP.baselines) == {"dequant", "bf16", "scaled_mm_tensor"}


def test_dlcore_ops_says_sm80_cannot_run_it(capsys):
    impl = F.KERNEL.implementation
    assert impl.limit("cuda", "gemm_tma_kernel", "80") is not None
    assert impl.limit("cuda", "gemm_tma_kernel", "90") is None
    for op in (None, "fp8_gemm"):
        run_ops(argparse.Namespace(op=op))
        assert "fp8_gemm.triton: cuda:80: gemm_kernel, gemm_tma_kernel stop before ttir" in capsys.readouterr().out
