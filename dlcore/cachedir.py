"""Where dlcore keeps its files between processes, and how it writes them.

The directory is ``DLCORE_CACHE_DIR`` (default ``$XDG_CACHE_HOME/dlcore`` or ``~/.cache/dlcore``).
It holds the selections (:mod:`dlcore.dispatch.store`) and the plugin index
(:mod:`dlcore.plugins.index`); the index is per environment: :func:`environment_key` names it.

This module imports nothing beyond the standard library: a new process's first ``get_op`` reads it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any


def default_directory() -> Path:
    configured = os.environ.get("DLCORE_CACHE_DIR")
    if configured:  # ~ expanded and made absolute: a relative path would move with the working directory
        return Path(configured).expanduser().absolute()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dlcore"


def environment_key() -> str:
    """The interpreter and its import path, less the script's own folder."""
    text = json.dumps([sys.prefix, sys.path[1:]])
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically: readers see the old file or the new one, never half
    of it (a temporary file beside it, then a rename).

    :raises OSError: it could not be written; nothing is left behind.
    """
    import tempfile

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, data: Any) -> bool:
    """Write ``data`` to ``path`` atomically (:func:`write_text`); False if it could not be written:
    what these files hold can always be rebuilt."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps(data, indent=1))
    except OSError:
        return False
    return True
