"""Whether tensors an op writes into share memory: the rules torch applies to its own in-place ops.

A tensor *overlaps itself* when two of its indices name one element (an ``expand``-ed view:
stride 0 over a dimension of size > 1, or any strides whose extents interleave); writing into it
leaves each element with one of several results. Two tensors *alias* when they start at the same
element of one storage with the same shape and strides (``q`` passed as ``k``), and *overlap
partly* when both are contiguous and their byte ranges in one storage intersect. As torch does
(``at::get_overlap_status``), a pair that is neither and not both contiguous is not refused:
strided views of one buffer that interleave without sharing an element (q and k sliced from a
packed qkv projection) are the common case, and telling them apart from real overlap in general
costs more than a call should.
"""

from __future__ import annotations

import enum

import torch


class Overlap(enum.Enum):
    NONE = "none"
    FULL = "the same memory"
    PARTIAL = "partly the same memory"


def overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two indices of ``t`` name one element (dims of size 1 ignored).

    Sorted by stride, each dimension's stride must exceed the span of all smaller ones; layouts
    that break this yet share no element (rare, hand-made with ``as_strided``) are refused too.
    """
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n > 1)
    span = 0
    for stride, size in dims:
        if stride <= span:
            return True
        span += stride * (size - 1)
    return False


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    start = t.storage_offset()
    end = start + sum(s * (n - 1) for s, n in zip(t.stride(), t.shape)) + 1
    return start * t.element_size(), end * t.element_size()


def overlap(a: torch.Tensor, b: torch.Tensor) -> Overlap:
    """How ``a`` and ``b`` share memory (see the module docstring)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return Overlap.NONE
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return Overlap.NONE
    if a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride():
        return Overlap.FULL
    (a0, a1), (b0, b1) = _byte_range(a), _byte_range(b)
    if a.is_contiguous() and b.is_contiguous() and a0 < b1 and b0 < a1:
        return Overlap.PARTIAL
    return Overlap.NONE
