"""The float8_e4m3fn quantisation rule, as ``@triton.jit`` helpers: a group's scale from its largest
magnitude (:func:`scale_of`) and its elements quantised by it (:func:`quantise`). Shared by
:mod:`~dlblas_kernels.kernels.quantize_fp8`'s kernels and the grouped GEMM's epilogue
(:mod:`dlblas_kernels.blocks.grouped`, ``QUANT_C``), so that both quantise alike.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: the largest finite float8_e4m3fn
FP8_MAX = 448.0


@triton.jit
def scale_of(amax):
    """``amax / 448`` (rounded correctly, as :func:`quantise` divides), or 1 where the group is all zeros."""
    return tl.where(amax > 0.0, tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 1.0)


@triton.jit
def quantise(x, scale):
    """``x / scale`` clamped to the e4m3 range and rounded to float8_e4m3fn. The division rounded
    correctly (``div_rn``): Triton's ``/`` is the approximate ``div.full.f32`` on CUDA, which
    quantised about one element in 10 million differently from torch."""
    return tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0).to(tl.float8e4nv)
