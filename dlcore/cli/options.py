"""Argument types shared by the subcommands."""

from __future__ import annotations

import torch

from dlcore.bench.presets import parse_sizes

__all__ = ["DTYPES", "default_device", "parse_sizes"]

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def default_device(requested: str | None) -> str:
    if requested:
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"
