"""``dlcore bench``: an op against its baselines on real model shapes, with rates and speedups.

:mod:`~dlcore.bench.presets` chooses the shapes, :mod:`~dlcore.bench.harness` times them,
:mod:`~dlcore.bench.report` holds the report and :mod:`~dlcore.bench.plot` draws it.
"""

from __future__ import annotations

from dlcore.bench.harness import run_bench
from dlcore.bench.presets import MODELS, PRESETS, Shape, shapes_for
from dlcore.bench.report import Report, ShapeResult

__all__ = ["MODELS", "PRESETS", "Report", "Shape", "ShapeResult", "run_bench", "shapes_for"]
