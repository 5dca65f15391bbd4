"""Landscapes: every config of a space measured once, kept as JSON, replayed to compare strategies.

Recording needs the device (``python -m dlcore.bench.landscape record ...`` on a GPU host);
replaying needs nothing but the file: each strategy searches the recorded space with the recorded
times as its objective, over many seeds, and the evaluations it needed to come within 5% of the
best config are counted. That is how search quality is judged without a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from dlcore.declarations.space import Config, SearchSpace
from dlcore.tuning.strategy import Budget, SearchResult, Strategy

WITHIN = 0.05


def _config_key(config: Config) -> str:
    return json.dumps(config, sort_keys=True)


class RecordedObjective:
    """The objective of a recorded landscape: a lookup of each config's measured time."""

    def __init__(self, evaluations: Sequence[dict[str, Any]]):
        self._times = {_config_key(e["config"]): e for e in evaluations}

    def __call__(self, config: Config) -> float:
        entry = self._times[_config_key(config)]
        if entry["time_ms"] is None:
            raise RuntimeError(entry.get("reason") or "failed when recorded")
        return float(entry["time_ms"])


def space_of(landscape: dict[str, Any]) -> SearchSpace:
    """The recorded configs as a space (a lookup space: exactly the configs that were measured)."""
    from dlcore.declarations.space import Choice, Constraint

    configs = [e["config"] for e in landscape["evaluations"]]
    names = list(configs[0])
    recorded = {_config_key(c) for c in configs}
    params = [Choice(n, tuple(sorted({c[n] for c in configs}))) for n in names]
    return SearchSpace(params=params, constraints=(
        Constraint("recorded in the landscape", lambda c: _config_key({n: c[n] for n in names}) in recorded),))


def replay(landscape: dict[str, Any], strategies: Sequence[Strategy], seeds: int = 20,
           fraction: float = WITHIN, budget: int | None = None) -> dict[str, dict[str, Any]]:
    """Per strategy: the median (over ``seeds``) evaluations to come within ``fraction`` of the optimum.

    A search that does not get there within ``budget`` evaluations (default: the whole space)
    counts as infinitely many.
    """
    space = space_of(landscape)
    objective = RecordedObjective(landscape["evaluations"])
    finite = [e["time_ms"] for e in landscape["evaluations"] if e["time_ms"] is not None]
    optimum = min(finite)
    size = space.size()
    report = {}
    for strategy in strategies:
        counts = []
        for seed in range(seeds):
            limit = Budget(evaluations=min(size, budget or size))
            result: SearchResult = strategy.search(space, objective, limit, seed=seed)
            count = result.evaluations_to_within(fraction, optimum)
            counts.append(count if count is not None else math.inf)
        report[strategy.name] = {
            "median_evaluations": statistics.median(counts),
            "fraction_of_space": statistics.median(counts) / size,
            "worst": max(counts),
            "seeds": seeds,
            "space_size": size,
        }
    return report


def _compile_chunk(job: tuple[str, str, dict[str, int], str, list[Config]]) -> int:
    """In a worker process: compile (``warmup``, no launch) every config of a chunk into Triton's cache."""
    import torch

    from dlcore.plugins.registry import registry

    op_name, impl_name, sizes, dtype, configs = job
    reg = registry()
    op = reg.op(op_name)
    impl = next(i for i in reg.implementations_of(op_name) if i.name == impl_name)
    args = op.example_inputs(sizes, getattr(torch, dtype), "cuda")
    profile = reg.device_profile(next(a for a in args if isinstance(a, torch.Tensor)).device)
    compiled = 0
    for config in configs:
        try:
            for call in impl.plan(args, config, profile).calls:
                call.kernel.warmup(*call.args, grid=call.grid, **call.kwargs)
            compiled += 1
        except Exception:  # noqa: BLE001 - the timing pass records the reason
            pass
    return compiled


def record(op_name: str, sizes: dict[str, int], dtype: str, impl_name: str = "triton", workers: int = 8,
           seconds: float | None = None, limit: int | None = None) -> dict:
    """Measure every config of ``impl_name``'s space for ``op_name`` at ``sizes`` on the current GPU.

    The configs are measured in a seeded random order, so that a recording cut short by ``seconds``
    (the timing) or ``limit`` (the first ``limit`` configs of that order, compiled and timed: what
    bounds the compiling of a large space) is a uniform sample of the space (``complete`` says
    whether it covers all of it).
    """
    import torch
    import triton

    from dlcore.declarations.signature import make_signature
    from dlcore.plugins.registry import registry
    from dlcore.tuning.objective import Objective

    reg = registry()
    op = reg.op(op_name)
    impl = next(i for i in reg.implementations_of(op_name) if i.name == impl_name)
    device = torch.device("cuda")
    args = op.example_inputs(sizes, getattr(torch, dtype), device)
    backend = reg.backend_for(device)
    signature = make_signature(op, op.bind(args), device)
    profile = reg.profile(backend, device)
    space = reg.refine_space(impl.space(profile), signature, profile)
    configs = list(space.configs())
    size = len(configs)
    random.Random(0).shuffle(configs)
    configs = configs[:limit] if limit is not None else configs
    if workers > 1:
        chunks = [configs[i::workers] for i in range(workers)]
        jobs = [(op_name, impl_name, sizes, dtype, chunk) for chunk in chunks]
        import multiprocessing

        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(_compile_chunk, jobs))
    objective = Objective(op, impl, args, backend, device, check="all")
    evaluations = []
    start = time.perf_counter()
    for i, config in enumerate(configs):
        if seconds is not None and time.perf_counter() - start > seconds:
            break
        try:
            time_ms, reason = objective(config), ""
        except Exception as exc:  # noqa: BLE001 - a failing config is part of the landscape
            time_ms, reason = None, f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        evaluations.append({"config": config, "time_ms": time_ms, "reason": reason})
        sys.stderr.write(f"\r{op_name} {i + 1}/{len(configs)}")
    sys.stderr.write("\n")
    return {
        "op": op_name, "implementation": impl_name, "sizes": sizes, "dtype": dtype,
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "recorded": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "timer": "triton.testing.do_bench median, results checked against the float64 reference",
        "space": space.to_dict(), "space_size": size, "complete": len(evaluations) == size, "evaluations": evaluations,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dlcore.bench.landscape")
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="measure every config of an op's space (GPU)")
    rec.add_argument("op")
    rec.add_argument("--shape", required=True, help="e.g. tokens=4096,hidden=4096,inter=14336")
    rec.add_argument("--dtype", default="bfloat16")
    rec.add_argument("--workers", type=int, default=8, help="processes compiling configs ahead of timing")
    rec.add_argument("--seconds", type=float, default=None, help="stop timing after this long (a random sample)")
    rec.add_argument("--limit", type=int, default=None,
                     help="compile and time only this many configs, a seeded random sample (bounds the compiling too)")
    rec.add_argument("--out", required=True)
    rep = sub.add_parser("replay", help="median evaluations each strategy needs to come within 5%% of the best")
    rep.add_argument("files", nargs="+")
    rep.add_argument("--seeds", type=int, default=20)
    rep.add_argument("--budget", type=int, default=None,
                     help="evaluations per search (default: the whole space); a search short of 5%% counts as inf")
    args = parser.parse_args(argv)
    if args.command == "record":
        from dlcore.bench.presets import parse_sizes

        data = record(args.op, parse_sizes(args.shape), args.dtype, workers=args.workers, seconds=args.seconds,
                      limit=args.limit)
        Path(args.out).write_text(json.dumps(data, indent=1))
        ok = [e for e in data["evaluations"] if e["time_ms"] is not None]
        best = min(e["time_ms"] for e in ok)
        print(f"{args.op}: {len(data['evaluations'])} configs, {len(ok)} ran; best {best:.4f} ms")
        return 0
    from dlcore.bench.table import table
    from dlcore.plugins.registry import registry

    strategies = [registry().strategy(n) for n in ("grid", "random", "tpe")]
    rows = []
    for path in args.files:
        landscape = json.loads(Path(path).read_text())
        for name, r in replay(landscape, strategies, seeds=args.seeds, budget=args.budget).items():
            rows.append((Path(path).name, landscape["gpu"], r["space_size"], name, r["median_evaluations"],
                         f"{100 * r['fraction_of_space']:.1f}%", r["worst"]))
    print(table(rows, ("landscape", "gpu", "configs", "strategy", "median evals to 5%", "of space", "worst")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
