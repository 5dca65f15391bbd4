"""Triton kernels for dlcore, one module per kernel.

Each module holds a kernel's whole story: the ``@triton.jit`` kernels, the launch plan, the torch
reference, the heuristic default config, the op declaration, the implementation, the public
function and its registration (each module is its own ``dlcore.kernels`` entry point).

The public functions validate their inputs and run the Triton kernel with its default config,
without selection or tuning; ``dlcore.get_op(name, args)`` is the tuned, cached path. Each op is
also a PyTorch custom op ``torch.ops.dlblas.<name>`` (see :mod:`dlcore.torch_ops`): the public
functions are differentiable through it and compile with ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

from dlblas_kernels.add_rms_norm import add_rms_norm
from dlblas_kernels.apply_rotary_pos_emb import apply_rotary_pos_emb
from dlblas_kernels.ffn import ffn
from dlblas_kernels.matmul import matmul
from dlblas_kernels.partial_rotary_emb import partial_rotary_emb
from dlblas_kernels.rms_norm import rms_norm
from dlblas_kernels.silu_and_mul import silu_and_mul

__all__ = ["add_rms_norm", "apply_rotary_pos_emb", "ffn", "matmul", "partial_rotary_emb", "rms_norm", "silu_and_mul"]
