"""Time the GEMM block's launch choices (tiles, pipelining, persistent descriptors or pointers,
split-K) against torch.matmul (cuBLAS) at the LLM presets, bfloat16, b the ``w.T`` view of an
nn.Linear weight; do_bench medians, Triton and cuBLAS alternating per shape. Each config's
output is checked against a float32 product first.

    python3 .ci/sweep_gemm.py sweep [OUT.jsonl]    every candidate of each row regime
    python3 .ci/sweep_gemm.py bench [OUT.jsonl]    matmul's default config (and the public function),
                                                   beside the alternatives the heuristic weighs

SWEEP_M and SWEEP_SHAPES (``NxK,...``) narrow the presets, SWEEP_SET=split sweeps split-K on the
persistent kernel, SWEEP_SET=ws its warp-specialised tiles (``WARP_SPECIALIZE``) against the default
ones; compiles run first, in parallel
processes that fill Triton's cache.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import multiprocessing
import os
import sys
import time

import torch
import triton

SHAPES = [(14336, 4096), (4096, 14336), (28672, 8192), (8192, 28672), (18944, 3584), (3584, 18944), (2048, 7168),
          (7168, 2048)]
MS = [1, 16, 128, 1024, 4096, 16384]


def cfg(bm, bn, bk, w, s, g=8, **extra):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": g, "num_warps": w, "num_stages": s, **extra}


def canonical(config: dict) -> dict:
    """``config`` with gemm_calls' defaults filled in and the bench's marks dropped."""
    filled = {"GROUP_M": 8, "SPLIT_K": 1, "TMA": 1, "FLATTEN": 1, "WARP_SPECIALIZE": 0, **config}
    return {k: v for k, v in filled.items() if k != "default"}


def alternatives(m: int) -> list[dict]:
    """What ``bench`` times beside the default: the choices the heuristic weighs in each regime."""
    if m <= 64:
        return [cfg(16, 64, 128, 4, 4, SPLIT_K=s, TMA=0) for s in (1, 2, 4)] + [
            cfg(16, 32, 256, 4, 4, TMA=0), cfg(16, 64, 256, 4, 3, TMA=0)]
    if m <= 512:
        return [cfg(64, 64, 128, 4, 4, SPLIT_K=s) for s in (1, 2, 4)] + [
            cfg(128, 128, 64, 4, 4, SPLIT_K=s) for s in (1, 2)] + [
            cfg(64, 128, 64, 4, 4, SPLIT_K=2), cfg(128, 64, 128, 4, 4, SPLIT_K=2), cfg(64, 128, 128, 4, 4, TMA=0)]
    if m <= 2048:
        return [cfg(128, 256, 64, 8, 3, SPLIT_K=s) for s in (1, 2)] + [
            cfg(128, 128, 64, 4, 4, SPLIT_K=s) for s in (1, 2)] + [cfg(64, 256, 64, 4, 4), cfg(256, 128, 64, 8, 3)]
    return [cfg(128, 256, 64, 8, 3), cfg(128, 256, 64, 8, 3, FLATTEN=0), cfg(256, 128, 64, 8, 3),
            cfg(128, 128, 64, 4, 4)]


def candidates(m: int) -> list[dict]:
    if os.environ.get("SWEEP_SET") == "ws":  # warp-specialised tiles (4-warp consumers) against the default's
        ws = {"WARP_SPECIALIZE": 1, "FLATTEN": 0}
        return [cfg(128, 256, 64, 8, 3), cfg(128, 128, 64, 4, 4), cfg(128, 256, 64, 4, 3, **ws),
                cfg(128, 256, 64, 4, 4, **ws), cfg(128, 128, 64, 4, 4, **ws), cfg(128, 128, 64, 4, 5, **ws),
                cfg(256, 128, 64, 4, 3, **ws), cfg(128, 128, 128, 4, 3, **ws)]
    if os.environ.get("SWEEP_SET") == "split":  # the persistent kernel's split-K against its plain tiles
        if m >= 1024:
            return [cfg(128, 256, 64, 8, 3), cfg(128, 128, 64, 4, 4), cfg(128, 256, 64, 8, 3, SPLIT_K=2),
                    cfg(128, 128, 64, 4, 4, SPLIT_K=2), cfg(64, 256, 64, 4, 4, SPLIT_K=2)]
        return [cfg(64, 64, 128, 4, 4), cfg(128, 128, 64, 4, 4), cfg(64, 128, 64, 4, 4, SPLIT_K=2),
                cfg(64, 64, 128, 4, 4, SPLIT_K=2), cfg(64, 64, 128, 4, 4, SPLIT_K=4),
                cfg(128, 128, 64, 4, 4, SPLIT_K=2), cfg(128, 64, 128, 4, 4, SPLIT_K=2),
                cfg(128, 128, 64, 8, 4, SPLIT_K=4), cfg(128, 256, 64, 8, 3, SPLIT_K=2),
                cfg(64, 128, 128, 4, 4, SPLIT_K=4)]
    if m >= 1024:
        return [cfg(128, 256, 64, 8, 3), cfg(128, 256, 64, 8, 3, FLATTEN=0), cfg(128, 128, 64, 8, 4),
                cfg(128, 128, 64, 4, 4), cfg(256, 128, 64, 8, 3), cfg(64, 256, 64, 4, 4),
                cfg(128, 256, 64, 8, 3, TMA=0), cfg(128, 128, 64, 4, 4, TMA=0)]
    if m >= 128:
        return [cfg(64, 128, 64, 4, 4), cfg(128, 128, 64, 8, 4), cfg(64, 256, 64, 4, 4), cfg(128, 64, 64, 4, 4),
                cfg(64, 64, 128, 4, 4), cfg(64, 128, 128, 4, 4, TMA=0), cfg(128, 128, 64, 8, 4, SPLIT_K=2, TMA=0),
                cfg(64, 128, 64, 4, 4, SPLIT_K=2, TMA=0)]
    bm = 16
    return [cfg(bm, 64, 128, 4, 4, TMA=0), cfg(bm, 128, 128, 4, 4, TMA=0), cfg(bm, 64, 256, 4, 3, TMA=0),
            cfg(bm, 32, 256, 4, 4, TMA=0), cfg(bm, 64, 128, 4, 4, SPLIT_K=2, TMA=0),
            cfg(bm, 64, 128, 4, 4, SPLIT_K=4, TMA=0), cfg(bm, 128, 128, 4, 4, SPLIT_K=4, TMA=0),
            cfg(bm, 64, 256, 4, 3, SPLIT_K=8, TMA=0), cfg(64, 64, 128, 4, 4), cfg(64, 128, 64, 4, 5)]


def operands(m: int, n: int, k: int):
    gen = torch.Generator(device="cuda").manual_seed(m * 7 + n * 3 + k)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = (torch.randn(n, k, device="cuda", generator=gen) / math.sqrt(k)).to(torch.bfloat16)
    return a, w


def calls_for(config: dict, a, w, c):
    from dlblas_kernels.blocks import gemm

    from dlcore.runtime.template import device_profile
    return gemm.gemm_calls(a, w.T, c, config, device_profile(c.device))[0]


def compile_one(job: tuple) -> str:
    """Run one (m, n, k, config) once, in a worker: its compile lands in Triton's cache."""
    m, n, k, config = job
    try:
        a, w = operands(m, n, k)
        c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        for call in calls_for(config, a, w, c):
            call.launch()
        torch.cuda.synchronize()
        return ""
    except Exception as error:  # a config the chip cannot take: reported, not fatal
        return f"{type(error).__name__}: {str(error)[:200]}"


def precompile(jobs: list[tuple]) -> dict:
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(14, len(jobs)), mp_context=context) as pool:
        return dict(zip([repr(j) for j in jobs], pool.map(compile_one, jobs)))


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3  # us


def main() -> None:
    from dlcore.runtime import launch as warm

    mode = sys.argv[1]
    out = open(sys.argv[2], "a") if len(sys.argv) > 2 else None
    ms = [int(x) for x in os.environ.get("SWEEP_M", ",".join(map(str, MS))).split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in os.environ["SWEEP_SHAPES"].split(",")] \
        if "SWEEP_SHAPES" in os.environ else SHAPES
    if mode == "sweep":
        plan = [(m, n, k, c) for m in ms for n, k in shapes for c in candidates(m)]
    else:
        from dlblas_kernels.kernels import matmul as mm

        from dlcore.declarations.signature import make_signature
        from dlcore.runtime.template import device_profile
        profile = device_profile(torch.device("cuda"))
        plan = []
        for m in ms:
            for n, k in shapes:
                a, w = (torch.empty(m, k, device="meta", dtype=torch.bfloat16),
                        torch.empty(n, k, device="meta", dtype=torch.bfloat16))
                sig = make_signature(mm.OP, (a, w.T, None, None, False), a.device)
                default = {**mm.default_config(sig, profile), "default": 1}
                plan.append((m, n, k, default))
                others = [c for c in alternatives(m) if canonical(c) != canonical(default)]
                plan += [(m, n, k, c) for c in others]
    t0 = time.time()
    failed = {key: err for key, err in precompile(plan).items() if err}
    print(f"compiled {len(plan)} in {time.time() - t0:.0f}s; failed: {failed}", flush=True)
    for m in ms:
        for n, k in shapes:
            a, w = operands(m, n, k)
            ref = a.float() @ w.float().T
            cublas = bench(lambda a=a, w=w: torch.matmul(a, w.T))
            rows = []
            for (pm, pn, pk, config) in plan:
                if (pm, pn, pk) != (m, n, k) or repr((pm, pn, pk, config)) in failed:
                    continue
                c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                calls = calls_for(config, a, w, c)
                for call in calls:
                    warm.launch(call)
                err = ((c.float() - ref).norm() / ref.norm()).item()
                us = bench(lambda calls=calls: [warm.launch(call) for call in calls])
                rows.append((us, config, err))
                if config.get("default"):
                    from dlblas_kernels import matmul
                    rows.append((bench(lambda a=a, w=w: matmul(a, w.T)), {"public function": 1}, err))
            cublas2 = bench(lambda a=a, w=w: torch.matmul(a, w.T))
            cublas = min(cublas, cublas2)
            flops = 2 * m * n * k
            for us, config, err in sorted(rows, key=lambda r: r[0]):
                record = {"m": m, "n": n, "k": k, "us": round(us, 2), "cublas_us": round(cublas, 2),
                          "ratio": round(cublas / us, 3), "tflops": round(flops / us / 1e6, 1),
                          "rel_err": float(f"{err:.2e}"), "config": config}
                if out:
                    out.write(json.dumps(record) + "\n")
            best = min(rows, key=lambda r: r[0])
            default = [r for r in rows if r[1].get("default")]
            shown = f"default x{cublas / default[0][0]:.3f} " if default else ""
            print(f"M={m:6d} N={n:6d} K={k:6d} cublas {cublas:9.1f}us {shown}best {best[0]:9.1f}us "
                  f"x{cublas / best[0]:.3f} err {best[2]:.1e} {best[1]}", flush=True)


if __name__ == "__main__":
    main()
