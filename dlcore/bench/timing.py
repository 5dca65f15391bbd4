"""Measuring the device: the timers an op's rounds go through, and the probes a run takes beside
them (its copy bandwidth, a same-size copy of each shape's bytes, the host's time for one small
op). :mod:`dlcore.bench.harness` runs the ops through them; :mod:`dlcore.bench.report` reports the
numbers."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

Timer = Callable[[Callable[[], object]], float]


def gbps(nbytes: float, ms: float) -> float:
    """Bytes moved in ``ms`` milliseconds, in GB/s (1e9 bytes per second)."""
    return nbytes / ms / 1e6


def first_line(exc: BaseException) -> str:
    """``Type: the message's first line``: why a timed callable stopped."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def time_round_robin(work: dict[str, Callable[[], object]], timer: Timer, rounds: int,
                     ) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Time each callable once per round; round ``r`` starts at the ``r``-th one (mod their number).

    Returns the times (ms) per name, and why each one that raised stopped being timed.
    """
    names = list(work)
    times: dict[str, list[float]] = {name: [] for name in names}
    failed: dict[str, str] = {}
    for r in range(rounds):
        start = r % len(names) if names else 0
        for name in names[start:] + names[:start]:
            if name in failed:
                continue
            try:
                times[name].append(timer(work[name]))
            except Exception as exc:  # noqa: BLE001 - one failing implementation must not end the run
                failed[name] = first_line(exc)
    return {n: t for n, t in times.items() if n not in failed}, failed


TIMERS = ("do_bench", "cudagraph")


class GraphTimer:
    """Median ms of ``fn`` replayed from a CUDA graph, on a side stream of its own.

    :func:`run_bench` runs every shape on :attr:`stream` (its inputs, its warm-up, the untimed
    forward of a backward), so the kernels of a backward, which go to the stream their forward ran
    on, are captured with the rest. Copies are timed with ``do_bench`` (:attr:`copy_timer`): a large
    copy replayed from a graph runs well below its eager bandwidth (most likely a copy engine
    instead of a copy kernel), which would make "%copy" meaningless.
    """

    def __init__(self, device: torch.device, rep_ms: float, copy_timer: Timer):
        self.device = device
        self.rep_ms = rep_ms
        self.copy_timer = copy_timer
        self.stream = torch.cuda.Stream(device)

    def __call__(self, fn: Callable[[], object]) -> float:
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            fn()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(5):
                fn()
            end.record()
            end.synchronize()
            calls = max(1, min(int(self.rep_ms / max(start.elapsed_time(end) / 5, 1e-3)), 1000))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self.stream):
                for _ in range(calls):
                    fn()
            times = []
            for _ in range(10):
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / calls)
            return statistics.median(times)


def default_timer(device: torch.device, backend: Any, warmup_ms: float = 10, rep_ms: float = 40,
                  kind: str = "do_bench") -> tuple[Timer, str]:
    """On CUDA: ``do_bench``'s median (L2 flushed before each run; the host's time per call shows
    where it exceeds the GPU's), or with ``kind="cudagraph"`` a :class:`GraphTimer` (the calls
    captured in a CUDA graph and replayed: GPU time alone, for every implementation alike, e.g. a
    backward whose autograd engine costs more host time than its kernels take). Elsewhere the
    backend's timer."""
    if kind not in TIMERS:
        raise ValueError(f"unknown timer {kind!r}; use one of {', '.join(TIMERS)}")
    if device.type == "cuda":
        from triton.testing import do_bench

        def timer(fn: Callable[[], object]) -> float:
            with torch.cuda.device(device):
                return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))

        name = f"triton.testing.do_bench median (warmup {warmup_ms:g} ms, rep {rep_ms:g} ms)"
        if kind == "cudagraph":
            return (GraphTimer(device, rep_ms, timer),
                    f"CUDA graph replays on a side stream, median of 10 (rep {rep_ms:g} ms); copies: {name}")
        return timer, name
    return (lambda fn: backend.timer(fn, device)), f"the {backend.name} backend's timer"


def copy_bandwidth(device: torch.device, timer: Timer, nbytes: int) -> float:
    """GB/s of one ``nbytes`` device-to-device copy, counting the bytes read and the bytes written."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return gbps(2 * src.nbytes, ms)


def host_call_us(device: torch.device, backend: Any, calls: int = 2000) -> float:
    """Microseconds of host time for one small op on ``device`` (an in-place add to one element),
    the least of three means of ``calls`` calls issued without waiting: the floor under every
    timed call of the run. A row whose time is near it (or near a few of it, for an op of several
    launches) times the host, not the device: hosts of the same GPU differ by 2x and more."""
    t = torch.zeros(1, device=device)
    for _ in range(100):
        t.add_(1)
    backend.synchronize(device)
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            t.add_(1)
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
        backend.synchronize(device)
    return best


def copy_ms(device: torch.device, timer: Timer, moved: int) -> float:
    """ms of a device-to-device copy that reads and writes ``moved`` bytes in all."""
    src = torch.ones(max(moved // 2, 1), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return timer(lambda: dst.copy_(src))


def default_copy_bytes(device: torch.device) -> int:
    """Far larger than any cache of the device: 1 GiB on accelerators, 64 MiB on the CPU."""
    return 2**26 if device.type == "cpu" else 2**30
