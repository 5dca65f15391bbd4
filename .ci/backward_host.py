"""Where a backward's time goes on the GPU host: the host time of ``torch.autograd.grad`` per call
(autograd's device threads on and off), do_bench's median of the same call (L2 flushed), and the GPU
time alone (20 backwards captured in a CUDA graph) and per kernel (torch.profiler), then cProfile's
top functions of 200 backwards (device threads off, so the profiler sees dlcore's formula). First,
the host cost of one launch of a small kernel (eight pointers) by ``kernel[grid]`` and by dlcore's
direct call of the compiled kernel (tensors, or their addresses as integers), and of one
``torch.empty_strided``. Each op is asked for with the named implementation, its inputs requiring
grad; the forward runs once, untimed, on the timing stream.

    python3 .ci/backward_host.py [OP:IMPL[:SIZES] ...]    (default: ffn:triton ffn:torch softmax:triton)

Shapes: ffn at DeepSeek-V3's shared expert (1024 tokens, 7168 -> 2048) unless SIZES says
(``tokens=16,hidden=4096,inter=14336``), softmax 4096 x 4096; bf16.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time

import torch
import triton
import triton.language as tl

import dlcore
from dlcore.bench.presets import parse_sizes
from dlcore.plugins.registry import registry
from dlcore.runtime import internals, launch

SIZES = {"ffn": dict(tokens=1024, hidden=7168, inter=2048)}


def host_us(fn, calls: int = 300) -> float:
    """The least of three means of ``calls`` calls, host time only (the GPU synchronised between)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return best


@triton.jit
def _eight_pointers(a, b, c, d, e, f, g, h, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(h + offs, tl.load(a + offs, mask=mask) + tl.load(b + offs, mask=mask), mask=mask)


def launch_costs() -> None:
    tensors = [torch.empty(1024, device="cuda") for _ in range(8)]
    compiled = _eight_pointers[(1,)](*tensors, 1024, BLOCK=1024)
    internals.checked()
    stream = torch.cuda.current_stream().cuda_stream
    addresses = [t.data_ptr() for t in tensors]
    costs = {
        "kernel[grid]": lambda: _eight_pointers[(1,)](*tensors, 1024, BLOCK=1024),
        "run_compiled, tensors": lambda: launch.run_compiled(compiled, (1, 1, 1), stream, [*tensors, 1024, 1024]),
        "run_compiled, addresses": lambda: launch.run_compiled(compiled, (1, 1, 1), stream,
                                                               [*addresses, 1024, 1024]),
        "torch.empty_strided": lambda: torch.empty_strided((1024, 7168), (7168, 1), dtype=torch.bfloat16,
                                                           device="cuda"),
    }
    for what, fn in costs.items():
        print(f"{what}: {host_us(fn, 3000):.2f} us", flush=True)


def inputs(name: str, sizes: dict[str, int] | None = None) -> list:
    op = registry().op(name)
    if name == "softmax":
        args = (torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16), -1)
    else:
        args = op.example_inputs(sizes or SIZES[name], torch.bfloat16, torch.device("cuda"))
    return [a.detach().requires_grad_() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]


def measure(name: str, impl: str, stream: torch.cuda.Stream, sizes: dict[str, int] | None = None) -> None:
    leaves = inputs(name, sizes)
    wrt = [a for a in leaves if torch.is_tensor(a) and a.requires_grad]
    bound = dlcore.get_op(name, leaves, impl=impl)
    out = bound(*leaves)
    out = out[0] if isinstance(out, tuple) else out
    dout = torch.randn_like(out)

    def backward():
        return torch.autograd.grad(out, wrt, dout, retain_graph=True)

    for threads in (True, False):
        torch.autograd.set_multithreading_enabled(threads)
        bench = triton.testing.do_bench(backward, warmup=10, rep=40, return_mode="median") * 1e3
        print(f"{name}:{impl} device threads {'on ' if threads else 'off'}: host {host_us(backward):.1f} us, "
              f"do_bench {bench:.1f} us", flush=True)
    graph = torch.cuda.CUDAGraph()
    backward()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(20):
            backward()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    print(f"{name}:{impl} GPU alone: {start.elapsed_time(end) / 20 * 1e3:.1f} us", flush=True)
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            backward()
        torch.cuda.synchronize()
    for event in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:10]:
        print(f"  {event.device_time_total / 20:8.1f} us a backward, {event.count // 20} launches: {event.key[:110]}")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(200):
        backward()
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(16)
    print(text.getvalue(), flush=True)


def main(argv: list[str]) -> None:
    launch_costs()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # the forward on the stream the graph captures (its backward follows it)
        for spec in argv or ["ffn:triton", "ffn:torch", "softmax:triton"]:
            name, _, rest = spec.partition(":")
            impl, _, sizes = rest.partition(":")
            measure(name, impl or "triton", stream, parse_sizes(sizes) if sizes else None)


if __name__ == "__main__":
    main(sys.argv[1:])
