"""Finding a backend's external compilers (tools), the same way for every backend.

A backend that drives executables beyond Triton (Ascend's ``triton-adapter-opt`` and
``bishengir-compile``, a Cambricon toolchain once published) declares each as a :class:`Tool`
and groups them in a :class:`Toolchain` (``Backend.toolchains``). Each tool is looked for, in
order:

1. its variable (e.g. ``DLC_ASCEND_ADAPTER_OPT``): a path that must be an executable file;
2. inside installed Python packages that ship it (``Tool.packages``: import name and the
   path inside the package), in the order given;
3. ``PATH``;
4. the toolchain's per-user tool cache (:meth:`Toolchain.cache_dir`), which its fetcher fills.

:func:`locate` returns where a tool was found, or raises
:class:`~dlcore.errors.ToolchainMissingError` saying exactly how to get it.
"""

from __future__ import annotations

import enum
import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from dlcore.errors import ToolchainMissingError


class Source(enum.Enum):
    """Where a tool was found."""

    VARIABLE = "variable"
    PACKAGE = "package"
    PATH = "PATH"
    CACHE = "tool cache"


@dataclass(frozen=True)
class Tool:
    """One executable a backend's pipeline runs."""

    name: str
    #: the variable that names its path, checked first
    variable: str
    #: the pipeline stage it produces
    stage: str
    #: what provides it, and the exact way to get it
    how_to_get: str
    #: ``(import name, path inside the package)`` of the packages that ship it, in search order
    packages: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Toolchain:
    """The tools of one backend's pipeline (``dlcore toolchain`` lists them)."""

    #: what ``dlcore toolchain fetch NAME`` calls it, e.g. ``ascend``
    name: str
    backend: str
    tools: tuple[Tool, ...]

    def tool(self, name: str) -> Tool:
        for t in self.tools:
            if t.name == name:
                return t
        raise KeyError(f"toolchain {self.name!r} has no tool {name!r}; it has {[t.name for t in self.tools]}")

    def cache_dir(self) -> Path:
        """The per-user tool cache: ``DLCORE_TOOL_CACHE/<name>`` (default
        ``$XDG_CACHE_HOME/dlcore/toolchains/<name>``, or under ``~/.cache``)."""
        configured = os.environ.get("DLCORE_TOOL_CACHE")
        base = Path(configured) if configured else Path(
            os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dlcore" / "toolchains"
        return base / self.name


@dataclass(frozen=True)
class Found:
    tool: Tool
    path: Path
    source: Source
    #: for :attr:`Source.PACKAGE`, the package it came from
    package: str = ""


def package_dir(package: str) -> Path | None:
    """The folder of an installed package, without importing it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def find(toolchain: Toolchain, name: str) -> Found | None:
    """Where tool ``name`` of ``toolchain`` is, by the order of the module docstring; ``None``
    when nowhere.

    :raises ToolchainMissingError: the tool's variable names something that is not an executable
        file (a wrong path is said, not silently passed over).
    """
    tool = toolchain.tool(name)
    named = os.environ.get(tool.variable)
    if named:
        path = Path(named)
        if not _executable(path):
            raise ToolchainMissingError(f"{tool.variable}={named!r} is not an executable file; "
                                        f"unset it or point it at {name}", missing=(name,))
        return Found(tool, path, Source.VARIABLE)
    for package, inside in tool.packages:
        root = package_dir(package)
        if root is not None and _executable(root / inside):
            return Found(tool, root / inside, Source.PACKAGE, package)
    on_path = shutil.which(name)
    if on_path:
        return Found(tool, Path(on_path), Source.PATH)
    cached = toolchain.cache_dir() / name
    if _executable(cached):
        return Found(tool, cached, Source.CACHE)
    return None


def locate(toolchain: Toolchain, name: str) -> Found:
    """:func:`find`, or :class:`ToolchainMissingError` naming the tool and how to get it."""
    found = find(toolchain, name)
    if found is None:
        tool = toolchain.tool(name)
        raise ToolchainMissingError(f"{name} (for the {tool.stage} stage) was not found: {tool.how_to_get}",
                                    missing=(name,))
    return found
