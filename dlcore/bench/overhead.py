"""What dlcore costs per call, apart from the kernel: ``python -m dlcore.bench.overhead``.

- ``warm`` (GPU): a tiny launch through the bound op against ``kernel[grid](...)`` of the same
  compiled kernel, microseconds of host time per call, median of 10^4 calls.
- ``train``: a training step (forward and backward) of one tiny call: the bound op's eager path,
  the same through the custom op's dispatcher, and eager torch.
- ``hot``: ``get_op`` on an in-process cache hit (the signature is computed, the bound op found).
- ``cold``: ``get_op`` in a new process on a disk-cache hit, plugin discovery included (torch and
  triton are imported first: a process that runs kernels has them anyway).
- ``first`` (GPU): in new processes, with Triton's cache and dlcore's warm (CUDA context up):
  ``get_op`` and the first and second call of rms_norm (bfloat16, 4096x4096), next to a plain
  Triton kernel's first call through ``kernel[grid](...)`` (Triton's own first-call floor).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl

CALLS = 10_000


def per_call_us(fn: Callable[[], object], calls: int = CALLS) -> float:
    """Median host microseconds of one ``fn()`` call (each call timed on its own)."""
    for _ in range(100):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1e3


def warm(device: str = "cuda") -> dict[str, float]:
    """silu_and_mul on one row of 256: the launch is all there is."""
    from dlblas_kernels import silu_and_mul as silu_module
    from dlblas_kernels.kernels.silu_and_mul import KERNEL

    import dlcore

    x = torch.randn(1, 512, device=device, dtype=torch.float16)
    bound = dlcore.get_op("silu_and_mul", (x,))
    plan = KERNEL.implementation.plan((x,), bound.config, bound.profile)
    (call,) = plan.calls
    out = plan.result

    def triton_launch():
        call.kernel[call.grid](*call.args, **call.kwargs)

    def triton_launch_with_output():
        o = torch.empty_like(out)
        call.kernel[call.grid](x, o, *call.args[2:], **call.kwargs)

    compiled = call.kernel[call.grid](*call.args, **call.kwargs)
    values = list(call.args) + [call.kwargs["BLOCK_N"]]
    grid = tuple(call.grid) + (1,) * (3 - len(call.grid))
    stream = torch.cuda.current_stream().cuda_stream

    def compiled_run():
        compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, None, None, None, *values)

    results = {
        "compiled.run(...) alone (the floor: no allocation, no checks)": per_call_us(compiled_run),
        "kernel[grid](...) (output preallocated)": per_call_us(triton_launch),
        "kernel[grid](...) + torch.empty output": per_call_us(triton_launch_with_output),
        "bound op (get_op result)": per_call_us(lambda: bound(x)),
        "dlblas_kernels.silu_and_mul (public function)": per_call_us(lambda: silu_module(x)),
    }
    torch.cuda.synchronize()
    return results


def train(device: str = "cuda") -> dict[str, float]:
    """silu_and_mul forward and backward (``torch.autograd.grad``) on one row of 256 that requires
    grad: the bound op's eager path (a ``torch.autograd.Function``), the same through the custom op
    (the dispatcher, as ``torch.compile`` and dispatch modes see it), and eager torch."""
    import dlcore
    import dlcore.runtime.template as template

    x = torch.randn(1, 512, device=device, dtype=torch.float16, requires_grad=True)
    grad = torch.ones(1, 256, device=device, dtype=torch.float16)
    bound = dlcore.get_op("silu_and_mul", (x,))

    def step(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], object]:
        return lambda: torch.autograd.grad(fn(x), x, grad)

    def composite(t: torch.Tensor) -> torch.Tensor:
        gate, up = t.chunk(2, -1)
        return torch.nn.functional.silu(gate) * up

    eager = template.plain_eager_forward
    results = {"training step, bound op (eager: autograd.Function)": per_call_us(step(bound), 2000)}
    template.plain_eager_forward = lambda values: False
    try:
        results["training step, bound op through the custom op (dispatcher)"] = per_call_us(step(bound), 2000)
    finally:
        template.plain_eager_forward = eager
    results["training step, eager torch (silu(gate) * up)"] = per_call_us(step(composite), 2000)
    if device == "cuda":
        torch.cuda.synchronize()
    return results


def hot(device: str) -> dict[str, float]:
    import dlcore

    x = torch.randn(8, 256, device=device)
    w = torch.randn(256, device=device)
    dlcore.get_op("rms_norm", (x, w))
    return {"get_op in-process hit (rms_norm)": per_call_us(lambda: dlcore.get_op("rms_norm", (x, w)), 2000)}


COLD = """
import json, sys, time, torch, triton
x = torch.randn(8, 256, device=sys.argv[1]); w = torch.randn(256, device=sys.argv[1])
start = time.perf_counter()
import dlcore
op = dlcore.get_op("rms_norm", (x, w))
bound = time.perf_counter()
op(x, w)
torch.cuda.synchronize() if x.is_cuda else None
done = time.perf_counter()
print(json.dumps({"ms": (bound - start) * 1e3, "first": (done - bound) * 1e3, "how": op.selection.describe()}))
"""


def cold(device: str, runs: int = 5) -> dict[str, float]:
    """A first ``dlcore tune`` fills the disk cache; new processes then hit it, plugin discovery (or
    the plugin index) included, and make their first call."""
    env = dict(os.environ)
    subprocess.run([sys.executable, "-m", "dlcore.cli", "tune", "rms_norm", "--shape", "tokens=8,hidden=256",
                    "--dtype", "float32", "--device", device, "--strategy", "grid", "--budget", "2"],
                   check=True, capture_output=True, env=env)
    found = []
    for _ in range(runs + 1):
        done = subprocess.run([sys.executable, "-c", COLD, device], check=True, capture_output=True, text=True,
                              env=env)
        found.append(json.loads(done.stdout.strip().splitlines()[-1]))
    found.pop(0)  # the first one wrote the plugin index the others read
    return {f"get_op in a new process, disk hit ({found[0]['how']}), ms": statistics.median(r["ms"] for r in found),
            "  then its first call, ms": statistics.median(r["first"] for r in found)}


@triton.jit
def _double_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    # out = 2 * x, one block of BLOCK elements per program: a kernel that costs nothing but its launch
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * 2, mask=mask)


def first_process(kind: str) -> None:
    """Run in a new process: prints the ms of ``get_op`` and of the first and second call, as JSON;
    ``kind`` is ``dlcore`` (rms_norm) or ``triton`` (:func:`_double_kernel` through Triton)."""
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    ms: dict[str, float] = {}
    if kind == "triton":
        out = torch.empty_like(x)

        def call() -> None:
            _double_kernel[(x.numel() // 1024,)](x, out, x.numel(), BLOCK=1024)
    else:
        import dlcore

        start = time.perf_counter()
        op = dlcore.get_op("rms_norm", (x, w))
        ms["get_op"] = (time.perf_counter() - start) * 1e3

        def call() -> None:
            op(x, w)
    for name in ("first call", "second call"):
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        ms[name] = (time.perf_counter() - start) * 1e3
    print(json.dumps(ms))


def first(runs: int = 5) -> dict[str, float]:
    """Medians over ``runs`` new processes of each kind, after one that fills the caches."""
    results = {}
    for kind in ("dlcore", "triton"):
        found = []
        for _ in range(runs + 1):
            done = subprocess.run([sys.executable, __file__, "--process", kind], check=True, capture_output=True,
                                  text=True)
            found.append(json.loads(done.stdout.strip().splitlines()[-1]))
        found.pop(0)
        label = "rms_norm bf16 4096x4096" if kind == "dlcore" else "plain Triton kernel"
        for name in found[0]:
            results[f"new process, warm caches, {label}: {name}, ms"] = statistics.median(r[name] for r in found)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--process"]:  # one of first()'s new processes
        first_process(argv[1])
        return 0
    parser = argparse.ArgumentParser(prog="python -m dlcore.bench.overhead")
    parser.add_argument("what", nargs="+", choices=("warm", "train", "hot", "cold", "first"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    results: dict[str, float] = {}
    for what in args.what:
        measure = {"warm": warm, "train": train, "hot": hot, "cold": cold, "first": lambda device: first()}[what]
        results.update(measure(args.device))
    for name, value in results.items():
        unit = "" if name.endswith("ms") else " us"
        print(f"{name:60s} {value:10.2f}{unit}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
