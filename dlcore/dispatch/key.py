"""The key of a choice: everything that changes which implementation and config serve a call.

:class:`Key` names a selection in the memo and on disk: the schema version, the op, the signature,
the device arch, the backend and its version, the Triton version, every candidate with the hash of
the source its code comes from (an edited kernel is never served a stale choice), and the compiler
passes that rewrite its launches. :func:`exact_key` is the in-process shortcut to a bound op for
inputs seen before: everything validation and the signature depend on, exactly, and the
:data:`ENVIRONMENT` variables that change a choice, read on every call.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dlcore.declarations.call import Call
from dlcore.declarations.implementation import Implementation

SCHEMA_VERSION = 2
#: ``op:impl,...``: implementations left out of the candidates (see ``find_candidates``)
DISABLE_IMPLS = "DLCORE_DISABLE_IMPLS"
#: the environment variables that change a choice or how it runs, besides the inputs
ENVIRONMENT = ("DLCORE_TUNE", "DLCORE_TUNE_STRATEGY", "DLCORE_TUNE_CHECK", "DLCORE_PLUGINS", "DLCORE_DISABLE_PLUGINS",
               DISABLE_IMPLS, "DLCORE_ENABLE_PASSES", "DLCORE_DISABLE_PASSES", "DLC_DUMP_IR", "TRITON_INTERPRET")



def _environment_reader() -> Callable[[], tuple]:
    """A function giving the values of :data:`ENVIRONMENT` now, read on every ``get_op`` miss of the
    exact-input memo's key: ``os.environ.get`` encodes each name and decodes each value, so where
    ``os.environ`` keeps its encoded mapping (CPython, every platform) the encoded names are looked
    up there directly, at about a third of the cost; values then stay encoded."""
    data, encode = getattr(os.environ, "_data", None), getattr(os.environ, "encodekey", None)
    if isinstance(data, dict) and callable(encode):
        names = tuple(encode(name) for name in ENVIRONMENT)
        return lambda: tuple(map(data.get, names))
    return lambda: tuple(map(os.environ.get, ENVIRONMENT))


#: the values of :data:`ENVIRONMENT` now, as a tuple (encoded where os.environ keeps them so)
environment = _environment_reader()


def exact_key(name: str, args: tuple | list, kwargs: dict[str, Any] | None, options: tuple) -> tuple | None:
    """A key for a hit without validation, cheap to compute: the op, the options, the environment,
    and each argument exactly (a tensor's dtype, shape, strides, device and alignment; a scalar's
    value; whether it requires grad, and whether grad mode is on: a training call is chosen apart).
    None when an argument cannot be part of a key (kwargs, lists, ...)."""
    if kwargs:
        return None
    key: list[Any] = [name, options, environment(), torch.is_grad_enabled()]
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.dtype, a.shape, a.stride(), a.device, a.data_ptr() % 16 == 0, a.requires_grad))
        elif isinstance(a, (int, float, bool, str, torch.dtype)) or a is None:
            key.append((type(a), a))
        else:
            return None
    return tuple(key)


def triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return triton.__version__


@dataclass(frozen=True)
class Key:
    """What a selection is valid for, readable (``parts``) and as the store's key (``digest``)."""

    op: str
    parts: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, call: Call, passes: tuple[str, ...] = ()) -> Key:
        """The key of ``call`` whose launches the passes named ``passes`` rewrite."""
        parts = {
            "schema": str(SCHEMA_VERSION),
            "signature": call.signature.key(),
            "device": f"{call.profile.backend}:{call.profile.arch}",
            "backend_version": call.backend.version,
            "triton": triton_version(),
            # sorted: the order plugins happened to load in is no part of what was chosen
            "candidates": ",".join(sorted(_candidate(c) for c in call.candidates)),
            "passes": ",".join(passes),
        }
        return cls(call.op.name, tuple(sorted(parts.items())))

    @property
    def digest(self) -> str:
        text = "|".join(f"{k}={v}" for k, v in self.parts)
        return f"{self.op}:{hashlib.sha256(text.encode()).hexdigest()[:24]}"

    def as_dict(self) -> dict[str, str]:
        return dict(self.parts)


def _candidate(impl: Implementation) -> str:
    return f"{impl.plugin}/{impl.name}@{impl.source_hash()}"
