"""Argument types shared by the subcommands."""

from __future__ import annotations

import os

import torch

from dlcore.bench.presets import parse_sizes
from dlcore.declarations.op import Op
from dlcore.errors import InvalidOptionError

__all__ = ["DTYPES", "check_sizes", "default_device", "default_dtype", "parse_sizes", "require_plotting",
           "resolve_device"]

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
        unavailable = _backend_unavailable(name)
        if unavailable:
            raise InvalidOptionError(f"--device {name}: {unavailable}; here: {here}") from exc
        raise InvalidOptionError(f"--device {name}: not a device name ({str(exc).splitlines()[0]}); "
                                 f"use a torch device name, e.g. cpu, cuda, cuda:1, npu, mlu; here: {here}") from exc
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as exc:  # torch asserts "not compiled with CUDA enabled"
        raise InvalidOptionError(f"--device {name}: this torch build cannot use it ({str(exc).splitlines()[0]}); "
                                 f"use {here}, or install the torch build (and dlcore backend) for it") from exc
    return device


def _backend_unavailable(name: str) -> str:
    """Why the installed backend for device ``name``'s type cannot run here (its own reason: "torch_npu
    is not installed (...)"), or '' when no installed backend serves that type: torch knows an npu only
    once torch_npu is imported, so without it the name alone says nothing."""
    from dlcore.plugins.registry import registry

    reg = registry()
    backend = reg.backends.get(name.split(":", 1)[0])
    if backend is None:
        return ""
    available = backend.available()
    if available:
        return ""
    plugin = reg.backend_plugin.get(backend.name, "")
    record = next((r for r in reg.plugins.records if r.id == plugin), None)
    source = f" ({record.distribution} {record.version})" if record is not None else ""
    return f"the {backend.name} backend{source} is installed, but {available.reason}"


def require_plotting(path: str | None = None, option: str = "--plot") -> None:
    """Fail before any work when ``option`` is given and matplotlib is not installed, or when the
    folder of ``path`` (the plot's file) does not exist or cannot be written."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise InvalidOptionError(f"{option} needs matplotlib, which is not installed: "
                                 f"pip install 'dlc-core[plot]' (or leave out {option})") from exc
    if path is not None:
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise InvalidOptionError(f"{option} {path}: the folder {folder} does not exist or cannot be written")


def default_dtype(requested: str | None, device: torch.device) -> str:
    """``--dtype`` as given; else bfloat16, or float32 on a CPU, where Triton's interpreter declines bfloat16
    (a search there would time the reference alone)."""
    if requested:
        return requested
    return "float32" if device.type == "cpu" else "bfloat16"


def check_sizes(op: Op, sizes: dict[str, int], option: str = "--shape") -> None:
    """Refuse size names ``op`` does not declare: a misspelt name would silently keep the example's value."""
    unknown = sorted(set(sizes) - set(op.example_sizes))
    if unknown:
        given = ",".join(f"{k}={sizes[k]}" for k in unknown)
        known = ", ".join(op.example_sizes) or "none (it declares no example sizes)"
        raise InvalidOptionError(f"{option} {given}: {op.name} has no size named {', '.join(unknown)}; "
                                 f"its sizes are {known} (`dlcore ops {op.name}` shows them)")
