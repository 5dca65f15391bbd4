"""``dlcore.reset()`` forgets everything the process remembered, not only the dispatcher's choices
and the plugins: each warning given once warns again, and each memo is derived again. Every case
fills what it checks first, so that a reset that left it would fail."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import triton
import triton.language as tl

from dlcore.compiler import folding, passes, rewrite, toolchain
from dlcore.declarations.implementation import KernelCall, LaunchPlan, TritonImplementation
from dlcore.dispatch.dispatcher import reset
from dlcore.runtime import launch, replay, shelf, torch_ops


@triton.jit
def _copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def _compiled(*args):  # stands for a compiled kernel: anything but Triton's InterpretedFunction
    pass


def _warns(category: type[Warning], fn) -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return sum(issubclass(w.category, category) for w in caught)


def test_a_forward_only_warning_warns_again_after_reset():
    impl = TritonImplementation("reset_op", "fwd", plan=lambda args, config, profile: None, kernels=(),
                                default_config=lambda signature, profile: {})
    x = torch.ones(2, requires_grad=True)
    assert _warns(torch_ops.ForwardOnlyWarning, lambda: torch_ops.warn_forward_only(impl, (x,))) == 1
    assert _warns(torch_ops.ForwardOnlyWarning, lambda: torch_ops.warn_forward_only(impl, (x,))) == 0
    reset()
    assert _warns(torch_ops.ForwardOnlyWarning, lambda: torch_ops.warn_forward_only(impl, (x,))) == 1


def test_a_no_gradient_warning_warns_again_after_reset():
    assert _warns(torch_ops.NoGradientWarning, lambda: torch_ops.warn_no_gradient("reset_op", "t")) == 1
    assert _warns(torch_ops.NoGradientWarning, lambda: torch_ops.warn_no_gradient("reset_op", "t")) == 0
    reset()
    assert _warns(torch_ops.NoGradientWarning, lambda: torch_ops.warn_no_gradient("reset_op", "t")) == 1


def test_a_not_replayed_warning_warns_again_after_reset():
    x, out, stray = torch.ones(4), torch.empty(4), torch.empty(8)
    plan = LaunchPlan(calls=[KernelCall(_compiled, (1,), (x, stray, out), {})], result=out)
    warn = lambda: replay._warn_not_replayed(_compiled, (x,), plan)  # noqa: E731
    assert _warns(replay.NotReplayedWarning, warn) == 1
    assert _warns(replay.NotReplayedWarning, warn) == 0
    reset()
    assert _warns(replay.NotReplayedWarning, warn) == 1


def test_the_launch_and_compiler_memos_are_forgotten(monkeypatch):
    launch.entry(_copy)
    rewrite.rewritten(_copy, ())
    folding.folded_kernel(_copy, 2)
    folding.refusals["reset_kernel"] = "refused"
    monkeypatch.setattr(passes, "_cache", passes._Cache(registry=object()))  # as passes.registered() leaves it
    monkeypatch.setattr(shelf, "_stamp", "stamp")  # shelf.stamp() reads a compiling Triton's internals
    assert _copy in launch._entries and rewrite._rewrites and folding._folded and folding.refusals
    assert passes._cache.registry is not None and shelf._stamp is not None
    reset()
    assert not launch._entries and not rewrite._rewrites and not folding._folded and not folding.refusals
    assert passes._cache.registry is None and shelf._stamp is None


def test_a_toolchain_probe_runs_again_after_reset(tmp_path: Path):
    runs = tmp_path / "runs"
    tool_path = tmp_path / "demo-opt"
    tool_path.write_text(f"#!/bin/sh\necho run >> {runs}\necho 'demo 1.0'\n")
    tool_path.chmod(0o755)
    tool = toolchain.Tool("demo-opt", "DEMO_OPT", "demo", "", probe=toolchain.Probe(r"demo"))
    found = toolchain.Found(tool, tool_path, toolchain.Source.PATH)
    toolchain.check(found)
    toolchain.check(found)
    assert runs.read_text().count("run") == 1
    reset()
    toolchain.check(found)
    assert runs.read_text().count("run") == 2


def test_a_kernel_s_configs_and_recorded_launches_are_forgotten():
    from dlblas_kernels.kernels.rms_norm import KERNEL

    x, w = torch.randn(3, 40), torch.randn(40)
    KERNEL.function(x, w)
    KERNEL.forward(x, w, 1e-6, *KERNEL.zeros)
    assert KERNEL.function.runner.seen and KERNEL.launches.replays
    reset()
    assert not KERNEL.function.runner.seen and not KERNEL.launches.replays
    torch.testing.assert_close(KERNEL.function(x, w), KERNEL.op.reference(x, w), rtol=1e-5, atol=1e-5)

