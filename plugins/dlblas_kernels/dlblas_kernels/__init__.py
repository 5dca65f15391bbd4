"""Triton kernels for dlcore: one module per kernel, under :mod:`dlblas_kernels.kernels`.

The public functions (``dlblas_kernels.rms_norm(x, w)``) validate their inputs and run the Triton
kernel with its heuristic config, without selection or tuning; ``dlcore.get_op(name, args)`` is the
tuned, cached path. Each op is also a PyTorch custom op ``torch.ops.dlblas.<name>`` (see
:mod:`dlcore.runtime.template`), registered when its module is imported (a public function's
first use, or ``get_op``): the public functions are differentiable through it and compile with
``torch.compile(fullgraph=True)``.

A public function is looked up on first use, importing its kernel module
(``dlblas_kernels.kernels.<name>``) and no other (see :mod:`dlcore.plugins.index`).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "add_rms_norm",
    "apply_rotary_pos_emb",
    "cross_entropy",
    "ffn",
    "flash_attention_v2",
    "fp8_gemm",
    "fused_linear_cross_entropy",
    "fused_moe",
    "fused_rotary_and_fa",
    "matmul",
    "partial_rotary_emb",
    "quantize_fp8",
    "rms_norm",
    "silu_and_mul",
    "softmax",
    "topk_gating",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        function = getattr(importlib.import_module(f"{__name__}.kernels.{name}"), name)
        globals()[name] = function
        return function
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
