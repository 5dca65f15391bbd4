"""What a ``dlcore bench`` run reports: per shape each implementation's time, rate and speedups, and
the table and JSON record of the whole run (:mod:`dlcore.bench.harness` makes the numbers).

Rates come from ``op.cost(args) -> (bytes, flops)``: GB/s for memory-bound shapes, with the
fraction of the device's copy bandwidth measured in the same run (a copy far larger than any
cache), and beside it the time of a device-to-device copy of the shape's own bytes over the op's
(``%copy same size``: what a kernel moving those bytes can reach, launch and ramp included, at
sizes where they count); TFLOP/s for shapes above :data:`RIDGE` flops per byte.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dlcore.bench.presets import Shape
from dlcore.bench.table import table
from dlcore.bench.timing import gbps

#: the op's own column: what ``get_op`` chooses
OWN = "dlcore"
#: the ratio of the op's time to the fastest of its ``dlcore[NAME]`` columns (does selection pick right?)
BEST = "best"
#: token ranges summarized apart when some shape is compute-bound: small batches and decode, prefill
TOKEN_GROUPS: dict[str, tuple[int, int | None]] = {"tokens <= 128": (0, 128), "tokens >= 1024": (1024, None)}
#: flops per byte above which a shape is compute-bound and reported in TFLOP/s. Between the ridge
#: points of an H100/H200 in float32 on CUDA cores (~14) and in bfloat16 on tensor cores (~200):
#: norms and activations sit below 10, GEMMs of a few hundred tokens and more well above.
RIDGE = 100.0


# -- the numbers ---------------------------------------------------------------------------------

def tflops(flops: float, ms: float) -> float:
    return flops / ms / 1e9


def geomean(values: list[float]) -> float | None:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def impl_column(name: str) -> str:
    """The column of implementation ``name`` run alone: ``dlcore[triton]``."""
    return f"{OWN}[{name}]"


def bound_of(nbytes: int | None, flops: int | None) -> str | None:
    """``memory`` or ``compute``, by arithmetic intensity; None without a cost."""
    if not nbytes:
        return None
    return "compute" if (flops or 0) / nbytes > RIDGE else "memory"


@dataclass
class ShapeResult:
    """One shape: each implementation's per-round times and what they mean."""

    shape: Shape
    nbytes: int | None = None
    flops: int | None = None
    rounds: dict[str, list[float]] = field(default_factory=dict)
    max_abs_diff: dict[str, float] = field(default_factory=dict)
    chosen: str = ""
    #: the name of the implementation ``get_op`` chose
    impl: str = ""
    #: how ``get_op`` chose: its selection's ``how``, each candidate's measured ms (forward and
    #: backward for a training call) and why any failed or declined (``Selection.to_json``)
    selection: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: ms of a device-to-device copy moving ``nbytes`` (read + written), timed in the same run
    copy_ms: float | None = None

    @property
    def bound(self) -> str | None:
        return bound_of(self.nbytes, self.flops)

    def ms(self, name: str) -> float | None:
        times = self.rounds.get(name)
        return statistics.median(times) if times else None

    def gbps(self, name: str) -> float | None:
        ms = self.ms(name)
        return gbps(self.nbytes, ms) if ms and self.nbytes else None

    def tflops(self, name: str) -> float | None:
        ms = self.ms(name)
        return tflops(self.flops, ms) if ms and self.flops else None

    def copy_fraction(self, name: str, copy_gbps: float | None) -> float | None:
        """GB/s over the device copy bandwidth, for memory-bound shapes."""
        rate = self.gbps(name)
        return rate / copy_gbps if rate and copy_gbps and self.bound == "memory" else None

    def same_size_copy_fraction(self, name: str) -> float | None:
        """The same-size copy's time over ``name``'s, for memory-bound shapes."""
        ms = self.ms(name)
        return self.copy_ms / ms if ms and self.copy_ms and self.bound == "memory" else None

    def speedup(self, baseline: str, of: str = OWN) -> float | None:
        """The baseline's time over the op's (or over column ``of``'s): above 1, the op is faster."""
        own, other = self.ms(of), self.ms(baseline)
        return other / own if own and other else None

    def speedup_vs_best(self, columns: list[str]) -> float | None:
        """The fastest of ``columns``' times over the op's: 1 when selection picked the fastest."""
        times = [t for c in columns if (t := self.ms(c)) is not None]
        own = self.ms(OWN)
        return min(times) / own if own and times else None

    def progress_line(self, baselines: list[str]) -> str:
        """The shape's times in a line, as a run reports its progress."""
        own = self.ms(OWN)
        if own is None:
            return "skipped" + (f" ({self.notes[-1]})" if self.notes else "")
        parts = [f"{OWN} {own:.4g} ms" + (f" ({self.impl})" if self.impl else "")]
        for b in baselines:
            ms = self.ms(b)
            if ms is not None:
                parts.append(f"{b} {ms:.4g} ms ({_ratio(self.speedup(b))})")
        return ", ".join(parts)


@dataclass
class Report:
    op: str
    mode: str
    dtype: torch.dtype
    device: dict[str, Any]
    baselines: list[str]
    copy_bytes: int
    #: the ``dlcore[NAME]`` columns: implementations run alone
    impls: list[str] = field(default_factory=list)
    #: baseline -> what it runs, in a line
    baseline_docs: dict[str, str] = field(default_factory=dict)
    copy_gbps: list[float] = field(default_factory=list)
    shapes: list[ShapeResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    timer: str = ""
    rounds: int = 0
    command: str = ""
    date: str = ""
    versions: dict[str, str | None] = field(default_factory=dict)
    #: the variables that change what runs: DLCORE_* (tuning policy, plugins) and TRITON_INTERPRET
    environment: dict[str, str] = field(default_factory=dict)
    #: the host's time for one small torch op (:func:`host_call_us`), at the run's start and end
    host_us: list[float] = field(default_factory=list)

    @property
    def copy_bandwidth(self) -> float | None:
        """The best device-to-device copy of the run, in GB/s (read + written bytes)."""
        return max(self.copy_gbps) if self.copy_gbps else None

    @property
    def implementations(self) -> list[str]:
        return [OWN, *self.impls, *self.baselines]

    @property
    def own_columns(self) -> list[str]:
        """dlcore's columns: what ``get_op`` chose, then each implementation run alone."""
        return [OWN, *self.impls]

    def speedups(self, baseline: str, of: str = OWN, shapes: list[ShapeResult] | None = None) -> list[float]:
        """Per shape, ``baseline``'s time over ``of``'s; ``baseline`` :data:`BEST`: the fastest
        ``dlcore[NAME]`` column's over the op's."""
        results = self.shapes if shapes is None else shapes
        if baseline == BEST:
            return [s for r in results if (s := r.speedup_vs_best(self.impls)) is not None]
        return [s for r in results if (s := r.speedup(baseline, of)) is not None]

    def geomean(self, baseline: str, of: str = OWN, shapes: list[ShapeResult] | None = None) -> float | None:
        return geomean(self.speedups(baseline, of, shapes))

    def worst(self, baseline: str, of: str = OWN, shapes: list[ShapeResult] | None = None) -> float | None:
        return min(self.speedups(baseline, of, shapes), default=None)

    def ratio_columns(self) -> list[tuple[str, str]]:
        """``(of, baseline)`` of each ratio the report gives: every dlcore column against every
        baseline, then the op against the fastest dlcore column alone (with any)."""
        pairs = [(of, b) for b in self.baselines for of in self.own_columns]
        return pairs + ([(OWN, BEST)] if self.impls else [])

    def token_groups(self) -> dict[str, list[ShapeResult]]:
        """:data:`TOKEN_GROUPS` with their shapes, when some shape is compute-bound and both hold some."""
        if not any(r.bound == "compute" for r in self.shapes):
            return {}
        groups = {label: [r for r in self.shapes if "tokens" in r.shape.sizes
                          and low <= r.shape.sizes["tokens"] and (high is None or r.shape.sizes["tokens"] <= high)]
                  for label, (low, high) in TOKEN_GROUPS.items()}
        return groups if all(groups.values()) else {}

    def show_chosen(self) -> bool:
        """Whether the table names the implementation chosen per shape: with dlcore columns, or
        when the choice varies."""
        return bool(self.impls) or len({r.impl for r in self.shapes if r.impl}) > 1

    # -- output ---------------------------------------------------------------------------------

    def table(self) -> str:
        header = ["model", "shape", "MiB", f"{OWN} ms", "rate", "%copy", "%copy same size"]
        header += ["chosen"] if self.show_chosen() else []
        for c in self.impls:
            header += [f"{c} ms", f"{c} rate"]
        lead = len(header)
        for b in self.baselines:
            header += [f"{b} ms"] + [_ratio_name(of, b) for of in self.own_columns]
        header += [_ratio_name(OWN, BEST)] if self.impls else []
        rows = [self._row(r) for r in self.shapes]
        if self.baselines or self.impls:
            summaries = [("geomean", self.geomean, None), ("min", self.worst, None)]
            summaries += [(f"geomean {label}", self.geomean, shapes) for label, shapes in self.token_groups().items()]
            for label, summary, shapes in summaries:
                row = ["", label] + [""] * (lead - 2)
                for b in self.baselines:
                    row += [""] + [_ratio(summary(b, of, shapes)) for of in self.own_columns]
                row += [_ratio(summary(BEST, OWN, shapes))] if self.impls else []
                rows.append(row)
        if not any(r.shape.models for r in self.shapes):
            header, rows = header[1:], [row[1:] for row in rows]
        dtype = str(self.dtype).removeprefix("torch.")
        copy = self.copy_bandwidth
        lines = [
            f"{self.op} {self.mode} {dtype} on {self.device.get('name', '?')} ({self.device.get('backend', '?')}); "
            f"timer: {self.timer}, median of {self.rounds} alternating rounds",
            "copy bandwidth: " + (f"{copy:.0f} GB/s ({self.copy_bytes / 2**20:.0f} MiB device-to-device copy, "
                                  f"bytes read + written)" if copy else "not measured"),
            *([f"host: {host_text(self.host_us)}"] if self.host_us else []),
            "",
            table(rows, header),
        ]
        lines += [f"note: {n}" for n in self.notes]
        where: dict[str, list[str]] = {}
        for r in self.shapes:
            for n in r.notes:
                where.setdefault(n, []).append(r.shape.label())
        for n, labels in where.items():
            shapes = "; ".join(labels) if len(labels) <= 2 else f"{len(labels)} shapes"
            lines.append(f"note: {n} ({shapes})")
        return "\n".join(lines)

    def _row(self, r: ShapeResult) -> list[str]:
        row = [",".join(r.shape.models), r.shape.label(), _num(r.nbytes / 2**20 if r.nbytes else None),
               _num(r.ms(OWN)), _rate(r, OWN),
               _percent(r.copy_fraction(OWN, self.copy_bandwidth)), _percent(r.same_size_copy_fraction(OWN))]
        row += [r.impl or "-"] if self.show_chosen() else []
        for c in self.impls:
            row += [_num(r.ms(c)), _rate(r, c)]
        for b in self.baselines:
            row += [_num(r.ms(b))] + [_ratio(r.speedup(b, of)) for of in self.own_columns]
        row += [_ratio(r.speedup_vs_best(self.impls))] if self.impls else []
        return row

    def to_json(self) -> dict[str, Any]:
        copy = self.copy_bandwidth
        return {
            "op": self.op,
            "mode": self.mode,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": self.device,
            "gpu": self.device.get("name") if self.device.get("backend") == "cuda" else None,
            "versions": self.versions,
            "environment": self.environment,
            "command": self.command,
            "date": self.date,
            "timer": self.timer,
            "rounds": self.rounds,
            "implementations": self.implementations,
            "dlcore_columns": self.impls,
            "baselines": self.baselines,
            "baseline_docs": self.baseline_docs,
            "copy_bandwidth_gbps": copy,
            "copy_bandwidth_runs_gbps": self.copy_gbps,
            "host_call_us": self.host_us,
            "copy_bytes": self.copy_bytes,
            "ridge_flops_per_byte": RIDGE,
            "notes": self.notes,
            "shapes": [self._shape_json(r, copy) for r in self.shapes],
            "geomean_speedup": {b: self.geomean(b) for b in self.baselines},
            "min_speedup": {b: self.worst(b) for b in self.baselines},
            # every ratio column: {of: {baseline: value}}, ``best`` under dlcore with dlcore columns
            "geomean_speedup_of": self._summary(self.geomean),
            "min_speedup_of": self._summary(self.worst),
            "geomean_speedup_by_tokens": {label: self._summary(self.geomean, shapes)
                                          for label, shapes in self.token_groups().items()},
        }

    def _summary(self, summary: Callable[..., float | None],
                 shapes: list[ShapeResult] | None = None) -> dict[str, dict[str, float | None]]:
        found: dict[str, dict[str, float | None]] = {}
        for of, b in self.ratio_columns():
            found.setdefault(of, {})[b] = summary(b, of, shapes)
        return found

    def _shape_json(self, r: ShapeResult, copy: float | None) -> dict[str, Any]:
        return {
            "sizes": r.shape.sizes,
            "models": list(r.shape.models),
            "bytes": r.nbytes,
            "flops": r.flops,
            "bound": r.bound,
            "same_size_copy_ms": r.copy_ms,
            "chosen": r.chosen,
            "chosen_impl": r.impl,
            "selection": r.selection,
            "results": {name: {"ms": r.ms(name), "rounds_ms": times, "gbps": r.gbps(name),
                               "tflops": r.tflops(name), "copy_fraction": r.copy_fraction(name, copy),
                               "same_size_copy_fraction": r.same_size_copy_fraction(name)}
                        for name, times in r.rounds.items()},
            "speedup": {b: r.speedup(b) for b in self.baselines},
            "speedup_of": {c: {b: r.speedup(b, c) for b in self.baselines} for c in self.impls},
            "speedup_vs_best": r.speedup_vs_best(self.impls) if self.impls else None,
            "max_abs_diff_vs_dlcore": r.max_abs_diff,
            "notes": r.notes,
        }


def _ratio_name(of: str, baseline: str) -> str:
    """``vs torch`` for the op's own column, ``dlcore[triton] vs torch`` for another."""
    return f"vs {baseline}" if of == OWN else f"{of} vs {baseline}"


def _rate(r: ShapeResult, name: str) -> str:
    rate = r.tflops(name) if r.bound == "compute" else r.gbps(name)
    unit = "TFLOP/s" if r.bound == "compute" else "GB/s"
    return f"{_num(rate)} {unit}" if rate else "-"


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.0f}" if abs(x) >= 1000 else f"{x:.4g}"


def _ratio(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}x" if x >= 0.1 else f"{x:.2g}x"


def _percent(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.0f}%" if x >= 0.01 else f"{100 * x:.2g}%"


def host_text(host_us: list[float]) -> str:
    """The host probe's times in words: what a row near them measures."""
    times = " and ".join(f"{t:.1f}" for t in host_us)
    return (f"{times} us a small torch op (run start and end); rows within a few times that time the "
            "host's launches, not the device")
