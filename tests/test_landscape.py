"""Replaying recorded landscapes: how fast each strategy gets within 5% of the best config."""

import json
import math
from pathlib import Path

import pytest

from dlcore.bench.landscape import RecordedObjective, replay, space_of
from dlcore.plugins.registry import registry

DATA = Path(__file__).parent / "data"


def synthetic_landscape():
    """~200 configs on a smooth bowl with one optimum and a few failing configs."""
    evaluations = []
    for bm in (16, 32, 64, 128, 256):
        for bn in (16, 32, 64, 128, 256):
            for warps in (2, 4, 8):
                for stages in (2, 3, 4):
                    if bm * bn > 128 * 256:
                        continue
                    fails = bm == 256 and stages == 4
                    t = 1 + 0.3 * abs(math.log2(bm / 64)) + 0.2 * abs(math.log2(bn / 128)) \
                        + 0.1 * abs(warps - 4) + 0.05 * abs(stages - 3)
                    config = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
                    evaluations.append({"config": config, "time_ms": None if fails else t,
                                        "reason": "out of resources" if fails else ""})
    return {"gpu": "synthetic", "evaluations": evaluations}


def test_space_and_objective_rebuild_the_recording():
    landscape = synthetic_landscape()
    space = space_of(landscape)
    assert space.size() == len(landscape["evaluations"])
    objective = RecordedObjective(landscape["evaluations"])
    assert objective({"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3}) == 1
    with pytest.raises(RuntimeError, match="out of resources"):
        objective({"BLOCK_M": 256, "BLOCK_N": 16, "num_warps": 4, "num_stages": 4})


@pytest.mark.slow
def test_tpe_beats_random_and_grid_on_a_synthetic_landscape():
    reg = registry()
    strategies = [reg.strategy(n) for n in ("grid", "random", "tpe")]
    report = replay(synthetic_landscape(), strategies, seeds=5, budget=100)
    assert report["tpe"]["median_evaluations"] < report["random"]["median_evaluations"]
    assert report["tpe"]["median_evaluations"] < report["grid"]["median_evaluations"]


RECORDED = sorted(DATA.glob("landscape_*.json"))


@pytest.mark.skipif(not RECORDED, reason="no landscape recorded on a GPU yet")
@pytest.mark.parametrize("path", RECORDED, ids=[p.stem for p in RECORDED])
def test_recorded_landscapes_are_usable(path):
    """A whole space, or a seeded sample of at least 100 configs of it (device time bounds a GEMM
    space of over a thousand), recorded on a GPU, most of them timed."""
    landscape = json.loads(path.read_text())
    evaluations = landscape["evaluations"]
    assert len(evaluations) >= 100 and len(evaluations) <= landscape["space_size"]
    assert landscape["complete"] == (len(evaluations) == landscape["space_size"])
    assert landscape["gpu"] and landscape["triton"] and landscape["torch"]
    assert sum(e["time_ms"] is not None for e in evaluations) >= 0.8 * len(evaluations)
