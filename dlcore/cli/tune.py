"""`dlcore tune`: search an op's configs for given shapes, remember the winners, show the curves."""

from __future__ import annotations

import argparse
import math
import sys
import warnings

from dlcore.bench.table import table
from dlcore.cli.options import DTYPES, check_sizes, default_dtype, parse_sizes, require_plotting, resolve_device
from dlcore.errors import CacheFileError, InvalidOptionError


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help="tune an op for shapes; the winners go to the cache")
    p.add_argument("op", nargs="?", help="the op (omit with --all)")
    p.add_argument("--shape", type=parse_sizes, action="append", default=[],
                   help="named sizes, e.g. tokens=4096,hidden=4096; repeat for several shapes")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="bfloat16; float32 on a CPU")
    p.add_argument("--device", default=None, help="cuda when available, else cpu")
    p.add_argument("--strategy", default="tpe", help="one or several, comma-separated: grid,random,tpe")
    p.add_argument("--budget", type=int, default=None, help="evaluations per implementation")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="best-so-far time against evaluations")
    p.add_argument("--all", action="store_true", help="every op, on the preset model shapes")
    p.set_defaults(func=run_tune)


#: token counts of the preset model shapes that ``--all`` tunes: decoding, a small batch, prefill
ALL_TOKENS = (1, 64, 4096)


def _shapes_for(op, args: argparse.Namespace) -> list[dict[str, int]]:
    if args.shape:
        return args.shape
    if args.all:
        from dlcore.bench.presets import shapes_for

        shapes, _ = shapes_for(op.example_sizes, "all", tokens=ALL_TOKENS)
        return [shape.sizes for shape in shapes]
    return [dict(op.example_sizes)]


def _nothing_to_tune(name: str, inputs, shape: str) -> str:
    """Why nothing but the op's torch reference would run ``inputs`` (a search would time the
    reference alone and store it), in one line; '' when an implementation to tune accepts them."""
    from dlcore.dispatch.dispatcher import FallbackWarning, default

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)  # the line returned says the same
        call = default().prepare(name, inputs)
    if not all(getattr(c, "fallback_only", False) for c in call.candidates):
        return ""
    why = "; ".join(f"{impl}: {reason}" for impl, reason in call.declined.items())
    return f"dlcore tune {name} ({shape}): nothing to tune, only the torch reference runs these inputs ({why})"


class Progress:
    """One status line per search, rewritten after each evaluation."""

    def __init__(self, label: str, total: int | None):
        self.label, self.total, self.done, self.best = label, total, 0, math.inf

    def __call__(self, evaluation) -> None:
        self.done += 1
        self.best = min(self.best, evaluation.time)
        total = f"/{self.total}" if self.total else ""
        best = f"{self.best:.4f} ms" if math.isfinite(self.best) else "-"
        sys.stderr.write(f"\r  {self.label}: {self.done}{total} evaluations, best {best}   ")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")


def run_tune(args: argparse.Namespace) -> int:
    from dlcore.dispatch.dispatcher import default
    from dlcore.plugins.registry import registry

    reg = registry()
    if not args.op and not args.all:
        raise InvalidOptionError("dlcore tune: name an op (`dlcore ops` lists them), or give --all")
    ops = sorted(reg.ops) if args.all and not args.op else [args.op]
    strategies = [s.strip() for s in args.strategy.split(",") if s.strip()]
    device = resolve_device(args.device)
    dtype = DTYPES[default_dtype(args.dtype, device)]
    if args.plot:
        require_plotting(args.plot)
    store = default().store
    if not store.writable:  # before the search: its results would be measured for nothing
        raise CacheFileError(f"cannot keep tuned configs: the kernel cache at {store.directory} is "
                             f"{store.mode.value} (point DLCORE_CACHE_DIR at a directory this user can write)")
    if not strategies:
        raise InvalidOptionError(f"--strategy {args.strategy!r} names no strategy")
    rows, curves = [], {}
    for name in ops:
        op = reg.op(name)
        if op.example is None and args.all:
            print(f"{name}: declares no example inputs; skipped", file=sys.stderr)
            continue
        for sizes in _shapes_for(op, args):
            check_sizes(op, sizes)
            full = {**op.example_sizes, **sizes}
            inputs = op.example_inputs(full, dtype, device)
            shape = ",".join(f"{k}={v}" for k, v in full.items())
            untunable = _nothing_to_tune(name, inputs, shape)
            if untunable and args.all:
                print(untunable, file=sys.stderr)
                continue
            if untunable:
                raise InvalidOptionError(untunable)
            for strategy in strategies:
                progress = Progress(f"{name} {shape} [{strategy}]", args.budget)
                bound, results = default().tune_op(name, inputs, strategy=strategy, budget=args.budget,
                                                   progress=progress)
                progress.close()
                for impl, result in results.items():
                    curves.setdefault(f"{name} {shape}", {})[f"{strategy}:{impl}"] = result.best_so_far()
                    rows.append((name, shape, strategy, impl, len(result.evaluations),
                                 f"{result.best_time:.4f}" if math.isfinite(result.best_time) else "failed",
                                 result.best_config))
                rows.append((name, shape, "-> kept", bound.impl.name, "", f"{bound.selection.time_ms:.4f}",
                             bound.config))
    if not rows:
        raise InvalidOptionError("dlcore tune --all: no op has an implementation to tune here (see above)")
    print(table(rows, ("op", "shape", "strategy", "implementation", "evaluations", "best ms", "config")))
    if args.plot:
        plot_curves(curves, args.plot)
        print(f"plot written to {args.plot}")
    return 0


def plot_curves(curves: dict[str, dict[str, list[float]]], path: str) -> None:
    """Best-so-far time against evaluations, one panel per (op, shape), one line per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(curves), 1, figsize=(7, 3.2 * len(curves)), squeeze=False)
    for ax, (title, lines) in zip(axes[:, 0], curves.items()):
        for label, best in lines.items():
            finite = [t if math.isfinite(t) else None for t in best]
            ax.plot(range(1, len(best) + 1), finite, label=label, marker=".")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("evaluations")
        ax.set_ylabel("best time so far (ms)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
