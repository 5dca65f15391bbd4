"""dlcore: a plugin-based framework to write, lower, select and tune Triton kernels.

``dlcore.get_op(name, args)`` returns the best implementation of an op for those inputs on their
device; plugins (backends, kernels, passes, strategies) arrive through entry points.
"""

from __future__ import annotations

import sys

from dlcore.errors import (
    BackendUnavailableError,
    DlcoreError,
    InvalidInputError,
    NoKernelError,
    PluginLoadError,
    UnknownOpError,
)

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError",
    "DlcoreError",
    "InvalidInputError",
    "NoKernelError",
    "PluginLoadError",
    "UnknownOpError",
    "get_op",
    "hookimpl",
]


def __getattr__(name: str):
    if name == "hookimpl":  # imports pluggy: only plugins need it
        from dlcore.hookspecs import hookimpl

        return hookimpl
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_op(name, args, kwargs=None, **options):
    """Pick, cache and bind the best implementation of op ``name`` for ``args``; see :mod:`dlcore.dispatch`.

    Until a process needs the full path, inputs bound by an earlier process are recalled from
    :mod:`dlcore.bindings` without discovering plugins.
    """
    if "dlcore.dispatch" not in sys.modules:
        from dlcore.bindings import recall

        bound = recall(name, args, kwargs, options)
        if bound is not None:
            return bound
    from dlcore.dispatch import get_op as _get_op

    return _get_op(name, args, kwargs, **options)
