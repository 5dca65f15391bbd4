"""Triton kernels for dlcore, one module per kernel.

Each module holds a kernel's whole story: the ``@triton.jit`` kernels, the launch plan, the torch
reference, the heuristic default config, the op declaration, the implementation, the public
function and its registration (each module is its own ``dlcore.kernels`` entry point).

The public functions validate their inputs and run the Triton kernel with its default config,
without selection or tuning; ``dlcore.get_op(name, args)`` is the tuned, cached path. Each op is
also a PyTorch custom op ``torch.ops.dlblas.<name>`` (see :mod:`dlcore.runtime.torch_ops`), registered when
its module is imported (``dlblas_kernels.<name>`` or ``get_op`` does that): the public functions are
differentiable through it and compile with ``torch.compile(fullgraph=True)``.

The modules are imported on first use, so that a process that calls one kernel does not build
every other kernel's jit functions and custom ops (see :mod:`dlcore.plugins.index`).
"""

from __future__ import annotations

import importlib
import sys
import types

__all__ = ["add_rms_norm", "apply_rotary_pos_emb", "ffn", "matmul", "partial_rotary_emb", "rms_norm", "silu_and_mul"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module(f"{__name__}.{name}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """Keeps ``dlblas_kernels.<name>`` the public function: importing a submodule would otherwise bind
    the module under the same name on its package."""

    def __setattr__(self, name: str, value: object) -> None:
        if name in __all__ and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
