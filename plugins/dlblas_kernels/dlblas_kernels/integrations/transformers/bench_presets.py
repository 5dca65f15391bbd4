"""The end-to-end benchmark's models and columns: each preset a real model's configuration (its
layer shapes and vocabulary), each column a way of running it (eager, ``torch.compile``,
Liger-Kernel, grouped_mm experts, dlcore, dlcore + ``torch.compile``), and why a column cannot run
here. :mod:`dlblas_kernels.integrations.transformers.bench` runs them.
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dlcore.api import first_line

# -- presets ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelPreset:
    """A model's configuration: its transformers ``model_type`` and the fields of its config.json that
    shape it (any number of decoder layers is built from it)."""

    name: str
    model_type: str
    #: the checkpoint whose config.json this is
    source: str
    config: dict[str, Any]

    @property
    def moe(self) -> bool:
        return "num_experts" in self.config or "num_local_experts" in self.config

    def build_config(self, layers: int) -> Any:
        from transformers import AutoConfig

        return AutoConfig.for_model(self.model_type, num_hidden_layers=layers, **self.config)

    def modeling_module(self) -> str:
        return f"transformers.models.{self.model_type}.modeling_{self.model_type}"


PRESETS: dict[str, ModelPreset] = {p.name: p for p in (
    ModelPreset("llama3-8b", "llama", "meta-llama/Meta-Llama-3-8B", {
        "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "tie_word_embeddings": False}),
    ModelPreset("qwen3-30b-a3b", "qwen3_moe", "Qwen/Qwen3-30B-A3B", {
        "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "tie_word_embeddings": False}),
    # The same code path at sizes a CPU runs in seconds (Triton's interpreter included): for checking
    # an installation and for the tests, never for numbers.
    ModelPreset("tiny-llama", "llama", "(a tiny LLaMA for checks)", {
        "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 128, "max_position_embeddings": 256, "tie_word_embeddings": False}),
    ModelPreset("tiny-qwen3-moe", "qwen3_moe", "(a tiny Qwen3-MoE for checks)", {
        "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 4,
        "num_experts_per_tok": 2, "norm_topk_prob": True, "mlp_only_layers": [], "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "max_position_embeddings": 256,
        "tie_word_embeddings": False}),
)}
DEFAULT_PRESETS = ("llama3-8b", "qwen3-30b-a3b")


# -- columns ------------------------------------------------------------------------------------------------


class Patch(str, enum.Enum):
    """What is done to a built model: nothing, Liger-Kernel's patch, or dlcore's."""

    NONE = "none"
    LIGER = "liger"
    DLCORE = "dlcore"


#: model_type -> Liger-Kernel's function patching a built model of the family
LIGER_FUNCTIONS = {"llama": "apply_liger_kernel_to_llama", "mistral": "apply_liger_kernel_to_mistral",
                   "mixtral": "apply_liger_kernel_to_mixtral", "qwen2": "apply_liger_kernel_to_qwen2",
                   "qwen3": "apply_liger_kernel_to_qwen3", "qwen3_moe": "apply_liger_kernel_to_qwen3_moe"}
#: where ``apply`` lives (imported when a dlcore column runs)
INTEGRATION = "dlblas_kernels.integrations.transformers"


@dataclass(frozen=True)
class Column:
    """One way of running the model. ``experts``: the MoE ``experts_implementation`` it is built with
    (None: transformers' default)."""

    name: str
    description: str
    experts: str | None = "eager"
    patch: Patch = Patch.NONE
    compiled: bool = False
    moe_only: bool = False


COLUMNS: tuple[Column, ...] = (
    Column("eager", "transformers as built: SDPA attention, MoE experts as the per-expert loop"),
    Column("compile", "torch.compile of the model as transformers builds it by default (SDPA; MoE experts "
           "grouped_mm where torch has it)", experts=None, compiled=True),
    Column("liger", "Liger-Kernel's apply_liger_kernel_to_<family>(model=...) on the eager model",
           patch=Patch.LIGER),
    Column("grouped_mm", "transformers' grouped_mm experts (torch._grouped_mm), SDPA attention",
           experts="grouped_mm", moe_only=True),
    Column("dlcore", "dlblas_kernels.integrations.transformers.apply(model) on the eager model",
           patch=Patch.DLCORE),
    Column("dlcore+compile", "apply(model), then torch.compile", patch=Patch.DLCORE, compiled=True),
)
COLUMN_NAMES = tuple(c.name for c in COLUMNS)
PHASES = ("train", "prefill", "decode")


def dlcore_apply() -> Callable[..., Any] | None:
    """The integration's ``apply``, or None where it is not there (yet)."""
    try:
        module = importlib.import_module(INTEGRATION)
    except ImportError:
        return None
    return getattr(module, "apply", None)


def unavailable(column: Column, preset: ModelPreset) -> str | None:
    """Why ``column`` cannot run ``preset`` here, or None."""
    if column.moe_only and not preset.moe:
        return f"{preset.name} has no experts"
    if column.patch == Patch.LIGER:
        if preset.model_type not in LIGER_FUNCTIONS:
            return f"Liger-Kernel has no apply_liger_kernel_to_* for {preset.model_type}"
        try:
            liger = importlib.import_module("liger_kernel.transformers")
        except ImportError as exc:
            return f"Liger-Kernel is not installed ({first_line(exc)}): pip install liger-kernel"
        if not hasattr(liger, LIGER_FUNCTIONS[preset.model_type]):
            return f"this Liger-Kernel has no {LIGER_FUNCTIONS[preset.model_type]}"
    if column.patch == Patch.DLCORE and dlcore_apply() is None:
        return f"{INTEGRATION}.apply is not available in this installation"
    return None
