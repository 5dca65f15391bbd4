"""The shelf: where, in Triton's own cache, the compiled kernel of each specialization lies.

Kept under dlcore's cache directory, one JSON file per JIT kernel. A new process's first launch of a
shelved specialization loads that compiled kernel itself and launches it
(:meth:`dlcore.runtime.launch.KernelEntry.launch`), skipping Triton's first-call path: the binder's
creation, the hash of every file of Triton's installation (``triton_key``) and the compile-cache
lookup. The shelf's folder is named by a stamp of the Triton installation (version, files' sizes and
times, ``TRITON_*`` variables, cache directory), each entry by the kernel's own ``cache_key`` (its
source and dependencies, as Triton hashes them), the target and the specialization; a missing cache
file sends the launch back through Triton. What the shelf saves a new process's first call is
measured in docs/performance.md ("First call").
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from dlcore.cachedir import default_directory, write_json
from dlcore.runtime import internals

#: specializations shelved per kernel; the least recently shelved are forgotten first
SHELF_LIMIT = 256

_PLAIN = (int, float, bool, str, type(None))
_stamp: str | None = None


def stamp() -> str:
    """Names the Triton installation and settings that Triton's compile-cache key depends on,
    cheaply: its version and the sizes and times of its files (not their hash), the ``TRITON_*``
    variables, the cache directory and the variables Triton says invalidate its cache."""
    global _stamp
    if _stamp is None:
        import triton

        root = Path(triton.__file__).parent
        files = []
        for folder in ("_C", "compiler", "backends", "language", "runtime"):
            for path, _, names in os.walk(root / folder):
                for name in names:
                    if name.endswith((".py", ".so")):
                        st = os.stat(os.path.join(path, name))
                        files.append((os.path.join(path, name), st.st_size, st.st_mtime_ns))
        settings = sorted((k, v) for k, v in os.environ.items() if k.startswith("TRITON_"))
        text = json.dumps([triton.__version__, sorted(files), settings, str(internals.found.cache.dir),
                           sorted(internals.found.env_vars().items())])
        _stamp = hashlib.sha256(text.encode()).hexdigest()[:20]
    return _stamp


def clear() -> None:
    """Forget the installation's stamp (``dlcore.reset()``): the next one reads the installation and
    the ``TRITON_*`` variables again."""
    global _stamp
    _stamp = None


def shelf_name(kernel: Any, key: tuple, kwargs: dict[str, Any]) -> str | None:
    """The shelf's name for a specialization, or None when it is not shelved: a stages hook or a
    JIT cache hook installed, compilation forced or dumped, or a constexpr of no plain type."""
    found = internals.found
    compilation = found.compilation
    if (key[1] != id(None) or found.runtime.jit_cache_hook is not None or compilation.always_compile
            or compilation.override or compilation.dump_ir):
        return None
    items = []
    for item in key[2:]:
        if isinstance(item, tuple) and item and isinstance(item[0], torch.dtype):
            items.append([str(item[0]), item[1]])
        elif isinstance(item, type):
            items.append(item.__name__)
        elif isinstance(item, _PLAIN):
            items.append(item)
        elif isinstance(item, tuple) and all(isinstance(i, _PLAIN) for i in item):
            items.append(list(item))
        else:
            return None
    target = found.driver.get_current_target()
    debug = bool(kwargs.get("debug", kernel.debug) or found.runtime.debug)
    text = json.dumps([kernel.cache_key, str(target), debug, str(compilation.instrumentation_mode), items])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _encode(value: Any) -> Any:
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (*_PLAIN, list, tuple)) for v in value):
        return [_encode(v) for v in value]
    raise TypeError(type(value).__name__)


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


class Shelf:
    """Where Triton keeps the compiled kernels of one JIT kernel, per specialization (a JSON file
    under ``<dlcore cache>/launch/<stamp>/``)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            entries = json.loads(path.read_text())
        except (OSError, ValueError):
            entries = {}
        # a shelf of another shape (damaged, or not dlcore's) is an empty one
        self.entries: dict[str, Any] = entries if isinstance(entries, dict) else {}

    @classmethod
    def of(cls, kernel: Any) -> Shelf:
        return cls(default_directory() / "launch" / stamp() / f"{kernel.fn.__module__}.{kernel.fn.__qualname__}.json")

    def load(self, name: str, kernel: Any) -> Any:
        """The compiled kernel shelved as ``name``, loaded from Triton's cache; None when the shelf
        or Triton's cache does not hold it."""
        shelved = self.entries.get(name)
        if shelved is None:
            return None
        found = internals.found
        try:
            group = found.cache_manager(shelved["hash"]).get_group(f"{shelved['name'][:150]}.json")
            if not group:
                return None
            signature = {k: _tuples(v) for k, v in shelved["signature"].items()}
            constexprs = {_tuples(k): _tuples(v) for k, v in shelved["constants"]}
            attrs = {_tuples(k): v for k, v in shelved["attrs"]}
            src = found.ast_source(kernel, signature, constexprs, attrs)
            return found.compiled_kernel(src, group, shelved["hash"])
        except (OSError, ValueError, KeyError, TypeError, StopIteration):
            return None  # a file of Triton's cache gone or changed: Triton compiles or finds it again

    def store(self, name: str, compiled: Any) -> None:
        src = getattr(compiled, "src", None)
        try:
            found = {"hash": compiled.hash, "name": compiled.name, "signature": dict(src.signature),
                     "constants": [[list(k), _encode(v)] for k, v in src.constants.items()],
                     "attrs": [[list(k), _encode(v)] for k, v in src.attrs.items()]}
        except (AttributeError, TypeError):
            return  # not an AST-compiled kernel, or a constant JSON cannot hold
        if self.entries.get(name) != found:
            self.entries.pop(name, None)
            self.entries[name] = found
            while len(self.entries) > SHELF_LIMIT:  # the least recently shelved go first
                del self.entries[next(iter(self.entries))]
            write_json(self.path, self.entries)
