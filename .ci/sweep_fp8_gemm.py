"""fp8_gemm on the GPU at issue #18's DeepSeek-V3 shapes: a small config sweep per granularity,
beside the dequantise-then-bf16-GEMM path and torch._scaled_mm; prints one JSON line per result
and a summary (GPU time of CUDA-graph replays, medians; bf16 out).

    python3 .ci/sweep_fp8_gemm.py [block|tensor|row ...]   (default: block tensor)

SWEEP_M=128,4096 (default 128,4096,16384) picks the row counts; SWEEP_CONFIGS (a Python list of
the tuples below) replaces every granularity's configs. Each row also times bf16 cuBLAS
(``a @ b.T`` dequantised, what the fp8 targets are measured against) and the torch._scaled_mm
candidate (``scaled_mm_tflops``; under block scales whatever its declines say, so that a host
whose cuBLASLt takes blocks shows it).
"""

from __future__ import annotations

import ast
import json
import math
import os
import sys

import torch
import triton.testing
from dlblas_kernels import vendor
from dlblas_kernels.kernels import fp8_gemm as F
from dlblas_kernels.kernels.quantize_fp8 import quantize_fp8, quantize_fp8_reference

from dlcore.declarations.signature import make_signature
from dlcore.runtime.template import device_profile

ROWS = tuple(int(m) for m in os.environ.get("SWEEP_M", "128,4096,16384").split(","))
SHAPES = [(m, n, k) for m in ROWS for n, k in ((7168, 2048), (2112, 7168), (24576, 1536),
                                                            (7168, 16384), (4096, 7168))]
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K, TMA[, WARP_SPECIALIZE, OCCUPANCY]); never
# warp-specialised (fp8_gemm.space); OCCUPANCY 2: two persistent programs a multiprocessor
CONFIGS = {
    "block": [(128, 256, 128, 8, 3, 1, 1), (128, 256, 128, 16, 3, 1, 1), (64, 256, 128, 4, 3, 1, 1),
              (128, 128, 128, 8, 4, 1, 1), (128, 128, 128, 4, 4, 1, 1), (64, 128, 128, 4, 5, 1, 1),
              (128, 128, 128, 8, 5, 1, 1), (256, 128, 128, 8, 3, 1, 1), (128, 64, 128, 4, 5, 1, 1),
              (64, 128, 128, 4, 4, 2, 1), (128, 128, 64, 8, 6, 1, 1), (128, 128, 128, 16, 4, 1, 1),
              (128, 128, 128, 16, 5, 1, 1), (256, 128, 128, 16, 3, 1, 1), (256, 128, 128, 16, 4, 1, 1),
              (64, 128, 128, 4, 3, 1, 1, 0, 2), (64, 128, 128, 4, 4, 1, 1, 0, 2), (64, 128, 128, 4, 4, 1, 0),
              (64, 128, 64, 4, 6, 1, 1, 0, 2),
              (64, 128, 128, 4, 2, 1, 1, 0, 2), (128, 64, 128, 4, 3, 1, 1, 0, 2), (128, 128, 128, 8, 4, 1, 0)],
    "tensor": [(128, 256, 128, 8, 3, 1, 1), (128, 128, 128, 8, 4, 1, 1), (256, 128, 128, 8, 3, 1, 1),
               (64, 128, 128, 4, 5, 1, 1), (128, 256, 64, 8, 4, 1, 1), (64, 256, 128, 4, 4, 1, 1),
               (128, 128, 128, 8, 2, 1, 1, 0, 2), (64, 128, 128, 4, 3, 1, 1, 0, 2)],
}
CONFIGS["row"] = CONFIGS["tensor"]
if os.environ.get("SWEEP_CONFIGS"):
    CONFIGS = dict.fromkeys(CONFIGS, ast.literal_eval(os.environ["SWEEP_CONFIGS"]))
QUANT = {"block": ("block", "block_128x128"), "row": ("row", "row"), "tensor": ("tensor", "tensor")}


def bench(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")


KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "SPLIT_K", "TMA", "WARP_SPECIALIZE", "OCCUPANCY")


def config(t: tuple) -> dict:
    return dict(zip(KEYS, t))


def check_quantiser() -> None:
    """quantize_fp8's kernels against the torch quantiser, exactly, and their time at 16384 x 7168."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    for m, k in ((37, 272), (300, 1000), (16384, 7168)):
        x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 3
        x[: m // 3, :128] = 0  # zero groups
        for gran in ("block", "block_128x128", "row", "tensor"):
            q, scale = quantize_fp8(x, gran)
            rq, rscale = quantize_fp8_reference(x, gran)
            row = {"quantize": gran, "m": m, "k": k, "scale_equal": bool(torch.equal(scale, rscale)),
                   "fp8_mismatches": int((q.view(torch.uint8) != rq.view(torch.uint8)).sum())}
            if m == 16384:
                ms = bench(lambda x=x, gran=gran: quantize_fp8(x, gran))
                row["gb_per_s"] = round((x.numel() * 3) / ms / 1e6, 1)
            print(json.dumps(row), flush=True)


def main(granularities: list[str]) -> None:
    profile = device_profile(torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    summary = {}
    for gran in granularities:
        speedups, vs_vendor = [], []
        for m, n, k in SHAPES:
            x = torch.randn(m, k, device="cuda", generator=gen)
            w = torch.randn(n, k, device="cuda", generator=gen) / math.sqrt(k)
            a, sa = quantize_fp8_reference(x, QUANT[gran][0])
            b, sb = quantize_fp8_reference(w, QUANT[gran][1])
            args = (a, b, sa, sb, torch.bfloat16)
            flops = 2 * m * n * k
            reference = F.dequant_gemm(*args).float()
            row = {"granularity": gran, "m": m, "n": n, "k": k}
            heuristic = F.default_config(make_signature(F.OP, args, a.device), profile)
            found = {}
            chosen = tuple(heuristic.get(key, 1 if key == "OCCUPANCY" else 0) for key in KEYS)
            for t in dict.fromkeys([chosen, *CONFIGS[gran]]):
                cfg = config(t)
                try:
                    plan = F.plan(args, cfg, profile)
                    out = plan.run().float()
                    err = ((out - reference).abs().max() / reference.abs().max()).item()
                    ms = bench(plan.run)
                except Exception as exc:  # noqa: BLE001 - a config that fails is reported, not fatal
                    found[str(t)] = f"failed: {str(exc).splitlines()[0][:120]}"
                    continue
                found[str(t)] = (round(flops / ms / 1e9, 1), round(err, 5))
            row["configs"] = found
            row["heuristic"] = str(chosen)
            best = max((v[0] for v in found.values() if isinstance(v, tuple)), default=0)
            heur = found.get(str(chosen))
            row["best_tflops"], row["heuristic_tflops"] = best, heur[0] if isinstance(heur, tuple) else None
            row["dequant_tflops"] = round(flops / bench(lambda args=args: F.dequant_gemm(*args)) / 1e9, 1)
            speedups.append(best / row["dequant_tflops"])
            a16, b16 = (t.to(torch.bfloat16) for t in F.dequantise(a, b, sa, sb, torch.float32))
            row["bf16_cublas_tflops"] = round(flops / bench(lambda a16=a16, b16=b16: a16 @ b16.T) / 1e9, 1)
            try:
                out = vendor.fp8_gemm(*args).float()
                row["scaled_mm_err"] = round(((out - reference).abs().max() / reference.abs().max()).item(), 5)
                ms = bench(lambda args=args: vendor.fp8_gemm(*args))
                row["scaled_mm_tflops"] = round(flops / ms / 1e9, 1)
                vs_vendor.append(best / row["scaled_mm_tflops"])
            except Exception as exc:  # noqa: BLE001
                row["scaled_mm_tflops"] = f"failed: {str(exc).splitlines()[0][:120]}"
            print(json.dumps(row), flush=True)
        summary[gran] = {"geomean_vs_dequant": math.exp(sum(map(math.log, speedups)) / len(speedups)),
                         "geomean_vs_scaled_mm": (math.exp(sum(map(math.log, vs_vendor)) / len(vs_vendor))
                                                  if vs_vendor else None)}
    print(json.dumps({"summary": summary}), flush=True)


if __name__ == "__main__":
    print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
                      "device": torch.cuda.get_device_name()}), flush=True)
    check_quantiser()
    main(sys.argv[1:] or ["block", "tensor"])
