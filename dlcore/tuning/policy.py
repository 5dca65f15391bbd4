"""How hard ``get_op`` works on a cache miss: ``DLCORE_TUNE=off|quick|full`` and friends.

- ``off`` (default): the implementation's heuristic config; several candidates are timed once
  each with their defaults.
- ``quick``: each candidate's search space searched with a small budget.
- ``full``: the strategy's whole budget.

A selection remembers its :class:`~dlcore.tuning.selection.Level`; a cached selection serves any
request at or below it, so a tuned result is never replaced by a heuristic one.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

from dlcore.declarations.space import SearchSpace
from dlcore.errors import InvalidOptionError
from dlcore.tuning.selection import Level, Selection
from dlcore.tuning.strategy import Budget

QUICK_EVALUATIONS = 16
QUICK_SECONDS = 30.0
FULL_SECONDS = 600.0
#: evaluations of a full random / TPE search, at most (grid searches the whole space)
FULL_SAMPLED_EVALUATIONS = 100
CHECKS = ("first", "all", "none")


class Tune(str, enum.Enum):
    """What a call asks for on a miss (``tune=`` or ``DLCORE_TUNE``)."""

    def __str__(self) -> str:
        return self.value

    OFF = "off"
    QUICK = "quick"
    FULL = "full"

    @property
    def wanted(self) -> Level:
        """The least level of a cached selection that serves this request."""
        return {Tune.OFF: Level.HEURISTIC, Tune.QUICK: Level.QUICK, Tune.FULL: Level.FULL}[self]


@dataclass(frozen=True)
class TunePolicy:
    level: Tune
    strategy: str
    evaluations: int | None = None  # an explicit budget, else the level's
    check: str = "first"

    def budget(self, space: SearchSpace) -> Budget:
        size = space.size()
        if self.evaluations is not None:
            return Budget(evaluations=min(self.evaluations, size))
        if self.level is Tune.QUICK:
            return Budget(evaluations=min(QUICK_EVALUATIONS, size), seconds=QUICK_SECONDS)
        whole = size if self.strategy == "grid" else min(size, FULL_SAMPLED_EVALUATIONS)
        return Budget(evaluations=whole, seconds=FULL_SECONDS)


def resolve(tune: str | None, strategy: str | None, budget: int | None) -> TunePolicy:
    """The policy for one call: arguments first, then the environment, then the defaults.

    :raises InvalidOptionError: a value of the wrong type or out of range, named.
    """
    for option, value in (("tune", tune), ("strategy", strategy)):
        if value is not None and not isinstance(value, str):
            raise InvalidOptionError(f"{option}={value!r} ({type(value).__name__}); give {option} as a str"
                                     + (f", one of {', '.join(t.value for t in Tune)}" if option == "tune" else
                                        " naming a search strategy, such as 'tpe', 'grid' or 'random'"))
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool)):
        raise InvalidOptionError(f"budget={budget!r} ({type(budget).__name__}); give the number of evaluations "
                                 "per implementation as an int, at least 1")
    name = tune or os.environ.get("DLCORE_TUNE", "off") or "off"
    try:
        level = Tune(name)
    except ValueError:
        raise InvalidOptionError(
            f"tune={name!r} (or DLCORE_TUNE); use one of {', '.join(t.value for t in Tune)}") from None
    check = os.environ.get("DLCORE_TUNE_CHECK", "first")
    if check not in CHECKS:
        raise InvalidOptionError(f"DLCORE_TUNE_CHECK={check!r}; use one of {', '.join(CHECKS)}")
    if budget is not None and budget < 1:
        raise InvalidOptionError(f"budget={budget}; give at least one evaluation")
    return TunePolicy(level, strategy or os.environ.get("DLCORE_TUNE_STRATEGY") or "tpe", budget, check)


def satisfies(selection: Selection, policy: TunePolicy) -> bool:
    """Whether ``selection`` is good enough for ``policy``."""
    return selection.level >= policy.level.wanted
