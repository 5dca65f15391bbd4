"""Stride classes of tensors: what a kernel must handle, and part of every signature.

- ``contiguous``: row-major and dense.
- ``rows``: viewable without a copy as a 2-D ``[rows, last]`` matrix with any two strides (the
  leading dimensions collapse into one); ``t.reshape(-1, t.shape[-1])`` is then a view.
- ``strided``: anything else (e.g. a permutation that interleaves the leading dimensions).
"""

from __future__ import annotations

import torch

ACCEPTED_LAYOUT_TEXT = {
    "contiguous": "contiguous tensors",
    "rows": "tensors whose leading dimensions flatten without a copy",
    "strided": "any strides",
}


def layout_of(t: torch.Tensor) -> str:
    if t.is_contiguous():
        return "contiguous"
    if _leading_dims_collapse(t):
        return "rows"
    return "strided"


def _leading_dims_collapse(t: torch.Tensor) -> bool:
    dims = [(s, st) for s, st in zip(t.shape[:-1], t.stride()[:-1]) if s != 1]
    for (_, outer_stride), (inner_size, inner_stride) in zip(dims, dims[1:]):
        if outer_stride != inner_stride * inner_size:
            return False
    return True


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 2-D ``[rows, last]`` view (never a copy for ``contiguous`` / ``rows`` layouts)."""
    return t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
