"""``dlcore bench --plot``: each implementation against the shape axis (matplotlib, imported here only)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from dlcore.bench.report import Report, ShapeResult


def plot(report: Report, path: str | Path) -> None:
    """Draw the time of each implementation per shape and, when the op declares a cost, its rate.

    The rate panel shows GB/s with the device copy bandwidth as a line when most shapes are
    memory-bound, TFLOP/s otherwise. Shapes of different models are not joined by lines.
    """
    from matplotlib.figure import Figure

    shapes = report.shapes
    has_rates = any(r.nbytes for r in shapes)
    fig = Figure(figsize=(max(6.0, 0.45 * len(shapes) + 3), 7.5 if has_rates else 4.5), layout="constrained")
    axes = fig.subplots(2 if has_rates else 1, 1, sharex=True, squeeze=False)[:, 0]
    dtype = str(report.dtype).removeprefix("torch.")
    fig.suptitle(f"{report.op} {report.mode} {dtype} on {report.device.get('name', '?')}")

    _lines(axes[0], report, lambda r, name: r.ms(name))
    axes[0].set_ylabel("time (ms, lower is better)")
    if has_rates:
        memory = sum(r.bound == "memory" for r in shapes) >= sum(r.bound == "compute" for r in shapes)
        _lines(axes[1], report, (lambda r, name: r.gbps(name)) if memory else (lambda r, name: r.tflops(name)))
        if memory and report.copy_bandwidth:
            axes[1].axhline(report.copy_bandwidth, color="gray", linestyle="--", label="device copy")
        axes[1].set_ylabel("GB/s" if memory else "TFLOP/s")
    for ax in axes:
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend()
    _mark_models(axes, report)
    labels = ["x".join(str(v) for v in r.shape.sizes.values()) for r in shapes]
    axes[-1].set_xticks(range(len(shapes)), labels, rotation=60, ha="right", fontsize=8)
    axes[-1].set_xlabel(" x ".join(shapes[0].shape.sizes) if shapes else "shape")
    fig.savefig(path, dpi=120)


def _groups(report: Report) -> list[range]:
    """Runs of consecutive shapes from the same models."""
    groups: list[range] = []
    start = 0
    for i in range(1, len(report.shapes) + 1):
        if i == len(report.shapes) or report.shapes[i].shape.models != report.shapes[start].shape.models:
            groups.append(range(start, i))
            start = i
    return groups


def _lines(ax: Any, report: Report, value: Callable[[ShapeResult, str], float | None]) -> None:
    """One colour per implementation, one line per group of shapes."""
    for n, name in enumerate(report.implementations):
        for k, group in enumerate(_groups(report)):
            ax.plot(list(group), [value(report.shapes[i], name) for i in group], marker="o", color=f"C{n}",
                    label=name if k == 0 else None)


def _mark_models(axes: list, report: Report) -> None:
    """A line before each model's first shape, with the model's name above the top panel."""
    for group in _groups(report):
        models = report.shapes[group.start].shape.models
        if models:
            for ax in axes:
                ax.axvline(group.start - 0.5, color="gray", linewidth=0.5)
            axes[0].annotate(",".join(models), (group.start - 0.4, 1.0), xycoords=("data", "axes fraction"),
                             va="bottom", fontsize=7)
