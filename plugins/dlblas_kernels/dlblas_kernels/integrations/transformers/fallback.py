"""Why a layer runs transformers' own code instead of dlcore's, said once per kind of layer and reason.

A layer that dlcore's op cannot take exactly (a sliding window within reach, soft-capping, dropout,
attention weights asked for, experts in another layout) is never computed approximately: it runs
the model's own path for that call, and :class:`ModelFallbackWarning` says which layer and why.
"""

from __future__ import annotations

import enum
import warnings

import torch
from torch import nn

from dlcore.api import FallbackWarning


class ModelFallbackWarning(FallbackWarning):
    """A layer of a patched model ran transformers' own path for a call that dlcore's op cannot take."""


class Reason(enum.Enum):
    """What a dlcore op cannot take; the value is the sentence the warning says."""

    MASK = ("its attention mask is neither causal nor causal with key padding (padding that leaves a row's "
            "keys more than one run, a sliding window the sequence reaches, packed sequences or a custom 4-D mask)")
    SOFTCAP = "logit soft-capping"
    DROPOUT = "attention dropout in training"
    OUTPUT_ATTENTIONS = "the attention weights are asked for (output_attentions)"
    EXTRA_TERMS = "attention sinks or a position bias"
    PACKED = "packed sequences given as cumulative lengths"
    HEAD_DIM = "a head dimension over 256"
    DTYPE = "a dtype other than float16, bfloat16 and float32, or q, k and v of different dtypes"
    EXPERTS_LAYOUT = ("experts that are not SiLU-gated [E, 2I, H] / [E, H, I] without bias (transposed, "
                      "interleaved, biased, post-normed, expert-parallel or another activation)")
    FP8_LAYOUT = ("fp8 experts that are not float8_e4m3fn with float32 128x128 block scales and a plain "
                  "SiLU gate (static activation scales, another block size, fp4, clamped or soft-capped gates)")
    FP8_GRAD = "a gradient through fp8 experts (fused_moe's fp8 path is forward only)"


#: (layer kind, reason) pairs already warned about in this process
_warned: set[tuple[str, Reason]] = set()


def layer_name(module: nn.Module) -> str:
    """``LlamaAttention (layer 3)``: the module's class and, where it has one, its layer index."""
    index = getattr(module, "layer_idx", None)
    return type(module).__name__ + ("" if index is None else f" (layer {index})")


def warn_once(module: nn.Module, reason: Reason, path: str) -> None:
    """Warn, once per kind of layer and reason, that ``module`` runs ``path`` because of ``reason``."""
    key = (type(module).__qualname__, reason)
    if key not in _warned:
        _warn(module, reason, path, key)


@torch.compiler.disable
def _warn(module: nn.Module, reason: Reason, path: str, key: tuple[str, Reason]) -> None:
    _warned.add(key)
    warnings.warn(f"{layer_name(module)} runs {path} instead of dlcore's kernels: {reason.value} "
                  f"(said once for every {type(module).__name__})", ModelFallbackWarning, stacklevel=3)
