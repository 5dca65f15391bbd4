"""Time rms_norm's backward over its launch choices (rows per tile, elements per thread, resident
elements per multiprocessor) at LLaMA-3 and Qwen2.5 sizes on the GPU, CUDA-graph replays, next to a
copy of the same bytes; prints one line each, the current default marked.

    python3 .ci/sweep_rms_norm_backward.py
"""

import functools
import importlib
import itertools
import os

import torch
import triton

from dlcore.declarations.signature import make_signature
from dlcore.plugins.registry import registry
from dlcore.runtime.template import device_profile

m = importlib.import_module("dlblas_kernels.kernels.rms_norm")

op = registry().op("rms_norm")
DEVICE = torch.device(os.environ.get("SWEEP_DEVICE", "cuda"))  # cpu (TRITON_INTERPRET=1): a dry run
SHAPES = [tuple(int(n) for n in s.split("x"))
          for s in os.environ.get("SWEEP_SHAPES", "4096x3584,4096x4096,16384x3584,4096x8192,16384x4096").split(",")]
DEFAULTS = (m.BACKWARD_ELEMENTS_PER_THREAD, m.RESIDENT_ELEMENTS)


def beyond_tolerance(got, expected) -> str:
    """Each output's largest error and how many elements are beyond 0.06 + 2% of the reference."""
    found = []
    for name, g, e in zip(("dx", "dw"), got, expected):
        err = (g.double() - e).abs()
        found.append(f"{name} max err {err.max().item():.3g}, {(err > 6e-2 + 2e-2 * e.abs()).sum().item()} beyond")
    return ", ".join(found)


def timed(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=40) if DEVICE.type == "cuda" else 1.0


for tokens, hidden in SHAPES:
    args = op.example({"tokens": tokens, "hidden": hidden}, torch.bfloat16, DEVICE, torch.Generator().manual_seed(0))
    x, weight, eps = args
    dy = torch.randn_like(x)
    bwd = (dy, x, weight, None, eps)
    nbytes = m.cost(args, "bwd")[0]
    source = torch.empty(nbytes // 2, dtype=torch.uint8, device=DEVICE)
    target = torch.empty_like(source)
    copy_ms = timed(functools.partial(target.copy_, source))
    expected = m.rms_norm_backward_reference(dy.double(), x.double(), weight.double(), None, eps)
    default = m.default_config(make_signature(op, args, DEVICE), device_profile(DEVICE))
    print(f"tokens={tokens} hidden={hidden} {nbytes / 2**20:.0f} MiB: copy {copy_ms * 1e3:.2f} us "
          f"({nbytes / copy_ms / 1e6:.0f} GB/s); forward default {default}", flush=True)
    plan = m.backward_plan(bwd, default, device_profile(DEVICE))
    ms = timed(plan.run)
    print(f"  default plan: warps={plan.calls[0].kwargs['num_warps']} programs={plan.calls[0].grid[0]} "
          f"{ms * 1e3:.2f} us {copy_ms / ms:.0%} of copy", flush=True)
    for block_m, per_thread, resident in itertools.product((1, 2, 4), (4, 8, 16, 32), (4096, 8192, 16384, 32768)):
        m.BACKWARD_ELEMENTS_PER_THREAD, m.RESIDENT_ELEMENTS = per_thread, resident
        config = dict(default, BLOCK_M=block_m, num_warps=1)
        plan = m.backward_plan(bwd, config, device_profile(DEVICE))
        if plan.calls[0].kwargs["BLOCK_M"] != block_m:
            continue  # narrowed to the same tile as a smaller block_m
        try:
            got = plan.run()
            ok = beyond_tolerance(got, expected)
            ms = timed(plan.run)
        except Exception as exc:  # noqa: BLE001
            print(f"  block_m={block_m} per_thread={per_thread} resident={resident} failed: {exc}"[:200])
            continue
        main = plan.calls[0]
        print(f"  block_m={block_m} per_thread={per_thread:3d} resident={resident:6d} "
              f"warps={main.kwargs['num_warps']:3d} programs={main.grid[0]:5d} {ms * 1e3:8.2f} us "
              f"{nbytes / ms / 1e6:6.0f} GB/s "
              f"{copy_ms / ms:5.0%} of copy; {ok}", flush=True)
    m.BACKWARD_ELEMENTS_PER_THREAD, m.RESIDENT_ELEMENTS = DEFAULTS
