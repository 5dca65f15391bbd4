"""Applying the ``ast`` and ``launch`` passes to a launch plan, before it runs or is lowered.

Each kernel's ``ast`` rewrite is built once and reused; a pipeline with IR passes also has them
hooked into Triton's compile (:mod:`dlcore.compiler.stages`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

from dlcore.compiler import source, stages
from dlcore.compiler.passes import AST, LAUNCH, Pass, Pipeline, default_pipeline
from dlcore.declarations.device import DeviceProfile
from dlcore.declarations.implementation import KernelCall, LaunchPlan
from dlcore.errors import DlcoreError, PassError


def launch_transform(profile: DeviceProfile, passes: Pipeline) -> Callable[[LaunchPlan], LaunchPlan] | None:
    """The ``ast`` and ``launch`` passes of ``passes`` as one rewrite of a plan for ``profile``'s
    device (None when none rewrites plans); hooks the IR passes into Triton if there are any."""
    if passes.has_ir_passes:
        stages.ensure_installed()
    if not passes.rewrites_plans:
        return None
    return lambda plan: apply_launch_passes(plan, profile, passes)


def apply_launch_passes(plan: LaunchPlan, profile: DeviceProfile, passes: Pipeline | None = None) -> LaunchPlan:
    """``plan`` with the ``ast`` and ``launch`` passes for ``profile``'s backend applied.

    Called on every plan before it runs or is lowered. Without such passes it returns ``plan``
    itself. Each kernel's ``ast`` rewrite is built once and reused. When the pipeline has IR
    passes, this also makes sure they are hooked into Triton (see :mod:`dlcore.compiler.stages`).

    :param passes: the pipeline to apply; default: :func:`default_pipeline` for the backend, which
        reads the environment on each call: a caller on a hot path (a bound op) passes the
        pipeline it looked up once (reading the environment costs several times the rest).
    """
    passes = passes if passes is not None else default_pipeline(profile.backend)
    if passes.has_ir_passes:
        stages.ensure_installed()
    if not passes.rewrites_plans:
        return plan
    ast_passes, launch_passes = passes.at(AST), passes.at(LAUNCH)
    calls = [_apply(call, ast_passes, launch_passes, profile) for call in plan.calls]
    return dataclasses.replace(plan, calls=calls)


def _apply(call: KernelCall, ast_passes: tuple[Pass, ...], launch_passes: tuple[Pass, ...],
           profile: DeviceProfile) -> KernelCall:
    if ast_passes:
        kernel = rewritten(call.kernel, ast_passes)
        if kernel is not call.kernel:
            call = dataclasses.replace(call, kernel=kernel)
    for p in launch_passes:
        try:
            out = p.run(call, profile)
        except DlcoreError:
            raise
        except Exception as exc:
            raise PassError(f"launch pass {p.name!r} failed on {_name(call.kernel)}: {exc}") from exc
        if out is not None:
            call = out
    return call


def rewritten(kernel: Any, ast_passes: tuple[Pass, ...]) -> Any:
    """``kernel`` after ``ast_passes`` (the same object when none changed it); built once per pair."""
    key = (id(kernel), tuple(p.fingerprint for p in ast_passes))
    hit = _rewrites.get(key)
    if hit is not None and hit[0] is kernel:
        return hit[1]
    with _lock:
        result = _rewrite(kernel, ast_passes)
        _rewrites[key] = (kernel, result)  # holding the kernel keeps its id from being reused
    return result


_rewrites: dict[tuple, tuple[Any, Any]] = {}
_lock = threading.Lock()


def clear() -> None:
    """Forget the rewritten kernels (``dlcore.reset()``): each is rewritten again when next asked for."""
    with _lock:
        _rewrites.clear()


def _rewrite(kernel: Any, ast_passes: tuple[Pass, ...]) -> Any:
    tree = source.syntax_tree(kernel)
    changed = []
    for p in ast_passes:
        try:
            out = p.run(tree, kernel)
        except Exception as exc:
            raise PassError(f"ast pass {p.name!r} failed on {_name(kernel)}: {exc}") from exc
        if out is not None:
            tree = out
            changed.append(p.name)
    if not changed:
        return kernel
    return source.rebuild(kernel, tree, "+".join(changed))


def _name(kernel: Any) -> str:
    fn = getattr(kernel, "fn", kernel)
    return getattr(fn, "__name__", repr(kernel))
