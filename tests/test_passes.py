"""Compiler passes: declaration, selection and order, the ast / launch / IR stages, and the hook
into Triton's pipeline chained with a hook the user installed before."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

from dlcore.compiler import passes, stages
from dlcore.compiler.passes import Pass, Pipeline, select
from dlcore.compiler.rewrite import apply_launch_passes
from dlcore.declarations.device import DeviceProfile
from dlcore.declarations.implementation import KernelCall, LaunchPlan
from dlcore.errors import PassError

NPU = DeviceProfile(backend="npu", vendor="huawei", name="test NPU", arch="Ascend910B", cores=2)
CUDA = DeviceProfile(backend="cuda", vendor="nvidia", name="test GPU", arch="sm_90", cores=2)


def noop(*args):
    return None


# -- declaring and choosing passes ------------------------------------------------------------------


def test_builtin_passes_arrive_through_entry_points():
    found = {p.name: p for p in passes.registered()}
    assert found["grid_folding"].stage == "launch"
    assert found["ir_dump"].stage == "*" and not found["ir_dump"].changes_ir


def test_selection_orders_by_order_then_name():
    chosen = select([Pass("b", "ttir", noop, order=5), Pass("a", "ttir", noop, order=5),
                     Pass("c", "ttir", noop, order=1)], "cuda")
    assert chosen.names == ("c", "a", "b")


def test_selection_by_backend_and_default():
    declared = [
        Pass("everywhere", "ttir", noop),
        Pass("npu_only", "ttir", noop, backends=("npu",)),
        Pass("opt_in", "ttir", noop, default_on=False),
        Pass("dsa_default", "launch", noop, default_on=("npu", "mlu")),
    ]
    assert select(declared, "cuda").names == ("everywhere",)
    assert select(declared, "npu").names == ("dsa_default", "everywhere", "npu_only")
    assert select(declared, "cuda", enable=["opt_in", "dsa_default"]).names == ("dsa_default", "everywhere", "opt_in")
    # a pass that does not apply to the backend stays off even when asked for
    assert "npu_only" not in select(declared, "cuda", enable=["npu_only"]).names


def test_environment_enables_and_disables(monkeypatch):
    declared = [Pass("a", "ttir", noop), Pass("b", "ttir", noop, default_on=False)]
    monkeypatch.setenv("DLCORE_ENABLE_PASSES", "b")
    assert select(declared, "cuda").names == ("a", "b")
    monkeypatch.setenv("DLCORE_DISABLE_PASSES", " a , b ")
    assert select(declared, "cuda").names == ()
    assert select(declared, "cuda", enable=["a"]).names == ()  # disabling wins


def test_registered_pass_disabled_by_name(monkeypatch):
    assert "grid_folding" in passes.default_pipeline("npu").names
    monkeypatch.setenv("DLCORE_DISABLE_PASSES", "grid_folding")
    assert "grid_folding" not in passes.default_pipeline("npu").names


def test_unknown_pass_names_are_refused():
    with pytest.raises(PassError, match="no pass named nope; registered passes: .*grid_folding"):
        passes.pipeline("cuda", enable=["nope"])


def test_a_variable_naming_no_pass_is_warned_about(monkeypatch):
    """A misspelt DLCORE_DISABLE_PASSES would leave the pass on without a word: a warning names it
    (not an error: the variable may name a pass of a plugin not installed here)."""
    monkeypatch.setenv("DLCORE_DISABLE_PASSES", "grid_foldnig")
    with pytest.warns(passes.PassWarning, match="DLCORE_DISABLE_PASSES names no registered pass: grid_foldnig"):
        assert "grid_folding" in passes.pipeline("npu").names


def test_malformed_passes_are_left_out_with_a_warning():
    good = Pass("good", "ttir", noop)
    with pytest.warns(passes.PassWarning) as warned:
        kept = passes.validated([good, object(), Pass("good", "llir", noop), Pass("bad", "ttir", "not callable")])
    assert kept == [good]
    messages = " | ".join(str(w.message) for w in warned)
    assert "expected a dlcore.compiler.passes.Pass" in messages
    assert "already has this name" in messages and "not callable" in messages


def test_ir_key_covers_only_passes_that_change_ir():
    reader = Pass("reader", "*", noop, changes_ir=False)
    writer = Pass("writer", "ttir", noop)
    assert Pipeline("cuda", (reader,)).ir_key == ""
    assert Pipeline("cuda", (reader, writer)).ir_key.startswith("writer@")


# -- ast and launch passes on a plan ----------------------------------------------------------------


@triton.jit
def add_one_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1.0, mask=mask)


class _OneToTwo(ast.NodeTransformer):
    def visit_Constant(self, node):
        return ast.copy_location(ast.Constant(2.0), node) if node.value == 1.0 else node


def add_two_instead(tree, kernel):
    return _OneToTwo().visit(tree)


def _plan(n=100, block=32):
    x = torch.randn(n)
    out = torch.full_like(x, float("nan"))
    return x, LaunchPlan([KernelCall(add_one_kernel, (triton.cdiv(n, block),), (x, out, n), {"BLOCK": block})], out)


def test_without_launch_passes_the_plan_is_returned_as_is():
    _, plan = _plan()
    assert apply_launch_passes(plan, CUDA, Pipeline("cuda")) is plan


def test_ast_pass_rewrites_the_kernel_once():
    rewrite = Pass("add_two", "ast", add_two_instead)
    x, plan = _plan()
    first = apply_launch_passes(plan, CUDA, Pipeline("cuda", (rewrite,)))
    second = apply_launch_passes(plan, CUDA, Pipeline("cuda", (rewrite,)))
    assert first.calls[0].kernel is second.calls[0].kernel is not add_one_kernel
    assert torch.equal(first.run(), x + 2.0)
    assert plan.calls[0].kernel is add_one_kernel  # the original plan is untouched


def test_launch_passes_run_in_order():
    seen = []

    def record(tag):
        def run(call, profile):
            seen.append((tag, profile.backend))
            return None
        return run

    pipe = select([Pass("second", "launch", record("second"), order=2),
                   Pass("first", "launch", record("first"), order=1)], "npu")
    apply_launch_passes(_plan()[1], NPU, pipe)
    assert seen == [("first", "npu"), ("second", "npu")]


def test_a_failing_launch_pass_is_named():
    def broken(call, profile):
        raise RuntimeError("boom")

    with pytest.raises(PassError, match="launch pass 'broken' failed on add_one_kernel: boom"):
        apply_launch_passes(_plan()[1], NPU, Pipeline("npu", (Pass("broken", "launch", broken),)))


# -- IR passes in Triton's stages (the hook, on a stand-in pipeline) ---------------------------------


class _Target:
    backend = "cuda"


class _Backend:
    target = _Target()


def _stand_in_stages():
    return {"ttir": lambda src, md: src + ["ttir"], "llir": lambda src, md: src + ["llir"]}


def _run(stage_fns, metadata=None):
    module = []
    metadata = metadata if metadata is not None else {"hash": "abc123"}
    for fn in stage_fns.values():
        module = fn(module, metadata)
    return module


def test_ir_passes_wrap_each_stage_in_order():
    def tag(name):
        def run(module, stage):
            return module + [f"{name}@{stage.stage}#{stage.index}"]
        return run

    pipe = select([Pass("late", "ttir", tag("late"), order=9), Pass("early", "ttir", tag("early"), order=1),
                   Pass("all", "*", tag("all"), order=5)], "cuda")
    stage_fns = _stand_in_stages()
    token = stages._pipeline.set(pipe)
    try:
        stages.StagesHook(previous=None)(_Backend(), stage_fns, object(), "triton", 90)
    finally:
        stages._pipeline.reset(token)
    assert _run(stage_fns) == ["ttir", "early@ttir#1", "all@ttir#1", "late@ttir#1", "llir", "all@llir#2"]


def test_hook_chains_to_the_previous_hook():
    calls = []

    def user_hook(self=None, stages=None, options=None, language=None, capability=None):
        if all(a is None for a in (stages, options, language, capability)):
            return "user-key", "user-hash"
        calls.append(capability)
        make = stages["ttir"]
        stages["ttir"] = lambda src, md: make(src, md) + ["user"]

    mine = Pass("mine", "ttir", lambda module, stage: module + ["mine"])
    hook = stages.StagesHook(previous=user_hook)
    stage_fns = _stand_in_stages()
    token = stages._pipeline.set(select([mine], "cuda"))
    try:
        hook(_Backend(), stage_fns, object(), "triton", 90)
        key, digest = hook()
    finally:
        stages._pipeline.reset(token)
    assert calls == [90]
    # the user's hook ran first; dlcore's pass sees what the user's stage produced
    assert _run(stage_fns) == ["ttir", "user", "mine", "llir"]
    assert key.startswith("user-key") and "mine@" in key and digest != "user-hash"


def test_hook_key_is_the_previous_one_when_no_pass_changes_ir():
    hook = stages.StagesHook(previous=lambda *a: ("user-key", "user-hash"))
    token = stages._pipeline.set(Pipeline("cuda", (Pass("reader", "*", noop, changes_ir=False),)))
    try:
        assert hook() == ("user-key", "user-hash")
    finally:
        stages._pipeline.reset(token)


def test_a_failing_ir_pass_is_named():
    def broken(module, stage):
        raise ValueError("bad IR")

    stage_fns = _stand_in_stages()
    token = stages._pipeline.set(Pipeline("cuda", (Pass("broken", "llir", broken),)))
    try:
        stages.StagesHook(previous=None)(_Backend(), stage_fns, object(), "triton", 90)
    finally:
        stages._pipeline.reset(token)
    with pytest.raises(PassError, match="IR pass 'broken' failed after stage llir"):
        _run(stage_fns)


def test_install_chains_and_uninstall_puts_the_user_hook_back(monkeypatch):
    from triton import knobs

    def user_hook(*args):
        return ("k", "h")

    monkeypatch.setattr(knobs.runtime, "add_stages_inspection_hook", user_hook)
    try:
        hook = stages.install()
        assert knobs.runtime.add_stages_inspection_hook is hook and hook.previous is user_hook
        assert stages.install() is hook  # idempotent
    finally:
        stages.uninstall()
    assert knobs.runtime.add_stages_inspection_hook is user_hook


# -- the real thing: Triton compiles with the hook chained to a user's hook --------------------------

REAL_COMPILE = """
import json, torch, triton, triton.language as tl
from triton import knobs
from triton.backends.compiler import GPUTarget
from dlcore.compiler import stages
from dlcore.compiler.lowering import compile_call
from dlcore.compiler.passes import Pass, Pipeline
from dlcore.declarations.implementation import KernelCall

@triton.jit
def scale_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 3, mask=offs < n)

seen = {"user": 0, "marker": 0}
def user_hook(self=None, stages=None, options=None, language=None, capability=None):
    if all(a is None for a in (stages, options, language, capability)):
        return "user-key", "user-hash"
    seen["user"] += 1
    make = stages["llir"]
    stages["llir"] = lambda src, md: make(src, md) + "\\n; user was here\\n"

def marker(module, stage):
    seen["marker"] += 1
    return module + "\\n; dlcore marker\\n"

knobs.runtime.add_stages_inspection_hook = user_hook
x = torch.empty(1024, device="meta")
call = KernelCall(scale_kernel, (4,), (x, x, 1024), {"BLOCK": 256})
target = GPUTarget("cuda", 90, 32)
plain = compile_call(call, target)
token = stages._pipeline.set(Pipeline("cuda", (Pass("marker", "llir", marker),)))
stages.install()
key = knobs.runtime.add_stages_inspection_hook() if stages.key_call_supported() else None
marked = compile_call(call, target)
stages._pipeline.reset(token)
again = compile_call(call, target)
stages.uninstall()
print(json.dumps({
    "seen": seen, "key": key, "restored": knobs.runtime.add_stages_inspection_hook is user_hook,
    "plain": "dlcore marker" in plain.asm["llir"], "marked": "dlcore marker" in marked.asm["llir"],
    "user_in_marked": "user was here" in marked.asm["llir"], "again": "dlcore marker" in again.asm["llir"],
}))
"""


@pytest.mark.slow
def test_real_compile_chains_hooks_and_keys_the_cache(tmp_path):
    """A binary compiled without the IR pass is not reused with it, nor the other way round."""
    script = tmp_path / "real_compile.py"  # @triton.jit needs its source in a file
    script.write_text(REAL_COMPILE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DLCORE_")}
    env.update(TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "triton"), TRITON_DEFAULT_FP_FUSION="1")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert not found["plain"]
    assert found["marked"] and found["user_in_marked"]  # both hooks shaped the binary
    assert found["seen"]["marker"] == 1  # the marked compile was not served from the cache
    assert not found["again"]  # with the pass off again, the first binary is served
    assert found["restored"]
    if found["key"] is not None:  # Triton >= 3.7 asks the hook for its cache key
        assert found["key"][0].startswith("user-key") and "marker@" in found["key"][0]
