"""ffn's prefill path (many tokens) and the tiles its GEMMs share: the row kernel that writes
``x * rms_w`` (or the normalised rows) and ``rstd``, the SwiGLU GEMM over both weights (the pair-tile
kernel of :mod:`dlblas_kernels.blocks.swiglu_pair` on sm_90, else the GEMM block's
:func:`~dlblas_kernels.blocks.gemm.swiglu_calls`), the prefill tile and the fit of pipelining stages
to shared memory. The formulas are :mod:`dlblas_kernels.kernels.ffn`'s module doc.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dlblas_kernels.blocks import gemm as gemm_block
from dlblas_kernels.blocks import swiglu_pair
from dlblas_kernels.blocks.gemm import swiglu_calls
from dlcore.api import Config, DeviceProfile, KernelCall, next_power_of_2

# Widest row slice the row kernel holds at once (longer rows loop).
MAX_ROW_BLOCK = 4096
# Declared for 16-bit inputs; a float32 config that overflows shared memory fails to compile and the
# tuner records it as failed.
SPACE_ELEMENT_BYTES = 2
#: the prefill tile above 128 rows: BLOCK_N columns of each weight, so a [128, 256] product per
#: tile for the pair-tile kernel (JOINT), the matmul's 128 x 256 tile
PREFILL_TILE = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, JOINT=1, num_warps=8, num_stages=4)


@triton.jit
def rms_scale_kernel(
    x_ptr, rms_w_ptr, xs_ptr, rstd_ptr, zero_ptr,
    M, K, eps, zeros,
    stride_xm, stride_xk,
    stride_rms_w,
    stride_xsm, stride_xsk,
    BLOCK_K: tl.constexpr, NORMALISE: tl.constexpr, ZERO: tl.constexpr = False,
):
    # One row per program: rstd = rsqrt(mean(x**2) + eps), then xs = x * rms_w (NORMALISE: the
    # normalised row x * rstd * rms_w), in xs's dtype; the second pass reads the row from cache.
    # ZERO: the `zeros` int32 counters at zero_ptr set to 0 too (the next launch's, spread over the M
    # programs; M passed rather than read from tl.num_programs, which grid folding refuses).
    row = tl.program_id(0).to(tl.int64)  # 64-bit: row * row stride may pass 2**31
    if ZERO:
        for i in range(tl.program_id(0), zeros, M):
            tl.store(zero_ptr + i, 0)
    cols = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row * stride_xm
    sum_sq = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        mask = start + cols < K
        x = tl.load(x_row + (start + cols) * stride_xk, mask=mask, other=0.0).to(tl.float32)
        sum_sq += x * x
    rstd = tl.rsqrt(tl.sum(sum_sq, axis=0) / K + eps)
    tl.store(rstd_ptr + row, rstd)
    for start in range(0, K, BLOCK_K):
        mask = start + cols < K
        x = tl.load(x_row + (start + cols) * stride_xk, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(rms_w_ptr + (start + cols) * stride_rms_w, mask=mask, other=0.0).to(tl.float32)
        xs = x * g
        if NORMALISE:
            xs = xs * rstd
        tl.store(xs_ptr + row * stride_xsm + (start + cols) * stride_xsk, xs.to(xs_ptr.dtype.element_ty), mask=mask)


def weights(w1: torch.Tensor | None, w3: torch.Tensor | None,
            w13: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w1, w3)``: the arguments themselves, or the two halves of ``w13`` (views)."""
    if w13 is None:
        return w1, w3
    n = w13.shape[0] // 2
    return w13[:n], w13[n:]


def rms_scale_call(x2: torch.Tensor, rms_w: torch.Tensor, xs: torch.Tensor, rstd: torch.Tensor, eps: float,
                   normalise: bool, zero: torch.Tensor | None = None) -> KernelCall:
    """``rstd [M]`` and ``xs [M, K]`` = ``x * rms_w`` (``normalise``: ``x * rstd * rms_w``), a program
    per row; ``zero`` (int32), when given, set to 0 too: the next launch's counters."""
    m, k = x2.shape
    block_k = min(next_power_of_2(k), MAX_ROW_BLOCK)
    return KernelCall(
        rms_scale_kernel, (m,),
        (x2, rms_w, xs, rstd, rstd if zero is None else zero, m, k, float(eps), 0 if zero is None else zero.numel(),
         x2.stride(0), x2.stride(1), rms_w.stride(0), xs.stride(0), xs.stride(1)),
        # About 16 elements of the row slice per thread.
        {"BLOCK_K": block_k, "NORMALISE": normalise, "ZERO": zero is not None,
         "num_warps": min(max(block_k // 512, 1), 8)},
    )


def prefill_calls(xs: torch.Tensor, w1: torch.Tensor | None, w3: torch.Tensor | None, rstd: torch.Tensor | None,
                  out2: torch.Tensor, config: Config, profile: DeviceProfile, w13: torch.Tensor | None,
                  gate2: torch.Tensor | None, up2: torch.Tensor | None) -> tuple[list[KernelCall], tuple]:
    """The prefill GEMM: with ``JOINT`` (the default) where the copy engine takes the operands, the
    pair-tile kernel (:func:`dlblas_kernels.blocks.swiglu_pair.swiglu_pair_calls`: one ``[BLOCK_M, 2 * BLOCK_N]``
    product over w1's and w3's tiles side by side, the matmul's loop); else the GEMM block's
    two-accumulator SwiGLU GEMM (:func:`dlblas_kernels.blocks.gemm.swiglu_calls`). Returns the launches and
    their scratch (the pair kernel's split last wave: ``(part, count)``, ``count`` for the row kernel
    to zero)."""
    v1, v3 = weights(w1, w3, w13)
    if config.get("JOINT", 1) and swiglu_pair.takes_swiglu_pair(profile, xs, v1, v3, out2, gate2, up2):
        return swiglu_pair.swiglu_pair_calls(xs, w1, w3, rstd, out2, config, profile, w13=w13, gate=gate2, up=up2)
    return swiglu_calls(xs, w1, w3, rstd, out2, config, profile, w13=w13, gate=gate2, up=up2), ()


def fit_stages(config: Config, profile: DeviceProfile | None, element_size: int, operands: int = 2) -> Config:
    """``config`` with pipelining stages dropped (down to 2) while the tiles of ``element_size``-byte
    elements (float32: 4) overflow the profile's shared memory; ``operands``: the B tiles per stage."""
    shared = profile.shared_memory_per_program if profile is not None else 0
    return gemm_block.fit_stages(config, shared, lambda c: shared_memory_bytes(c, element_size, operands))


def shared_memory_bytes(c: Config, element_size: int = SPACE_ELEMENT_BYTES, operands: int = 2) -> int:
    # The pipelined tiles per stage: the x (or xs) tile and the w1 and w3 tiles (one B tile for the
    # backward's GEMMs), as the GEMM block counts them for its pointer kernel.
    return gemm_block.shared_memory_bytes({**c, "TMA": 0}, element_size, second_operand=operands == 2)
