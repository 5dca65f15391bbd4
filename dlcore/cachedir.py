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
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dlcore"


def environment_key() -> str:
    """The interpreter and its import path, less the script's own folder."""
    text = json.dumps([sys.prefix, sys.path[1:]])
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def write_json(path: Path, data: Any) -> bool:
    """Write ``data`` to ``path`` atomically (readers see the old file or the new one); False if it
    could not be written: what these files hold can always be rebuilt."""
    import tempfile

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=".tmp")
    except OSError:
        return False
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        Path(tmp).unlink(missing_ok=True)
        return False
    return True
