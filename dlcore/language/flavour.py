"""Which Triton is active: upstream Triton, or triton-ascend (Huawei's fork, which replaces the
``triton`` package wholesale and adds a language extension for Ascend's DSA cores).

Found once, from what the installed ``triton`` package holds, without importing torch_npu:
triton-ascend ships the backend package ``triton.backends.ascend``; its language extension is
the module ``triton.language.extra.cann.extension`` in current releases, while 3.2.0 sets the
same functions (``compile_hint``, ``insert_slice``, ...) on ``triton.language`` itself.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType

import triton.language as tl

#: triton-ascend's backend package: present only where triton-ascend is the installed Triton
ASCEND_BACKEND = "triton.backends.ascend"
#: where current triton-ascend releases keep the language extension
ASCEND_EXTENSION = "triton.language.extra.cann.extension"
#: what dlcore.language takes from the extension
EXTENSION_NAMES = ("compile_hint", "multibuffer", "insert_slice", "extract_slice")


class TritonFlavour(enum.Enum):
    """The Triton that compiles the kernels of this process."""

    UPSTREAM = "upstream"
    ASCEND = "ascend"


@dataclass(frozen=True)
class ActiveTriton:
    """The active Triton and, under triton-ascend, the module its language extension is read from
    (None when it has none: the plain-Triton forms serve then)."""

    flavour: TritonFlavour
    extension: ModuleType | None = None


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a parent package is missing
        return False


def ascend_extension() -> ModuleType | None:
    """triton-ascend's language extension, or None if this triton-ascend has none."""
    if _has_module(ASCEND_EXTENSION):
        return importlib.import_module(ASCEND_EXTENSION)
    if all(hasattr(tl, name) for name in EXTENSION_NAMES):
        return tl
    return None


def detect() -> ActiveTriton:
    """The active Triton, from the installed ``triton`` package."""
    if not _has_module(ASCEND_BACKEND):
        return ActiveTriton(TritonFlavour.UPSTREAM)
    return ActiveTriton(TritonFlavour.ASCEND, ascend_extension())
