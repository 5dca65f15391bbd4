"""Where selections are kept between processes: :class:`DiskCache`, keyed by
:class:`dlcore.dispatch.key.Key` digests.

``diskcache`` under ``DLCORE_CACHE_DIR``, safe for several processes. It holds JSON text only: a
shared or tampered cache can hand back at worst a record that fails to parse, which is ignored;
nothing in it is ever unpickled or executed.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dlcore.cachedir import default_directory
from dlcore.dispatch.key import SCHEMA_VERSION
from dlcore.errors import CacheFileError
from dlcore.tuning.selection import Selection

EXPORT_FORMAT = "dlcore-cache"


class CacheWarning(UserWarning):
    """The disk cache was corrupt and set aside, or an entry in it was unreadable."""


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

        from dlcore.dispatch.jsondisk import TextOnlyDisk

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

    def items(self) -> Iterator[tuple[str, dict[str, Any]]]:
        cache = self._open()
        for key in list(cache.iterkeys()):
            record = self.get_record(key)
            if record is not None:
                yield key, record

    def delete(self, key: str) -> bool:
        deleted = bool(self._open().delete(key))
        return deleted

    def clear(self) -> int:
        count = self._open().clear()
        return count

    def export(self, path: Path | str) -> int:
        entries = dict(self.items())
        Path(path).write_text(json.dumps({"format": EXPORT_FORMAT, "schema": SCHEMA_VERSION, "entries": entries},
                                         indent=1, sort_keys=True))
        return len(entries)

    def import_(self, path: Path | str) -> tuple[int, int]:
        """Add the entries of an exported file; returns (imported, rejected)."""
        try:
            data = json.loads(Path(path).read_text())
        except ValueError as exc:  # not JSON, or not text
            raise CacheFileError(f"{path} is not a dlcore cache export: {exc}") from None
        if not isinstance(data, dict) or data.get("format") != EXPORT_FORMAT:
            raise CacheFileError(f"{path} is not a dlcore cache export (no \"format\": \"{EXPORT_FORMAT}\")")
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
