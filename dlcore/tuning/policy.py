"""How hard ``get_op`` works on a cache miss: ``DLCORE_TUNE=off|quick|full`` and friends.

- ``off`` (default): the implementation's heuristic config; several candidates are timed once
  each with their defaults.
- ``quick``: each candidate's search space searched with a small budget.
- ``full``: the strategy's whole budget.

A selection remembers how it was made; a cached selection serves any request at or below its
level, so a tuned result is never replaced by a heuristic one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dlcore.tuning.space import SearchSpace
from dlcore.tuning.strategy import Budget

POLICIES = ("off", "quick", "full")
LEVELS = {"heuristic": 0, "measured": 1, "quick": 2, "full": 3}
QUICK_EVALUATIONS = 16
QUICK_SECONDS = 30.0
FULL_SECONDS = 600.0
#: evaluations of a full random / TPE search, at most (grid searches the whole space)
FULL_SAMPLED_EVALUATIONS = 100


@dataclass(frozen=True)
class TunePolicy:
    level: str  # off | quick | full
    strategy: str
    evaluations: int | None = None  # an explicit budget, else the level's
    check: str = "first"

    def budget(self, space: SearchSpace) -> Budget:
        size = space.size()
        if self.evaluations is not None:
            return Budget(evaluations=min(self.evaluations, size))
        if self.level == "quick":
            return Budget(evaluations=min(QUICK_EVALUATIONS, size), seconds=QUICK_SECONDS)
        whole = size if self.strategy == "grid" else min(size, FULL_SAMPLED_EVALUATIONS)
        return Budget(evaluations=whole, seconds=FULL_SECONDS)


def resolve(tune: str | None, strategy: str | None, budget: int | None) -> TunePolicy:
    """The policy for one call: arguments first, then the environment, then the defaults."""
    level = tune or os.environ.get("DLCORE_TUNE", "off") or "off"
    if level not in POLICIES:
        raise ValueError(f"tune={level!r} (or DLCORE_TUNE); use one of {', '.join(POLICIES)}")
    name = strategy or os.environ.get("DLCORE_TUNE_STRATEGY") or "tpe"
    check = os.environ.get("DLCORE_TUNE_CHECK", "first")
    if budget is not None and budget < 1:
        raise ValueError(f"budget={budget}; give at least one evaluation")
    return TunePolicy(level, name, budget, check)


def satisfies(selection_how: str, policy: TunePolicy) -> bool:
    """Whether a selection made ``selection_how`` is good enough for ``policy``."""
    wanted = LEVELS["heuristic"] if policy.level == "off" else LEVELS[policy.level]
    return LEVELS.get(level_of(selection_how), 0) >= wanted


def level_of(how: str) -> str:
    if how.startswith("tuned"):
        return "full" if "full" in how else "quick"
    return "measured" if how == "measured" else "heuristic"
