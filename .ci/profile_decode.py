"""Where flash_attention_v2's decode time goes on a GPU (issue #14): Sq 1 against Sk keys, GQA 32/8,
D 128, B 1, bfloat16.

    python3 .ci/profile_decode.py OUT.json [sweep]

For each Sk and each implementation (the Triton bound op, the Triton plan run on every call as the
bound op did while its split scratch was undeclared, SDPA flash and cuDNN as the benchmark's
baselines call them, and the ``sdpa_cudnn`` vendor candidate through ``get_op``):

- ``host_us``: ``time.perf_counter`` around one call, median of 300 (the GPU kept from falling behind);
- ``bench_us``: what ``dlcore bench`` measures, ``triton.testing.do_bench``'s median (L2 flushed by
  a 256 MiB memset before each call: a call whose host time exceeds the memset's shows host time);
- ``gpu_us``: the same do_bench of one call captured in a CUDA graph (the L2 flush alike, the host's
  time hidden behind it): the kernels' own time as the benchmark's flush leaves the L2;
- ``warm_us``: the graph replayed back to back (no flush; the L2 holds what fits).

Then the Triton kernels alone per launch (torch.profiler, flushed), cProfile of the host path, and with
``sweep`` the split kernel's tiles and split counts by ``gpu_us``.
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import statistics
import sys
import time

import torch
from triton.testing import do_bench

SKS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)


def host_us(fn, n=300):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for i in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        if i % 16 == 15:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def graph_of(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def bench_us(fn):
    return do_bench(fn, warmup=5, rep=25, return_mode="median") * 1e3


def warm_us(fn, n=50):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n * 1e3


def measure(fn, found):
    row = {"host_us": host_us(fn), "bench_us": bench_us(fn)}
    try:
        graph = graph_of(fn)
        row["gpu_us"] = bench_us(graph.replay)
        row["warm_us"] = warm_us(graph.replay)
    except Exception as exc:  # noqa: BLE001 - a backend that cannot be captured still has its host numbers
        row["graph_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    found.append(row)
    return row


def workloads(args, bound, vendor, flash, cudnn, planned):
    return {
        "triton bound op": lambda: bound(*args),
        "triton planned each call": lambda: planned(args),
        "sdpa_flash": lambda: flash(*args),
        "sdpa_cudnn": lambda: cudnn(*args),
        "sdpa_cudnn vendor bound op": lambda: vendor(*args),
    }


def main(path, sweep):
    from dlblas_kernels.blocks import attention_decode as decode
    from dlblas_kernels.kernels import flash_attention_v2 as fa

    import dlcore
    from dlcore.runtime.launch import launch, run_plan
    from dlcore.runtime.template import device_profile

    device = torch.device("cuda")
    profile = device_profile(device)
    cache = torch.empty(256 << 18, dtype=torch.int, device=device)
    report = {"device": profile.describe(), "memset_256MiB_us": warm_us(cache.zero_), "rows": [], "sweep": []}
    flash, cudnn = fa.OP.baselines["sdpa_flash"](), fa.OP.baselines["sdpa_cudnn"]()
    gen = torch.Generator(device="cuda").manual_seed(0)

    def write():
        with open(path, "w") as f:
            json.dump(report, f, indent=1)

    for sk in SKS:
        q = torch.randn(1, 1, 32, 128, device=device, dtype=torch.bfloat16, generator=gen)
        k = torch.randn(1, sk, 8, 128, device=device, dtype=torch.bfloat16, generator=gen)
        v = torch.randn(1, sk, 8, 128, device=device, dtype=torch.bfloat16, generator=gen)
        args = (q, k, v, False, None, False)
        bound = dlcore.get_op("flash_attention_v2", args, impl="triton")
        vendor = dlcore.get_op("flash_attention_v2", args, impl="sdpa_cudnn")
        work = workloads(args, bound, vendor, flash, cudnn, lambda a, c=bound.config: run_plan(fa.plan(a, c, profile)))
        with torch.no_grad():
            expected = flash(*args).float()
            for name, fn in work.items():
                rows = []
                row = measure(fn, rows)
                out = fn()
                row.update(name=name, sk=sk, max_abs_diff=(out.float() - expected).abs().max().item())
                report["rows"].append(row)
                print(json.dumps(row), flush=True)
        write()

        if sk in (4096, 65536):
            # the two Triton kernels' own times, the L2 flushed before each call as do_bench does
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile
            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    cache.zero_()
                    bound(*args)
                torch.cuda.synchronize()
            kernels = {e.key: e.device_time_total / e.count for e in prof.key_averages() if "decode" in e.key}
            report[f"kernels_us_sk{sk}"] = kernels
            print(sk, kernels, flush=True)
            for name in ("triton bound op", "sdpa_cudnn"):
                profiler = cProfile.Profile()
                fn = work[name]
                profiler.enable()
                for _ in range(500):
                    fn()
                profiler.disable()
                torch.cuda.synchronize()
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(12)
                report[f"cprofile_{name}_sk{sk}"] = text.getvalue()[-3500:]
            write()

        if sweep and sk in (1024, 4096, 16384, 65536):
            base = decode.default_config(q, k, profile)
            tiles = [(64, 4, 3), (64, 4, 2), (64, 8, 3), (128, 4, 2), (128, 8, 2), (32, 4, 3)]
            out = torch.empty_like(q)
            lse = torch.empty(1, 32, 1, device=device, dtype=torch.float32)
            for block_n, warps, stages in tiles:
                tile_bytes = 2 * block_n * 128 * 2
                resident = max(1, profile.shared_memory_per_program // (stages * tile_bytes))
                splits = max(1, min(profile.cores * resident // 8, base["SPLITS"] * 2))
                for s in sorted({max(1, splits // 2), splits, base["SPLITS"], 2 * splits}):
                    config = {"SPLITS": s, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
                    calls, scratch = decode.decode_calls(q, k, v, out, lse, causal=False, scale=128 ** -0.5,
                                                         profile=profile, config=config)

                    def run(calls=calls):
                        for call in calls:
                            launch(call)
                    try:
                        run()
                        torch.cuda.synchronize()
                        diff = (out.float() - expected).abs().max().item()
                        graph = graph_of(run)
                        row = {"sk": sk, **config, "gpu_us": bench_us(graph.replay), "max_abs_diff": diff,
                               "default": config == {**base}}
                    except Exception as exc:  # noqa: BLE001 - a config out of resources is a row, not a stop
                        row = {"sk": sk, **config, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                    report["sweep"].append(row)
                    print(json.dumps(row), flush=True)
            write()


if __name__ == "__main__":
    main(sys.argv[1], "sweep" in sys.argv[2:])
