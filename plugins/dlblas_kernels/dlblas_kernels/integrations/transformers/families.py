"""What :func:`~dlblas_kernels.integrations.transformers.apply` switches in each model family, as data.

A family is named by its config's ``model_type``. Its entry names the classes of its modeling file
whose instances are switched: the RMSNorms (the decoder layers', the final one, Qwen3's q and k
norms, DeepSeek-V3's latent norms), the SwiGLU MLPs (the dense ones: an MoE block's experts go
through the experts interface), the attentions whose rotary functions are rebound, and the
decoder layer's (norm, MLP) attribute pair whose norm the MLP's ``ffn`` applies. Attention and
experts need no entry: they go through transformers' interfaces for any model.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """The module classes of one modeling file that ``apply`` switches."""

    norms: tuple[str, ...]
    mlps: tuple[str, ...]
    attentions: tuple[str, ...]
    #: the decoder layer's attributes: the norm whose output only the MLP reads, and that MLP
    norm_before_mlp: tuple[str, str] = ("post_attention_layernorm", "mlp")


def _family(prefix: str) -> Family:
    """A family whose classes follow LLaMA's names: ``<prefix>RMSNorm``, ``<prefix>MLP``, ``<prefix>Attention``."""
    return Family(norms=(f"{prefix}RMSNorm",), mlps=(f"{prefix}MLP",), attentions=(f"{prefix}Attention",))


FAMILIES: dict[str, Family] = {
    "llama": _family("Llama"),
    "mistral": _family("Mistral"),
    "qwen2": _family("Qwen2"),
    "qwen3": _family("Qwen3"),
    "mixtral": _family("Mixtral"),  # its MLP is the sparse block: experts only
    "qwen3_moe": _family("Qwen3Moe"),  # dense MLPs in its mlp_only_layers
    "deepseek_v3": _family("DeepseekV3"),  # dense MLPs in its first_k_dense_replace layers and shared experts
}
