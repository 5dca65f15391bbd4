"""Helpers for testing kernels against their references: one tolerance table for every kernel.

References are computed in float64 from the same inputs (see :func:`upcast`), outputs are
poisoned before a kernel writes them (see :func:`poison`), and inputs are fresh random numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

#: absolute and relative tolerance per output dtype, for a float64 reference
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
    # quantized outputs: one unit in the last place (3 and 2 mantissa bits), and the least subnormal
    torch.float8_e4m3fn: (2.0**-9, 2.0**-3),
    torch.float8_e5m2: (2.0**-16, 2.0**-2),
}

POISON = float("nan")


def tolerance(dtype: torch.dtype, reduce_dim: int = 1) -> tuple[float, float]:
    """Tolerances for an output of ``dtype`` that sums ``reduce_dim`` products (rounding grows with it)."""
    atol, rtol = TOLERANCES[dtype]
    scale = max(1.0, math.sqrt(reduce_dim) / 8)
    return atol * scale, rtol * scale


def least_precise(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """The dtype of the widest tolerance among ``dtypes`` (floating ones of the table): the precision
    a computation mixing them works at (float32 routing weights beside bfloat16 activations)."""
    return max((d for d in dtypes if d in TOLERANCES), key=lambda d: TOLERANCES[d][0])


def assert_close(actual: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype | None = None,
                 reduce_dim: int = 1) -> None:
    """``actual`` matches the float64 ``reference`` within the tolerance of its dtype."""
    dtype = dtype or actual.dtype
    assert actual.dtype == dtype, f"output dtype {actual.dtype}, expected {dtype}"
    assert actual.shape == reference.shape, f"shape {tuple(actual.shape)} vs reference {tuple(reference.shape)}"
    assert not torch.isnan(actual).any(), "output holds NaN: an element was never written"
    atol, rtol = tolerance(dtype, reduce_dim)
    torch.testing.assert_close(actual.double().cpu(), reference.double().cpu(), atol=atol, rtol=rtol)


def upcast(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in tensors)


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` so that an element a kernel forgot to write shows: NaN, or for integers the dtype's
    least value (no index or count a kernel writes, -1 included; the greatest for unsigned ones)."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return t.fill_(POISON)
    if t.dtype == torch.bool:
        return t.fill_(True)
    info = torch.iinfo(t.dtype)
    return t.fill_(info.min if t.dtype.is_signed else info.max)


def randn(*shape: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
          generator: torch.Generator | None = None, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=generator, dtype=torch.float32) * scale).to(device=device, dtype=dtype)


def strided_like(t: torch.Tensor, how: str = "pad") -> torch.Tensor:
    """A non-contiguous copy of ``t`` with the same values.

    ``pad``: the last dimension lives in a wider buffer (row stride > row length, a ``rows``
    layout); ``transpose``: stored transposed in memory (unit stride on the first dimension).
    """
    if how == "pad":
        wide = torch.empty(*t.shape[:-1], t.shape[-1] + 7, dtype=t.dtype, device=t.device)
        poison(wide)
        view = wide[..., : t.shape[-1]]
        view.copy_(t)
        return view
    if how == "transpose":
        return t.transpose(0, -1).contiguous().transpose(0, -1)
    raise ValueError(f"unknown layout {how!r}; use 'pad' or 'transpose'")
