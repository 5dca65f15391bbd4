"""Checking an op's result against its reference: for tuning and ``dlcore check``.

The reference runs in float64 on the same inputs; the tolerance comes from the output dtype
(:data:`dlcore.testing.TOLERANCES`), scaled by the size of the reduction behind each element.
Integer outputs (indices) match exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dlcore.declarations.op import Op
from dlcore.testing import tolerance, upcast


def as_tuple(x: Any) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def reference_result(op: Op, args: Sequence[Any]) -> tuple:
    """The op's reference on float64 copies of ``args``."""
    return as_tuple(op.reference(*upcast(*args)))


def reduce_dim_of(args: Sequence[Any]) -> int:
    """The longest last dimension among the tensor arguments: the length of the reductions an
    output element may sum over, which scales the tolerance."""
    return max((t.shape[-1] for t in args if isinstance(t, torch.Tensor) and t.dim()), default=1)


def mismatch(actual: Any, expected: Sequence[torch.Tensor], reduce_dim: int = 1) -> str | None:
    """``None`` if ``actual`` matches the float64 ``expected`` within tolerance, else what differs."""
    actual = as_tuple(actual)
    if len(actual) != len(expected):
        return f"{len(actual)} outputs, expected {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected)):
        if tuple(a.shape) != tuple(e.shape):
            return f"output {i} has shape {tuple(a.shape)}, expected {tuple(e.shape)}"
        if not a.is_floating_point():  # indices and counts: exactly
            differs = a.detach().cpu() != e.detach().cpu()
            if differs.any():
                return f"output {i}: {int(differs.sum())} of {differs.numel()} elements differ"
            continue
        atol, rtol = tolerance(a.dtype, reduce_dim)
        a64, e64 = a.detach().double().cpu(), e.detach().double().cpu()
        if torch.isnan(a64).any() and not torch.isnan(e64).any():
            return f"output {i} holds NaN"
        bad = (a64 - e64).abs() > atol + rtol * e64.abs()
        if bad.any():
            worst = (a64 - e64).abs().max().item()
            return f"output {i}: {int(bad.sum())} of {bad.numel()} elements off, max abs error {worst:.3g}"
    return None
