"""The built-in search strategies: ``grid``, ``random`` and ``tpe``.

They are registered like any third-party strategy, through the ``dlcore.strategies`` entry points
``grid_plugin``, ``random_plugin`` and ``tpe_plugin``: one plugin object each, because pluggy
registers an object once and a module is one object.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from dlcore.declarations.space import SearchSpace
from dlcore.plugins.hookspecs import hookimpl
from dlcore.tuning.strategy import Budget, Evaluation, Objective, Runner, SearchResult, Strategy

# TPE may keep proposing configs it has already seen or that break a constraint; neither costs an
# evaluation, so this many proposals per allowed evaluation bounds the search instead.
_PROPOSALS_PER_EVALUATION = 20


class GridStrategy(Strategy):
    """Every valid config in the space's stable order, until the budget is spent.

    Exhaustive and reproducible: the reference the other strategies are measured against.
    """

    name = "grid"

    def search(
        self,
        space: SearchSpace,
        objective: Objective,
        budget: Budget,
        seed: int,
        progress: Callable[[Evaluation], None] | None = None,
    ) -> SearchResult:
        runner = Runner(space, objective, budget, progress)
        runner.evaluate_in_order(space.configs())
        return runner.result(self.name, seed)


class RandomStrategy(Strategy):
    """Valid configs in a random order drawn from ``seed``, none twice, until the budget is spent.

    A shuffled enumeration rather than repeated sampling: no config repeats and, with a large
    enough budget, every config is reached without a coupon-collector's tail of rejected draws.
    """

    name = "random"

    def search(
        self,
        space: SearchSpace,
        objective: Objective,
        budget: Budget,
        seed: int,
        progress: Callable[[Evaluation], None] | None = None,
    ) -> SearchResult:
        runner = Runner(space, objective, budget, progress)
        order = list(space.configs())
        random.Random(seed).shuffle(order)
        runner.evaluate_in_order(order)
        return runner.result(self.name, seed)


class TPEStrategy(Strategy):
    """hyperopt's Tree-structured Parzen Estimator: models which configs are fast and samples there.

    Every parameter is a categorical choice of its position in its value list. (Treating block
    sizes as quantised ordinals was tried: on small kernel spaces it found the optimum later.)

    Only new, valid configs reach the objective. A config that breaks a constraint, and one that
    was measured already, is answered to TPE with an infinite loss without counting against the
    budget: the first so that TPE learns to avoid its region, the second because the config's real
    time is already in TPE's history, and "nothing new here" steers a converged TPE towards configs
    not yet measured instead of re-proposing the same one until the proposal cap.
    """

    name = "tpe"

    def search(
        self,
        space: SearchSpace,
        objective: Objective,
        budget: Budget,
        seed: int,
        progress: Callable[[Evaluation], None] | None = None,
    ) -> SearchResult:
        # Imported here: hyperopt pulls in scipy and friends, and importing dlcore must stay fast.
        import numpy as np
        from hyperopt import STATUS_OK, Trials, fmin, hp, tpe

        runner = Runner(space, objective, budget, progress)
        if not space.params:
            # hyperopt cannot build an empty space, and with nothing to model there is one config.
            runner.evaluate_in_order(space.configs())
        if runner.exhausted():
            return runner.result(self.name, seed)
        evaluations = min(budget.evaluations or space.size(), space.size())
        max_proposals = _PROPOSALS_PER_EVALUATION * evaluations
        proposals = 0

        def loss(point: dict[str, int]) -> dict[str, Any]:
            nonlocal proposals
            proposals += 1
            config = {**{p.name: p.values[point[p.name]] for p in space.params}, **space.fixed}
            new = space.is_valid(config) is None and runner.known(config) is None
            evaluation = runner.evaluate(config) if new else None
            return {"loss": evaluation.time if evaluation is not None else math.inf, "status": STATUS_OK}

        def stop(trials: Trials, *args: Any) -> tuple[bool, tuple]:
            return runner.exhausted() or proposals >= max_proposals, args

        with _quiet("hyperopt"):
            fmin(
                loss,
                {p.name: hp.choice(p.name, list(range(len(p.values)))) for p in space.params},
                algo=partial(tpe.suggest, n_startup_jobs=min(20, max(5, evaluations // 4)), verbose=False),
                max_evals=max_proposals,
                trials=Trials(),
                rstate=np.random.default_rng(seed),
                show_progressbar=False,
                early_stop_fn=stop,
                return_argmin=False,
            )
        return runner.result(self.name, seed)


@contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    """Hide a library's INFO chatter (hyperopt logs as it searches) for the duration of a search."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


class _StrategyPlugin:
    """A plugin object that provides exactly one strategy."""

    def __init__(self, strategy: Strategy):
        self.strategy = strategy

    @hookimpl
    def dlcore_strategies(self) -> list[Strategy]:
        return [self.strategy]


grid_plugin = _StrategyPlugin(GridStrategy())
random_plugin = _StrategyPlugin(RandomStrategy())
tpe_plugin = _StrategyPlugin(TPEStrategy())
