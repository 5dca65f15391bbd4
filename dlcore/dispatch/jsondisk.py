"""A ``diskcache`` storage policy that only ever stores and reads inline text: no pickle, no files.

``diskcache`` pickles anything that is not a number, bytes or text, unpickles any row whose mode
says so, keeps large values in files the row names, and deletes a row's file when the row is
replaced. A cache directory shared between users, or tampered with, could then run code, read a
file outside the cache, or delete one (a row naming ``../victim.txt``). This policy writes only
``str`` values, always inline in the database; it reads only rows stored that way; and it never
removes a file, since it never writes one.
"""

from __future__ import annotations

import diskcache
from diskcache.core import MODE_RAW


class TextOnlyDisk(diskcache.Disk):
    def put(self, key):
        if type(key) is not str:
            raise TypeError(f"dlcore cache keys are str, not {type(key).__name__}")
        return super().put(key)

    def get(self, key, raw):
        if not raw or type(key) is not str:
            raise ValueError("a cache key not stored as text; refusing to decode it")
        return key

    def store(self, value, read, key=diskcache.core.UNKNOWN):
        if type(value) is not str or read:
            raise TypeError(f"dlcore cache values are JSON text, not {type(value).__name__}")
        # inline whatever the size: a row never names a file
        return 0, MODE_RAW, None, value

    def fetch(self, mode, filename, value, read):
        if mode != MODE_RAW or filename is not None or read or type(value) is not str:
            raise ValueError(f"a cache value stored with mode {mode} (file {filename!r}); only inline text is accepted")
        return value

    def remove(self, file_path):
        """Nothing: dlcore never writes value files, so a file a row names is not the cache's."""
        return None
