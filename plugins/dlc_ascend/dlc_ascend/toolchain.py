"""Finding the Ascend compilers: ``triton-adapter-opt``, ``bishengir-compile`` and ``hivmc``.

None of them is a Python dependency of dlc-ascend. Each tool is looked for, in order:

1. its variable (``DLC_ASCEND_ADAPTER_OPT``, ``DLC_ASCEND_BISHENGIR``, ``DLC_ASCEND_HIVMC``);
2. the ``ascendnpu-ir`` package (``pip install 'dlc-ascend[tools]'``), which ships
   ``bishengir-compile``;
3. an installed triton-ascend distribution (a real Ascend host), which ships the adapter;
4. ``PATH``;
5. the per-user tool cache that ``dlcore toolchain fetch ascend`` fills.

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
    PACKAGE = "ascendnpu-ir"
    TRITON_ASCEND = "triton-ascend"
    PATH = "PATH"
    CACHE = "tool cache"


@dataclass(frozen=True)
class Tool:
    """One executable of the Ascend pipeline."""

    name: str
    #: the variable that names its path, checked first
    variable: str
    #: the pipeline stage it produces
    stage: str
    #: what provides it, and the exact way to get it
    how_to_get: str
    #: its path inside the ascendnpu-ir package, if that ships it
    package_path: str | None = None
    #: its path inside an installed triton-ascend's ``triton`` package, if that ships it
    triton_ascend_path: str | None = None


ADAPTER = Tool(
    name="triton-adapter-opt",
    variable="DLC_ASCEND_ADAPTER_OPT",
    stage="linalg",
    how_to_get="`dlcore toolchain fetch ascend` (takes the one binary out of the triton-ascend wheel; "
               "never installs triton-ascend), or set DLC_ASCEND_ADAPTER_OPT to its path",
    triton_ascend_path="backends/ascend/triton-adapter-opt",
)
BISHENGIR = Tool(
    name="bishengir-compile",
    variable="DLC_ASCEND_BISHENGIR",
    stage="hivm",
    how_to_get="`pip install 'dlc-ascend[tools]'` (the ascendnpu-ir package), or set DLC_ASCEND_BISHENGIR to its path",
    package_path="bin/bishengir-compile",
)
HIVMC = Tool(
    name="hivmc",
    variable="DLC_ASCEND_HIVMC",
    stage="bin",
    how_to_get="install Huawei CANN and source its set_env.sh (hivmc is not published apart from CANN), "
               "or set DLC_ASCEND_HIVMC to its path",
)
TOOLS: dict[str, Tool] = {t.name: t for t in (ADAPTER, BISHENGIR, HIVMC)}


@dataclass(frozen=True)
class Found:
    tool: Tool
    path: Path
    source: Source


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def cache_dir() -> Path:
    """The per-user tool cache (``DLC_ASCEND_TOOL_CACHE``, default ``~/.cache/dlcore/toolchains/ascend``)."""
    configured = os.environ.get("DLC_ASCEND_TOOL_CACHE")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dlcore" / "toolchains" / "ascend"


def find(name: str) -> Found | None:
    """Where tool ``name`` is, by the order of the module docstring; ``None`` when nowhere.

    :raises ToolchainMissingError: the tool's variable names something that is not an executable
        file (a wrong path is said, not silently passed over).
    """
    tool = TOOLS[name]
    named = os.environ.get(tool.variable)
    if named:
        path = Path(named)
        if not _executable(path):
            raise ToolchainMissingError(f"{tool.variable}={named!r} is not an executable file", missing=(name,))
        return Found(tool, path, Source.VARIABLE)
    if tool.package_path:
        root = _package_dir("ascendnpuir")
        if root is not None and _executable(root / tool.package_path):
            return Found(tool, root / tool.package_path, Source.PACKAGE)
    if tool.triton_ascend_path:
        root = _package_dir("triton")
        if root is not None and _executable(root / tool.triton_ascend_path):
            return Found(tool, root / tool.triton_ascend_path, Source.TRITON_ASCEND)
    on_path = shutil.which(name)
    if on_path:
        return Found(tool, Path(on_path), Source.PATH)
    cached = cache_dir() / name
    if _executable(cached):
        return Found(tool, cached, Source.CACHE)
    return None


def locate(name: str) -> Found:
    """:func:`find`, or :class:`ToolchainMissingError` naming the tool and how to get it."""
    found = find(name)
    if found is None:
        tool = TOOLS[name]
        raise ToolchainMissingError(f"{name} (for the {tool.stage} stage) was not found: {tool.how_to_get}",
                                    missing=(name,))
    return found
