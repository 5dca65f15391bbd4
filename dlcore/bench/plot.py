"""``dlcore bench --plot``: each implementation against the shape axis (matplotlib, imported here only)."""

from __future__ import annotations

from pathlib import Path

from dlcore.bench.harness import Report


def plot(report: Report, path: str | Path) -> None:
    """Draw the time of each implementation per shape and, when the op declares a cost, its rate.

    The rate panel shows GB/s with the device copy bandwidth as a line when most shapes are
    memory-bound, TFLOP/s otherwise.
    """
    from matplotlib.figure import Figure

    shapes = report.shapes
    xs = list(range(len(shapes)))
    labels = ["x".join(str(v) for v in r.shape.sizes.values()) for r in shapes]
    size_names = "x".join(shapes[0].shape.sizes) if shapes else "shape"
    has_rates = any(r.nbytes for r in shapes)
    fig = Figure(figsize=(max(6.0, 0.45 * len(shapes) + 3), 7.5 if has_rates else 4.5), layout="constrained")
    axes = fig.subplots(2 if has_rates else 1, 1, sharex=True, squeeze=False)[:, 0]
    dtype = str(report.dtype).removeprefix("torch.")
    fig.suptitle(f"{report.op} {report.mode} {dtype} on {report.device.get('name', '?')}")

    for name in report.implementations:
        axes[0].plot(xs, [r.ms(name) for r in shapes], marker="o", label=name)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("time (ms, lower is better)")

    if has_rates:
        memory = sum(r.bound == "memory" for r in shapes) >= sum(r.bound == "compute" for r in shapes)
        for name in report.implementations:
            rates = [r.gbps(name) if memory else r.tflops(name) for r in shapes]
            axes[1].plot(xs, rates, marker="o", label=name)
        if memory and report.copy_bandwidth:
            axes[1].axhline(report.copy_bandwidth, color="gray", linestyle="--", label="device copy")
        axes[1].set_ylabel("GB/s" if memory else "TFLOP/s")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend()
    axes[-1].set_xticks(xs, labels, rotation=60, ha="right", fontsize=8)
    axes[-1].set_xlabel(size_names)
    fig.savefig(path, dpi=120)
