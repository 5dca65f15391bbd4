"""Attention by torch's ``F.scaled_dot_product_attention`` on the BSHD tensors flash_attention_v2 takes.

One function serves the op's eager ``torch`` baseline (torch picks its backend), the ``sdpa_flash``
and ``sdpa_cudnn`` baselines, and the vendor candidates of the same names in :mod:`dlblas_kernels.vendor`.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float | None,
                   backend: SDPBackend | None = None, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(scale * q k^T) v`` for ``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hk, D]`` by
    ``F.scaled_dot_product_attention``, with ``backend`` alone (None: the backend torch picks, what a
    model runs). The ``[B, H, S, D]`` it takes are transposed views (no copy but for a head
    dimension of stride other than 1, which SDPA's kernels do not read), ``enable_gqa`` where
    Hq != Hk, the causal mask bottom-right as the op's (query i sees keys ``j <= i + Sk - Sq``):
    ``is_causal`` when Sq == Sk, else ``causal_lower_right``, which the flash backend runs natively.
    ``key_mask`` (boolean ``[B, Sk]``, True where a key is seen) joins the causal mask as an explicit
    boolean mask (the math or memory-efficient backend; rows that see no key give 0).
    The result is ``[B, Sq, Hq, D]``, a view of SDPA's output."""
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    sq, sk = q.shape[1], k.shape[1]
    mask = causal_lower_right(sq, sk) if causal and sq != sk else None
    if key_mask is not None:
        mask = key_mask[:, None, None, :]
        if causal:
            rows = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
            mask = mask & (torch.arange(sk, device=q.device)[None, :] <= rows)
        causal = False
    with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
            is_causal=causal and sq == sk, scale=softmax_scale, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)
