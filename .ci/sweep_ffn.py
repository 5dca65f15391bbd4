"""Time the prefill ffn's GEMM configs on the GPU (bf16): the pair-tile kernel (``JOINT=1``, one
``[BLOCK_M, 2 * BLOCK_N]`` product per tile) and the two-accumulator GEMM (``JOINT=0``), beside
the matmul over ``[w1; w3]`` alone (Triton, matmul's heuristic config; cuBLAS) and the eager
composite (F.rms_norm, one cuBLAS GEMM over ``[w1; w3]``, SwiGLU). do_bench medians (L2 flushed);
each config's output is checked against the float32 composite first. Then get_op's selection at
the small shapes (what it measured, against the two candidates timed in alternating rounds, and
the first timing after the GPU idled).

    python3 .ci/sweep_ffn.py [OUT.jsonl] [--apply]

SWEEP_SHAPES (``MxKxN,...``) narrows the shapes (SWEEP_SELECTION=0 skips get_op's selection); at 16
rows or fewer the streaming kernel's column spreads, tiles, depths and K slice counts are timed,
each with its share of the copy bandwidth. ``--apply`` rewrites ``PREFILL_TILE`` in the installed
and the checked-out ``blocks/ffn_prefill.py`` to the config of least summed time over the shapes above 128
rows, when it beats the current one by more than 2% and lies in the op's space.
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import pathlib
import re
import sys
import time

import torch
import triton

SHAPES = "4096x4096x14336,16384x4096x14336,128x4096x14336,128x7168x2048"


def cfg(bm, bn, bk, w, s, joint=1, **extra):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "JOINT": joint, "num_warps": w,
            "num_stages": s, **extra}


def candidates(m: int) -> list[dict]:
    if m <= 16:  # weight streaming: the default (columns spread over whole waves, decode_columns; K
        # slices where the column blocks leave SMs idle, decode_splits; tensor descriptors where
        # decode_tma takes them) beside SPREAD=0 (blocks of BLOCK_N) and SPREAD=2 (fewer blocks than
        # SMs spread over one wave too), and TMA=1 (descriptors always) over tiles and depths
        tma = [cfg(64, bn, bk, w, s, TMA=1) for bn, bk, w, s in (
            (128, 64, 4, 4), (128, 64, 4, 6), (128, 64, 8, 4), (128, 128, 4, 3), (128, 128, 4, 4), (128, 128, 8, 3),
            (256, 64, 8, 4), (64, 64, 4, 6), (64, 128, 4, 4))]
        # the default (descriptors where decode_tma takes them) beside pointers alone (TMA=0)
        pointers = [cfg(64, 128, 64, 4, 4, TMA=0), cfg(64, 128, 64, 4, 6, TMA=0), cfg(64, 128, 64, 8, 4, TMA=0),
                    cfg(64, 128, 64, 4, 4, SPREAD=0, TMA=0), cfg(64, 128, 64, 4, 4, SPREAD=2, TMA=0)]
        # one wave of wider programs (Qwen2.5-7B: 132 of 144 columns in tiles of 256, not 264 of 72 in two waves)
        wide = [cfg(64, 256, 64, 8, 3, SPREAD=2, TMA=0), cfg(64, 256, 64, 8, 3, SPREAD=2, TMA=1),
                cfg(64, 256, 128, 8, 2, SPREAD=2, TMA=1)]
        # every SM streaming (LLaMA-3-8B: 132 programs of 109 columns) through descriptors, 128-wide K slices
        spread = [cfg(64, 128, 64, 4, 4, SPREAD=2, TMA=1), cfg(64, 128, 128, 4, 3, SPREAD=2, TMA=1)]
        return [cfg(64, 128, 64, 4, 4), *pointers, *spread, *tma, *wide]
    if m > 128:  # TAIL=0: the pair kernel's last wave unsplit (swiglu_pair.pair_tail)
        return [cfg(128, 128, 64, 8, 4), cfg(128, 128, 64, 8, 4, TAIL=0), cfg(128, 128, 64, 8, 3),
                cfg(128, 128, 64, 8, 4, FLATTEN=0), cfg(256, 64, 64, 8, 3), cfg(128, 64, 64, 4, 4)]
    return [cfg(64, 64, 128, 4, 4), cfg(64, 64, 128, 4, 4, TAIL=0), cfg(64, 128, 64, 4, 4),
            cfg(64, 128, 64, 4, 4, TAIL=0), cfg(64, 64, 64, 4, 6), cfg(64, 64, 64, 4, 6, TAIL=0),
            cfg(64, 64, 128, 8, 4), cfg(64, 64, 128, 4, 4, FLATTEN=0), cfg(64, 128, 128, 8, 3),
            cfg(64, 32, 128, 4, 4)]


def inputs(m: int, k: int, n: int):
    from dlblas_kernels.kernels import ffn

    gen = torch.Generator().manual_seed(m + 7 * k + 3 * n)
    x, w1, w3, rms_w, eps, _ = ffn.example({"tokens": m, "hidden": k, "inter": n}, torch.bfloat16,
                                           torch.device("cuda"), gen)
    return x, w1, w3, rms_w, eps


def plan_of(config: dict, args: tuple):
    from dlblas_kernels.kernels import ffn

    from dlcore.runtime.template import device_profile
    return ffn.plan((*args, None), config, device_profile(torch.device("cuda")))


def compile_one(job: tuple) -> str:
    m, k, n, config = job
    try:
        plan_of(config, inputs(m, k, n)).run()
        torch.cuda.synchronize()
        return ""
    except Exception as error:  # a config the chip cannot take: reported, not fatal
        return f"{type(error).__name__}: {str(error)[:200]}"


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3  # us


def apply(best: dict) -> None:
    from dlblas_kernels.blocks import ffn_prefill

    line = "PREFILL_TILE = dict(" + ", ".join(f"{k}={v}" for k, v in best.items()) + ")"
    for path in {pathlib.Path(ffn_prefill.__file__),
                 pathlib.Path("plugins/dlblas_kernels/dlblas_kernels/blocks/ffn_prefill.py")}:
        text = path.read_text()
        path.write_text(re.sub(r"^PREFILL_TILE = dict\(.*\)$", line, text, count=1, flags=re.M))
        print(f"applied to {path}: {line}")


def selection(m: int, k: int, n: int) -> None:
    """get_op's choice at a small shape, what it measured, and both candidates timed alternately."""
    import dlcore

    args = inputs(m, k, n)
    bound = dlcore.get_op("ffn", args)
    print(f"M={m} K={k} N={n}: get_op chose {bound.impl.name}; measured "
          f"{ {name: round(t * 1e3, 1) for name, t in bound.selection.measured.items()} } us")
    impls = {name: dlcore.get_op("ffn", args, impl=name) for name in ("triton", "torch")}
    for fn in impls.values():
        fn(*args)
    times = {name: [] for name in impls}
    for _ in range(3):
        for name, fn in impls.items():
            times[name].append(round(bench(lambda fn=fn: fn(*args)), 1))
    print(f"  alternating rounds (us): {times}")
    torch.cuda.synchronize()
    time.sleep(2)  # the GPU idles, as while a candidate compiles
    first = round(bench(lambda fn=impls["triton"]: fn(*args)), 1)
    again = round(bench(lambda fn=impls["triton"]: fn(*args)), 1)
    print(f"  triton after 2 s idle: {first} us, then {again} us")


def references(args: tuple, profile) -> tuple[dict[str, float], torch.Tensor]:
    """The matmul over [w1; w3] alone (cuBLAS, Triton) and the eager composite, in us; the float32 output."""
    from dlblas_kernels.blocks import gemm
    from dlblas_kernels.kernels import ffn
    from dlblas_kernels.kernels import matmul as mm

    from dlcore.runtime import launch as warm
    x, w1, w3, rms_w, eps = args
    (m, k), n = x.shape, w1.shape[0]
    w13 = torch.cat([w1, w3])
    xn = torch.nn.functional.rms_norm(x, (k,), rms_w, eps)
    c = torch.empty(m, 2 * n, device="cuda", dtype=torch.bfloat16)
    calls = gemm.gemm_calls(xn, w13.T, c, mm.heuristic(m, 2 * n, k, profile), profile)[0]
    refs = {"cublas gemm [M, 2N]": bench(lambda: torch.matmul(xn, w13.T)),
            "triton matmul [M, 2N]": bench(lambda: [warm.launch(call) for call in calls]),
            "eager composite": bench(lambda: ffn.ffn_w13_composite(x, w13, rms_w, eps))}
    return refs, ffn.ffn_w13_composite(x.float(), w13.float(), rms_w.float(), eps)


def main() -> None:
    from dlblas_kernels.kernels import ffn

    from dlcore.runtime import launch as warm
    from dlcore.runtime.template import device_profile

    out = open(sys.argv[1], "a") if len(sys.argv) > 1 and not sys.argv[1].startswith("--") else None
    shapes = [tuple(int(v) for v in s.split("x")) for s in os.environ.get("SWEEP_SHAPES", SHAPES).split(",")]
    jobs = [(m, k, n, c) for m, k, n in shapes for c in candidates(m)]
    t0 = time.time()
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(12, len(jobs)), mp_context=context) as pool:
        failed = {repr(j): e for j, e in zip(jobs, pool.map(compile_one, jobs)) if e}
    print(f"compiled {len(jobs)} in {time.time() - t0:.0f}s; failed: {failed}", flush=True)
    profile = device_profile(torch.device("cuda"))
    block = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    copy = 2 * block.numel() / bench(block.clone) / 1e3  # GB/s, bytes read + written
    print(f"copy bandwidth {copy:.0f} GB/s", flush=True)
    space = ffn.KERNEL.implementation.space(profile)
    totals: dict[str, float] = {}
    for m, k, n in shapes:
        args = inputs(m, k, n)
        refs, ref = references(args, profile)
        flops = 4 * m * n * k
        for name, us in refs.items():
            print(f"M={m:6d} K={k:5d} N={n:6d} {name:24s} {us:9.1f} us {flops / us / 1e6:6.1f} TFLOP/s", flush=True)
        for config in candidates(m):
            if repr((m, k, n, config)) in failed:
                continue
            plan = plan_of(config, args)
            plan.result.fill_(float("nan"))
            plan.run()
            err = ((plan.result.float() - ref).norm() / ref.norm()).item()
            us = bench(lambda plan=plan: [warm.launch(call) for call in plan.calls])
            kernel = plan.calls[-1].kernel.__name__
            if plan.calls[-1].kwargs.get("TAIL"):
                kernel += f" tail_split={plan.calls[-1].args[17]}"
            if m <= 16:  # streaming: the share of a copy's bandwidth spent reading w1 and w3
                splits = plan.calls[0].kwargs.get("SPLIT_K", 1)
                rate = 4 * n * k / us / 1e3
                kernel += (f" programs={plan.calls[0].grid[0]} columns={plan.calls[0].args[15]} SPLIT_K={splits}"
                           f" TMA={int(plan.calls[0].kwargs.get('TMA', 0))}"
                           f" {rate:.0f} GB/s {rate / copy:.0%} of copy")
            if m > 128 and space.is_valid(config) is None:
                key = json.dumps(config, sort_keys=True)
                totals[key] = totals.get(key, 0.0) + us
            print(f"M={m:6d} K={k:5d} N={n:6d} {us:9.1f} us {flops / us / 1e6:6.1f} TFLOP/s "
                  f"x{refs['eager composite'] / us:.3f} of eager  err {err:.1e}  {kernel} {config}", flush=True)
            if out:
                out.write(json.dumps({"m": m, "k": k, "n": n, "us": round(us, 2), "tflops": round(flops / us / 1e6, 1),
                                      "rel_err": float(f"{err:.2e}"), "kernel": kernel, "config": config,
                                      "refs_us": {k_: round(v, 2) for k_, v in refs.items()}}) + "\n")
    if "--apply" in sys.argv and totals:
        best = min(totals, key=totals.__getitem__)
        current = json.dumps(ffn.PREFILL_TILE, sort_keys=True)
        print(f"best over the large shapes: {best} {totals[best]:.1f} us; current {totals.get(current)}")
        if current not in totals or totals[best] < 0.98 * totals[current]:
            apply(json.loads(best))
    for m, k, n in shapes:
        if m <= 128 and os.environ.get("SWEEP_SELECTION", "1") != "0":
            selection(m, k, n)


if __name__ == "__main__":
    main()
