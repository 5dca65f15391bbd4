"""``dlcore bench``: an op against its baselines on real model shapes, with rates and speedups.

:mod:`~dlcore.bench.presets` chooses the shapes, :mod:`~dlcore.bench.harness` times them and holds
the report, :mod:`~dlcore.bench.plot` draws it.
"""

from __future__ import annotations

from dlcore.bench.harness import Report, ShapeResult, run_bench
from dlcore.bench.presets import MODELS, PRESETS, Shape, shapes_for

__all__ = ["MODELS", "PRESETS", "Report", "Shape", "ShapeResult", "run_bench", "shapes_for"]
