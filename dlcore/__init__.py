"""dlcore: a plugin-based framework to write, lower, select and tune Triton kernels.

``dlcore.get_op(name, args)`` returns the best implementation of an op for those inputs on their
device; plugins (backends, kernels, passes, strategies) arrive through entry points.
"""

from __future__ import annotations

from dlcore.errors import (
    BackendUnavailableError,
    DlcoreError,
    InvalidInputError,
    NoKernelError,
    PluginLoadError,
    UnknownOpError,
)
from dlcore.hookspecs import hookimpl

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


def get_op(name, args, kwargs=None, **options):
    """Pick, cache and bind the best implementation of op ``name`` for ``args``; see :mod:`dlcore.dispatch`."""
    from dlcore.dispatch import get_op as _get_op

    return _get_op(name, args, kwargs, **options)
