"""From router logits to the ``(topk_weights, topk_ids)`` an MoE layer takes.

- :func:`softmax_topk`: softmax over the experts (float32), the ``k`` largest; their weights
  renormalised to sum to 1 (Mixtral, DeepSeek-V3's ``norm_topk_prob``) or left as they are.
- :func:`capacity_topk`: GShard-style gating with expert capacity through ``dlblas_kernels.topk_gating``
  (looked up when called): choices past an expert's capacity are dropped (id ``-1``, weight 0), and
  the auxiliary load-balancing loss comes with them.
"""

from __future__ import annotations

import torch

import dlblas_kernels
from dlcore.api import InvalidInputError


def _check(logits: torch.Tensor, k: int, name: str) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise InvalidInputError(name, "logits", f"has shape {list(logits.shape)} and dtype {logits.dtype}",
                                "a floating-point [T, E]")
    if not 1 <= k <= logits.shape[1]:
        raise InvalidInputError(name, "k", f"is {k}", f"1 to the {logits.shape[1]} experts")


def softmax_topk(logits: torch.Tensor, k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [T, E]`` -> ``topk_weights [T, k]`` float32 and ``topk_ids [T, k]`` int64, largest first
    (ties to the lower expert id)."""
    _check(logits, k, "softmax_topk")
    probs = torch.softmax(logits.float(), dim=-1)
    # a stable sort, not torch.topk, whose order among equal values is unspecified
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :k], ids[:, :k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def capacity_topk(logits: torch.Tensor, k: int, capacity_factor: float = 1.0, min_capacity: int = 2
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``logits [T, E]`` -> ``(topk_weights [T, k], topk_ids [T, k], l_aux)`` through ``topk_gating``:
    weights renormalised over each token's kept choices, dropped choices as id ``-1``."""
    _check(logits, k, "capacity_topk")
    tokens, experts = logits.shape
    l_aux, slot_of_choice, choice_weights, token_of_slot = dlblas_kernels.topk_gating(
        logits, k, capacity_factor, min_capacity)
    # the expert capacity C: token_of_slot is [E * C]; the choices come choice-major ([k * T], index
    # j * T + t), each with its slot e * C + c; a dropped choice has weight 0
    capacity = token_of_slot.numel() // experts
    weights = choice_weights.view(k, tokens).t().float()
    ids = (slot_of_choice.view(k, tokens).t().long() // capacity).masked_fill(weights == 0, -1)
    return weights, ids, l_aux
