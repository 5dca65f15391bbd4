"""fused_rotary_and_fa's training step (forward and ``torch.autograd.grad`` of q, k, v, as get_op's
selection times it) for the composite and the Triton kernel, bf16, B 2, H 16, D 128: do_bench's
median, back-to-back steps (GPU time per step, and host time per step without synchronising), and
the step captured in a CUDA graph (GPU time alone). A step whose host time exceeds its GPU time is
host-bound, and eager selection then measures the host.

    python3 .ci/training_step_host.py
"""

from __future__ import annotations

import json
import time

import torch
from dlblas_kernels.kernels import fused_rotary_and_fa as F
from triton.testing import do_bench

from dlcore.tuning.selection import step

SHAPES = ((2048, True), (2048, False), (4096, True))


def inputs(seq: int, causal: bool) -> tuple:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, seq, 16, 128, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for _ in range(3))
    cos, sin = (torch.randn(seq, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    return q, k, v, cos, sin, causal


def measure(fn) -> dict:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    found = {"do_bench_ms": round(do_bench(fn, warmup=5, rep=25, return_mode="median"), 4)}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    began = time.perf_counter()
    start.record()
    for _ in range(50):
        fn()
    end.record()
    host = time.perf_counter() - began
    torch.cuda.synchronize()
    found["loop_ms"] = round(start.elapsed_time(end) / 50, 4)
    found["host_ms"] = round(host * 1e3 / 50, 4)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
        found["graph_ms"] = round(do_bench(graph.replay, warmup=5, rep=25, return_mode="median"), 4)
    except Exception as exc:  # noqa: BLE001 - a step that cannot be captured says why
        found["graph"] = str(exc).splitlines()[0][:100]
    return found


def main() -> None:
    for seq, causal in SHAPES:
        args = inputs(seq, causal)
        row = {"seq": seq, "causal": causal}
        for name, run in (("composite", lambda a: F.composite(*a)), ("triton", lambda a: F.fused_rotary_and_fa(*a))):
            row |= {f"{name}_{key}": value for key, value in measure(step(run, args, True)).items()}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
