"""The ``"dlcore"`` experts of transformers' ``ExpertsInterface`` (and of its fp8 interface): ``fused_moe``.

transformers' experts modules hold ``gate_up_proj [E, 2I, H]`` (each expert's I gate rows, then
its I up rows) and ``down_proj [E, H, I]``, and their forward receives ``(hidden [T, H],
top_k_index [T, k], top_k_weights [T, k])``: ``fused_moe``'s layout and arguments, so the weights
are passed as they are. Experts in another form (bias, transposed or interleaved weights, no gate,
a post-expert norm, expert parallelism, an activation other than SiLU, a gate of their own) run
the module's own forward, with a warning once. fp8 experts (``FP8Experts``) run ``fused_moe``'s fp8
path where their weights are float8_e4m3fn with float32 128x128 block scales (``*_scale_inv``,
multiplied in: DeepSeek-V3's checkpoints) and no gradient is asked for.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers.integrations.moe import _default_apply_gate

from dlblas_kernels.integrations.transformers.fallback import Reason, warn_once
from dlblas_kernels.integrations.transformers.modules import is_silu
from dlblas_kernels.integrations.transformers.ops import call
from dlblas_kernels.kernels.fused_moe import FP8, ID_DTYPES, SCALE_BLOCK, fused_moe

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def dlcore_experts(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor) -> torch.Tensor:
    """``sum_j w[t, j] * down[e] @ (silu(g) * u)``, ``g, u = gate_up[e] @ hidden[t]``, ``e = index[t, j]``."""
    if not (_plain_swiglu(module) and _dtypes_fit(module.gate_up_proj, module.down_proj, hidden_states,
                                                  top_k_index, top_k_weights)):
        warn_once(module, Reason.EXPERTS_LAYOUT, "its own forward")
        return original_forward(module)(module, hidden_states, top_k_index, top_k_weights)
    return call("fused_moe", fused_moe, hidden_states, module.gate_up_proj, module.down_proj, top_k_weights,
                top_k_index)


def dlcore_fp8_experts(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
    """:func:`dlcore_experts` for ``FP8Experts``: fp8 weights and their block scales."""
    reason = _fp8_unsupported(module, hidden_states, top_k_index, top_k_weights)
    if reason is not None:
        warn_once(module, reason, "its own forward")
        return original_forward(module)(module, hidden_states, top_k_index, top_k_weights)
    return fused_moe(hidden_states, module.gate_up_proj, module.down_proj, top_k_weights, top_k_index,
                     module.gate_up_proj_scale_inv, module.down_proj_scale_inv)


def original_forward(module: nn.Module) -> Callable:
    """The experts class's own forward, which ``use_experts_implementation`` wraps."""
    forward = type(module).forward
    return getattr(forward, "__wrapped__", forward)


def _plain_swiglu(module: nn.Module) -> bool:
    """SiLU-gated experts in fused_moe's layout, computed by transformers' default gate."""
    return (getattr(module, "has_gate", False) and not getattr(module, "has_bias", True)
            and not getattr(module, "is_transposed", True) and getattr(module, "is_concatenated", False)
            and not getattr(module, "has_post_expert_norm", True) and not getattr(module, "_is_expert_parallel", True)
            and getattr(type(module), "_apply_gate", None) is _default_apply_gate
            and is_silu(getattr(module, "act_fn", None)))


def _dtypes_fit(w13: torch.Tensor, w2: torch.Tensor, hidden: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor) -> bool:
    return (hidden.dtype in DTYPES and w13.dtype == w2.dtype == hidden.dtype and weights.dtype in DTYPES
            and ids.dtype in ID_DTYPES and not torch.is_autocast_enabled(hidden.device.type))


def _fp8_unsupported(module: nn.Module, hidden: torch.Tensor, ids: torch.Tensor,
                     weights: torch.Tensor) -> Reason | None:
    w13, w2 = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if w13 is None or w2 is None or w13.dtype != FP8 or w2.dtype != FP8:
        return Reason.FP8_LAYOUT
    scales = (getattr(module, "gate_up_proj_scale_inv", None), getattr(module, "down_proj_scale_inv", None))
    experts, two_i, h = w13.shape

    def blocks(rows: int, cols: int) -> tuple[int, int, int]:
        return experts, -(-rows // SCALE_BLOCK), -(-cols // SCALE_BLOCK)

    if (any(s is None or s.dtype != torch.float32 for s in scales)
            or tuple(scales[0].shape) != blocks(two_i, h) or tuple(scales[1].shape) != blocks(h, two_i // 2)
            or tuple(getattr(module, "block_size", None) or ()) != (SCALE_BLOCK, SCALE_BLOCK)
            or getattr(module, "activation_scheme", None) != "dynamic"
            or not getattr(module, "has_gate", False) or getattr(module, "has_bias", True)
            or getattr(module, "_is_expert_parallel", False)
            or any(getattr(module, name, None) is not None
                   for name in ("swiglu_alpha", "limit", "gate_softcap", "up_softcap"))
            or not is_silu(getattr(module, "act_fn", None))):
        return Reason.FP8_LAYOUT
    if (hidden.dtype not in (torch.float16, torch.bfloat16) or weights.dtype not in DTYPES
            or ids.dtype not in ID_DTYPES):
        return Reason.DTYPE
    if torch.is_grad_enabled() and (hidden.requires_grad or weights.requires_grad):
        return Reason.FP8_GRAD
    return None
