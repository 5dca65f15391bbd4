"""Where selections are remembered, and the keys they are remembered under.

A key names everything that makes a selection valid: the schema version, the signature, the
device arch, the backend, the Triton version, and every candidate with the hash of its source
(an edited kernel is never served a stale choice).
"""

from __future__ import annotations

import hashlib
from importlib.metadata import PackageNotFoundError, version

from dlcore.device import DeviceProfile
from dlcore.implementation import Implementation
from dlcore.selection import Selection
from dlcore.signature import Signature

SCHEMA_VERSION = 1


def _version_of(distribution: str) -> str:
    try:
        return version(distribution)
    except PackageNotFoundError:
        return "none"


def triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return triton.__version__


def cache_key(signature: Signature, profile: DeviceProfile, candidates: list[Implementation]) -> str:
    """A stable key for the selection among ``candidates`` for ``signature`` on ``profile``."""
    sources = ",".join(f"{c.plugin}/{c.name}@{c.source_hash()}" for c in candidates)
    parts = [
        f"v{SCHEMA_VERSION}",
        signature.key(),
        f"{profile.backend}:{profile.arch}",
        f"triton={triton_version()}",
        sources,
    ]
    text = "|".join(parts)
    return f"{signature.op}:{hashlib.sha256(text.encode()).hexdigest()[:24]}"


class MemoryCache:
    """The in-process store of selections (the disk cache sits behind the same two methods)."""

    def __init__(self) -> None:
        self._entries: dict[str, Selection] = {}

    def get(self, key: str) -> Selection | None:
        return self._entries.get(key)

    def put(self, key: str, selection: Selection) -> None:
        self._entries[key] = selection

    def clear(self) -> None:
        self._entries.clear()
