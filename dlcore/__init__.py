"""dlcore: a plugin-based framework to write, lower, select and tune Triton kernels.

``dlcore.get_op(name, args)`` returns the best implementation of an op for those inputs on their
device; plugins (backends, kernels, passes, strategies) arrive through entry points.
"""

from __future__ import annotations

from dlcore.errors import (
    BackendUnavailableError,
    DlcoreError,
    InvalidInputError,
    InvalidOptionError,
    NoKernelError,
    PluginLoadError,
    UnknownOpError,
)

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError",
    "DlcoreError",
    "InvalidInputError",
    "InvalidOptionError",
    "NoKernelError",
    "PluginLoadError",
    "UnknownOpError",
    "get_op",
    "hookimpl",
]


def __getattr__(name: str):
    # Each imports what only its users need: pluggy for plugins, the dispatcher for callers.
    if name == "hookimpl":
        from dlcore.plugins.hookspecs import hookimpl as found
    elif name == "get_op":
        from dlcore.dispatch.dispatcher import get_op as found
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = found
    return found
