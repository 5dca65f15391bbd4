"""Where selections are remembered, and the keys they are remembered under.

A key names everything that makes a selection valid: the schema version, the signature, the
device arch, the backend and its version, the Triton version, and every candidate with the hash
of its source (an edited kernel is never served a stale choice).

Two stores sit behind the same methods: the in-process :class:`MemoryCache`, and the on-disk
:class:`DiskCache` (``diskcache``, safe for several processes) under ``DLCORE_CACHE_DIR``. The disk
holds JSON text only: a shared or tampered cache can hand back at worst a record that fails to
parse, which is ignored; nothing in it is ever unpickled or executed.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dlcore.cachedir import default_directory, new_generation
from dlcore.device import DeviceProfile
from dlcore.implementation import Implementation
from dlcore.selection import Selection
from dlcore.signature import Signature

SCHEMA_VERSION = 1
EXPORT_FORMAT = "dlcore-cache"


class CacheWarning(UserWarning):
    """The disk cache was corrupt and set aside, or an entry in it was unreadable."""


def triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return triton.__version__


def key_parts(signature: Signature, profile: DeviceProfile, backend_version: str,
              candidates: list[Implementation]) -> dict[str, str]:
    """What a selection depends on, in readable form (stored with each entry)."""
    return {
        "schema": str(SCHEMA_VERSION),
        "signature": signature.key(),
        "device": f"{profile.backend}:{profile.arch}",
        "backend_version": backend_version,
        "triton": triton_version(),
        # sorted: the order plugins happened to load in is no part of what was chosen
        "candidates": ",".join(sorted(f"{c.plugin}/{c.name}@{c.source_hash()}" for c in candidates)),
    }


def cache_key(parts: dict[str, str], op: str) -> str:
    text = "|".join(f"{k}={v}" for k, v in sorted(parts.items()))
    return f"{op}:{hashlib.sha256(text.encode()).hexdigest()[:24]}"


def parse_record(text: Any) -> dict[str, Any] | None:
    """A stored record, or None if it is not one (never more than ``json.loads`` is run on it)."""
    if not isinstance(text, str):
        return None
    try:
        record = json.loads(text)
        Selection.from_json(record["selection"])
    except (ValueError, TypeError, KeyError):
        return None
    if not isinstance(record.get("parts"), dict) or not isinstance(record.get("op"), str):
        return None
    return record


def make_record(op: str, parts: dict[str, str], selection: Selection) -> dict[str, Any]:
    return {"op": op, "parts": parts, "selection": selection.to_json()}


class MemoryCache:
    """The in-process store of selections."""

    def __init__(self) -> None:
        self._entries: dict[str, Selection] = {}

    def get(self, key: str) -> Selection | None:
        return self._entries.get(key)

    def put(self, key: str, record: dict[str, Any]) -> None:
        self._entries[key] = Selection.from_json(record["selection"])

    def clear(self) -> None:
        self._entries.clear()


class DiskCache:
    """Selections on disk, as JSON text, shared by every process using the same directory."""

    def __init__(self, directory: Path | str | None = None) -> None:
        self.directory = Path(directory) if directory is not None else default_directory()
        self._cache = None

    def _open(self):
        if self._cache is None:
            self._cache = self._open_or_recover()
        return self._cache

    def _open_or_recover(self):
        import diskcache

        from dlcore.jsondisk import TextOnlyDisk

        try:
            cache = diskcache.Cache(str(self.directory), disk=TextOnlyDisk)
            len(cache)  # a query: a damaged database fails here, not at the first lookup
            return cache
        except (sqlite3.DatabaseError, OSError) as exc:
            aside = self.directory.with_name(f"{self.directory.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
            warnings.warn(
                f"dlcore: the kernel cache at {self.directory} is unreadable ({exc}); moved it to {aside} "
                f"and started an empty one. Tuned configs will be measured again.",
                CacheWarning, stacklevel=3,
            )
            shutil.move(str(self.directory), str(aside))
            fresh = diskcache.Cache(str(self.directory), disk=TextOnlyDisk)
            new_generation(self.directory)
            return fresh

    def get_record(self, key: str) -> dict[str, Any] | None:
        try:
            text = self._open().get(key)
        except ValueError:  # an entry stored in a form we never write: tampered
            text = "\0"
        if text is None:
            return None
        record = parse_record(text)
        if record is None:
            warnings.warn(f"dlcore: ignoring the unreadable cache entry {key} in {self.directory}",
                          CacheWarning, stacklevel=3)
        return record

    def get(self, key: str) -> Selection | None:
        record = self.get_record(key)
        return Selection.from_json(record["selection"]) if record is not None else None

    def put(self, key: str, record: dict[str, Any]) -> None:
        self._open().set(key, json.dumps(record, sort_keys=True))
        new_generation(self.directory)

    def items(self) -> Iterator[tuple[str, dict[str, Any]]]:
        cache = self._open()
        for key in list(cache.iterkeys()):
            record = self.get_record(key)
            if record is not None:
                yield key, record

    def delete(self, key: str) -> bool:
        deleted = bool(self._open().delete(key))
        new_generation(self.directory)
        return deleted

    def clear(self) -> int:
        count = self._open().clear()
        new_generation(self.directory)
        return count

    def export(self, path: Path | str) -> int:
        entries = dict(self.items())
        Path(path).write_text(json.dumps({"format": EXPORT_FORMAT, "schema": SCHEMA_VERSION, "entries": entries},
                                         indent=1, sort_keys=True))
        return len(entries)

    def import_(self, path: Path | str) -> tuple[int, int]:
        """Add the entries of an exported file; returns (imported, rejected)."""
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict) or data.get("format") != EXPORT_FORMAT:
            raise ValueError(f"{path} is not a dlcore cache export (no \"format\": \"{EXPORT_FORMAT}\")")
        imported = rejected = 0
        for key, record in data.get("entries", {}).items():
            if isinstance(key, str) and parse_record(json.dumps(record)) is not None:
                self.put(key, record)
                imported += 1
            else:
                rejected += 1
        return imported, rejected

    def close(self) -> None:
        if self._cache is not None:
            self._cache.close()
            self._cache = None
