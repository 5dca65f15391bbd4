"""The shapes a benchmark runs: model presets and explicit sizes, mapped onto an op's size names.

An op names its sizes in ``example_sizes`` (``tokens``, ``hidden``, ``inter``, ...). A model
preset knows the dimensions of a real model under canonical names; each of the op's size names is
matched to one of them through :data:`ALIASES`, the token axis takes every value of the token list,
a batch axis is 1 (the tokens are all in the sequence), and a name no alias knows keeps the op's
example value. A model that lacks a dimension the op needs (LLaMA has no MLA rope dimension) does
not apply to that op and is left out with a note.

A preset name may end in a :data:`VARIANTS` suffix: ``gemm-down`` is the ``gemm`` preset with each
model's hidden and intermediate sizes swapped, the MLP's down projection (for ``matmul``, whose
``a [tokens, hidden] @ b [hidden, inter]`` is the up projection: K = inter, N = hidden).

Besides models, a preset may hold :data:`SETUPS`: the fixed shapes an issue measures its targets at
(attention at B 2, H 16, D 128; decode against a KV cache), which set dimensions no model has
(``batch``, ``causal``). A preset's token counts go to its token axis (:data:`PRESET_AXIS`): the
sequence length, or for ``decode`` the key/value length (one query against ``n`` keys). Optional
dimensions (:data:`OPTIONAL`) a model or setup leaves unset keep the op's example value (``kv_seq``
0: the query length; ``causal`` 0), ``batch`` 1 where there are tokens.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

#: tokens of one forward pass: decode (1) to long prefill (16384)
TOKENS = (1, 16, 64, 256, 1024, 4096, 16384)
#: the token counts (GEMM rows, M) of the ``gemm`` preset: decode (1, 16), small batches (128) and
#: prefill (1024 to 16384)
GEMM_TOKENS = (1, 16, 128, 1024, 4096, 16384)

#: canonical dimension -> the size names ops may give it (lower case)
ALIASES: dict[str, tuple[str, ...]] = {
    "tokens": ("tokens", "num_tokens", "rows", "m", "seq", "seq_len", "seqlen", "s", "l"),
    "batch": ("batch", "batch_size", "bs", "b"),
    "hidden": ("hidden", "hidden_size", "d_model"),
    "inter": ("inter", "intermediate", "intermediate_size", "ffn", "ffn_dim"),
    "heads": ("heads", "num_heads", "n_heads", "q_heads", "num_q_heads", "hq"),
    "kv_heads": ("kv_heads", "num_kv_heads", "n_kv_heads", "num_key_value_heads", "hk"),
    "head_dim": ("head_dim", "head_size", "d"),
    "nope_dim": ("nope_dim", "nope", "qk_nope_head_dim"),
    "rope_dim": ("rope_dim", "rope", "qk_rope_head_dim"),
    "v_dim": ("v_dim", "v", "v_head_dim"),
    "kv_tokens": ("kv_tokens", "kv_seq", "seq_k", "seqlen_k", "kv_len", "sk"),
    # a mixture of experts: routed experts per layer, experts per token
    "experts": ("experts", "num_experts", "n_experts", "n_routed_experts"),
    "topk": ("topk", "top_k", "experts_per_token", "num_experts_per_tok"),
    # flags an op takes as sizes (0 or 1): no model sets them
    "causal": ("causal", "is_causal"),
    "interleaved": ("interleaved",),
    # fp8 weights with block scales (1) or 16-bit weights (0): the -fp8 setups set it
    "fp8": ("fp8",),
    # the vocabulary: an LM head's rows, a loss's classes
    "vocab": ("vocab", "vocab_size", "classes"),
}
#: canonical dimensions a model or setup may leave unset: the op's example value (batch: 1 with tokens)
OPTIONAL = ("batch", "kv_tokens", "causal", "interleaved", "fp8", "vocab")
_CANONICAL = {alias: name for name, aliases in ALIASES.items() for alias in aliases}

#: model -> its dimensions under canonical names (from each model's published config.json)
MODELS: dict[str, dict[str, int]] = {
    "llama3-8b": {"hidden": 4096, "inter": 14336, "heads": 32, "kv_heads": 8, "head_dim": 128, "vocab": 128256},
    "llama3-70b": {"hidden": 8192, "inter": 28672, "heads": 64, "kv_heads": 8, "head_dim": 128},
    "qwen2.5-7b": {"hidden": 3584, "inter": 18944, "heads": 28, "kv_heads": 4, "head_dim": 128, "vocab": 152064},
    # MLA: the rotary embedding covers the 64 rope dimensions of the query heads and of one shared
    # key head (q_pe [.., H, 64], k_pe [.., 1, 64]); nope 128 and v 128 for the MLA layout. The FFN
    # width is the dense layers'.
    "deepseek-v2": {"hidden": 5120, "inter": 12288, "heads": 128, "kv_heads": 1, "head_dim": 64,
                    "nope_dim": 128, "rope_dim": 64, "v_dim": 128},
    "deepseek-v2-lite": {"hidden": 2048, "inter": 10944, "heads": 16, "kv_heads": 1, "head_dim": 64,
                         "nope_dim": 128, "rope_dim": 64, "v_dim": 128},
    "deepseek-v3": {"hidden": 7168, "inter": 18432, "heads": 128, "kv_heads": 1, "head_dim": 64,
                    "nope_dim": 128, "rope_dim": 64, "v_dim": 128},
    # the routed experts: their FFN width, how many, how many per token
    "deepseek-v3-moe": {"hidden": 7168, "inter": 2048, "experts": 256, "topk": 8},
    # the shared expert (n_shared_experts 1, moe_intermediate_size 2048): a dense FFN every token
    # goes through, so its GEMMs have as many rows as there are tokens
    "deepseek-v3-shared": {"hidden": 7168, "inter": 2048},
}

#: setup -> its dimensions: the shapes an issue's targets are measured at, under canonical names
SETUPS: dict[str, dict[str, int]] = {
    # issue #14's attention anchors: B 2, H 16 (no GQA), D 128, non-causal and causal
    "attention-b2-h16-d128": {"batch": 2, "heads": 16, "kv_heads": 16, "head_dim": 128, "causal": 0},
    "attention-b2-h16-d128-causal": {"batch": 2, "heads": 16, "kv_heads": 16, "head_dim": 128, "causal": 1},
    # issue #14's decode: one query of LLaMA-3-8B's attention (GQA 32/8, D 128) against a KV cache
    "decode-h32-kv8-d128": {"batch": 1, "tokens": 1, "heads": 32, "kv_heads": 8, "head_dim": 128},
    # issue #19's routed experts of Mixtral-8x7B (beside DeepSeek-V3's, a model of its own)
    "moe-mixtral-8x7b": {"experts": 8, "topk": 2, "hidden": 4096, "inter": 14336},
    # the same routed experts with fp8 weights and 128x128 block scales (DeepSeek-V3's checkpoints)
    "moe-mixtral-8x7b-fp8": {"experts": 8, "topk": 2, "hidden": 4096, "inter": 14336, "fp8": 1},
    "deepseek-v3-moe-fp8": {"hidden": 7168, "inter": 2048, "experts": 256, "topk": 8, "fp8": 1},
    # issue #18's MoE routing (topk_gating): 64 or 256 experts, top 2 or top 8
    **{f"gating-e{e}-k{k}": {"experts": e, "topk": k} for e in (64, 256) for k in (2, 8)},
    # issue #18's fp8 GEMMs of DeepSeek-V3 (N = inter, K = hidden: fp8_gemm's b [N, K])
    **{f"deepseek-fp8-n{n}-k{k}": {"inter": n, "hidden": k}
       for n, k in ((7168, 2048), (2112, 7168), (24576, 1536), (7168, 16384), (4096, 7168))},
}

#: preset name -> models and setups; every model is a preset on its own
PRESETS: dict[str, tuple[str, ...]] = {
    "all": tuple(MODELS),
    "gqa": ("llama3-8b", "llama3-70b", "qwen2.5-7b"),
    "mla": ("deepseek-v2", "deepseek-v2-lite", "deepseek-v3"),
    # the MLP GEMMs of issue #13: LLaMA-3-8B, LLaMA-3-70B, Qwen2.5-7B and DeepSeek-V3's shared expert
    "gemm": ("llama3-8b", "llama3-70b", "qwen2.5-7b", "deepseek-v3-shared"),
    # issue #14: attention (prefill) at S 2048 to 16384, causal or not; decode at Sk 1024 to 65536
    "attention": ("attention-b2-h16-d128", "attention-b2-h16-d128-causal"),
    "decode": ("decode-h32-kv8-d128",),
    # issue #19: fused_moe at 1 to 16384 tokens
    "moe": ("moe-mixtral-8x7b", "deepseek-v3-moe"),
    # issue #19: fused_moe with fp8 weights, against the bf16 path (baseline ``bf16``)
    "moe-fp8": ("moe-mixtral-8x7b-fp8", "deepseek-v3-moe-fp8"),
    # issue #18: topk_gating at S 4096 and 16384, and at a few tokens (1 to 64)
    "gating": ("gating-e64-k2", "gating-e64-k8", "gating-e256-k2", "gating-e256-k8"),
    # issue #18: fp8_gemm at DeepSeek-V3's shapes, M 128, 4096 and 16384
    "deepseek-fp8": tuple(name for name in SETUPS if name.startswith("deepseek-fp8-")),
    # issue #42: the LM head and its loss (fused_linear_cross_entropy, cross_entropy) of LLaMA-3-8B and Qwen2.5-7B
    "lm-head": ("llama3-8b", "qwen2.5-7b"),
    **{name: (name,) for name in MODELS},
}
DEFAULT_PRESET = "all"
#: preset -> its token counts when none are given (the others: :data:`TOKENS`)
PRESET_TOKENS: dict[str, tuple[int, ...]] = {
    "gemm": GEMM_TOKENS,
    "attention": (2048, 4096, 8192, 16384),
    "decode": (1024, 2048, 4096, 8192, 16384, 32768, 65536),
    "gating": (1, 16, 64, 4096, 16384),
    "deepseek-fp8": (128, 4096, 16384),
    "lm-head": (4096, 16384),
}
#: preset -> the canonical dimension its token counts go to (the others: ``tokens``)
PRESET_AXIS: dict[str, str] = {"decode": "kv_tokens"}
#: suffix -> (label, canonical dimensions whose model values are swapped): ``PRESET-SUFFIX``
VARIANTS: dict[str, tuple[str, tuple[str, str]]] = {"down": ("down", ("hidden", "inter"))}

_DIMS = re.compile(r"\d+(x\d+)*")


@dataclass(frozen=True)
class Shape:
    """One set of sizes for ``op.example``, and the models it comes from (none when given explicitly)."""

    sizes: dict[str, int]
    models: tuple[str, ...] = ()

    def label(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.sizes.items())


def canonical(size_name: str) -> str | None:
    """The canonical dimension an op's size name stands for, or None if no alias matches."""
    return _CANONICAL.get(size_name.lower())


def shapes_for(example_sizes: dict[str, int], text: str | None, tokens: tuple[int, ...] | None = None,
               ) -> tuple[list[Shape], list[str]]:
    """Parse ``--shapes`` for an op whose sizes default to ``example_sizes``; return shapes and notes.

    ``text``: a preset (``all``, ``llama3-8b``, ``gemm``, ...), possibly with a variant suffix
    (``gemm-down``), several joined by commas; named sizes, one set per ``;``
    (``tokens=4096,hidden=4096;tokens=1,hidden=4096``; names left out keep their example value); or
    ``MxN`` dimensions mapped onto the op's size names in order, several joined by commas
    (``4096x4096,1x4096``). ``None``: the default preset.
    ``tokens``: the token counts of every preset; None: each preset's own (:data:`PRESET_TOKENS`,
    else :data:`TOKENS`).
    :raises ValueError: unknown preset or size name, malformed sizes.
    """
    text = (text or DEFAULT_PRESET).strip()
    shapes: list[Shape] = []
    notes: list[str] = []
    for chunk in filter(None, (c.strip() for c in text.split(";"))):
        if "=" in chunk:
            shapes.append(Shape(_named_sizes(example_sizes, chunk)))
            continue
        for item in filter(None, (i.strip() for i in chunk.split(","))):
            if _DIMS.fullmatch(item):
                shapes.append(Shape(_positional_sizes(example_sizes, item)))
            elif (found_preset := preset_and_variant(item)) is not None:
                name, variant = found_preset
                counts = tokens or PRESET_TOKENS.get(name, TOKENS)
                found, why = preset_shapes(example_sizes, PRESETS[name], counts, variant,
                                           PRESET_AXIS.get(name, "tokens"))
                shapes += found
                notes += why
            else:
                raise ValueError(f"--shapes: {item!r} is neither a preset ({', '.join(PRESETS)}; each may end in "
                                 f"{', '.join('-' + v for v in VARIANTS)}), nor NAME=SIZE sizes, nor MxN "
                                 f"dimensions; e.g. --shapes llama3-8b or --shapes 4096x4096")
    if not shapes:
        raise ValueError(f"--shapes {text!r} gives no shape to run" + (f": {'; '.join(notes)}" if notes else ""))
    return _unique(shapes), _unique_notes(notes)


def preset_and_variant(item: str) -> tuple[str, str | None] | None:
    """``gemm`` -> ``("gemm", None)``, ``gemm-down`` -> ``("gemm", "down")``; None for no preset."""
    if item in PRESETS:
        return item, None
    name, _, suffix = item.rpartition("-")
    return (name, suffix) if name in PRESETS and suffix in VARIANTS else None


def preset_shapes(example_sizes: dict[str, int], models: tuple[str, ...], tokens: tuple[int, ...] = TOKENS,
                  variant: str | None = None, axis: str = "tokens") -> tuple[list[Shape], list[str]]:
    """The shapes of ``models`` (times ``tokens``) for an op with ``example_sizes``, and notes.

    ``models``: names of :data:`MODELS` or :data:`SETUPS`. ``variant``: a key of :data:`VARIANTS`;
    its two dimensions swap values in every model, and the models are labelled ``MODEL (LABEL)``.
    ``axis``: the canonical dimension the token counts go to.
    """
    notes = []
    names = {name: canonical(name) for name in example_sizes}
    unknown = [name for name, dim in names.items() if dim is None]
    if unknown:
        notes.append(f"size {', '.join(unknown)} is not a model dimension the presets know: "
                     f"kept at the op's example value")
    has_tokens = axis in names.values()
    if not has_tokens:
        notes.append(f"the op has no {'token' if axis == 'tokens' else axis} size: one shape per model")
    shapes = []
    label, swapped = VARIANTS[variant] if variant else ("", ())
    for model in models:
        dims = dict(MODELS[model] if model in MODELS else SETUPS[model])
        lacking = [name for name, dim in names.items()
                   if dim not in (None, axis, "tokens", *OPTIONAL) and dim not in dims]
        if lacking:
            notes.append(f"{model} has no {', '.join(lacking)}: left out")
            continue
        if swapped:
            first, second = swapped
            if first not in dims or second not in dims:
                notes.append(f"{model} has no {first} and {second} to swap for -{variant}: left out")
                continue
            dims[first], dims[second] = dims[second], dims[first]
        name_of_model = f"{model} ({label})" if label else model
        for count in tokens if has_tokens else tokens[:1]:
            shapes.append(Shape({name: _model_size(example_sizes[name], dim, dims, count, axis, has_tokens)
                                 for name, dim in names.items()}, (name_of_model,)))
    return shapes, notes


def _model_size(example: int, dim: str | None, dims: dict[str, int], tokens: int, axis: str,
                has_tokens: bool) -> int:
    """The size of canonical ``dim``: the token count on the token axis, else the model's value, else
    the op's example value (batch: 1 where there are tokens)."""
    if dim == axis:
        return tokens
    if dim in dims:
        return dims[dim]
    if dim == "batch" and has_tokens:
        return 1
    return example


def _named_sizes(example_sizes: dict[str, int], text: str) -> dict[str, int]:
    sizes = dict(example_sizes)
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or not value.strip().isdigit():
            raise ValueError(f"--shapes: bad size {part!r}: expected NAME=INTEGER, e.g. tokens=4096")
        if key not in example_sizes:
            raise ValueError(f"--shapes: the op has no size {key!r}; its sizes are {', '.join(example_sizes)}")
        sizes[key] = int(value)
    return sizes


def _positional_sizes(example_sizes: dict[str, int], text: str) -> dict[str, int]:
    values = [int(v) for v in text.split("x")]
    names = list(example_sizes)
    if len(values) > len(names):
        raise ValueError(f"--shapes: {text!r} gives {len(values)} sizes; the op has {len(names)} "
                         f"({'x'.join(names)})")
    return {**example_sizes, **dict(zip(names, values))}


def _unique(shapes: list[Shape]) -> list[Shape]:
    """One shape per set of sizes, in first-seen order, with the models of its duplicates merged."""
    merged: dict[tuple, Shape] = {}
    for shape in shapes:
        key = tuple(shape.sizes.items())
        seen = merged.get(key)
        models = shape.models if seen is None else seen.models + tuple(m for m in shape.models
                                                                       if m not in seen.models)
        merged[key] = Shape(shape.sizes, models)
    return list(merged.values())


def _unique_notes(notes: list[str]) -> list[str]:
    return list(dict.fromkeys(notes))


def parse_sizes(text: str) -> dict[str, int]:
    """``tokens=37,hidden=256`` -> ``{"tokens": 37, "hidden": 256}``."""
    sizes = {}
    for part in filter(None, text.split(",")):
        key, sep, value = part.partition("=")
        if not sep or not value.strip().isdigit():
            raise argparse.ArgumentTypeError(f"bad size {part!r}: expected NAME=INTEGER, e.g. tokens=37")
        sizes[key.strip()] = int(value)
    return sizes
