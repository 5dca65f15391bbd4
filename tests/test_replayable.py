"""Every kernel's launch plan can be recorded and replayed by a bound op (dlcore/runtime/replay.py):
each tensor a launch takes is an input, a result or declared scratch. A plan that allocates a tensor
without declaring it still computes the right result, but every call of its bound op plans again on
the host (tens of microseconds: a decode step's whole budget), so these are checked here, without a
GPU, on the paths each plan takes for an NVIDIA H200 and for this CPU."""

from __future__ import annotations

import warnings

import pytest
import torch

from dlcore.compiler.lowering import target_profile
from dlcore.declarations.implementation import KernelCall, LaunchPlan
from dlcore.declarations.signature import make_signature
from dlcore.errors import InvalidInputError
from dlcore.plugins.registry import registry
from dlcore.runtime import replay, template

CPU = torch.device("cpu")
# per op, sizes that take each of its paths (split-K, weight streaming, decode, TMA, fp8, looped rows):
# the paths it declares (Op.example_paths, what `dlcore lower` plans), and many rows for the others
EXTRA_ROWS = ("rms_norm", "add_rms_norm", "silu_and_mul", "apply_rotary_pos_emb", "partial_rotary_emb")
CASES = [(name, sizes) for name, op in sorted(registry().ops.items()) for sizes in op.example_paths.values()]
CASES += [(name, {"tokens": 300}) for name in EXTRA_ROWS]


@pytest.mark.parametrize("target", ["cpu", "cuda:90"])
@pytest.mark.parametrize("name, sizes", CASES, ids=[f"{n}-{'-'.join(map(str, s.values()))}" for n, s in CASES])
def test_every_plan_is_replayable(name, sizes, target, monkeypatch):
    reg = registry()
    op = reg.ops[name]
    profile = template.device_profile(CPU) if target == "cpu" else target_profile(target)
    # plans on these CPU tensors see the target's profile (nested plans too): the paths it takes, real addresses
    monkeypatch.setitem(reg._profiles, CPU, profile)
    dtype = torch.bfloat16 if name == "fp8_gemm" else torch.float16
    args = op.bind(op.example_inputs(sizes, dtype, CPU, seed=0), None)
    impls = [i for i in reg.implementations_of(name) if getattr(i, "replayable", False)]
    assert impls
    for impl in impls:
        config = impl.default_config(make_signature(op, args, CPU), profile)
        plan = impl.plan(args, config, profile)
        assert plan.calls
        assert replay.why_not_replayable(args, plan) is None
        # a training call's plan, where the forward also computes what its backward reads
        residuals = [k.residuals for k in list(template._kernels) if k.implementation is impl and k.residuals]
        for training in residuals:
            try:
                training_plan = training.plan(args, config, profile)
            except InvalidInputError:  # a path training refuses (fused_moe's fp8 weights are forward only)
                continue
            assert replay.why_not_replayable(args, training_plan) is None


def _kernel(*args):  # stands for a compiled kernel: anything but Triton's InterpretedFunction
    pass


def test_why_not_replayable_names_an_undeclared_tensor():
    x = torch.ones(4)
    out, scratch, stray = torch.empty(4), torch.empty(8), torch.empty(8)
    declared = LaunchPlan(calls=[KernelCall(_kernel, (1,), (x, scratch, out), {})], result=out, scratch=(scratch,))
    assert replay.why_not_replayable((x,), declared) is None
    undeclared = LaunchPlan(calls=[KernelCall(_kernel, (1,), (x, stray, out), {})], result=out)
    assert "launch 0 (_kernel), argument 1: a tensor (8,)" in replay.why_not_replayable((x,), undeclared)
    view = LaunchPlan(calls=[KernelCall(_kernel, (1,), (x[1:], out[2:]), {})], result=out)
    assert replay.why_not_replayable((x,), view) is None  # views into an input and a result: replayed as views
    stray_view = LaunchPlan(calls=[KernelCall(_kernel, (1,), (x, stray[1:], out), {})], result=out)
    assert "argument 1" in replay.why_not_replayable((x,), stray_view)
    y = torch.ones(8)
    q, k = y[:4], y[4:]
    ambiguous = LaunchPlan(calls=[KernelCall(_kernel, (1,), (q[1:], out), {})], result=out)
    assert "argument 0" in replay.why_not_replayable((q, k), ambiguous)  # a view of q's storage, or of k's?
    shared = LaunchPlan(calls=[KernelCall(_kernel, (1,), (x,), {})], result=x[:2])
    assert "shares memory" in replay.why_not_replayable((x,), shared)
    # tensors of no elements (all at address 0) hold no memory: they share none
    none, unused = torch.empty(0), torch.empty(0)
    empty_results = LaunchPlan(calls=[KernelCall(_kernel, (1,), (x, none, out), {})],
                               result=(out, none, unused), scratch=(torch.empty(0),))
    assert replay.why_not_replayable((x, torch.empty(0)), empty_results) is None  # none passed as itself
    stray_empty = LaunchPlan(calls=[KernelCall(_kernel, (1,), (x, torch.empty(0), out), {})], result=(out, none))
    assert "argument 1" in replay.why_not_replayable((x,), stray_empty)


def test_an_unreplayed_plan_warns_once():
    x, out, stray = torch.ones(4), torch.empty(4), torch.empty(8)
    plan = LaunchPlan(calls=[KernelCall(_kernel, (1,), (x, stray, out), {})], result=out)
    with pytest.warns(replay.NotReplayedWarning, match="each call plans again: launch 0"):
        replay._warn_not_replayed(_kernel, (x,), plan)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        replay._warn_not_replayed(_kernel, (x,), plan)


def test_a_plan_that_makes_an_input_contiguous_does_not_warn():
    # An expanded gradient (sum().backward()) made contiguous by the plan: not recorded for that
    # input, rightly, and nothing the plan's author could declare; a stray tensor still warns.
    grad = torch.ones(()).expand(2, 3)
    copy, out = grad.reshape(6).contiguous(), torch.empty(6)
    plan = LaunchPlan(calls=[KernelCall(_kernel, (1,), (copy, out), {})], result=out)
    assert "argument 0" in replay.why_not_replayable((grad,), plan)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        replay._warn_not_replayed(_kernel, (grad,), plan)
    stray = LaunchPlan(calls=[KernelCall(_kernel, (1,), (torch.zeros(6), out), {})], result=out)
    with pytest.warns(replay.NotReplayedWarning, match="argument 0"):
        replay._warn_not_replayed(_kernel, (grad,), stray)


def test_a_custom_op_body_is_named_by_its_plan():
    from dlcore.runtime.torch_ops import Launches

    def ffn_like_plan(args, config):
        raise AssertionError("not called")

    body = Launches(ffn_like_plan, lambda args, ints: None)
    x, out, stray = torch.ones(4), torch.empty(4), torch.empty(8)
    plan = LaunchPlan(calls=[KernelCall(_kernel, (1,), (x, stray, out), {})], result=out)
    with pytest.warns(replay.NotReplayedWarning, match="ffn_like_plan's launches"):
        replay._warn_not_replayed(body.planned, (x,), plan)
