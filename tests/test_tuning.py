"""Tuning through get_op: policies, strategies, budgets, the correctness check, persistence."""

import time

import pytest
import torch
from test_dispatch import OpsPlugin, double_op, with_plugins

import dlcore
import dlcore.dispatch.dispatcher
from dlcore.declarations.implementation import Implementation
from dlcore.declarations.space import Choice, Constraint, PowerOfTwo, SearchSpace
from dlcore.plugins.registry import registry

BEST = {"BLOCK": 64, "WARPS": 4}
WRONG_BUT_FASTEST = {"BLOCK": 8, "WARPS": 1}
BROKEN = {"BLOCK": 512, "WARPS": 8}


class Sleepy(Implementation):
    """Computes x * 2; its speed depends on the config: BEST is fastest among the correct ones."""

    kind = "torch"

    def __init__(self):
        super().__init__("double", "sleepy")
        self.calls = []

    def space(self, profile=None):
        return SearchSpace(
            params=(PowerOfTwo("BLOCK", 8, 512), Choice("WARPS", (1, 2, 4, 8))),
            constraints=(Constraint("few warps for small blocks", lambda c: c["BLOCK"] >= 16 * c["WARPS"]
                                    or c == WRONG_BUT_FASTEST),),
        )

    def default_config(self, signature, profile):
        return {"BLOCK": 128, "WARPS": 4}

    def source_hash(self):
        return "sleepy-1"

    def run(self, args, config):
        self.calls.append(dict(config))
        if config == BROKEN:
            raise RuntimeError("out of resources: shared memory")
        if config == WRONG_BUT_FASTEST:
            return args[0] * 3
        distance = abs(config["BLOCK"].bit_length() - 7) + abs(config["WARPS"].bit_length() - 3)
        time.sleep(0.0002 * (1 + distance))
        return args[0] * 2


@pytest.fixture
def sleepy(monkeypatch):
    impl = Sleepy()
    with_plugins(monkeypatch, OpsPlugin([double_op()], [impl]))
    return impl


def test_full_grid_search_finds_the_best_correct_config(sleepy):
    x = torch.randn(32)
    op = dlcore.get_op("double", (x,), tune="full", strategy="grid")
    assert op.selection.strategy == "grid"
    assert op.selection.evaluations == sleepy.space().size()
    assert op.config == BEST, op.explain()
    assert "tuned (full, grid)" in op.explain()
    torch.testing.assert_close(op(x), x * 2)


def test_a_wrong_result_never_wins(sleepy):
    op = dlcore.get_op("double", (torch.randn(32),), tune="full", strategy="grid")
    assert op.config != WRONG_BUT_FASTEST
    assert BROKEN in sleepy.calls and WRONG_BUT_FASTEST in sleepy.calls


def test_the_budget_is_honoured(sleepy):
    op = dlcore.get_op("double", (torch.randn(32),), tune="quick", strategy="random", budget=5)
    assert op.selection.evaluations == 5


@pytest.mark.parametrize("strategy", ["grid", "random", "tpe"])
def test_every_builtin_strategy_tunes(sleepy, strategy):
    op = dlcore.get_op("double", (torch.randn(32),), tune="quick", strategy=strategy, budget=12)
    assert op.selection.strategy == strategy
    assert op.config != WRONG_BUT_FASTEST and op.config != BROKEN
    assert 1 <= op.selection.evaluations <= 12


def test_tune_from_the_environment(sleepy, monkeypatch):
    monkeypatch.setenv("DLCORE_TUNE", "quick")
    monkeypatch.setenv("DLCORE_TUNE_STRATEGY", "random")
    op = dlcore.get_op("double", (torch.randn(32),))
    assert op.selection.describe() == "tuned (quick, random)"


def test_off_uses_the_heuristic_without_measuring(sleepy):
    op = dlcore.get_op("double", (torch.randn(32),))
    assert op.config == {"BLOCK": 128, "WARPS": 4} and sleepy.calls == []


def test_a_tuned_selection_serves_later_untuned_calls_from_disk(sleepy, monkeypatch):
    x = torch.randn(32)
    tuned = dlcore.get_op("double", (x,), tune="full", strategy="grid")
    reg = registry()
    dlcore.dispatch.dispatcher.default().clear()
    monkeypatch.setattr("dlcore.plugins.registry._registry", reg)
    sleepy.calls.clear()
    again = dlcore.get_op("double", (x,))
    assert again.config == tuned.config == BEST
    assert sleepy.calls == []
    # asking for more than was done tunes again
    quick = dlcore.get_op("double", (x,), tune="quick", strategy="random", budget=3)
    assert quick.config == BEST  # a full search satisfies a quick request


def test_unknown_policy_and_strategy(sleepy):
    with pytest.raises(ValueError, match="use one of off, quick, full"):
        dlcore.get_op("double", (torch.randn(4),), tune="max")
    with pytest.raises(dlcore.DlcoreError, match="no search strategy 'annealing'"):
        dlcore.get_op("double", (torch.randn(4),), tune="quick", strategy="annealing")


def test_refine_space_hook(sleepy, monkeypatch):
    class OnlySmallBlocks:
        @dlcore.hookimpl
        def dlcore_refine_space(self, space, signature, profile):
            return space.restrict(BLOCK=[16, 32])

    reg = with_plugins(monkeypatch, OpsPlugin([double_op()], [sleepy]), OnlySmallBlocks())
    assert reg is registry()
    op = dlcore.get_op("double", (torch.randn(32),), tune="full", strategy="grid")
    assert op.config["BLOCK"] in (16, 32)


def test_triton_kernel_tuning(kernel_device):
    x, w = torch.randn(8, 96, device=kernel_device), torch.randn(96, device=kernel_device)
    space = registry().implementations_of("rms_norm")[1].space()
    if space is None:
        pytest.skip("rms_norm declares no search space yet")
    op = dlcore.get_op("rms_norm", (x, w), tune="quick", strategy="random", budget=3)
    assert op.selection.evaluations == 3
    torch.testing.assert_close(op(x, w), registry().op("rms_norm").reference(x, w), rtol=1e-4, atol=1e-4)


# The rotary spaces hold blocks of one or two heads: many programs, seconds each in the interpreter.
SPACED_OPS = ["silu_and_mul", "rms_norm", "add_rms_norm", "ffn", "matmul",
              *(pytest.param(name, marks=pytest.mark.slow) for name in ("apply_rotary_pos_emb", "partial_rotary_emb"))]


@pytest.mark.parametrize("name", SPACED_OPS)
def test_sampled_configs_of_every_space_compute_the_op(name, kernel_device):
    """Every declared space is real: configs drawn from it run and match the reference."""
    import random

    from dlcore.tuning.objective import Objective

    reg = registry()
    op = reg.op(name)
    impl = next(i for i in reg.implementations_of(name) if i.name == "triton")
    device = torch.device(kernel_device)
    # the space of this device (its shared memory bounds the GEMM tiles), drawn for the 16-bit inputs
    # the GEMM spaces are declared for on a GPU; the interpreter has no such bound
    space = impl.space(reg.profile(reg.backend_for(device), device))
    assert space is not None and space.size() >= 20
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    args = op.example(op.example_sizes, dtype, device, torch.Generator().manual_seed(0))
    objective = Objective(op, impl, args, reg.backend_for(device), device, check="all")
    for config in random.Random(0).sample(list(space.configs()), 3):
        objective.verify(config)
