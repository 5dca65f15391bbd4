"""A ``diskcache`` storage policy that only ever stores and reads text: no pickle, either way.

``diskcache`` pickles anything that is not a number, bytes or text, and unpickles any row whose
mode says so; a cache directory shared between users, or tampered with, could then run code. This
policy refuses to write anything but ``str`` and refuses to read anything stored otherwise.
"""

from __future__ import annotations

import diskcache
from diskcache.core import MODE_RAW, MODE_TEXT


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
        return super().store(value, read, key)

    def fetch(self, mode, filename, value, read):
        if mode not in (MODE_RAW, MODE_TEXT) or read:
            raise ValueError(f"a cache value stored with mode {mode}; only text is accepted")
        result = super().fetch(mode, filename, value, read)
        if type(result) is not str:
            raise ValueError("a cache value that is not text")
        return result
