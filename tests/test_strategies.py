"""Search strategies on synthetic objectives with a known optimum, and the bookkeeping they share."""

from __future__ import annotations

import logging
import math
import os
import statistics
import subprocess
import sys
import time
from importlib import import_module
from pathlib import Path

import pluggy
import pytest

from dlcore.declarations.space import Choice, Constraint, PowerOfTwo, SearchSpace, num_stages, num_warps
from dlcore.plugins import hookspecs
from dlcore.tuning.strategies import GridStrategy, RandomStrategy, TPEStrategy
from dlcore.tuning.strategy import Budget, Evaluation, Runner, SearchResult

STRATEGIES = [GridStrategy(), RandomStrategy(), TPEStrategy()]
SEEDED = [RandomStrategy(), TPEStrategy()]


def kernel_space() -> SearchSpace:
    """198 configs of a matmul-like kernel."""
    return SearchSpace(
        [PowerOfTwo("BLOCK_M", 16, 512), PowerOfTwo("BLOCK_N", 16, 512), num_warps(2, 4, 8), num_stages(2, 3)],
        [Constraint("tile fits shared memory", lambda c: c["BLOCK_M"] * c["BLOCK_N"] <= 65536)],
    )


def kernel_time(config: dict) -> float:
    """A smooth landscape in log2 of the sizes with one optimum: BLOCK 128x64, 4 warps, 3 stages.

    Every other config is at least 10% slower, so "within 5%" means "found the optimum".
    """
    m, n, w = (math.log2(config[k]) for k in ("BLOCK_M", "BLOCK_N", "num_warps"))
    stages = config["num_stages"]
    return (
        1.0
        + 0.3 * (m - 7) ** 2
        + 0.2 * (n - 6) ** 2
        + 0.1 * abs(w - 2)
        + 0.15 * (stages - 3) ** 2
        + 0.05 * (m - 7) * (w - 2) ** 2
    )


OPTIMUM = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}


def key(config: dict) -> tuple:
    return tuple(sorted(config.items()))


class Recorder:
    """An objective that remembers its calls and checks that only valid configs reach it."""

    def __init__(self, space: SearchSpace, measure=kernel_time):
        self.space = space
        self.measure = measure
        self.calls: list[dict] = []

    def __call__(self, config: dict) -> float:
        assert self.space.is_valid(config) is None, config
        self.calls.append(dict(config))
        return self.measure(config)


# --- properties every strategy has -------------------------------------------------------------


def test_the_landscape_has_the_optimum_the_tests_rely_on():
    space = kernel_space()
    times = sorted(kernel_time(c) for c in space.configs())
    assert space.size() == 198
    assert times[0] == kernel_time(OPTIMUM) == 1.0
    assert times[1] > 1.05


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
def test_honours_the_evaluation_budget_without_repeats_or_invalid_configs(strategy):
    space = kernel_space().with_constraints(Constraint("square-ish", lambda c: c["BLOCK_M"] <= 4 * c["BLOCK_N"]))
    objective = Recorder(space)
    result = strategy.search(space, objective, Budget(evaluations=25), seed=3)

    assert len(result.evaluations) == len(objective.calls) == 25
    assert len({key(c) for c in objective.calls}) == 25
    assert [e.config for e in result.evaluations] == objective.calls
    assert [e.index for e in result.evaluations] == list(range(25))
    assert result.strategy == strategy.name and result.seed == 3
    best = min(result.evaluations, key=lambda e: e.time)
    assert (result.best_config, result.best_time) == (best.config, best.time)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
def test_a_budget_beyond_the_space_measures_every_config_once(strategy):
    space = SearchSpace([PowerOfTwo("BLOCK", 16, 128), num_warps(2, 4, 8)])
    objective = Recorder(space, lambda c: 1.0 / c["BLOCK"] + abs(c["num_warps"] - 4))
    result = strategy.search(space, objective, Budget(evaluations=100), seed=0)

    assert sorted(key(c) for c in objective.calls) == sorted(key(c) for c in space.configs())
    assert result.best_config == {"BLOCK": 128, "num_warps": 4}


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
def test_a_space_with_nothing_to_tune_is_measured_once(strategy):
    space = SearchSpace([], fixed={"num_warps": 4})
    objective = Recorder(space, lambda c: 2.0)
    result = strategy.search(space, objective, Budget(evaluations=10), seed=0)
    assert objective.calls == [{"num_warps": 4}]
    assert (result.best_config, result.best_time) == ({"num_warps": 4}, 2.0)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
def test_honours_a_time_budget(strategy):
    space = kernel_space()

    def slow(config: dict) -> float:
        time.sleep(0.05)
        return kernel_time(config)

    result = strategy.search(space, slow, Budget(seconds=0.2), seed=0)

    # The search runs until the budget is spent (not a count: hyperopt's start-up time varies).
    # After the first, an evaluation starts only inside the budget and is then finished.
    assert 1 <= len(result.evaluations) <= 5
    assert result.evaluations[-1].elapsed >= 0.2
    assert all(e.elapsed - 0.05 < 0.2 for e in result.evaluations[1:])
    # and it stops within one evaluation of the budget's end (or of a first evaluation that ends after it)
    assert result.evaluations[-1].elapsed < max(0.2, result.evaluations[0].elapsed) + 0.05 + 0.1


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
def test_failures_are_recorded_and_never_win(strategy):
    space = kernel_space()

    def fragile(config: dict) -> float:
        if config["num_stages"] == 3:
            raise RuntimeError(f"out of resources: shared memory for BLOCK_M={config['BLOCK_M']}")
        if config["BLOCK_N"] == 16:
            return math.nan
        return kernel_time(config)

    result = strategy.search(space, fragile, Budget(evaluations=60), seed=1)

    failed = [e for e in result.evaluations if e.failed]
    assert failed and len(failed) < 60
    for evaluation in failed:
        assert evaluation.time == math.inf
        if evaluation.config["num_stages"] == 3:
            assert evaluation.reason == (
                f"RuntimeError: out of resources: shared memory for BLOCK_M={evaluation.config['BLOCK_M']}"
            )
        else:
            assert evaluation.reason == "objective returned nan"
    assert all(e.reason == "" for e in result.evaluations if not e.failed)
    assert result.best_config["num_stages"] == 2 and result.best_config["BLOCK_N"] != 16
    assert result.best_time == min(e.time for e in result.evaluations)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
def test_when_every_config_fails_there_is_no_best(strategy):
    def broken(config: dict) -> float:
        raise ValueError("wrong result")

    result = strategy.search(kernel_space(), broken, Budget(evaluations=10), seed=0)
    assert len(result.evaluations) == 10
    assert result.best_config is None and result.best_time == math.inf
    assert result.best_so_far() == [math.inf] * 10


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
def test_progress_sees_each_evaluation_as_it_is_recorded(strategy):
    seen: list[Evaluation] = []
    result = strategy.search(kernel_space(), kernel_time, Budget(evaluations=12), seed=0, progress=seen.append)
    assert seen == result.evaluations


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
def test_the_same_seed_gives_the_same_sequence(strategy):
    def sequence(seed: int) -> list[dict]:
        result = strategy.search(kernel_space(), kernel_time, Budget(evaluations=30), seed=seed)
        return [e.config for e in result.evaluations]

    assert sequence(5) == sequence(5)


@pytest.mark.parametrize("strategy", SEEDED, ids=lambda s: s.name)
def test_different_seeds_give_different_sequences(strategy):
    def sequence(seed: int) -> list[dict]:
        result = strategy.search(kernel_space(), kernel_time, Budget(evaluations=30), seed=seed)
        return [e.config for e in result.evaluations]

    assert sequence(0) != sequence(1)


# --- each strategy ----------------------------------------------------------------------------


def test_grid_follows_the_space_order_and_stops_at_the_budget():
    space = kernel_space()
    result = GridStrategy().search(space, kernel_time, Budget(evaluations=40), seed=0)
    assert [e.config for e in result.evaluations] == list(space.configs())[:40]


def test_grid_finds_the_optimum_where_the_space_order_puts_it():
    space = kernel_space()
    position = list(space.configs()).index(OPTIMUM) + 1
    result = GridStrategy().search(space, kernel_time, Budget(evaluations=space.size()), seed=0)
    assert result.best_config == OPTIMUM
    assert result.evaluations_to_within(0.0, 1.0) == position


def test_random_visits_a_permutation_of_the_space():
    space = kernel_space()
    result = RandomStrategy().search(space, kernel_time, Budget(evaluations=1000), seed=0)
    configs = [e.config for e in result.evaluations]
    assert sorted(map(key, configs)) == sorted(map(key, space.configs()))
    assert configs != list(space.configs())


def test_tpe_does_not_spend_the_budget_on_configs_that_break_constraints():
    # Two thirds of the product break the constraint, so TPE's first, random proposals do too.
    space = kernel_space().with_constraints(Constraint("warps match the tile", lambda c: c["num_warps"] == 4))
    objective = Recorder(space)
    result = TPEStrategy().search(space, objective, Budget(evaluations=30), seed=0)
    assert len(result.evaluations) == len(objective.calls) == 30
    assert result.best_config == OPTIMUM or result.best_time < 1.5


def test_tpe_keeps_hyperopt_quiet(caplog, capsys):
    caplog.set_level(logging.DEBUG)
    level = logging.getLogger("hyperopt").level
    TPEStrategy().search(kernel_space(), kernel_time, Budget(evaluations=25), seed=0)
    assert not [r for r in caplog.records if r.name.startswith("hyperopt") and r.levelno < logging.WARNING]
    assert capsys.readouterr() == ("", "")
    assert logging.getLogger("hyperopt").level == level


@pytest.mark.slow
def test_tpe_finds_the_optimum_sooner_than_grid_and_random():
    space = kernel_space()

    def to_optimum(strategy, budget: int, seeds: range) -> list[float]:
        counts = []
        for seed in seeds:
            result = strategy.search(space, kernel_time, Budget(evaluations=budget), seed=seed)
            counts.append(result.evaluations_to_within(0.05, 1.0) or math.inf)
        return counts

    grid_position = list(space.configs()).index(OPTIMUM) + 1
    # Random is cheap, so it gets many seeds (its median is then close to the expected 99.5) and
    # the whole space, so its count is never cut short. TPE gets 15 seeds and under a third of the
    # space; over 100 seeds its median was about 30, and it missed the optimum within 60
    # evaluations 13% of the time (counted as inf, which the median tolerates).
    random_median = statistics.median(to_optimum(RandomStrategy(), space.size(), range(100)))
    tpe_median = statistics.median(to_optimum(TPEStrategy(), 60, range(15)))

    assert tpe_median < grid_position / 2
    assert tpe_median < random_median / 2


# --- the shared bookkeeping ---------------------------------------------------------------------


def test_runner_answers_a_repeat_from_its_record():
    space = kernel_space()
    objective = Recorder(space)
    runner = Runner(space, objective, Budget(evaluations=5))
    first = runner.evaluate(dict(OPTIMUM))
    again = runner.evaluate(dict(reversed(list(OPTIMUM.items()))))
    assert again is first and len(objective.calls) == 1
    assert runner.known(OPTIMUM) is first


def test_runner_refuses_an_invalid_config():
    runner = Runner(kernel_space(), kernel_time, Budget(evaluations=5))
    with pytest.raises(ValueError, match="tile fits shared memory"):
        runner.evaluate({"BLOCK_M": 512, "BLOCK_N": 512, "num_warps": 4, "num_stages": 3})


def test_runner_stops_at_the_budget():
    space = kernel_space()
    runner = Runner(space, kernel_time, Budget(evaluations=2))
    configs = list(space.configs())
    assert runner.evaluate(configs[0]) is not None
    assert runner.evaluate(configs[1]) is not None
    assert runner.exhausted()
    assert runner.evaluate(configs[2]) is None
    assert len(runner.evaluations) == 2


def test_objective_receives_a_copy():
    space = SearchSpace([Choice("a", (1, 2))])

    def vandal(config: dict) -> float:
        config["a"] = 99
        return 1.0

    result = GridStrategy().search(space, vandal, Budget(evaluations=2), seed=0)
    assert [e.config for e in result.evaluations] == [{"a": 1}, {"a": 2}]


def test_a_slow_start_still_measures_one_config():
    # A strategy whose own start-up outlasts the time budget (hyperopt's, on a busy machine).
    runner = Runner(kernel_space(), kernel_time, Budget(seconds=0.01))
    time.sleep(0.05)
    runner.evaluate_in_order(kernel_space().configs())
    assert len(runner.evaluations) == 1


def test_budget_needs_a_limit_and_stops_at_either():
    with pytest.raises(ValueError):
        Budget()
    with pytest.raises(ValueError):
        Budget(evaluations=0)
    both = Budget(evaluations=10, seconds=1.0)
    assert not both.exhausted(9, 0.9)
    assert both.exhausted(10, 0.1)
    assert both.exhausted(1, 1.0)
    # Time never ends a search before its first evaluation.
    assert not both.exhausted(0, 5.0)


def test_search_result_curves():
    times = [5.0, math.inf, 3.0, 4.0, 1.2, 1.0]
    result = SearchResult(
        best_config={"i": 5},
        best_time=1.0,
        evaluations=[Evaluation({"i": i}, t, i, 0.1 * i) for i, t in enumerate(times)],
        strategy="test",
        seed=0,
    )
    assert result.best_so_far() == [5.0, 5.0, 3.0, 3.0, 1.2, 1.0]
    assert result.evaluations_to_within(0.25, 1.0) == 5
    assert result.evaluations_to_within(0.0, 1.0) == 6
    assert result.evaluations_to_within(0.0, 0.5) is None


# --- plugins ------------------------------------------------------------------------------------


def test_the_declared_entry_points_provide_the_built_in_strategies():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    entry_points = pyproject["project"]["entry-points"]["dlcore.strategies"]
    manager = pluggy.PluginManager("dlcore")
    manager.add_hookspecs(hookspecs)
    for name, target in entry_points.items():
        module, attribute = target.split(":")
        manager.register(getattr(import_module(module), attribute), name=name)
    manager.check_pending()

    provided = [s for strategies in manager.hook.dlcore_strategies() for s in strategies]
    assert sorted(s.name for s in provided) == sorted(entry_points) == ["grid", "random", "tpe"]


def test_importing_the_strategies_does_not_import_hyperopt():
    code = "import sys, dlcore.tuning.strategies; print('hyperopt' in sys.modules)"
    root = Path(__file__).parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    out = run.stdout
    assert out.strip() == "False"
