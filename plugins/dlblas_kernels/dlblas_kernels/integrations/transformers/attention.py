"""The ``"dlcore"`` attention of transformers' ``AttentionInterface``, with its mask function.

transformers builds one mask per forward through the mask function registered under the model's
``attn_implementation`` (``ALL_MASK_ATTENTION_FUNCTIONS``) and hands it to every attention layer;
an attention function registered without one receives ``attention_mask=None`` even for a padded
batch. :func:`dlcore_mask` is that function, and transformers hands what it returns, untouched,
to the attention of the same name. When the mask is causal aligned bottom-right (no sliding window
the sequence reaches, no packed sequences, the queries the last positions of the keys: prefill, or
decoding against a dynamic cache), it returns ``None`` without padding, and with padding that
leaves each row's keys one run (left padding, as ``generate`` pads, or right padding) a
:class:`KeyPadding`: the run's bounds per row. Otherwise it returns the boolean 4-D mask SDPA's own
function builds.

:func:`dlcore_attention` runs ``flash_attention_v2`` (causal bottom-right, GQA) when the mask is
``None``, and with the bounds as its ``kv_start`` and ``kv_end`` when it is a :class:`KeyPadding`
(queries that see no key, left-padded positions, give 0 as SDPA does); queries and values of
different head dimensions (DeepSeek-V3's MLA: 192 and 128) are zero-padded to the wider one,
which leaves ``q . k`` and the first columns of the output exact. Everything else runs
transformers' SDPA attention (or the model's eager attention where SDPA cannot, soft-capping or
attention weights) for that call, with a warning once (:mod:`.fallback`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

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

@dataclass(frozen=True)
class KeyPadding:
    """A causal mask with key padding: row ``b`` sees the keys ``kv_start[b] <= j < kv_end[b]``
    (int32 ``[B]``, None where no row is cut on that side) under the bottom-right causal mask."""

    kv_start: torch.Tensor | None
    kv_end: torch.Tensor | None

    def dense(self, q_length: int, kv_length: int, causal: bool) -> torch.Tensor:
        """The same mask as SDPA takes it: boolean ``[B, 1, q_length, kv_length]``, True where seen."""
        bound = self.kv_start if self.kv_start is not None else self.kv_end
        keys = torch.arange(kv_length, device=bound.device)
        seen = torch.ones(bound.shape[0], 1, q_length, kv_length, dtype=torch.bool, device=bound.device)
        if self.kv_start is not None:
            seen = seen & (keys >= self.kv_start[:, None, None, None])
        if self.kv_end is not None:
            seen = seen & (keys < self.kv_end[:, None, None, None])
        if causal:
            seen = seen & (keys <= torch.arange(q_length, device=keys.device)[:, None] + (kv_length - q_length))
        return seen


def dlcore_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                mask_function: Callable = causal_mask_function, attention_mask: torch.Tensor | None = None,
                local_size: int | None = None, allow_is_causal_skip: bool = True,
                **kwargs) -> torch.Tensor | KeyPadding | None:
    """``None`` when the mask is plain causal aligned bottom-right (what ``flash_attention_v2``'s
    ``causal=True`` computes), a :class:`KeyPadding` when it is that with each row's keys one run,
    else SDPA's boolean ``[B, 1, q_length, kv_length]`` mask, never skipped."""
    padding_mask = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if allow_is_causal_skip and _causal(q_length, kv_length, q_offset, kv_offset, mask_function, local_size):
        if padding_mask is None:
            return None
        if not is_tracing(padding_mask):
            padding = key_padding(padding_mask[:, kv_offset:kv_offset + kv_length])
            if padding is not None:
                return None if padding.kv_start is None and padding.kv_end is None else padding
    kwargs.pop("allow_is_bidirectional_skip", None)
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                     local_size=local_size, allow_is_causal_skip=False, allow_is_bidirectional_skip=False,
                     **kwargs)


def key_padding(valid: torch.Tensor) -> KeyPadding | None:
    """The bounds of each row's run of True in ``valid`` (boolean ``[B, Sk]``: the keys present), or
    None where a row's keys are not one run. A row without keys gets the bounds ``(0, 0)``; a bound
    that cuts no row is left None. One read of the device's values."""
    sk = valid.shape[1]
    count = valid.sum(1)
    present = count > 0
    start = torch.where(present, valid.int().argmax(1), 0)
    end = torch.where(present, sk - valid.flip(1).int().argmax(1), 0)
    one_run, cut_start, cut_end = torch.stack(
        [(end - start == count).all(), (start > 0).any(), (end < sk).any()]).tolist()
    if not one_run:
        return None
    return KeyPadding(start.to(torch.int32) if cut_start else None, end.to(torch.int32) if cut_end else None)


def _causal(q_length: int, kv_length: int, q_offset, kv_offset: int, mask_function: Callable,
            local_size: int | None) -> bool:
    """Whether every query at position ``q_offset + i`` sees the keys at positions up to its own
    (those present): the causal mask aligned bottom-right.

    A sliding-window or chunked mask (``local_size``: transformers passes the window or chunk with
    its mask function) is causal while every position lies below ``local_size``."""
    if not isinstance(q_offset, int) or not isinstance(kv_offset, int):
        return False  # a static cache's offset tensor: the keys hold unfilled slots
    if q_offset + q_length != kv_offset + kv_length:
        return False  # the queries are not the last keys (a static cache's slots beyond them)
    return mask_function is causal_mask_function or (local_size is not None and q_offset + q_length <= local_size)


# --- the attention -------------------------------------------------------------------------------

def dlcore_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | KeyPadding | None, dropout: float = 0.0,
                     scaling: float | None = None, is_causal: bool | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
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
    padding = attention_mask if isinstance(attention_mask, KeyPadding) else KeyPadding(None, None)
    out = call("flash_attention_v2", flash_attention_v2, q, k, v, bool(causal) and query.shape[2] > 1, float(scale),
               False, padding.kv_start, padding.kv_end)
    return (out if dv == width else out[..., :dv]), None


def unsupported(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | KeyPadding | None, dropout: float, kwargs: dict) -> Reason | None:
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
    if attention_mask is not None and not isinstance(attention_mask, KeyPadding):
        return Reason.MASK
    if max(query.shape[-1], value.shape[-1]) > MAX_HEAD_DIM:
        return Reason.HEAD_DIM
    if query.dtype not in DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        return Reason.DTYPE
    return None


def fallback(module: nn.Module, reason: Reason, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attention_mask: torch.Tensor | KeyPadding | None, dropout: float, scaling: float | None, causal: bool,
             kwargs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' SDPA attention, or the model's eager attention where SDPA cannot (soft-capping,
    attention weights, sinks); a ``None`` mask or a :class:`KeyPadding` made explicit first, for
    neither aligns a causal mask bottom-right when there are more keys than queries."""
    eager = reason in (Reason.SOFTCAP, Reason.OUTPUT_ATTENTIONS, Reason.EXTRA_TERMS)
    warn_once(module, reason, "the model's eager attention" if eager else "transformers' SDPA attention")
    sq, sk = query.shape[2], key.shape[2]
    if isinstance(attention_mask, KeyPadding):
        attention_mask = attention_mask.dense(sq, sk, causal and sq > 1)
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
