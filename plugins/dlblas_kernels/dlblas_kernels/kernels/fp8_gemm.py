"""fp8_gemm: ``(a * a_scale) @ (b * b_scale).T`` for float8_e4m3fn ``a [M, K]`` and ``b [N, K]``.

``b`` is in nn.Linear layout (``[N, K]``, K-major: the only way round Hopper's ``wgmma`` takes fp8
``B``); ``a`` takes any strides. The product is accumulated in float32 and returned ``[M, N]`` in
``out_dtype`` (bfloat16, float16 or float32). The scales are float32, and their shapes choose the
granularity (:class:`Granularity`):

- **block** (DeepSeek-V3): ``a_scale [M, ceil(K/128)]``, one per 1x128 of a row of ``a``, and
  ``b_scale [ceil(N/128), ceil(K/128)]``, one per 128x128 block of ``b``; any strides (an
  M-major ``a_scale``, as :func:`~dlblas_kernels.kernels.quantize_fp8.quantize_fp8` gives, is read
  in coalesced rows);
- **row**: ``a_scale [M, 1]`` and ``b_scale [N, 1]`` (per token, per output channel);
- **tensor**: 0-dim ``a_scale`` and ``b_scale``.

M, N and K need not be multiples of 128 (the tail blocks are partial); K must be a multiple of 16
(the copy engine's 16-byte rows, and ``torch._scaled_mm``'s rule).

The GEMM is :mod:`dlblas_kernels.blocks.gemm`'s, the same tile loops as ``matmul``: per-row and per-tensor
scales are its epilogue's row and column scales (a 0-dim scale read with stride 0); block scales
scale each K step's product inside the loop (``BLOCK_SCALED``), so ``BLOCK_K`` must divide 128
there and ``BLOCK_N`` divide 128 or be 256 (one or two b-scales per tile and K step: scalar loads,
not a vector of per-column ones; a wider config runs as 256). fp8 ``tl.dot`` needs
sm_89 or later: on sm_80 the kernels do not compile (``dlcore ops`` says so). On sm_90 a config's
``GLUON`` runs block scales through :mod:`dlblas_kernels.blocks.fp8_wgmma` instead, a Gluon kernel
that scales one product while the next runs (the GEMM block's loop waits for each); the heuristic
takes it above 128 rows.

Precision: on Hopper, ``wgmma`` sums fp8 products inside the tensor cores with about 14
significant bits before they reach the float32 accumulator (cuBLAS's "fast accumulation"; the
reason DeepSeek-V3 promotes every 128 of K): outputs agree with the float64 product to about
bfloat16's tolerance whatever ``out_dtype``. Tiles of fewer than 64 rows run ``mma`` and the
interpreter ``tl.dot`` exactly in float32.

Baselines: ``dequant``, what a user without an fp8 kernel runs (both operands dequantised to
bfloat16, then a bfloat16 GEMM); ``bf16``, that GEMM alone (the operands dequantised beforehand);
``scaled_mm_tensor``, cuBLAS fp8 on the operands quantised again per tensor beforehand. The vendor
candidate is ``torch._scaled_mm`` (:mod:`dlblas_kernels.vendor`: per-tensor, per-row, and block
scales where cuBLASLt takes them).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dlblas_kernels.blocks import gemm
from dlblas_kernels.blocks.fp8_scales import BLOCK as BLOCK
from dlblas_kernels.blocks.fp8_scales import Granularity as Granularity
from dlblas_kernels.blocks.fp8_scales import granularity as granularity
from dlblas_kernels.blocks.fp8_scales import signature_granularity as signature_granularity
from dlblas_kernels.kernels.quantize_fp8 import quantize_fp8_reference
from dlcore.api import (
    Choice,
    Config,
    Constraint,
    DeviceProfile,
    InvalidInputError,
    LaunchPlan,
    LoweringLimit,
    Op,
    PowerOfTwo,
    ScalarArg,
    SearchSpace,
    Signature,
    TensorArg,
    cdiv,
    define_kernel,
    num_stages,
    num_warps,
)

FP8 = torch.float8_e4m3fn
#: block scales with more than 128 rows on sm_90 run the Gluon kernel (:mod:`dlblas_kernels.blocks.fp8_wgmma`)
GLUON_BY_DEFAULT = True
#: the architecture of that kernel's ``wgmma`` (its ``ARCH``, named here so that importing fp8_gemm loads no Gluon)
GLUON_ARCH = "sm_90"
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: K must be a multiple of this (16-byte rows of fp8)
K_MULTIPLE = 16


def expand_scale(scale: torch.Tensor, rows: int, cols: int, block_rows: int, block_cols: int) -> torch.Tensor:
    """``scale`` repeated over the ``block_rows x block_cols`` elements each entry covers, cut to
    ``[rows, cols]`` (a 0-dim scale broadcast)."""
    if scale.dim() == 0:
        return scale.expand(rows, cols)
    return scale.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]


def dequantise(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a * a_scale, b * b_scale)`` in ``dtype``, the scales expanded by their granularity."""
    (m, k), n = a.shape, b.shape[0]
    found = granularity(a_scale, b_scale, m, n, k)
    rows = BLOCK if found is Granularity.BLOCK else 1
    cols = BLOCK if found is Granularity.BLOCK else k
    return ((a.to(dtype) * expand_scale(a_scale.to(dtype), m, k, 1, cols)),
            (b.to(dtype) * expand_scale(b_scale.to(dtype), n, k, rows, cols)))


def fp8_gemm_reference(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                       out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The dequantised product in float64, returned in ``out_dtype``."""
    a64, b64 = dequantise(a, b, a_scale, b_scale, torch.float64)
    return (a64 @ b64.T).to(out_dtype)


def dequant_gemm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                 out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """What a user without an fp8 kernel runs: both operands dequantised to bfloat16 (in float32,
    then rounded), a bfloat16 GEMM, the result in ``out_dtype``."""
    a16, b16 = (t.to(torch.bfloat16) for t in dequantise(a, b, a_scale, b_scale, torch.float32))
    return torch.matmul(a16, b16.T).to(out_dtype)


def bf16_inputs(args: tuple) -> tuple:
    """``args`` with ``a`` and ``b`` dequantised to bfloat16 (what the ``bf16`` baseline multiplies)."""
    a, b, a_scale, b_scale, out_dtype = args
    a16, b16 = (t.to(torch.bfloat16) for t in dequantise(a, b, a_scale, b_scale, torch.float32))
    return a16, b16, a_scale, b_scale, out_dtype


def per_tensor_inputs(args: tuple) -> tuple:
    """``args`` quantised again with one scale per tensor (what the ``scaled_mm_tensor`` baseline takes)."""
    a, b, a_scale, b_scale, out_dtype = args
    a32, b32 = dequantise(a, b, a_scale, b_scale, torch.float32)
    (qa, sa), (qb, sb) = quantize_fp8_reference(a32, "tensor"), quantize_fp8_reference(b32, "tensor")
    return qa, qb, sa, sb, out_dtype


def bf16_gemm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
              out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """bf16 cuBLAS: ``a @ b.T`` on operands already dequantised to bfloat16 (once per shape, untimed:
    :func:`bf16_inputs`), the rate fp8 is measured against."""
    return torch.matmul(a, b.T).to(out_dtype)


def scaled_mm_tensor(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                     out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """cuBLAS fp8 with one scale per tensor (``torch._scaled_mm``) on operands quantised so once per
    shape, untimed (:func:`per_tensor_inputs`): the fp8 rate cuBLAS reaches without block scales."""
    return torch._scaled_mm(a, b.T, scale_a=a_scale, scale_b=b_scale, out_dtype=out_dtype)


bf16_gemm.prepare = bf16_inputs  # type: ignore[attr-defined]
scaled_mm_tensor.prepare = per_tensor_inputs  # type: ignore[attr-defined]


def output(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
           out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(a.shape[0], b.shape[0], dtype=out_dtype, device=a.device)


def plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    a, b, a_scale, b_scale, out_dtype = args
    out = output(*args)
    if out.numel() == 0:
        return LaunchPlan(calls=[], result=out)
    (m, k), n = a.shape, b.shape[0]
    found = granularity(a_scale, b_scale, m, n, k)
    epilogue, block_scales = gemm.Epilogue(), None
    if found is Granularity.BLOCK and config.get("GLUON"):
        from dlblas_kernels.blocks import fp8_wgmma  # Gluon: imported where a config asks for it

        if fp8_wgmma.takes(profile, a, b, out):
            return LaunchPlan(calls=[fp8_wgmma.wgmma_call(a, b, out, a_scale, b_scale, config, profile)], result=out)
    if found is Granularity.BLOCK:
        block_scales = gemm.BlockScales(a_scale, b_scale)
        config = {**config, "BLOCK_N": min(config["BLOCK_N"], 2 * BLOCK), "BLOCK_K": min(config["BLOCK_K"], BLOCK)}
    elif found is Granularity.ROW:
        epilogue = gemm.Epilogue(row_scale=a_scale[:, 0], col_scale=b_scale[:, 0])
    else:
        epilogue = gemm.Epilogue(row_scale=a_scale, col_scale=b_scale)
    calls, scratch = gemm.gemm_calls(a, b.T, out, config, profile, epilogue=epilogue, block_scales=block_scales)
    return LaunchPlan(calls=calls, result=out, scratch=scratch)


def _tile(block_m: int, block_n: int, block_k: int, warps: int, stages: int, **extra: int) -> Config:
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": warps, "num_stages": stages,
            "SPLIT_K": 1, "TMA": 1, "WARP_SPECIALIZE": 0, "OCCUPANCY": 1, "GLUON": 0, **extra}


def heuristic(m: int, n: int, k: int, found: Granularity | None, profile: DeviceProfile | None) -> Config:
    """A config for ``[m, k] @ [n, k].T`` in fp8 with scales of granularity ``found``, from the
    sweep at the DeepSeek-V3 shapes (``python3 .ci/sweep_fp8_gemm.py``, bf16 out; docs/performance.md,
    fp8_gemm).

    - No persistent descriptor kernel (not sm_90, or no core count): the pointer kernel's 64x64
      tiles, K steps of 64 (what the interpreter runs quickly).
    - Up to 128 rows: 64x128 tiles, K steps of 128, 5 stages; under block scales split in two
      along K where the tiles fill under 1.15 waves of the multiprocessors even split and K
      gives each half 8 steps (the column tiles alone leave most multiprocessors idle).
    - Block scales, more rows: 128x128 tiles (BLOCK_N of 128: one b-scale per tile and step), K
      steps of 128, 8 warps, 4 stages (5 stages, 256x128 and 64-row tiles are slower); on sm_90 through
      the Gluon kernel (``GLUON``, :data:`GLUON_BY_DEFAULT`): 1.08x to 1.25x the Triton loop at
      DeepSeek-V3's shapes on the H100 (``python3 .ci/probe_fp8_wgmma.py``).
    - Per-row and per-tensor scales, more rows: 128x256x128 tiles, 8 warps, 3 stages; 128x128
      where N is no multiple of 256 (less of the last column tile wasted).
    """
    if profile is None or profile.arch not in gemm.TMA_ARCHS or profile.cores <= 0:
        return _tile(64, 64, 64, 4, 3, TMA=0)
    if m <= 128:
        tiles = cdiv(m, 64) * cdiv(n, 128)
        if found is Granularity.BLOCK and 2 * tiles <= 1.15 * profile.cores and k >= 2 * 8 * 128:
            return _tile(64, 128, 128, 4, 4, SPLIT_K=2)
        return _tile(64, 128, 128, 4, 5)
    if found is Granularity.BLOCK:
        return _tile(128, 128, 128, 8, 4, GLUON=int(GLUON_BY_DEFAULT and profile.arch == GLUON_ARCH))
    if n % 256:
        return _tile(128, 128, 128, 8, 4)
    return _tile(128, 256, 128, 8, 3)


def default_config(sig: Signature, profile: DeviceProfile) -> Config:
    rows = sig.tensor("a").shape[0]  # rounded up to a power of two
    n, k = sig.tensor("b").shape
    return heuristic(rows, n, k, signature_granularity(sig), profile)


def _shared_memory_bytes(c: Config) -> int:
    return gemm.shared_memory_bytes(c, 1, out_element_size=2)


def space(profile: DeviceProfile) -> SearchSpace:
    """The tiles, warps and pipelining depth of the fp8 GEMM (1-byte operands, a 16-bit output tile
    staged), descriptor or pointer kernel, split-K; K steps of 32 to 128 (under block scales one
    step lies in one scale block), the pipelined tiles within the profile's shared memory.

    Never warp-specialised (``WARP_SPECIALIZE`` 0 only; the GEMM block runs a config that asks for
    it unspecialised, :func:`dlblas_kernels.blocks.gemm.loop_flags`): on sm_90 with Triton 3.6.0 the
    specialised descriptor loop over fp8 operands gives wrong products at the DeepSeek-V3 shapes of
    ``.ci/sweep_fp8_gemm.py`` (block, row and tensor scales alike; docs/performance.md, Other
    measurements), where the same loop over bf16 operands is right. It compiles, so only a GPU run
    shows it. ``OCCUPANCY`` 2 keeps two persistent programs on each multiprocessor where both fit
    (:func:`~dlblas_kernels.blocks.gemm.occupancy_constraints`): one program's wgmma runs while the
    other scales its last product, the overlap warp specialisation would give. ``GLUON`` 1 (sm_90 only)
    runs block scales through :mod:`dlblas_kernels.blocks.fp8_wgmma`, which keeps one product in
    flight while it scales the last; other scales ignore it."""
    shared = profile.shared_memory_per_program
    fits = [Constraint(
        f"the pipelined fp8 a and b tiles and the staged 16-bit output tile fit in {shared} bytes of shared memory",
        lambda c: _shared_memory_bytes(c) <= shared,
    )] if shared else []
    return SearchSpace(
        [
            PowerOfTwo("BLOCK_M", 16, 256),
            PowerOfTwo("BLOCK_N", 32, 256),
            PowerOfTwo("BLOCK_K", 32, 128),
            num_warps(4, 8),
            num_stages(3, 4, 5, 6),
            Choice("SPLIT_K", (1, 2, 4)),
            Choice("TMA", (0, 1)),
            Choice("WARP_SPECIALIZE", (0,)),
            Choice("OCCUPANCY", (1, 2)),
            Choice("GLUON", (0, 1) if profile.arch == GLUON_ARCH else (0,)),
        ],
        [
            *fits,
            Constraint("GLUON (the Gluon kernel under block scales) runs 128 x 128 x 128 tiles, 8 warps, one "
                       "persistent program a multiprocessor, its copies in 3 to 5 stages",
                       lambda c: not c.get("GLUON") or (
                           (c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["num_warps"]) == (128, 128, 128, 8)
                           and (c["TMA"], c["SPLIT_K"], c["OCCUPANCY"]) == (1, 1, 1) and 3 <= c["num_stages"] <= 5)),
            *gemm.accumulator_constraints(),
            *gemm.kernel_constraints(),
            # block scales hold each step's product beside the accumulator: two tiles a thread
            *gemm.occupancy_constraints(profile, _shared_memory_bytes, accumulators=2),
        ],
    )


def _expected_scales(m: int, n: int, k: int) -> str:
    kb, nb = cdiv(k, BLOCK), cdiv(n, BLOCK)
    return (f"a_scale and b_scale of shapes ({m}, {kb}) and ({nb}, {kb}) (block: 1x128 of a, 128x128 of b), "
            f"({m}, 1) and ({n}, 1) (per row and channel), or () and () (per tensor)")


def check(op: Op, args: dict[str, Any]) -> None:
    a, b, a_scale, b_scale = args["a"], args["b"], args["a_scale"], args["b_scale"]
    (m, k), n = a.shape, b.shape[0]
    op.expect_shape("b", b, (n, k), "[N, K], K being a's last dimension (the nn.Linear layout)")
    if k % K_MULTIPLE or k == 0:
        raise InvalidInputError(op.name, "a", f"has K = {k} (shape {tuple(a.shape)})",
                                f"a K that is a positive multiple of {K_MULTIPLE} (16-byte fp8 rows)",
                                "Pad K with zeros (in a and b) to a multiple of 16.")
    if granularity(a_scale, b_scale, m, n, k) is None:
        named = "a_scale" if tuple(a_scale.shape) not in ((), (m, 1), (m, cdiv(k, BLOCK))) else "b_scale"
        raise InvalidInputError(op.name, named, f"has shape {tuple(args[named].shape)} (a_scale "
                                f"{tuple(a_scale.shape)}, b_scale {tuple(b_scale.shape)})", _expected_scales(m, n, k))


def example(sizes: dict[str, int], dtype: torch.dtype, device: torch.device,
            generator: torch.Generator) -> tuple:
    """Random ``a [tokens, hidden]`` and an nn.Linear weight ``b [inter, hidden]`` (variance
    1/hidden), quantised with DeepSeek-V3's block scales (1x128 of a, 128x128 of b); the output in
    ``dtype`` (bfloat16 where ``dtype`` is no output dtype)."""
    tokens, hidden, inter = sizes["tokens"], sizes["hidden"], sizes["inter"]
    x = torch.randn(tokens, hidden, generator=generator).to(device)
    w = (torch.randn(inter, hidden, generator=generator) / math.sqrt(hidden)).to(device)
    a, a_scale = quantize_fp8_reference(x, "block")
    b, b_scale = quantize_fp8_reference(w, "block_128x128")
    return a, b, a_scale, b_scale, dtype if dtype in OUT_DTYPES else torch.bfloat16


def cost(args: tuple) -> tuple[int, int]:
    """a, b and the scales read once, the output written once; a multiply and an add per term."""
    a, b, a_scale, b_scale, out_dtype = args
    (m, k), n = a.shape, b.shape[0]
    nbytes = a.numel() + b.numel() + 4 * (a_scale.numel() + b_scale.numel()) + m * n * out_dtype.itemsize
    return nbytes, 2 * m * n * k


OP = Op(
    name="fp8_gemm",
    args=(
        TensorArg("a", (FP8,), min_rank=2, max_rank=2, bucket="rows", differentiable=False),
        TensorArg("b", (FP8,), min_rank=2, max_rank=2, same_dtype_as="a", differentiable=False),
        TensorArg("a_scale", (torch.float32,), min_rank=0, max_rank=2, bucket="rows", differentiable=False,
                  layouts=("contiguous", "rows", "strided")),
        TensorArg("b_scale", (torch.float32,), min_rank=0, max_rank=2, differentiable=False,
                  layouts=("contiguous", "rows", "strided")),
        ScalarArg("out_dtype", (torch.dtype,), default=torch.bfloat16, keyed=True, choices=OUT_DTYPES),
    ),
    reference=fp8_gemm_reference,
    doc="(a * a_scale) @ (b * b_scale).T for float8_e4m3fn a [M, K], b [N, K]; block (1x128, 128x128), per-row or "
        "per-tensor float32 scales; float32 accumulation, bf16/fp16/fp32 out",
    check=check,
    example=example,
    example_sizes={"tokens": 37, "hidden": 272, "inter": 160},
    example_paths={"split-K": {"tokens": 1, "hidden": 4096, "inter": 256},
                   "tiles": {"tokens": 300, "hidden": 512, "inter": 256}},
    cost=cost,
    baselines={"dequant": lambda: dequant_gemm, "bf16": lambda: bf16_gemm,
               "scaled_mm_tensor": lambda: scaled_mm_tensor},
)

KERNEL = define_kernel(
    OP, plan,
    kernels=gemm.KERNELS,
    results=output,
    default_config=default_config,
    space=space,
    doc="the GEMM block on fp8 tiles: block scales in the K loop, per-row / per-tensor scales in the epilogue",
    limits=(LoweringLimit(
        "cuda", ("gemm_kernel", "gemm_tma_kernel"), "ttir",
        "fp8 (e4m3) tl.dot needs sm_89 or later: Triton 3.6 rejects float8e4nv on sm_80", archs=("80",)),
        LoweringLimit(
            "npu", ("gemm_kernel", "gemm_tma_kernel"), "ttir",
            "float8_e4m3fn, which the Ascend 910B has no type for: upstream Triton 3.6, making the npu pipeline's "
            "ttir at its sm_80 target, rejects it ('type fp8e4nv not supported in this architecture')")),
)
fp8_gemm = KERNEL.function
dlcore_ops, dlcore_implementations = KERNEL.dlcore_ops, KERNEL.dlcore_implementations
