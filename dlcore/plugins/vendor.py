"""Lazy import of a vendor's torch extension (torch_npu, torch_mlu), for backend plugins.

Importing such a runtime can fail in many ways (missing driver libraries, CANN not sourced): the
failure becomes a reason, never a crash, and nothing is imported before a backend is asked.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType


def import_runtime(module: str, install_hint: str) -> tuple[ModuleType | None, str]:
    """``(module, "")`` if ``module`` imports, else ``(None, reason)``."""
    if importlib.util.find_spec(module) is None:
        return None, f"{module} is not installed ({install_hint})"
    try:
        return importlib.import_module(module), ""
    except Exception as exc:  # noqa: BLE001 - vendor runtimes fail with arbitrary errors
        return None, f"{module} is installed but failed to import: {type(exc).__name__}: {exc}"
