"""The ``"dlcore"`` attention of transformers' ``AttentionInterface``, with its mask function.

transformers builds one mask per forward through the mask function registered under the model's
``attn_implementation`` (``ALL_MASK_ATTENTION_FUNCTIONS``) and hands it to every attention layer;
an attention function registered without one receives ``attention_mask=None`` even for a padded
batch. :func:`dlcore_mask` is that function: it returns ``None`` exactly when the mask is the plain
causal one aligned bottom-right (no padding, no sliding window the sequence reaches, no packed
sequences, the queries the last positions of the keys: prefill, or decoding against a dynamic
cache), and otherwise the boolean 4-D mask SDPA's own function builds.

:func:`dlcore_attention` runs ``flash_attention_v2`` (causal bottom-right, GQA) when the mask is
``None``; queries and values of different head dimensions (DeepSeek-V3's MLA: 192 and 128) are
zero-padded to the wider one, which leaves ``q . k`` and the first columns of the output exact.
Everything else runs transformers' SDPA attention (or the model's eager attention where SDPA
cannot, soft-capping or attention weights) for that call, with a warning once
(:mod:`.fallback`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import causal_mask_function, prepare_padding_mask, sdpa_mask
from transformers.utils.import_utils import is_tracing

from dlblas_kernels.integrations.transformers.fallback import Reason, warn_once
from dlblas_kernels.integrations.transformers.ops import call
from dlblas_kernels.kernels.flash_attention_v2 import MAX_HEAD_DIM, flash_attention_v2

NAME = "dlcore"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --- the mask ------------------------------------------------------------------------------------

def dlcore_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                mask_function: Callable = causal_mask_function, attention_mask: torch.Tensor | None = None,
                local_size: int | None = None, allow_is_causal_skip: bool = True, **kwargs) -> torch.Tensor | None:
    """``None`` when the mask is plain causal aligned bottom-right (what ``flash_attention_v2``'s
    ``causal=True`` computes), else SDPA's boolean ``[B, 1, q_length, kv_length]`` mask, never skipped."""
    padding_mask = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if allow_is_causal_skip and _plain_causal(q_length, kv_length, q_offset, kv_offset, mask_function,
                                              padding_mask, local_size):
        return None
    kwargs.pop("allow_is_bidirectional_skip", None)
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                     local_size=local_size, allow_is_causal_skip=False, allow_is_bidirectional_skip=False,
                     **kwargs)


def _plain_causal(q_length: int, kv_length: int, q_offset, kv_offset: int, mask_function: Callable,
                  padding_mask: torch.Tensor | None, local_size: int | None) -> bool:
    """Whether every query at position ``q_offset + i`` sees exactly the keys at positions up to its
    own, all of them present: the causal mask aligned bottom-right.

    A sliding-window or chunked mask (``local_size``: transformers passes the window or chunk with
    its mask function) is causal while every position lies below ``local_size``. Values of a
    tensor being traced (``torch.compile``) are not read: such a padding mask is never skipped."""
    if not isinstance(q_offset, int) or not isinstance(kv_offset, int):
        return False  # a static cache's offset tensor: the keys hold unfilled slots
    if q_offset + q_length != kv_offset + kv_length:
        return False  # the queries are not the last keys (a static cache's slots beyond them)
    if mask_function is not causal_mask_function and (local_size is None or q_offset + q_length > local_size):
        return False
    if padding_mask is None:
        return True
    if is_tracing(padding_mask):
        return False
    return bool(padding_mask[:, kv_offset:kv_offset + kv_length].all())


# --- the attention -------------------------------------------------------------------------------

def dlcore_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention over transformers' ``[B, H, S, D]`` query, key and value: ``(out [B, Sq, Hq, Dv], None)``."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    reason = unsupported(query, key, value, attention_mask, dropout, kwargs)
    if reason is not None:
        return fallback(module, reason, query, key, value, attention_mask, dropout, scaling, causal, kwargs)
    dq, dv = query.shape[-1], value.shape[-1]
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [B, S, H, D] views, no copy
    width = max(dq, dv)
    if dq < width:
        q, k = F.pad(q, (0, width - dq)), F.pad(k, (0, width - dq))
    if dv < width:
        v = F.pad(v, (0, width - dv))
    scale = scaling if scaling is not None else dq ** -0.5
    out = call("flash_attention_v2", flash_attention_v2, q, k, v, bool(causal) and query.shape[2] > 1, float(scale))
    return (out if dv == width else out[..., :dv]), None


def unsupported(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                dropout: float, kwargs: dict) -> Reason | None:
    """Why ``flash_attention_v2`` cannot compute this call exactly, or None."""
    if kwargs.get("output_attentions"):
        return Reason.OUTPUT_ATTENTIONS
    if kwargs.get("softcap") is not None:
        return Reason.SOFTCAP
    if dropout:
        return Reason.DROPOUT
    if kwargs.get("s_aux") is not None or kwargs.get("position_bias") is not None:
        return Reason.EXTRA_TERMS
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        return Reason.PACKED
    if attention_mask is not None:
        return Reason.MASK
    if max(query.shape[-1], value.shape[-1]) > MAX_HEAD_DIM:
        return Reason.HEAD_DIM
    if query.dtype not in DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        return Reason.DTYPE
    return None


def fallback(module: nn.Module, reason: Reason, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attention_mask: torch.Tensor | None, dropout: float, scaling: float | None, causal: bool,
             kwargs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' SDPA attention, or the model's eager attention where SDPA cannot (soft-capping,
    attention weights, sinks); a ``None`` mask made explicit first, for neither aligns a causal mask
    bottom-right when there are more keys than queries."""
    eager = reason in (Reason.SOFTCAP, Reason.OUTPUT_ATTENTIONS, Reason.EXTRA_TERMS)
    warn_once(module, reason, "the model's eager attention" if eager else "transformers' SDPA attention")
    sq, sk = query.shape[2], key.shape[2]
    if attention_mask is None and causal and sq > 1:
        rows = torch.arange(sq, device=query.device)[:, None] + (sk - sq)
        attention_mask = (rows >= torch.arange(sk, device=query.device)[None, :]).view(1, 1, sq, sk)
    if eager:
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device
                                         ).masked_fill(~attention_mask, torch.finfo(query.dtype).min)
        return eager_attention(module)(module, query, key, value, attention_mask, dropout=dropout,
                                       scaling=scaling, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=False if attention_mask is not None else causal, **kwargs)


def eager_attention(module: nn.Module) -> Callable:
    """The eager attention of the module's own modeling file (its ``eager_attention_forward``)."""
    return sys.modules[type(module).__module__].eager_attention_forward
