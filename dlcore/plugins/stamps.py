"""Stamps of installed code: cheap fingerprints that change when the code does.

What is remembered between processes about plugins (:mod:`dlcore.plugins.index`) is bound to these,
and trusted only while they are unchanged. This module imports nothing beyond the standard library.
"""

from __future__ import annotations

import hashlib
import os
import sys


def plugin_root(module_name: str) -> str | None:
    """The folder of an imported module's top-level package, or the file of a top-level module."""
    top = sys.modules.get(module_name.split(".")[0])
    if top is None:
        return None
    paths = list(getattr(top, "__path__", ()))
    if paths:
        return str(paths[0])
    return getattr(top, "__file__", None)


def stamp(root: str) -> str:
    """Size and modification time of every Python file under ``root`` (or of ``root`` itself)."""
    digest = hashlib.sha256()
    if os.path.isfile(root):
        info = os.stat(root)
        digest.update(f":{info.st_size}:{info.st_mtime_ns};".encode())
    else:
        _stamp_folder(root, "", digest)
    return digest.hexdigest()[:20]


class Stamps:
    """:func:`stamp` taken once per root for the life of this object (what is checked against the
    code as it was when first looked at; an edit made later is seen by a later object)."""

    def __init__(self) -> None:
        self._taken: dict[str, str] = {}

    def __call__(self, root: str) -> str:
        if root not in self._taken:
            self._taken[root] = stamp(root)
        return self._taken[root]


def _stamp_folder(folder: str, relative: str, digest) -> None:
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        name = entry.name
        if name.endswith(".py"):
            try:
                info = entry.stat()
            except OSError:
                continue
            digest.update(f"{relative}{name}:{info.st_size}:{info.st_mtime_ns};".encode())
        elif name != "__pycache__" and not name.startswith(".") and entry.is_dir():
            _stamp_folder(entry.path, f"{relative}{name}/", digest)


def import_path_stamp() -> str:
    """The modification time of each entry of the import path, less the script's own folder:
    installing, upgrading or removing a distribution changes its site directory's."""
    times = []
    for entry in sys.path[1:]:
        try:
            times.append(os.stat(entry or ".").st_mtime_ns)
        except OSError:
            times.append(0)
    return ",".join(map(str, times))
