"""The one interface every search strategy implements, and the data a search produces.

A strategy only decides which config to try next. Everything else (calling the objective, turning
its failures into ``inf``, never running a config twice, stopping at the budget, reporting
progress) lives in :class:`Runner`, so a built-in strategy and a third-party one behave alike and a
plugin author writes only the proposing part.
"""

from __future__ import annotations

import abc
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from dlcore.declarations.space import Config, SearchSpace
from dlcore.errors import InvalidOptionError, SearchSpaceError

Objective = Callable[[Config], float]
"""Measures one config and returns its time in milliseconds. It may raise (failed to compile, out
of resources, wrong result): the search records the config as failed and goes on."""


@dataclass(frozen=True)
class Budget:
    """When a search stops: after ``evaluations`` objective calls, or ``seconds``, whichever first.

    An evaluation already started is finished, so a search may run over ``seconds`` by up to one
    objective call. ``seconds`` never ends a search before its first evaluation: a strategy's own
    start-up (hyperopt's takes a few tenths of a second on a busy machine) must not leave a search
    with nothing measured.
    """

    evaluations: int | None = None
    seconds: float | None = None

    def __post_init__(self) -> None:
        if self.evaluations is None and self.seconds is None:
            raise InvalidOptionError("Budget() limits nothing; give evaluations=, seconds= or both")
        if self.evaluations is not None and self.evaluations < 1:
            raise InvalidOptionError(f"Budget evaluations={self.evaluations}; give at least 1")
        if self.seconds is not None and self.seconds <= 0:
            raise InvalidOptionError(f"Budget seconds={self.seconds}; give a positive duration")

    def exhausted(self, n_done: int, elapsed: float) -> bool:
        """Whether a search that made ``n_done`` evaluations in ``elapsed`` seconds must stop."""
        if self.evaluations is not None and n_done >= self.evaluations:
            return True
        return self.seconds is not None and n_done >= 1 and elapsed >= self.seconds


@dataclass(frozen=True)
class Evaluation:
    """One call of the objective.

    :param config: the config measured.
    :param time: its time in milliseconds; ``math.inf`` if it failed.
    :param index: its position in the search, from 0.
    :param elapsed: seconds from the start of the search to the end of this evaluation.
    :param reason: why it failed (the objective's exception), empty if it did not.
    """

    config: Config
    time: float
    index: int
    elapsed: float
    reason: str = ""

    @property
    def failed(self) -> bool:
        return math.isinf(self.time)


@dataclass
class SearchResult:
    """What a search found and the whole history behind it (for tables and best-so-far plots).

    ``best_config`` is ``None`` when no config succeeded; ``best_time`` is then ``math.inf``.
    """

    best_config: Config | None
    best_time: float
    evaluations: list[Evaluation]
    strategy: str
    seed: int

    def best_so_far(self) -> list[float]:
        """The running minimum of the times, one entry per evaluation."""
        best, curve = math.inf, []
        for evaluation in self.evaluations:
            best = min(best, evaluation.time)
            curve.append(best)
        return curve

    def evaluations_to_within(self, fraction: float, optimum: float) -> int | None:
        """How many evaluations it took to come within ``fraction`` of ``optimum``, or ``None``.

        Compares strategies: e.g. ``fraction=0.05`` counts the evaluations until a config no more
        than 5% slower than the known optimum was seen.
        """
        threshold = optimum * (1 + fraction)
        for count, best in enumerate(self.best_so_far(), start=1):
            if best <= threshold:
                return count
        return None


class Runner:
    """The bookkeeping shared by every strategy during one search.

    It calls the objective for the configs a strategy proposes, records each call as an
    :class:`Evaluation`, answers a repeated config from its record instead of measuring it again,
    and refuses to start an evaluation once the budget is spent or every valid config has been
    measured.
    """

    def __init__(
        self,
        space: SearchSpace,
        objective: Objective,
        budget: Budget,
        progress: Callable[[Evaluation], None] | None = None,
    ):
        self.space = space
        self.objective = objective
        self.budget = budget
        self.progress = progress
        self.evaluations: list[Evaluation] = []
        self._seen: dict[tuple, Evaluation] = {}
        self._start = time.perf_counter()

    def elapsed(self) -> float:
        """Seconds since the search started."""
        return time.perf_counter() - self._start

    def exhausted(self) -> bool:
        """Whether no further evaluation may start: the budget is spent or nothing is left to try."""
        if len(self._seen) >= self.space.size():
            return True
        return self.budget.exhausted(len(self.evaluations), self.elapsed())

    def known(self, config: Config) -> Evaluation | None:
        """The earlier evaluation of ``config`` in this search, if any."""
        return self._seen.get(_key(config))

    def evaluate(self, config: Config) -> Evaluation | None:
        """Measure ``config``, or return its earlier evaluation; ``None`` once the search must stop.

        :raises SearchSpaceError: ``config`` is not in the space, which is a bug in the strategy: an
            invalid config is never handed to the objective.
        """
        earlier = self.known(config)
        if earlier is not None:
            return earlier
        reason = self.space.is_valid(config)
        if reason is not None:
            raise SearchSpaceError(f"strategy proposed {config}, which is not in the search space: {reason}")
        if self.exhausted():
            return None
        measured, failure = self._measure(config)
        evaluation = Evaluation(dict(config), measured, len(self.evaluations), self.elapsed(), failure)
        self.evaluations.append(evaluation)
        self._seen[_key(config)] = evaluation
        if self.progress is not None:
            self.progress(evaluation)
        return evaluation

    def evaluate_in_order(self, configs: Iterable[Config]) -> None:
        """Measure ``configs`` one after another until the search must stop."""
        for config in configs:
            if self.evaluate(config) is None:
                return

    def result(self, strategy: str, seed: int) -> SearchResult:
        """The search's outcome; ties go to the config measured first."""
        finished = [e for e in self.evaluations if not e.failed]
        best = min(finished, key=lambda e: e.time, default=None)
        return SearchResult(
            best_config=dict(best.config) if best is not None else None,
            best_time=best.time if best is not None else math.inf,
            evaluations=list(self.evaluations),
            strategy=strategy,
            seed=seed,
        )

    def _measure(self, config: Config) -> tuple[float, str]:
        # The objective gets a copy so that nothing it does can alter the record of the search.
        try:
            measured = float(self.objective(dict(config)))
        except Exception as error:  # any failure of one config must not end the search
            return math.inf, f"{type(error).__name__}: {error}"
        if math.isnan(measured) or math.isinf(measured):
            return math.inf, f"objective returned {measured}"
        return measured, ""


def _key(config: Config) -> tuple:
    # Sorted by name so that the same config built in a different key order is still a repeat.
    return tuple(sorted(config.items()))


class Strategy(abc.ABC):
    """A way to search a space. Plugins provide instances through ``dlcore_strategies``."""

    name: str
    """Unique among the loaded strategies; what ``dlcore tune --strategy`` takes."""

    @abc.abstractmethod
    def search(
        self,
        space: SearchSpace,
        objective: Objective,
        budget: Budget,
        seed: int,
        progress: Callable[[Evaluation], None] | None = None,
    ) -> SearchResult:
        """Search ``space`` for the config with the lowest ``objective``.

        :param space: the (possibly backend-refined) space; only its valid configs are measured.
        :param objective: measures a config in milliseconds; may raise.
        :param budget: when to stop.
        :param seed: the same seed gives the same sequence of configs for a deterministic objective.
        :param progress: called with each :class:`Evaluation` as soon as it is recorded.
        """
