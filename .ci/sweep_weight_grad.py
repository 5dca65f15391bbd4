"""Time ffn's weight gradient ``dw13 [2N, K] = dh.T @ xn`` (the GEMM block's persistent kernel, a
``[M, 2N]`` row-major read column-major, a reduction over the M tokens) by tile, against cuBLAS's
``torch.matmul`` of the same views, bfloat16, on the GPU; do_bench medians, each config's output
checked against the float32 product first.

    python3 .ci/sweep_weight_grad.py [OUT.jsonl]

SWEEP_SHAPES (``TOKENSxHIDDENxINTER,...``) narrows the shapes; the default is LLaMA-3-70B's and
-8B's at 16 and 128 tokens, where ``ffn_bwd.json`` found the backward behind compile's.
``default`` is what ffn's backward runs (:func:`dlblas_kernels.kernels.ffn.weight_grad_config`),
``forward tile`` the tile it ran before: the forward config's, both weights' columns in one
(:func:`dlblas_kernels.kernels.ffn.backward_gemm_config`).
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import sys

import torch
import triton

SHAPES = "128x8192x28672,16x8192x28672,128x4096x14336,1024x8192x28672"


def cfg(bm, bn, bk, w, s, g=8, **extra):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": g, "num_warps": w, "num_stages": s, **extra}


CANDIDATES = [
    cfg(128, 256, 64, 8, 3), cfg(128, 256, 64, 8, 3, FLATTEN=0), cfg(128, 256, 64, 8, 4),
    cfg(128, 128, 64, 4, 4), cfg(128, 128, 64, 8, 4), cfg(128, 128, 64, 4, 4, FLATTEN=0),
    cfg(256, 128, 64, 8, 3), cfg(128, 256, 32, 8, 4), cfg(64, 256, 64, 4, 4), cfg(64, 128, 64, 4, 4),
    cfg(128, 256, 128, 8, 2), cfg(128, 128, 128, 8, 2), cfg(128, 256, 64, 8, 3, g=1), cfg(128, 256, 64, 8, 3, g=16),
]


def operands(tokens: int, hidden: int, inter: int):
    gen = torch.Generator(device="cuda").manual_seed(tokens + hidden + inter)
    dh = torch.randn(tokens, 2 * inter, device="cuda", dtype=torch.bfloat16, generator=gen)
    xn = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    return dh, xn


def labelled_configs(tokens: int, hidden: int, inter: int) -> list[tuple[str, dict]]:
    """``default`` (what ffn's backward gives dw13), ``forward tile`` (the forward config's tile,
    both weights' columns in one) and the candidates."""
    from dlblas_kernels.kernels import ffn

    from dlcore.declarations.signature import make_signature
    from dlcore.runtime.template import device_profile
    profile = device_profile(torch.device("cuda"))
    x = torch.empty(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.empty(inter, hidden, device="cuda", dtype=torch.bfloat16)
    sig = make_signature(ffn.OP, (x, w, w, torch.empty(hidden, device="cuda", dtype=torch.bfloat16), 1e-6, None),
                         x.device)
    forward = ffn.fit_stages(ffn.backward_gemm_config(ffn.default_config(sig, profile)), profile, 2, operands=1)
    return [("default", ffn.weight_grad_config(2, profile)), ("forward tile", forward),
            *(("", c) for c in CANDIDATES)]


def calls_for(config: dict, dh, xn, c):
    from dlblas_kernels.blocks import gemm

    from dlcore.runtime.template import device_profile
    return gemm.gemm_calls(dh.T, xn, c, config, device_profile(c.device))[0]


def compile_one(job: tuple) -> str:
    tokens, hidden, inter, config = job
    try:
        dh, xn = operands(tokens, hidden, inter)
        c = torch.empty(2 * inter, hidden, device="cuda", dtype=torch.bfloat16)
        for call in calls_for(config, dh, xn, c):
            call.launch()
        torch.cuda.synchronize()
        return ""
    except Exception as error:  # noqa: BLE001 - a config the chip cannot take is reported
        return f"{type(error).__name__}: {str(error)[:200]}"


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3  # us


def main() -> None:
    from dlcore.runtime import launch as warm

    out = open(sys.argv[1], "a") if len(sys.argv) > 1 else None
    shapes = [tuple(int(v) for v in s.split("x")) for s in os.environ.get("SWEEP_SHAPES", SHAPES).split(",")]
    configs = {shape: labelled_configs(*shape) for shape in shapes}
    jobs = [(t, h, i, c) for (t, h, i), cands in configs.items() for _, c in cands]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(14, len(jobs)), mp_context=context) as pool:
        failed = {repr(j): e for j, e in zip(jobs, pool.map(compile_one, jobs)) if e}
    print(f"compiled {len(jobs)}; failed: {failed}", flush=True)
    for tokens, hidden, inter in shapes:
        dh, xn = operands(tokens, hidden, inter)
        ref = (dh.float().T @ xn.float())
        c = torch.empty(2 * inter, hidden, device="cuda", dtype=torch.bfloat16)
        written = c.numel() * 2

        def write_gbps(us: float, written: int = written) -> float:
            return written / us / 1e3
        cublas = bench(lambda dh=dh, xn=xn: torch.matmul(dh.T, xn))
        print(f"tokens={tokens} hidden={hidden} inter={inter}: cuBLAS {cublas:.1f} us "
              f"({write_gbps(cublas):.0f} GB/s of dw13 written)", flush=True)
        for label, config in configs[(tokens, hidden, inter)]:
            if repr((tokens, hidden, inter, config)) in failed:
                continue
            calls = calls_for(config, dh, xn, c)
            c.fill_(float("nan"))
            for call in calls:
                call.launch()
            err = ((c.float() - ref).norm() / ref.norm()).item()
            us = bench(lambda calls=calls: [warm.launch(call) for call in calls])
            print(f"  {us:8.1f} us  x{cublas / us:.3f} of cuBLAS  {write_gbps(us):5.0f} GB/s  err {err:.1e}  "
                  f"{label + ' ' if label else ''}{config}", flush=True)
            if out:
                out.write(json.dumps({"tokens": tokens, "hidden": hidden, "inter": inter, "us": round(us, 2),
                                      "cublas_us": round(cublas, 2), "rel_err": float(f"{err:.2e}"),
                                      "label": label, "config": config}) + "\n")


if __name__ == "__main__":
    main()
