"""fused_moe's float64-checkable references: loops over the experts in float32 (or wider) for the
forward (with the pre-activations a training call saves), the fp8 kernels' arithmetic, and the
backward's formulas (:mod:`dlblas_kernels.kernels.fused_moe`'s module doc).
"""

from __future__ import annotations

from typing import Any

import torch

from dlblas_kernels.blocks.moe_launches import dims
from dlblas_kernels.kernels.fused_moe_fp8 import dequantise_weight, quantised


def _per_expert(hidden: torch.Tensor, w13: torch.Tensor, topk_ids: torch.Tensor, x: torch.Tensor | None = None):
    """``(e, slots, tokens, x, g, u)`` per expert with routed slots, in float32 (or wider); ``x``:
    the hidden rows to multiply (default ``hidden`` in that dtype)."""
    compute = torch.promote_types(hidden.dtype, torch.float32) if x is None else x.dtype
    _, _, experts, inter, topk = dims(hidden, w13, topk_ids)
    flat = topk_ids.reshape(-1)
    h = hidden.to(compute) if x is None else x
    for e in range(experts):
        slots = (flat == e).nonzero().squeeze(1)
        if slots.numel():
            x = h[slots // topk]
            w = w13[e].to(compute)
            yield e, slots, slots // topk, x, x @ w[:inter].T, x @ w[inter:].T


def fused_moe_training_reference(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                                 topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                                 w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, gate, up)``: a loop over the experts in float32 (or wider), in ``hidden``'s dtype;
    the pre-activations of dropped slots are zero. fp8 weights: dequantised (float64), the
    activations as they are (:func:`fused_moe_fp8_reference` quantises them as the kernels do)."""
    if w13_scale is not None:
        w13, w2 = dequantise_weight(w13, w13_scale, torch.float64), dequantise_weight(w2, w2_scale, torch.float64)
    tokens, h, _, inter, topk = dims(hidden, w13, topk_ids)
    compute = torch.promote_types(torch.promote_types(hidden.dtype, w13.dtype), torch.float32)
    out = torch.zeros(tokens, h, dtype=compute, device=hidden.device)
    gate = torch.zeros(tokens * topk, inter, dtype=compute, device=hidden.device)
    up = torch.zeros_like(gate)
    weights = topk_weights.reshape(-1).to(compute)
    for e, slots, token, _, g, u in _per_expert(hidden, w13, topk_ids, hidden.to(compute)):
        y = (torch.nn.functional.silu(g) * u) @ w2[e].to(compute).T
        out.index_add_(0, token, y * weights[slots, None])
        gate[slots], up[slots] = g, u
    return out.to(hidden.dtype), gate.to(hidden.dtype), up.to(hidden.dtype)


def fused_moe_fp8_reference(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                            topk_ids: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor,
                            cast: Any = None) -> torch.Tensor:
    """What the fp8 kernels compute, in float64: the weights dequantised, ``hidden`` and each
    slot's SwiGLU output (rounded to float32 first) quantised per 1x128 and dequantised
    (:func:`quantised`, ``cast`` its conversion), the loop over the experts; in ``hidden``'s dtype."""
    w13, w2 = dequantise_weight(w13, w13_scale, torch.float64), dequantise_weight(w2, w2_scale, torch.float64)
    out = torch.zeros(hidden.shape, dtype=torch.float64, device=hidden.device)
    weights = topk_weights.reshape(-1).double()
    for e, slots, token, _, g, u in _per_expert(hidden, w13, topk_ids, quantised(hidden, cast)):
        act = quantised(torch.nn.functional.silu(g) * u, cast)
        out.index_add_(0, token, (act @ w2[e].T) * weights[slots, None])
    return out.to(hidden.dtype)


def fused_moe_reference(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
                        w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts' output, by a loop over the experts in float32 (or wider), in ``hidden``'s
    dtype; with fp8 weights what the kernels compute (:func:`fused_moe_fp8_reference`)."""
    if w13_scale is not None:
        return fused_moe_fp8_reference(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    return fused_moe_training_reference(hidden, w13, w2, topk_weights, topk_ids)[0]


def fused_moe_backward_reference(dout: torch.Tensor, hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                                 topk_weights: torch.Tensor, topk_ids: torch.Tensor, gate: torch.Tensor,
                                 up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward formulas of the module doc by a loop over the experts, in float32 (or wider),
    from the saved pre-activations (as the kernel takes them); in the inputs' dtypes."""
    compute = torch.promote_types(hidden.dtype, torch.float32)
    d = dout.to(compute)
    dh = torch.zeros(hidden.shape, dtype=compute, device=hidden.device)
    dw13 = torch.zeros(w13.shape, dtype=compute, device=hidden.device)
    dw2 = torch.zeros(w2.shape, dtype=compute, device=hidden.device)
    dtw = torch.zeros(topk_weights.numel(), dtype=compute, device=hidden.device)
    weights = topk_weights.reshape(-1).to(compute)
    for e, slots, token, x, _, _ in _per_expert(hidden, w13, topk_ids):
        g, u = gate[slots].to(compute), up[slots].to(compute)
        s = torch.sigmoid(g)
        a = g * s * u
        w = weights[slots, None]
        r = d[token] @ w2[e].to(compute)
        dtw[slots] = (r * a).sum(1)
        dw2[e] = (w * d[token]).T @ a
        da = w * r
        dh13 = torch.cat([da * u * s * (1 + g * (1 - s)), da * g * s], dim=1)
        dw13[e] = dh13.T @ x
        dh.index_add_(0, token, dh13 @ w13[e].to(compute))
    return (dh.to(hidden.dtype), dw13.to(w13.dtype), dw2.to(w2.dtype),
            dtw.view(topk_weights.shape).to(topk_weights.dtype))
