"""Where selections are kept between processes: :class:`DiskCache`, keyed by
:class:`dlcore.dispatch.key.Key` digests.

``diskcache`` under ``DLCORE_CACHE_DIR``, safe for several processes. It holds JSON text only,
inline in its database: a shared or tampered cache can hand back at worst a record that fails to
parse, which is ignored; nothing in it is ever unpickled or executed, and no row can make dlcore
read or delete a file (see :mod:`dlcore.dispatch.jsondisk`).
"""

from __future__ import annotations

import enum
import json
import os
import sqlite3
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dlcore.cachedir import default_directory, write_text
from dlcore.dispatch.key import SCHEMA_VERSION, Key
from dlcore.errors import CacheFileError
from dlcore.tuning.selection import Selection

EXPORT_FORMAT = "dlcore-cache"
#: diskcache's database file in the cache directory
DATABASE = "cache.db"


class StoreMode(enum.Enum):
    WRITABLE = "writable"
    READ_ONLY = "read-only"
    ABSENT = "absent"


class CacheWarning(UserWarning):
    """The disk cache was corrupt and set aside, or an entry in it was unreadable."""


def parse_record(text: Any) -> dict[str, Any] | None:
    """A stored record, or None if it is not one (never more than ``json.loads`` is run on it)."""
    if not isinstance(text, str):
        return None
    try:
        record = json.loads(text)
        Selection.from_json(record["selection"])
    except (ValueError, TypeError, KeyError, RecursionError):
        return None
    if not isinstance(record.get("parts"), dict) or not isinstance(record.get("op"), str):
        return None
    return record


def make_record(op: str, parts: dict[str, str], selection: Selection) -> dict[str, Any]:
    return {"op": op, "parts": parts, "selection": selection.to_json()}


class DiskCache:
    """Selections on disk, as JSON text, shared by every process using the same directory.

    The directory's state decides how it is used, and dlcore never moves or deletes what it did
    not create:

    - writable: a ``diskcache.Cache`` with :class:`~dlcore.dispatch.jsondisk.TextOnlyDisk`, every
      setting passed explicitly so that none is taken from the (possibly tampered) database;
    - read-only (the directory or its database cannot be written): served as it is, writes
      skipped, one warning;
    - a path that is not a directory (a user's file), or a directory that cannot be created: no
      disk cache for this process, one warning;
    - a database that is corrupt or holds settings diskcache cannot use: its files
      (``cache.db`` and SQLite's ``-wal``/``-shm`` beside it) are renamed to
      ``cache.db.corrupt-<time>`` in the same directory and an empty one started, one warning.
    """

    def __init__(self, directory: Path | str | None = None) -> None:
        self.directory = Path(directory) if directory is not None else default_directory()
        self._cache: Any = None
        self.mode: StoreMode | None = None
        self._warned = False

    def _open(self):
        if self._cache is None:
            self.mode, self._cache = self._open_or_recover()
        return self._cache

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"dlcore: {message}", CacheWarning, stacklevel=4)

    def _open_or_recover(self) -> tuple[StoreMode, Any]:
        directory = self.directory
        if directory.exists() and not directory.is_dir():
            self._warn(f"the kernel cache path {directory} is not a directory; running without a disk cache "
                       "(point DLCORE_CACHE_DIR at a directory)")
            return StoreMode.ABSENT, _Absent()
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self._warn(f"cannot create the kernel cache directory {directory} ({exc}); running without a disk cache")
            return StoreMode.ABSENT, _Absent()
        database = directory / DATABASE
        readable = os.access(directory, os.R_OK | os.X_OK)
        exists = readable and database.exists()  # in a directory it cannot search, exists() would raise
        if not readable or (exists and not os.access(database, os.R_OK)):
            self._warn(f"cannot read the kernel cache at {directory} (permissions); running without a disk cache")
            return StoreMode.ABSENT, _Absent()
        if not os.access(directory, os.W_OK) or (exists and not os.access(database, os.W_OK)):
            reader = _ReadOnly(database)
            self._warn(f"the kernel cache at {directory} is read-only: serving its selections, storing no new ones")
            return StoreMode.READ_ONLY, reader
        try:
            return StoreMode.WRITABLE, self._writable()
        except (sqlite3.DatabaseError, KeyError, TypeError, ValueError, OSError) as exc:
            why = f"{type(exc).__name__}: {exc}"
            try:
                aside = self._set_aside(database)
                fresh = self._writable()
            except (sqlite3.DatabaseError, OSError) as again:
                self._warn(f"the kernel cache at {directory} is unreadable ({why}) and could not be set aside "
                           f"({again}); running without a disk cache")
                return StoreMode.ABSENT, _Absent()
            self._warn(f"the kernel cache at {directory} is unreadable ({why}); moved {DATABASE} to {aside.name} "
                       "and started an empty one. Tuned configs will be measured again.")
            return StoreMode.WRITABLE, fresh

    def _writable(self):
        import diskcache

        from dlcore.dispatch.jsondisk import TextOnlyDisk

        cache = diskcache.Cache(str(self.directory), disk=TextOnlyDisk, **diskcache.DEFAULT_SETTINGS)
        try:
            len(cache)  # a query: a damaged database fails here, not at the first lookup
        except BaseException:
            cache.close()
            raise
        return cache

    @staticmethod
    def _set_aside(database: Path) -> Path:
        aside = database.with_name(f"{database.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
        for suffix in ("", "-wal", "-shm"):
            part = database.with_name(database.name + suffix)
            if part.exists():
                os.replace(part, aside.with_name(aside.name + suffix))
        return aside

    @property
    def writable(self) -> bool:
        self._open()
        return self.mode is StoreMode.WRITABLE

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
        """Store ``record``; skipped (the opening warning said why) unless the cache is writable."""
        if self.writable:
            self._open().set(key, json.dumps(record, sort_keys=True))

    def keys(self) -> list[str]:
        """Every key stored as text; a row keyed otherwise (dlcore never writes one) is warned about."""
        self._open()
        if self.mode is StoreMode.ABSENT:
            return []
        keys, foreign = _text_keys(self.directory / DATABASE, immutable=self.mode is StoreMode.READ_ONLY)
        if foreign:
            warnings.warn(f"dlcore: ignoring {foreign} cache entries in {self.directory} whose keys are not text",
                          CacheWarning, stacklevel=2)
        return keys

    def items(self) -> Iterator[tuple[str, dict[str, Any]]]:
        for key in self.keys():
            record = self.get_record(key)
            if record is not None:
                yield key, record

    def _require_writable(self, action: str) -> None:
        if not self.writable:
            raise CacheFileError(f"cannot {action}: the kernel cache at {self.directory} is {self.mode.value}")

    def delete(self, key: str) -> bool:
        self._require_writable(f"delete {key!r}")
        return bool(self._open().delete(key))

    def clear(self) -> int:
        self._require_writable("clear it")
        return self._open().clear()

    def export(self, path: Path | str) -> int:
        entries = dict(self.items())
        _write_atomically(Path(path), json.dumps({"format": EXPORT_FORMAT, "schema": SCHEMA_VERSION,
                                                  "entries": entries}, indent=1, sort_keys=True))
        return len(entries)

    def import_(self, path: Path | str) -> tuple[int, int]:
        """Add the entries of an exported file; returns (imported, rejected)."""
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise CacheFileError(f"cannot read {path}: {exc.strerror or exc}") from None
        except (ValueError, RecursionError) as exc:  # not JSON, not text, or nested past the parser's depth
            raise CacheFileError(f"{path} is not a dlcore cache export: {type(exc).__name__}: {exc}") from None
        if not isinstance(data, dict) or data.get("format") != EXPORT_FORMAT:
            raise CacheFileError(f"{path} is not a dlcore cache export (no \"format\": \"{EXPORT_FORMAT}\")")
        if data.get("schema") != SCHEMA_VERSION:
            raise CacheFileError(f"{path} holds cache schema {data.get('schema')!r}; this dlcore reads schema "
                                 f"{SCHEMA_VERSION} (export it again with this dlcore's version)")
        imported = rejected = 0
        self._require_writable(f"import {path}")
        entries = data.get("entries")
        if not isinstance(entries, dict):
            raise CacheFileError(f"{path} is not a dlcore cache export (its \"entries\" is not an object)")
        for key, record in entries.items():
            if isinstance(key, str) and parse_record(json.dumps(record)) is not None and _keyed_by(key, record):
                self.put(key, record)
                imported += 1
            else:
                rejected += 1
        return imported, rejected

    def close(self) -> None:
        if self._cache is not None:
            self._cache.close()
            self._cache = None


def _keyed_by(key: str, record: dict[str, Any]) -> bool:
    """Whether ``key`` is the digest of ``record``'s op and parts (an import takes no other key)."""
    parts = record["parts"]
    if not all(isinstance(v, str) for v in parts.values()):
        return False
    return key == Key(record["op"], tuple(sorted(parts.items()))).digest


def _write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (a reader never sees half an export)."""
    try:
        write_text(path, text)
    except OSError as exc:
        raise CacheFileError(f"cannot write {path}: {exc.strerror or exc}") from None


def _connect(database: Path, immutable: bool) -> sqlite3.Connection:
    """A read-only connection. ``immutable``: where SQLite may be unable to create its lock files
    (a read-only directory), fall back to reading the database file as it is, without its WAL."""
    connection = sqlite3.connect(f"{database.as_uri()}?mode=ro", uri=True)
    if not immutable:
        return connection
    try:
        connection.execute("SELECT 1 FROM sqlite_master LIMIT 1")
        return connection
    except sqlite3.OperationalError:
        connection.close()
        return sqlite3.connect(f"{database.as_uri()}?mode=ro&immutable=1", uri=True)


def _text_keys(database: Path, immutable: bool) -> tuple[list[str], int]:
    """The text keys of diskcache's table, in insertion order, and how many rows are keyed otherwise."""
    if not database.exists():
        return [], 0
    try:
        connection = _connect(database, immutable)
    except sqlite3.DatabaseError:
        return [], 0
    try:
        rows = connection.execute("SELECT key, raw FROM Cache ORDER BY rowid").fetchall()
    except sqlite3.DatabaseError:
        return [], 0
    finally:
        connection.close()
    keys = [key for key, raw in rows if type(key) is str and raw == 1]
    return keys, len(rows) - len(keys)


class _ReadOnly:
    """Lookups in a cache directory dlcore may not write: plain SQLite reads, rows checked as
    :class:`~dlcore.dispatch.jsondisk.TextOnlyDisk` checks them (inline text only)."""

    def __init__(self, database: Path) -> None:
        self.database = database

    def get(self, key: str) -> str | None:
        if not self.database.exists():
            return None
        try:
            connection = _connect(self.database, immutable=True)
        except sqlite3.DatabaseError as exc:
            raise ValueError(f"unreadable database: {exc}") from None
        try:
            row = connection.execute("SELECT mode, filename, value FROM Cache WHERE key = ? AND raw = 1",
                                     (key,)).fetchone()
        except sqlite3.DatabaseError as exc:
            raise ValueError(f"unreadable database: {exc}") from None
        finally:
            connection.close()
        if row is None:
            return None
        mode, filename, value = row
        if mode != 1 or filename is not None or type(value) is not str:  # diskcache's MODE_RAW, inline
            raise ValueError(f"a cache value stored with mode {mode}; only inline text is accepted")
        return value

    def close(self) -> None:
        pass


class _Absent:
    """No disk cache: every lookup misses."""

    def get(self, key: str) -> None:
        return None

    def close(self) -> None:
        pass
