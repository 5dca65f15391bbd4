"""A causal LM's training loss by ``fused_linear_cross_entropy``: the logits never made whole.

transformers' causal LMs compute ``logits = lm_head(hidden)`` for every position, then
``loss_function(logits, labels, ...)`` (``ForCausalLMLoss``: labels shifted by one, float32
cross-entropy, ``num_items_in_batch`` dividing a sum). :func:`switch_loss` keeps that code and
changes three hooks of one model instance:

- its ``forward`` (:class:`LossForward`): a call with ``labels`` in training mode, with gradients
  on, marks the LM head to defer; the output's ``logits`` are then None (as Liger-Kernel's models
  in training);
- its LM head's ``forward`` (:class:`DeferredHead`): when marked, it passes the hidden states on
  instead of projecting them (when their dtype is not the weight's, or autocast is on, it projects
  as before and the loss is transformers' own);
- its ``loss_function`` (:class:`FusedCausalLMLoss`): on deferred hidden states, the shifted
  labels and ``fused_linear_cross_entropy`` with the head's weight (and bias); otherwise the model's
  own loss function.

Anything else (evaluation, generation, a forward without labels, a model whose forward soft-caps
its logits) runs exactly as before. A router's auxiliary loss (Mixtral, Qwen3-MoE) is added to the
returned loss by the model's own code, as before.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dlblas_kernels.integrations.transformers.modules import DTYPES
from dlblas_kernels.integrations.transformers.ops import call
from dlblas_kernels.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy


class DeferredHead:
    """The LM head's forward: the hidden states themselves while :attr:`defer` is set (and they
    suit the kernel), the projection otherwise."""

    def __init__(self, head: nn.Linear) -> None:
        self.head = head
        #: set by the model's forward for a call whose loss is to be fused
        self.defer = False
        #: hidden states passed on, not yet taken by the loss
        self.deferred = False
        #: hidden states passed on in the current forward (its output's logits are not logits)
        self.used = False

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        head = self.head
        dtype = hidden_states.dtype
        self.deferred = (self.defer and dtype in DTYPES and dtype == head.weight.dtype
                         and not torch.is_autocast_enabled(hidden_states.device.type))
        if self.deferred:
            self.used = True
            return hidden_states
        return F.linear(hidden_states, head.weight, head.bias)


class FusedCausalLMLoss:
    """The model's ``loss_function``: on the deferred head's hidden states, the shifted labels'
    ``fused_linear_cross_entropy``; on logits, ``own`` (the model's own loss function)."""

    def __init__(self, head: DeferredHead, own: Callable[..., torch.Tensor]) -> None:
        self.head = head
        self.own = own

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                 num_items_in_batch: torch.Tensor | int | None = None, ignore_index: int = -100,
                 shift_labels: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        if not self.head.deferred:
            return self.own(logits=logits, labels=labels, vocab_size=vocab_size, num_items_in_batch=num_items_in_batch,
                            ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        self.head.deferred = False
        hidden = logits  # the head passed its input on
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        head = self.head.head
        reduction = "mean" if num_items_in_batch is None else "sum"
        loss = call("fused_linear_cross_entropy", fused_linear_cross_entropy,
                    hidden.reshape(-1, hidden.shape[-1]), head.weight,
                    shift_labels.reshape(-1).to(hidden.device), head.bias, ignore_index, reduction, 0.0, None)
        if num_items_in_batch is not None:
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return loss


class LossForward:
    """The model's forward: with ``labels``, in training mode and with gradients on, its LM head
    defers to the fused loss for this call, and the output carries no logits."""

    def __init__(self, model: nn.Module, head: DeferredHead) -> None:
        self.model = model
        self.head = head

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        original = types.MethodType(type(model).forward, model)
        if kwargs.get("labels") is None or not model.training or not torch.is_grad_enabled():
            return original(*args, **kwargs)
        head = self.head
        head.defer, head.used = True, False
        try:
            out = original(*args, **kwargs)
        finally:
            head.defer = head.deferred = False
        if head.used:
            out.logits = None
        return out


def can_switch_loss(model: nn.Module) -> bool:
    """A causal LM whose loss is transformers' ``ForCausalLMLoss`` of an ``nn.Linear`` head's
    logits, which its forward does not soft-cap."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    config = getattr(model, "config", None)
    return (isinstance(head, nn.Linear) and type(head).forward is nn.Linear.forward
            and getattr(model, "loss_type", None) in (None, "ForCausalLM")
            and getattr(config, "final_logit_softcapping", None) is None
            and type(model).__name__.endswith("ForCausalLM"))


def switch_loss(model: nn.Module) -> None:
    """Make ``model``'s training loss ``fused_linear_cross_entropy`` (see the module doc); a second
    call changes nothing."""
    if isinstance(model.__dict__.get("forward"), LossForward):
        return
    head = model.get_output_embeddings()
    deferred = DeferredHead(head)
    own = model.loss_function
    head.forward = deferred
    model.loss_function = FusedCausalLMLoss(deferred, own)
    model.forward = LossForward(model, deferred)
