"""Portable helpers for Triton kernels on DSA chips, after DLCompiler's
``triton.language.extra.deeplink``: one kernel source for upstream Triton (GPUs, its interpreter,
and dlcore's own npu pipeline, which lowers upstream TTIR) and for triton-ascend.

Use inside ``@triton.jit`` code as ``import dlcore.language as dl``:

- ``for item in dl.persistent_range(pid, items, programs)``: the loop of a persistent program over
  its work items (the grid sized to the chip's cores);
- ``dl.compile_hint(x, name, value=None)``: an annotation for triton-ascend's compiler
  (``tl.compile_hint``); nothing elsewhere;
- ``dl.multibuffer(x, 2)``: ask triton-ascend to double-buffer ``x`` (its load overlaps the
  previous iteration's compute); nothing elsewhere;
- ``dl.extract_slice(x, offsets, sizes, strides)`` and
  ``dl.insert_slice(full, sub, offsets, sizes, strides)``: a strided slice of a tensor held by the
  program, read or written, one offset, size and stride per dimension. triton-ascend's
  ``tensor.extract_slice`` / ``insert_slice`` there; elsewhere ``tl.gather`` along each axis not
  taken whole, which needs power-of-two sizes (:mod:`dlcore.language.plain`).

Which Triton is active is found once, at import (:mod:`dlcore.language.flavour`); ``ACTIVE`` says
what was found. This package imports only triton.
"""

from __future__ import annotations

from dlcore.language.flavour import ActiveTriton, TritonFlavour, detect
from dlcore.language.mapping import Helpers, helpers_for

__all__ = [
    "ACTIVE",
    "ActiveTriton",
    "Helpers",
    "TritonFlavour",
    "compile_hint",
    "detect",
    "extract_slice",
    "helpers_for",
    "insert_slice",
    "multibuffer",
    "persistent_range",
]

ACTIVE: ActiveTriton = detect()
_HELPERS = helpers_for(ACTIVE)

persistent_range = _HELPERS.persistent_range
compile_hint = _HELPERS.compile_hint
multibuffer = _HELPERS.multibuffer
extract_slice = _HELPERS.extract_slice
insert_slice = _HELPERS.insert_slice
