"""Argument types shared by the subcommands."""

from __future__ import annotations

import torch

from dlcore.bench.presets import parse_sizes
from dlcore.errors import InvalidOptionError

__all__ = ["DTYPES", "default_device", "parse_sizes", "require_plotting", "resolve_device"]

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def default_device(requested: str | None) -> str:
    if requested:
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(requested: str | None) -> torch.device:
    """The device ``--device`` names (default: cuda when available, else cpu), checked to exist here."""
    name = default_device(requested)
    here = ", ".join(f"--device {d}" for d in ("cpu", "cuda") if d == "cpu" or torch.cuda.is_available())
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise InvalidOptionError(f"--device {name}: not a device name ({str(exc).splitlines()[0]}); "
                                 f"use a torch device name, e.g. cpu, cuda, cuda:1, npu, mlu; here: {here}") from exc
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as exc:  # torch asserts "not compiled with CUDA enabled"
        raise InvalidOptionError(f"--device {name}: this torch build cannot use it ({str(exc).splitlines()[0]}); "
                                 f"use {here}, or install the torch build (and dlcore backend) for it") from exc
    return device


def require_plotting(option: str = "--plot") -> None:
    """Fail before any work when ``option`` is given and matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise InvalidOptionError(f"{option} needs matplotlib, which is not installed: "
                                 f"pip install 'dlc-core[plot]' (or leave out {option})") from exc
