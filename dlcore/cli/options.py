"""Argument types shared by the subcommands."""

from __future__ import annotations

import argparse

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def parse_sizes(text: str) -> dict[str, int]:
    """``tokens=37,hidden=256`` -> ``{"tokens": 37, "hidden": 256}``."""
    sizes = {}
    for part in filter(None, text.split(",")):
        key, sep, value = part.partition("=")
        if not sep or not value.strip().isdigit():
            raise argparse.ArgumentTypeError(f"bad size {part!r}: expected NAME=INTEGER, e.g. tokens=37")
        sizes[key.strip()] = int(value)
    return sizes


def default_device(requested: str | None) -> str:
    if requested:
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"
