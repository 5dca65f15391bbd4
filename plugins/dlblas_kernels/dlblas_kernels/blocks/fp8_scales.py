"""fp8_gemm's scale granularity, read off the scales' shapes: the one rule the Triton kernel's plan
and heuristic and the cuBLAS candidate (:mod:`dlblas_kernels.vendor`) share."""

from __future__ import annotations

import enum
from typing import Any

from dlblas_kernels.blocks.gemm import SCALE_BLOCK
from dlcore.api import Signature, cdiv

#: the K (and b's N) extent of one block scale
BLOCK = SCALE_BLOCK.value


class Granularity(enum.Enum):
    """What one scale covers, read off the scales' shapes."""

    BLOCK = "block"
    ROW = "row"
    TENSOR = "tensor"


def granularity(a_scale: Any, b_scale: Any, m: int, n: int, k: int) -> Granularity | None:
    """The granularity of scales of shapes ``a_scale.shape`` and ``b_scale.shape`` (tensors or
    specs) for ``a [m, k]``, ``b [n, k]``; None when they fit none. Where the shapes fit both
    (K <= 128 and N == 1) per-row and block scales mean the same product; per-row is named."""
    sa, sb = tuple(a_scale.shape), tuple(b_scale.shape)
    if sa == () and sb == ():
        return Granularity.TENSOR
    if sa == (m, 1) and sb == (n, 1):
        return Granularity.ROW
    if sa == (m, cdiv(k, BLOCK)) and sb == (cdiv(n, BLOCK), cdiv(k, BLOCK)):
        return Granularity.BLOCK
    return None


def signature_granularity(sig: Signature) -> Granularity | None:
    """:func:`granularity` from a signature: ``a``'s rows are bucketed there, so the rows are the
    scales' own."""
    a_scale, b_scale = sig.tensor("a_scale"), sig.tensor("b_scale")
    n, k = sig.tensor("b").shape
    rows = a_scale.shape[0] if len(a_scale.shape) == 2 else 0
    return granularity(a_scale, b_scale, rows, n, k)
