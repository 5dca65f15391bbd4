"""The objects of the compiler and tuning layers as the layers below them see them: protocols.

A backend declares toolchains and lowers launches (:class:`~dlcore.declarations.backend.Backend`);
a plugin hands over passes and search strategies (:mod:`dlcore.plugins.hookspecs`). The objects
themselves are made by :mod:`dlcore.compiler` and :mod:`dlcore.tuning`, layers above this one,
which it never imports, not even for an annotation. Each protocol names only what a lower layer
relies on; the classes above satisfy it by shape, without naming it:

==================  ===============================================
protocol            satisfied by
==================  ===============================================
``ToolchainSpec``   :class:`dlcore.compiler.toolchain.Toolchain`
``PassPipeline``    :class:`dlcore.compiler.passes.Pipeline`
``LoweringResult``  :class:`dlcore.compiler.lowering.Lowering`
``CompilerPass``    :class:`dlcore.compiler.passes.Pass`
``SearchStrategy``  :class:`dlcore.tuning.strategy.Strategy`
==================  ===============================================
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from dlcore.declarations.space import Config, SearchSpace


@runtime_checkable
class ToolchainSpec(Protocol):
    """The external compilers one backend's ``lower`` runs, beyond Triton (``Backend.toolchains``)."""

    @property
    def name(self) -> str:
        """What ``dlcore toolchain fetch NAME`` calls it."""

    @property
    def backend(self) -> str:
        """The backend whose pipeline runs its tools."""

    @property
    def tools(self) -> tuple[Any, ...]:
        """Its tools, each with a ``name``."""


@runtime_checkable
class CompilerPass(Protocol):
    """A compiler pass a plugin provides (hook ``dlcore_passes``)."""

    @property
    def name(self) -> str:
        """Unique among all passes."""

    @property
    def stage(self) -> str:
        """``"ast"``, ``"launch"``, an IR stage name, or ``"*"``."""

    @property
    def run(self) -> Callable[..., Any]:
        """The pass itself; what it takes depends on the stage."""


@runtime_checkable
class PassPipeline(Protocol):
    """The passes that run for one backend, in order (what ``Backend.lower`` is given)."""

    @property
    def backend(self) -> str:
        """The backend the passes were chosen for."""

    @property
    def names(self) -> tuple[str, ...]:
        """The names of its passes, in order."""

    def at(self, stage: str) -> tuple[CompilerPass, ...]:
        """The passes that run at ``stage``."""


@runtime_checkable
class LoweringResult(Protocol):
    """What one kernel launch became for one target, stage by stage (what ``Backend.lower`` returns)."""

    @property
    def kernel(self) -> str:
        """The kernel's name."""

    @property
    def target(self) -> str:
        """``BACKEND:ARCH``."""

    @property
    def planned(self) -> tuple[str, ...]:
        """Every stage of the target's pipeline, reached or not."""

    @property
    def reached(self) -> list[str]:
        """The stages that ran."""

    @property
    def notes(self) -> list[str]:
        """What the backend's pipeline noted on the way."""


@runtime_checkable
class SearchStrategy(Protocol):
    """A way to search a space for tuning (hook ``dlcore_strategies``)."""

    @property
    def name(self) -> str:
        """Unique among the loaded strategies; what ``dlcore tune --strategy`` takes."""

    def search(self, space: SearchSpace, objective: Callable[[Config], float], budget: Any, seed: int,
               progress: Callable[[Any], None] | None = None) -> Any:
        """Search ``space`` for the config with the lowest ``objective`` within ``budget``."""
