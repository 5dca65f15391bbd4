"""Compiler passes: what a pass declares, which passes run for a backend, and applying them.

A pass is provided by a plugin of the ``dlcore.passes`` entry-point group (hook
:func:`~dlcore.plugins.hookspecs.dlcore_passes`), dlcore's own passes included. It is bound to one stage:

``ast``
    rewrites a kernel's Python syntax tree before Triton sees it:
    ``run(tree: ast.FunctionDef, kernel) -> ast.FunctionDef | None`` (``None``: unchanged). The
    rewritten kernel is built once per kernel and reused.
``launch``
    rewrites one launch of a :class:`~dlcore.declarations.implementation.LaunchPlan` (kernel, grid, arguments):
    ``run(call: KernelCall, profile: DeviceProfile) -> KernelCall | None``.
an IR stage of the backend's compiler (``ttir``, ``ttgir``, ``llir``, ``ptx``, ``cubin``, ...), or ``*`` for every one
    runs on what that stage produced: ``run(module, stage: StageContext) -> module | None``
    (``None``: the module was only inspected, or changed in place). These enter Triton's pipeline
    through :mod:`dlcore.compiler.stages`.

Which passes run for a backend: those that apply to it (``backends``), are on by default there
(``default_on``) or are asked for, and are not switched off. By environment:
``DLCORE_ENABLE_PASSES=a,b`` turns on opt-in passes; ``DLCORE_DISABLE_PASSES=a,b`` turns passes
off (it wins). Within a stage, passes run by ``order``, then name.

:func:`apply_launch_passes` is the one call that runs the ``ast`` and ``launch`` passes on a plan
before it is launched or lowered.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import os
import sys
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dlcore.errors import PassError

if TYPE_CHECKING:
    pass

AST = "ast"
LAUNCH = "launch"
#: the stage name of an IR pass that runs after every IR stage
EVERY_IR_STAGE = "*"

ENABLE_VARIABLE = "DLCORE_ENABLE_PASSES"
DISABLE_VARIABLE = "DLCORE_DISABLE_PASSES"


class PassWarning(UserWarning):
    """A pass a plugin provided was left out; the message says why."""


@dataclass(frozen=True)
class Pass:
    """A compiler pass, as a plugin declares it.

    :param name: unique among all passes; what ``DLCORE_DISABLE_PASSES`` and ``--no-pass`` name.
    :param stage: ``"ast"``, ``"launch"``, an IR stage name, or ``"*"`` (every IR stage).
    :param run: the pass itself; its signature depends on the stage (see the module docstring).
    :param backends: the dlcore backends it applies to (``"cuda"``, ``"npu"``, ...); empty: all.
    :param default_on: ``True``: on wherever it applies; ``False``: opt-in; a tuple of backend
        names: on by default there, opt-in on the others.
    :param order: position within its stage (lower runs first; ties run by name).
    :param changes_ir: an IR pass that only reads the IR sets this False; every other IR pass is
        part of Triton's compile cache key, so a binary compiled without it is never reused.
    :param doc: one line for ``dlcore lower`` and the plugin list.
    """

    name: str
    stage: str
    run: Callable[..., Any]
    backends: tuple[str, ...] = ()
    default_on: bool | tuple[str, ...] = True
    order: int = 0
    changes_ir: bool = True
    doc: str = ""

    @property
    def is_ir(self) -> bool:
        return self.stage not in (AST, LAUNCH)

    def applies_to(self, backend: str) -> bool:
        return not self.backends or backend in self.backends

    def on_by_default(self, backend: str) -> bool:
        if isinstance(self.default_on, bool):
            return self.default_on
        return backend in self.default_on

    @functools.cached_property
    def fingerprint(self) -> str:
        """``name@hash``: the hash changes whenever the module defining ``run`` changes."""
        module = sys.modules.get(getattr(self.run, "__module__", ""), None)
        try:
            text = inspect.getsource(module) if module is not None else inspect.getsource(self.run)
        except (OSError, TypeError):
            text = repr(self.run)
        return f"{self.name}@{hashlib.sha256(text.encode()).hexdigest()[:16]}"


@dataclass(frozen=True)
class Pipeline:
    """The passes that run for one backend, in order."""

    backend: str
    passes: tuple[Pass, ...] = ()

    def at(self, stage: str) -> tuple[Pass, ...]:
        """The passes of ``stage``; for an IR stage, those bound to it and those bound to ``*``."""
        found = self._stages.get(stage)
        if found is None:
            wanted = (stage,) if stage in (AST, LAUNCH) else (stage, EVERY_IR_STAGE)
            found = self._stages[stage] = tuple(p for p in self.passes if p.stage in wanted)
        return found

    @functools.cached_property
    def _stages(self) -> dict[str, tuple[Pass, ...]]:
        return {}

    @functools.cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.passes)

    @functools.cached_property
    def has_ir_passes(self) -> bool:
        return any(p.is_ir for p in self.passes)

    @functools.cached_property
    def rewrites_plans(self) -> bool:
        """Whether it has ``ast`` or ``launch`` passes (without, plans run as they are)."""
        return bool(self.at(AST) or self.at(LAUNCH))

    @functools.cached_property
    def ir_key(self) -> str:
        """What the IR passes add to Triton's compile cache key ('' when no pass changes IR)."""
        return ",".join(sorted(p.fingerprint for p in self.passes if p.is_ir and p.changes_ir))


def names_from_env(variable: str) -> frozenset[str]:
    return frozenset(n.strip() for n in os.environ.get(variable, "").split(",") if n.strip())


def select(
    passes: Iterable[Pass], backend: str, enable: Iterable[str] = (), disable: Iterable[str] = ()
) -> Pipeline:
    """The pipeline for ``backend`` from ``passes``, with the environment's and these choices."""
    enabled = names_from_env(ENABLE_VARIABLE) | set(enable)
    disabled = names_from_env(DISABLE_VARIABLE) | set(disable)
    chosen = [
        p for p in passes
        if p.applies_to(backend) and p.name not in disabled and (p.name in enabled or p.on_by_default(backend))
    ]
    return Pipeline(backend, tuple(sorted(chosen, key=lambda p: (p.order, p.name))))


def validated(candidates: Iterable[object]) -> list[Pass]:
    """The well-formed passes among what plugins returned; the others warned about and left out."""
    found: dict[str, Pass] = {}
    for candidate in candidates:
        problem = _problem(candidate, found)
        if problem:
            warnings.warn(f"dlcore pass {getattr(candidate, 'name', candidate)!r} left out: {problem}",
                          PassWarning, stacklevel=2)
            continue
        found[candidate.name] = candidate  # type: ignore[union-attr]
    return list(found.values())


def _problem(candidate: object, found: dict[str, Pass]) -> str:
    if not isinstance(candidate, Pass):
        return f"a {type(candidate).__name__}, expected a dlcore.compiler.passes.Pass"
    if not candidate.name or not candidate.stage:
        return "a pass needs a name and a stage"
    if not callable(candidate.run):
        return "its run is not callable"
    if candidate.name in found:
        return "another pass already has this name"
    return ""


@dataclass
class _Cache:
    """What is derived from one registry; dropped when the registry is rebuilt."""

    registry: Any = None
    passes: list[Pass] = dataclasses.field(default_factory=list)
    pipelines: dict[tuple[str, str, str], Pipeline] = dataclasses.field(default_factory=dict)


_cache = _Cache()


def _current() -> _Cache:
    from dlcore.plugins.registry import registry

    global _cache
    reg = registry()
    if _cache.registry is not reg:
        _cache = _Cache(reg, validated(reg.passes))
    return _cache


def clear() -> None:
    """Forget the passes and pipelines derived from the registry (``dlcore.reset()``)."""
    global _cache
    _cache = _Cache()


def registered() -> list[Pass]:
    """Every pass the loaded plugins provide, validated once per registry."""
    return _current().passes


def pipeline(backend: str, enable: Iterable[str] = (), disable: Iterable[str] = ()) -> Pipeline:
    """The registered passes that run for ``backend``.

    :param enable: pass names to turn on beyond the defaults (``--pass``).
    :param disable: pass names to turn off (``--no-pass``).
    :raises PassError: a name in ``enable`` or ``disable`` is no registered pass.
    """
    passes = registered()
    names = {p.name for p in passes}
    known = ", ".join(sorted(names)) or "none"
    unknown = (set(enable) | set(disable)) - names
    if unknown:
        raise PassError(f"no pass named {', '.join(sorted(unknown))}; registered passes: {known}")
    for variable in (ENABLE_VARIABLE, DISABLE_VARIABLE):
        # a warning, not an error: the variable may name a pass of a plugin not installed here
        unset = names_from_env(variable) - names
        if unset:
            warnings.warn(f"dlcore: {variable} names no registered pass: {', '.join(sorted(unset))} "
                          f"(registered: {known}); it has no effect", PassWarning, stacklevel=3)
    return select(passes, backend, enable, disable)


def default_pipeline(backend: str) -> Pipeline:
    """:func:`pipeline` with the environment's choices only, cached until they or the plugins change."""
    cache = _current()
    key = (backend, os.environ.get(ENABLE_VARIABLE, ""), os.environ.get(DISABLE_VARIABLE, ""))
    found = cache.pipelines.get(key)
    if found is None:
        found = cache.pipelines[key] = pipeline(backend)
    return found
