"""fp8_gemm's Gluon block-scaled kernel (blocks/fp8_wgmma.py) on the GPU: its products against the float64
reference (output poisoned with NaN; odd shapes, K tails, padded rows of a, each output dtype), then TFLOP/s of
its variants beside the Triton loop (GLUON 0), cuBLASLt's blockwise GEMM and bf16 cuBLAS at DeepSeek-V3's
shapes (4096 rows).

    python3 .ci/probe_fp8_wgmma.py [M,N,K ...]

One JSON line per check, then per shape: ``gluon_s{STAGES}_u{UNROLL}`` (``_np``: one program per tile,
not persistent), ``triton`` (the GEMM block's loop, the heuristic's tiles), ``cublaslt_block``, ``bf16``.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch
import triton
import triton.testing
from dlblas_kernels import vendor
from dlblas_kernels.blocks import fp8_wgmma
from dlblas_kernels.kernels import fp8_gemm as F

from dlcore.runtime.profile import device_profile

DEVICE = torch.device("cuda")
PROFILE = device_profile(DEVICE)
CHECKS = [(300, 200, 272), (128, 256, 128), (129, 384, 384), (4096, 7168, 2048), (1000, 2112, 7184),
          (4096, 24576, 1536)]
VARIANTS = [(4, 4, True), (4, 4, False), (4, 2, True), (4, 8, True), (3, 4, True), (5, 4, True), (4, 8, False)]
SHAPES = [(4096, n, k) for n, k in ((7168, 2048), (2112, 7168), (24576, 1536), (7168, 16384), (4096, 7168))]


def inputs(m: int, n: int, k: int, seed: int = 0) -> tuple:
    generator = torch.Generator().manual_seed(seed)
    return F.example({"tokens": m, "hidden": k, "inter": n}, torch.bfloat16, DEVICE, generator)


def gluon(args: tuple, stages: int = 4, unroll: int = 8, persistent: bool = True, out=None) -> torch.Tensor:
    a, b, a_scale, b_scale, out_dtype = args
    m, n = a.shape[0], b.shape[0]
    c = out if out is not None else torch.empty(m, n, dtype=out_dtype, device=DEVICE)
    call = fp8_wgmma.wgmma_call(a, b, c, a_scale, b_scale, {"num_stages": stages, "UNROLL": unroll}, PROFILE)
    if not persistent:
        call = dataclasses.replace(call, grid=(triton.cdiv(m, 128) * triton.cdiv(n, 128),))
    call.launch()
    return c


def check(m: int, n: int, k: int, out_dtype=torch.bfloat16, padded: bool = False, launch=None, **variant) -> dict:
    """One check of ``launch`` (default :func:`gluon`; called as it is, with ``out=`` and ``variant``)."""
    a, b, a_scale, b_scale, _ = inputs(m, n, k, seed=m + n + k)
    if padded:  # a's rows 32 bytes apart more than K
        wide = torch.zeros(m, k + 32, dtype=a.dtype, device=DEVICE)
        wide[:, :k] = a
        a = wide[:, :k]
    want = F.fp8_gemm_reference(a, b, a_scale, b_scale, torch.float64)
    got = torch.full((m, n), float("nan"), dtype=out_dtype, device=DEVICE)
    (launch or gluon)((a, b, a_scale, b_scale, out_dtype), out=got, **variant)
    error = (got.double() - want).abs()
    bad = ~(error <= 1e-2 * want.abs() + 1e-2 * want.abs().max())
    return {"check": [m, n, k], "out": str(out_dtype), "padded": padded, **variant,
            "max_error": float(error.nan_to_num(float("inf")).max()), "bad": int(bad.sum()),
            "nan": int(got.isnan().sum())}


def tflops(flops: int, fn) -> float:
    return round(flops / triton.testing.do_bench(fn, warmup=25, rep=100) * 1e-9, 1)


def main(shapes: list[tuple[int, int, int]]) -> None:
    for shape in CHECKS:
        for stages, unroll, persistent in ((4, 4, True), (3, 2, True), (4, 8, True), (4, 4, False)):
            print(json.dumps(check(*shape, stages=stages, unroll=unroll, persistent=persistent)), flush=True)
    for out_dtype in (torch.float32, torch.float16):
        print(json.dumps(check(300, 200, 272, out_dtype)), flush=True)
    print(json.dumps(check(257, 384, 1024, padded=True)), flush=True)
    for m, n, k in shapes:
        args = inputs(m, n, k)
        flops = 2 * m * n * k
        row: dict = {"shape": [m, n, k]}
        for stages, unroll, persistent in VARIANTS:
            name = f"gluon_s{stages}_u{unroll}" + ("" if persistent else "_np")
            row[name] = tflops(flops, lambda v=(stages, unroll, persistent), args=args: gluon(args, *v))
        loop = {**F.heuristic(m, n, k, F.Granularity.BLOCK, PROFILE), "GLUON": 0}
        row["triton"] = tflops(flops, lambda args=args, loop=loop: F.plan(args, loop, PROFILE).run())
        row["cublaslt_block"] = tflops(flops, lambda args=args: vendor._blockwise_scaled_mm(*args))
        a16, b16 = F.bf16_inputs(args)[:2]
        row["bf16"] = tflops(flops, lambda a16=a16, b16=b16: a16 @ b16.T)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main([tuple(map(int, s.split(","))) for s in sys.argv[1:]] or SHAPES)
