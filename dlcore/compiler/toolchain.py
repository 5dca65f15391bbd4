"""Finding a backend's external compilers (tools), the same way for every backend.

A backend that drives executables beyond Triton (Ascend's ``triton-adapter-opt`` and
``bishengir-compile``, a Cambricon toolchain once published) declares each as a :class:`Tool`
and groups them in a :class:`Toolchain` (``Backend.toolchains``). Each tool is looked for in the
order of :data:`SEARCH_ORDER`:

1. its variable (e.g. ``DLC_ASCEND_ADAPTER_OPT``): a path that must be an executable file;
2. inside installed Python packages that ship it (``Tool.packages``: import name and the
   path inside the package), in the order given;
3. ``PATH``;
4. the toolchain's per-user tool cache (:meth:`Toolchain.cache_dir`), which its fetcher
   (``Toolchain.fetch``, run by ``dlcore toolchain fetch NAME``) fills, with a manifest per tool
   saying where it came from (:class:`Fetched`).

:func:`find` says where a tool is without running it; :func:`check` runs the tool's
:class:`Probe` once per file (a file that does not run, or answers as some other program would,
is :attr:`State.BROKEN`, with the reason); :func:`locate` does both, and returns only a tool that
answered as itself, raising :class:`~dlcore.errors.ToolchainMissingError` (or its subclass
:class:`~dlcore.errors.ToolchainBrokenError`) saying exactly how to get or fix it.
"""

from __future__ import annotations

import enum
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from dlcore.errors import ToolchainBrokenError, ToolchainMissingError


class Source(enum.Enum):
    """Where a tool was found."""

    VARIABLE = "variable"
    PACKAGE = "package"
    PATH = "PATH"
    CACHE = "tool cache"


#: the order in which the sources are searched; the first that has the tool wins
SEARCH_ORDER = (Source.VARIABLE, Source.PACKAGE, Source.PATH, Source.CACHE)


@dataclass(frozen=True)
class Probe:
    """How to ask a tool who it is: run it with ``args``; its output (stdout and stderr) must
    match ``pattern`` (a regular expression searched in it), whose group ``version``, if it has
    one, is the tool's version."""

    pattern: str
    args: tuple[str, ...] = ("--version",)
    #: seconds the tool has to answer
    timeout: float = 10.0


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
    #: how to tell it is this tool and which version; ``None``: it is not run before use
    probe: Probe | None = None


@dataclass(frozen=True)
class Fetched:
    """A tool a fetcher put in a toolchain's cache, and where it came from: the manifest
    ``<cache>/<tool>.json`` beside it."""

    tool: str
    #: the distribution and version it was taken from, e.g. ``triton-ascend`` ``3.2.0``
    package: str
    version: str
    #: the archive (a wheel's file name), its sha256, and where it came from (the URL, or the
    #: local file it was taken from; ``""`` where unknown)
    wheel: str
    sha256: str
    url: str
    #: the archive member that is the tool, and the sha256 of the tool itself
    member: str
    binary_sha256: str

    @property
    def origin(self) -> str:
        return f"{self.package} {self.version}"


@dataclass(frozen=True)
class Toolchain:
    """The tools of one backend's pipeline (``dlcore toolchain`` lists them)."""

    #: what ``dlcore toolchain fetch NAME`` calls it, e.g. ``ascend``
    name: str
    backend: str
    tools: tuple[Tool, ...]
    #: fills the tool cache (``dlcore toolchain fetch NAME``); ``None``: nothing can be fetched
    fetch: Fetcher | None = field(default=None, compare=False)
    #: what ``fetch`` gets, in a few words, for ``dlcore toolchain``
    fetches: str = ""

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

    def manifest_path(self, name: str) -> Path:
        """Where the fetcher records where tool ``name`` in the cache came from."""
        return self.cache_dir() / f"{name}.json"


def _quiet(message: str) -> None:
    """A message shown nowhere."""


@dataclass(frozen=True)
class FetchRequest:
    """What ``dlcore toolchain fetch`` asks of a toolchain's fetcher."""

    #: a file to take the tools from instead of downloading it (offline hosts, tests); its hash is
    #: checked all the same
    local: Path | None = None
    #: fetch again even when the cache already holds the very file
    force: bool = False
    #: a line for the user (what is being done, what was skipped)
    say: Callable[[str], None] = _quiet


#: ``fetch(toolchain, request)``: fill ``toolchain.cache_dir()`` and say what was put there
#: (raises :class:`~dlcore.errors.ToolFetchError`, leaving the cache as it was)
Fetcher = Callable[[Toolchain, FetchRequest], tuple[Fetched, ...]]


@dataclass(frozen=True)
class Found:
    tool: Tool
    path: Path
    source: Source
    #: for :attr:`Source.PACKAGE`, the package it came from
    package: str = ""


class State(enum.Enum):
    """What a found tool's probe said."""

    #: it answered as the tool
    OK = "ok"
    #: it did not run, or answered as some other program
    BROKEN = "broken"
    #: the tool declares no probe: found, not run
    UNCHECKED = "unchecked"


@dataclass(frozen=True)
class Health:
    state: State
    #: the version the probe read (may be empty when the probe has no ``version`` group)
    version: str = ""
    #: why it is broken
    reason: str = ""


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


def _from_variable(toolchain: Toolchain, tool: Tool) -> Iterator[Found]:
    named = os.environ.get(tool.variable)
    if named:
        path = Path(named)
        if not _executable(path):
            raise ToolchainMissingError(f"{tool.variable}={named!r} is not an executable file; "
                                        f"unset it or point it at {tool.name}", missing=(tool.name,))
        yield Found(tool, path, Source.VARIABLE)


def _from_packages(toolchain: Toolchain, tool: Tool) -> Iterator[Found]:
    for package, inside in tool.packages:
        root = package_dir(package)
        if root is not None and _executable(root / inside):
            yield Found(tool, root / inside, Source.PACKAGE, package)


def _from_path(toolchain: Toolchain, tool: Tool) -> Iterator[Found]:
    on_path = shutil.which(tool.name)
    if on_path:
        yield Found(tool, Path(on_path), Source.PATH)


def _from_cache(toolchain: Toolchain, tool: Tool) -> Iterator[Found]:
    cached = toolchain.cache_dir() / tool.name
    if _executable(cached):
        yield Found(tool, cached, Source.CACHE)


_SEARCHES = {Source.VARIABLE: _from_variable, Source.PACKAGE: _from_packages, Source.PATH: _from_path,
             Source.CACHE: _from_cache}


def candidates(toolchain: Toolchain, name: str) -> Iterator[Found]:
    """Every place tool ``name`` of ``toolchain`` is, in :data:`SEARCH_ORDER`; the first is the one used.

    :raises ToolchainMissingError: the tool's variable names something that is not an executable
        file (a wrong path is said, not silently passed over).
    """
    tool = toolchain.tool(name)
    for source in SEARCH_ORDER:
        yield from _SEARCHES[source](toolchain, tool)


def find(toolchain: Toolchain, name: str) -> Found | None:
    """Where tool ``name`` of ``toolchain`` is, by :data:`SEARCH_ORDER`, without running it; ``None``
    when nowhere.

    :raises ToolchainMissingError: the tool's variable names something that is not an executable
        file (a wrong path is said, not silently passed over).
    """
    return next(candidates(toolchain, name), None)


#: probe results by (path, size, modification time): each file is run once per process
_checked: dict[tuple[str, int, int], Health] = {}


def clear() -> None:
    """Forget the probe results (``dlcore.reset()``): each tool is run again when next checked."""
    _checked.clear()


def check(found: Found) -> Health:
    """Run the tool's probe (once per file and process) and say whether it answered as the tool."""
    probe = found.tool.probe
    if probe is None:
        return Health(State.UNCHECKED)
    try:
        stat = found.path.stat()
    except OSError as exc:
        return Health(State.BROKEN, reason=f"cannot be read: {exc.strerror}")
    key = (str(found.path), stat.st_size, stat.st_mtime_ns)
    if key not in _checked:
        _checked[key] = _run_probe(found.path, probe)
    return _checked[key]


def _run_probe(path: Path, probe: Probe) -> Health:
    command = " ".join((path.name, *probe.args))
    try:
        done = subprocess.run([str(path), *probe.args], capture_output=True, timeout=probe.timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return Health(State.BROKEN, reason=f"`{command}` did not answer within {probe.timeout:g} s")
    except OSError as exc:
        return Health(State.BROKEN, reason=f"does not run: {exc.strerror or exc}")
    output = (done.stdout + done.stderr).decode(errors="replace")
    first = next((line.strip() for line in output.splitlines() if line.strip()), "nothing")
    if done.returncode != 0:
        return Health(State.BROKEN, reason=f"`{command}` exited {done.returncode}: {first}")
    match = re.search(probe.pattern, output)
    if match is None:
        return Health(State.BROKEN, reason=f"`{command}` printed {first!r}, not what {path.name} prints "
                                           f"(expected a match of {probe.pattern!r}): another program?")
    return Health(State.OK, version=match.groupdict().get("version") or "")


def locate(toolchain: Toolchain, name: str) -> Found:
    """:func:`find`, then :func:`check`: a tool that answered as itself (or declares no probe).

    :raises ToolchainMissingError: found nowhere; the message names the tool and how to get it.
    :raises ToolchainBrokenError: found, but it does not run or answers as another program; the
        message says where, why, and how to replace it.
    """
    found = find(toolchain, name)
    tool = toolchain.tool(name)
    if found is None:
        raise ToolchainMissingError(f"{name} (for the {tool.stage} stage) was not found: {tool.how_to_get}",
                                    missing=(name,))
    health = check(found)
    if health.state is State.BROKEN:
        raise ToolchainBrokenError(f"{name} at {found.path} (found by {found.source.value}) is broken: "
                                   f"{health.reason}; replace it: {tool.how_to_get}", missing=(name,))
    return found


def manifest(toolchain: Toolchain, name: str) -> Fetched | None:
    """What the toolchain's fetcher recorded about tool ``name`` in its cache, if it did (and the
    record is readable)."""
    return _read_manifest(toolchain.manifest_path(name))


def _read_manifest(path: Path) -> Fetched | None:
    try:
        return Fetched(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def origin(found: Found) -> str:
    """The distribution and version a found tool came from, where that is known: the fetcher's
    manifest for the cache (only while the file is the one fetched), the installed distribution
    for a package; else ``""``."""
    if found.source is Source.CACHE:
        record = _read_manifest(found.path.with_name(f"{found.tool.name}.json"))
        if record is None:
            return ""
        if sha256_of(found.path) != record.binary_sha256:
            return f"not the file fetched from {record.origin} (its sha256 differs from the manifest's)"
        return record.origin
    if found.source is Source.PACKAGE:
        for name in importlib.metadata.packages_distributions().get(found.package, []):
            try:
                distribution = importlib.metadata.distribution(name)
            except importlib.metadata.PackageNotFoundError:
                continue
            # the distribution that installed this very folder, not another of the same import name
            if found.path.is_relative_to(Path(str(distribution.locate_file(found.package)))):
                return f"{name} {distribution.version}"
    return ""
