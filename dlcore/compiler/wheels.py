"""Taking one tool out of a published wheel, for a toolchain's fetcher (:class:`~dlcore.compiler.toolchain.Fetcher`).

The wheel is downloaded by ``pip download`` (so the package index, mirror, proxy and certificates
pip is configured with serve here too; pip shows the download's progress) into a temporary
folder, or a local copy is given. Its sha256 is checked against the one pinned in the code, and
the one member that is the tool is extracted into the toolchain's cache: written to a temporary
file beside its place, made executable, then renamed over it, so the cache holds the old tool or
the new one, never half of one. A manifest (:class:`~dlcore.compiler.toolchain.Fetched`) beside it
says where it came from. The wheel is never installed, and nothing else of it is kept.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import stat
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dlcore.compiler.toolchain import Fetched, FetchRequest, Toolchain, manifest, sha256_of
from dlcore.errors import ToolFetchError

_BLOCK = 1 << 20


@dataclass(frozen=True)
class PinnedWheel:
    """A published wheel, known by its sha256, and the member of it that is a tool."""

    #: the distribution and its version, e.g. ``triton-ascend`` ``3.2.0``
    package: str
    version: str
    filename: str
    sha256: str
    #: the path inside the wheel of the tool, e.g. ``triton/backends/ascend/triton-adapter-opt``
    member: str
    #: what ``pip download`` is told to fetch it: ``--platform`` and ``--python-version``
    platform: str
    python: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


def take_tool(toolchain: Toolchain, tool: str, wheel: PinnedWheel, request: FetchRequest) -> Fetched:
    """Put tool ``tool`` of ``toolchain``, the member ``wheel.member`` of ``wheel``, in the
    toolchain's cache; return the manifest written beside it.

    Without ``request.local`` the wheel is downloaded (``pip download``), unless the cache already
    holds the very file (``request.force`` fetches it again).

    :raises ToolFetchError: the download failed, the wheel's sha256 is not ``wheel.sha256``, or it
        lacks the member; the cache is left as it was.
    """
    target = toolchain.cache_dir() / tool
    if request.local is None and not request.force:
        held = _held(toolchain, tool, wheel, target)
        if held is not None:
            request.say(f"{tool}: {target} is already the one of {wheel.filename} (--force fetches it again)")
            return held
    with _wheel_file(wheel, request) as (path, url):
        binary_sha256 = _extract(path, wheel.member, target)
    fetched = Fetched(tool=tool, package=wheel.package, version=wheel.version, wheel=wheel.filename,
                      sha256=wheel.sha256, url=url, member=wheel.member, binary_sha256=binary_sha256)
    _write_atomically(toolchain.manifest_path(tool), asdict(fetched))
    request.say(f"{tool}: {target} (from {wheel.filename}, sha256 {wheel.sha256[:12]}... checked)")
    return fetched


def _held(toolchain: Toolchain, tool: str, wheel: PinnedWheel, target: Path) -> Fetched | None:
    """The manifest of the cache's ``tool``, if it is the member of ``wheel`` and unchanged since."""
    record = manifest(toolchain, tool)
    if record is None or record.sha256 != wheel.sha256 or not target.is_file():
        return None
    return record if sha256_of(target) == record.binary_sha256 else None


@contextmanager
def _wheel_file(wheel: PinnedWheel, request: FetchRequest) -> Iterator[tuple[Path, str]]:
    """The wheel as a local file whose sha256 is the pinned one, and where it came from:
    ``request.local``, or a download into a temporary folder that is deleted afterwards."""
    if request.local is not None:
        if not request.local.is_file():
            raise ToolFetchError(f"{request.local} is not a file; expected a copy of {wheel.filename}")
        request.say(f"checking {request.local}")
        _check_hash(request.local, wheel)
        yield request.local, str(request.local.resolve())
        return
    with tempfile.TemporaryDirectory(prefix="dlcore-fetch-") as folder:
        path, url = _download(wheel, Path(folder), request)
        _check_hash(path, wheel)
        yield path, url


def _download(wheel: PinnedWheel, folder: Path, request: FetchRequest) -> tuple[Path, str]:
    """``pip download`` the wheel into ``folder`` (pip's output and progress bar shown as it goes);
    the file and the URL pip took it from (``""`` if its log does not say)."""
    if importlib.util.find_spec("pip") is None:
        raise ToolFetchError(f"pip is not installed in {sys.executable}, and dlcore downloads through it: install "
                             f"pip, or download {wheel.filename} elsewhere and pass it with --wheel")
    log = folder / "pip.log"
    python = wheel.python.replace(".", "")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--platform", wheel.platform, "--python-version", wheel.python, "--implementation", "cp",
               "--abi", f"cp{python}", "--progress-bar", "on", "--dest", str(folder / "wheels"),
               "--log", str(log), wheel.requirement]
    request.say(f"downloading {wheel.filename} with pip")
    done = subprocess.run(command, stdin=subprocess.DEVNULL, check=False)
    if done.returncode != 0:
        raise ToolFetchError(f"`pip download {wheel.requirement}` for {wheel.platform} failed (exit "
                             f"{done.returncode}, its output is above): on a host without network, download "
                             f"{wheel.filename} elsewhere and pass it with --wheel")
    path = folder / "wheels" / wheel.filename
    if not path.is_file():
        got = ", ".join(p.name for p in (folder / "wheels").glob("*")) or "nothing"
        raise ToolFetchError(f"`pip download {wheel.requirement}` gave {got}, not {wheel.filename}")
    # the URL is only recorded in the manifest, for the reader: pip's log is the one place that has it
    found = re.search(r"(\S+://\S+/" + re.escape(wheel.filename) + r")", log.read_text(errors="replace"))
    return path, found.group(1) if found else ""


def _check_hash(path: Path, wheel: PinnedWheel) -> None:
    digest = sha256_of(path)
    if digest != wheel.sha256:
        raise ToolFetchError(f"{path.name} has sha256 {digest}; {wheel.filename} (pinned) has {wheel.sha256}: "
                             f"refusing it (a different or damaged file)")


def _extract(archive: Path, member: str, target: Path) -> str:
    """Write ``member`` of the zip ``archive`` to ``target`` atomically, executable; its sha256."""
    try:
        with zipfile.ZipFile(archive) as wheel:
            try:
                info = wheel.getinfo(member)
            except KeyError:
                raise ToolFetchError(f"{archive.name} has no {member}; expected a wheel that ships it") from None
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}-", suffix=".tmp")
            try:
                digest = hashlib.sha256()
                with os.fdopen(fd, "wb") as out, wheel.open(info) as src:
                    for block in iter(lambda: src.read(_BLOCK), b""):
                        out.write(block)
                        digest.update(block)
                os.chmod(tmp, stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
                os.replace(tmp, target)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
    except zipfile.BadZipFile as exc:
        raise ToolFetchError(f"{archive.name} is not a wheel (zip archive): {exc}") from exc
    except OSError as exc:
        raise ToolFetchError(f"could not write {target}: {exc.strerror or exc}") from exc
    return digest.hexdigest()


def _write_atomically(path: Path, data: Any) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.chmod(tmp, stat.S_IRUSR | stat.S_IWUSR | stat.S_IRGRP | stat.S_IROTH)  # mkstemp's 0600, as a file is
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise ToolFetchError(f"could not write {path}: {exc.strerror or exc}") from exc
        raise

