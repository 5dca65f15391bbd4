"""dlcore's kernels inside Hugging Face transformers models (``pip install dlblas-kernels[transformers]``).

    from dlblas_kernels.integrations.transformers import apply
    model = apply(AutoModelForCausalLM.from_pretrained(...))

:func:`register` adds ``"dlcore"`` to transformers' extension points: the attention interface with
its mask function (:mod:`.attention`), the experts interface and its fp8 twin (:mod:`.experts`).
Then ``from_config(cfg, attn_implementation="dlcore", experts_implementation="dlcore")`` works.
:func:`apply` registers, switches a built model to ``"dlcore"`` and switches its RMSNorm, rotary and
SwiGLU MLP modules to dlcore's ops in place (:mod:`.modules`, per family: :mod:`.families`), and a
causal LM's training loss to ``fused_linear_cross_entropy`` (:mod:`.loss`).
Whatever an op cannot take runs the model's own code for that call, with a warning once
(:mod:`.fallback`); the results are the unpatched model's.
"""

from __future__ import annotations

from torch import nn
from transformers import AttentionInterface
from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from dlblas_kernels.integrations.transformers.attention import NAME, dlcore_attention, dlcore_mask
from dlblas_kernels.integrations.transformers.experts import dlcore_experts, dlcore_fp8_experts
from dlblas_kernels.integrations.transformers.fallback import ModelFallbackWarning
from dlblas_kernels.integrations.transformers.families import FAMILIES, Family
from dlblas_kernels.integrations.transformers.loss import can_switch_loss, switch_loss
from dlblas_kernels.integrations.transformers.modules import (
    NormedMLPForward,
    is_swiglu_mlp,
    switch_norm,
    switch_norm_and_mlp,
    switch_rotary,
)

__all__ = ["NAME", "FAMILIES", "Family", "ModelFallbackWarning", "apply", "register"]


def register() -> None:
    """Add ``"dlcore"`` to transformers' attention interface (with its mask function), experts
    interface and fp8 experts interface. Registering again changes nothing."""
    AttentionInterface.register(NAME, dlcore_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, dlcore_mask)
    ALL_EXPERTS_FUNCTIONS.register(NAME, dlcore_experts)
    ALL_FP8_EXPERTS_FUNCTIONS.register(NAME, dlcore_fp8_experts)


def apply(model: nn.Module, *, attention: bool = True, experts: bool = True, norms: bool = True,
          rotary: bool = True, mlp: bool = True, loss: bool = True) -> nn.Module:
    """Switch ``model`` (a transformers ``PreTrainedModel``) to dlcore's kernels in place; returns it.

    - ``attention``: ``attn_implementation="dlcore"`` (``flash_attention_v2``);
    - ``experts``: ``experts_implementation="dlcore"`` (``fused_moe``), for models with experts;
    - ``norms``: the family's RMSNorms run ``rms_norm``;
    - ``rotary``: the family's attentions rotate q and k with ``apply_rotary_pos_emb``;
    - ``mlp``: a dense SwiGLU MLP and the RMSNorm before it run as one ``ffn`` (the norm inside it,
      whatever ``norms`` says), then the down projection. That norm module then passes its input
      on: a hook on it, or a caller of it other than the decoder layer, sees the input un-normed
      (``mlp=False`` keeps it a norm);
    - ``loss``: a causal LM's training loss (labels given, training mode) is
      ``fused_linear_cross_entropy`` of the last hidden states and the LM head, the logits never
      made (:mod:`.loss`); the output then has no logits.

    Parameters, buffers and the state dict do not change. A family without an entry in
    :data:`~.families.FAMILIES` gets attention and experts only. Applying again changes nothing."""
    register()
    if attention:
        model.set_attn_implementation(NAME)
    if experts and _has_experts(model):
        model.set_experts_implementation(NAME)
    if loss and can_switch_loss(model):
        switch_loss(model)
    family = FAMILIES.get(getattr(model.config, "model_type", None))
    if family is None:
        return model
    modules = list(model.modules())
    in_mlp: set[int] = set()
    if mlp:
        for layer in modules:
            norm, dense = (getattr(layer, name, None) for name in family.norm_before_mlp)
            if _is(norm, family.norms) and _is(dense, family.mlps) and is_swiglu_mlp(dense):
                if not isinstance(dense.__dict__.get("forward"), NormedMLPForward):
                    switch_norm_and_mlp(norm, dense)
                in_mlp.add(id(norm))
    for module in modules:
        if norms and _is(module, family.norms) and id(module) not in in_mlp and "forward" not in module.__dict__:
            switch_norm(module)
        if rotary and _is(module, family.attentions) and "forward" not in module.__dict__:
            switch_rotary(module)
    return model


def _is(module: object, class_names: tuple[str, ...]) -> bool:
    return isinstance(module, nn.Module) and type(module).__name__ in class_names


def _has_experts(model: nn.Module) -> bool:
    """Whether any module dispatches through the experts interface (``use_experts_implementation``)."""
    return any(hasattr(type(m).forward, "__wrapped__") and hasattr(m, "_is_expert_parallel") for m in model.modules())
