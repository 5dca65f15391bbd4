"""ffn: the gate and up half of a LLaMA MLP, fused: RMSNorm, two projections and SwiGLU, with its backward.

    xn  = x * rsqrt(mean(x**2, -1) + eps) * rms_w          x: [M, K], rms_w: [K]
    out = silu(xn @ w1.T) * (xn @ w3.T)                     w1, w3: [N, K] (nn.Linear layout)

The weights come either as ``w1`` and ``w3``, or as one ``w13`` of shape ``[2N, K]`` (rows ``0..N-1``
being ``w1``, ``N..2N-1`` being ``w3``: what vLLM and SGLang keep) with ``w1 = w3 = None``. Both
forms run the same kernels: ``w13``'s halves are two views.

The row scale factors out of the product, ``xn @ w.T = rstd[:, None] * ((x * rms_w) @ w.T)``, so the
normalised input is never written at full precision and the GEMMs need only ``rstd`` per row. Two
regimes, chosen by the config: when one row block holds every row (``rows <= BLOCK_M``),

- **weight streaming** (decoding, a few tokens; :mod:`dlblas_kernels.blocks.ffn_decode`): one kernel, one
  program per ``BLOCK_N`` columns of both weights (fewer where N spreads evenly over whole waves of
  the cores), every row in it. Each program computes the rows' sums of squares and ``x * rms_w``
  in its K loop from ``x`` (a few kilobytes, read from L2), and streams its slices of ``w1`` and
  ``w3`` once from memory (loads marked evict-first: nothing reads them again; on sm_90 through
  tensor descriptors where that measured faster), so the kernel reads the weights once at close to
  the copy bandwidth;

otherwise

- **prefill** (many tokens): a row kernel writes ``xs = x * rms_w`` (input dtype) and ``rstd``
  (float32), then one GEMM computes ``xs @ w1.T`` and ``xs @ w3.T`` in the same program, scales both
  by ``rstd`` and applies SwiGLU in its epilogue: the ``[M, 2N]`` pre-activations never reach
  memory. On sm_90 (``JOINT``, where the copy engine takes the operands) it is the pair-tile kernel
  (:func:`dlblas_kernels.blocks.swiglu_pair.swiglu_pair_calls`): persistent, w1's and w3's tiles loaded as the two
  planes of one tensor descriptor, so each K step is ONE ``[BLOCK_M, 2 * BLOCK_N]`` product, the
  matmul's loop, faster than two accumulators fed from the same ``xs`` tile (the GEMM block's
  :func:`dlblas_kernels.blocks.gemm.swiglu_calls`, which runs everywhere else).

The ``tl.dot`` inputs keep the input dtype (float16 / bfloat16 tensor cores, exact float32 for
float32 inputs), accumulating in float32.

Backward, with ``g = xn @ w1.T``, ``u = xn @ w3.T``, ``s = sigmoid(g)`` and ``dout`` the output
gradient::

    dg = dout * u * s * (1 + g * (1 - s))      du = dout * g * s          dh = [dg | du]   [M, 2N]
    dxn = dg @ w1 + du @ w3                    dw1 = dg.T @ xn            dw3 = du.T @ xn
    dx, drms_w = rms_norm's backward of dxn

The pre-activations ``g`` and ``u`` are saved, not recomputed (what ``torch.compile`` of the
composite keeps too): recomputing them would cost the backward a third GEMM of the forward's
size. The op's custom op, which autograd and ``torch.compile`` call, runs
:func:`training_plan`: the forward with ``g`` and ``u`` stored by the GEMM's (or the streaming
kernel's) epilogue, returned as the template's residuals (:class:`~dlcore.runtime.template.Residuals`)
and saved; that costs the forward an ``[M, 2N]`` write (about 3% at 4096 tokens). It saves the
normalised input ``xn`` (input dtype) too, which its row kernel writes in place of ``x * rms_w``
(the GEMM then takes no row scale), so the backward does not write it again (what
``torch.compile`` keeps too). The public function without autograd and bound ops run
:func:`plan`, which stores none of them. The backward: ``dh`` elementwise from the saved
``g``, ``u`` and ``dout``, ``dxn = dh @ w13`` (for separate ``w1`` and ``w3``,
:func:`ffn_input_grad_kernel` reduces over both without a concatenated copy), ``dw13 = dh.T @ xn``
(GEMMs through the GEMM block), then ``dx`` and ``drms_w`` from rms_norm's backward kernels. The
weights' gradient is one ``[2N, K]`` buffer; with ``w1`` and ``w3`` given, their gradients are its
two halves (views).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from dlblas_kernels.blocks import gemm as gemm_block
from dlblas_kernels.blocks import swiglu_pair
from dlblas_kernels.blocks.ffn_decode import DECODE_KERNELS, MIN_SLICE_STEPS, decode_calls
from dlblas_kernels.blocks.gemm import dot_range, gemm_calls, grouped_tile, swiglu_calls
from dlblas_kernels.kernels import rms_norm
from dlcore.api import (
    Backward,
    Choice,
    Config,
    Constraint,
    DeviceProfile,
    InvalidInputError,
    KernelCall,
    LaunchPlan,
    Op,
    PowerOfTwo,
    Residuals,
    ScalarArg,
    SearchSpace,
    Signature,
    TensorArg,
    as_rows,
    cdiv,
    define_kernel,
    ensure_allocator,
    next_power_of_2,
    num_stages,
    num_warps,
)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Widest row slice the row kernel holds at once (longer rows loop).
MAX_ROW_BLOCK = 4096
# Most rows the heuristic default streams the weights for (decoding, :mod:`dlblas_kernels.blocks.ffn_decode`);
# more take the prefill GEMM.
DECODE_ROWS = 64
# Widest row slice of the SwiGLU backward's programs.
SWIGLU_BLOCK = 2048


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


@triton.jit
def swiglu_backward_kernel(
    gate_ptr, up_ptr, dout_ptr, dh_ptr,
    N,
    stride_gm, stride_gn, stride_um, stride_un, stride_dm, stride_dn, stride_hm,
    BLOCK_N: tl.constexpr,
):
    # One row slice per program: dh [M, 2N] = [d gate | d up] (unit column stride) from the saved
    # pre-activations gate and up and the output gradient dout, each [M, N].
    row = tl.program_id(0).to(tl.int64)  # 64-bit: row * row stride may pass 2**31
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    gate = tl.load(gate_ptr + row * stride_gm + cols * stride_gn, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_um + cols * stride_un, mask=mask, other=0.0).to(tl.float32)
    dout = tl.load(dout_ptr + row * stride_dm + cols * stride_dn, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(gate)
    dh_row = dh_ptr + row * stride_hm
    # d silu(g) / dg = s * (1 + g * (1 - s))
    tl.store(dh_row + cols, (dout * up * s * (1 + gate * (1 - s))).to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(dh_row + N + cols, (dout * gate * s).to(dh_ptr.dtype.element_ty), mask=mask)


@triton.jit
def ffn_input_grad_kernel(
    dh_ptr, w1_ptr, w3_ptr, out_ptr,
    M, K, N, k_per_split,
    stride_dm, stride_dn,
    stride_w1n, stride_w1k,
    stride_w3n, stride_w3k,
    stride_om, stride_ok, stride_osplit,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # out [M, K] = dh[:, :N] @ w1 + dh[:, N:] @ w3: one accumulator, the reduction over the N
    # columns of d gate against w1's rows, then over those of d up against w3's. BLOCK_N tiles
    # the output's K columns and BLOCK_K the reduction; the tile order and the K loop are the
    # GEMM block's. program_id(1) takes the reduction's slice [s * k_per_split, ...) of the 2N
    # columns (its part in w1, then its part in w3) and stores at out + s * stride_osplit (with
    # several slices: a float32 workspace [slices, M, K] the GEMM block's split-K reduce adds up).
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(K, BLOCK_N), GROUP_M)
    split = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_c = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_c = offs_c < K
    # 64-bit: the reduction step times a weight's row stride may pass 2**31 elements.
    stride_dn = tl.cast(stride_dn, tl.int64)
    stride_w1n = tl.cast(stride_w1n, tl.int64)
    stride_w3n = tl.cast(stride_w3n, tl.int64)
    start = split * k_per_split
    end = tl.minimum(start + k_per_split, 2 * N)
    lo1, hi1 = tl.minimum(start, N), tl.minimum(end, N)
    lo3, hi3 = tl.maximum(start, N) - N, tl.maximum(end, N) - N

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_ptrs = dh_ptr + offs_m[:, None] * stride_dm + (lo1 + offs_r)[None, :] * stride_dn
    b_ptrs = w1_ptr + (lo1 + offs_r)[:, None] * stride_w1n + offs_c[None, :] * stride_w1k
    acc = dot_range(acc, a_ptrs, b_ptrs, mask_m, mask_c, offs_r, lo1, hi1, stride_dn, stride_w1n, BLOCK_K, "ieee")
    a_ptrs = dh_ptr + offs_m[:, None] * stride_dm + (N + lo3 + offs_r)[None, :] * stride_dn
    b_ptrs = w3_ptr + (lo3 + offs_r)[:, None] * stride_w3n + offs_c[None, :] * stride_w3k
    acc = dot_range(acc, a_ptrs, b_ptrs, mask_m, mask_c, offs_r, lo3, hi3, stride_dn, stride_w3n, BLOCK_K, "ieee")

    out_ptrs = out_ptr + split.to(tl.int64) * stride_osplit + offs_m[:, None] * stride_om + offs_c[None, :] * stride_ok
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_c[None, :])


@triton.jit
def ffn_input_grad_tma_kernel(
    dh_ptr, w1_ptr, w3_ptr, out_ptr,
    M, K, N,
    stride_dm, stride_w1n, stride_w3n, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # ffn_input_grad_kernel's out [M, K] = dh[:, :N] @ w1 + dh[:, N:] @ w3, persistent, every tile
    # moved by the copy engine: dh's halves and the weights ([N, K], unit K strides) through
    # descriptors bounded at N, so a ragged last reduction step reads zeros, not the other half.
    d_desc = tl.make_tensor_descriptor(dh_ptr, shape=[M, N], strides=[stride_dm, 1], block_shape=[BLOCK_M, BLOCK_K])
    u_desc = tl.make_tensor_descriptor(dh_ptr + N, shape=[M, N], strides=[stride_dm, 1],
                                       block_shape=[BLOCK_M, BLOCK_K])
    w1_desc = tl.make_tensor_descriptor(w1_ptr, shape=[N, K], strides=[stride_w1n, 1], block_shape=[BLOCK_K, BLOCK_N])
    w3_desc = tl.make_tensor_descriptor(w3_ptr, shape=[N, K], strides=[stride_w3n, 1], block_shape=[BLOCK_K, BLOCK_N])
    c_desc = tl.make_tensor_descriptor(out_ptr, shape=[M, K], strides=[stride_om, 1], block_shape=[BLOCK_M, BLOCK_N])
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(K, BLOCK_N)
    steps = tl.cdiv(N, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0)):
        pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(steps):
            acc = tl.dot(d_desc.load([off_m, ki * BLOCK_K]), w1_desc.load([ki * BLOCK_K, off_n]), acc,
                         input_precision="ieee")
        for ki in range(steps):
            acc = tl.dot(u_desc.load([off_m, ki * BLOCK_K]), w3_desc.load([ki * BLOCK_K, off_n]), acc,
                         input_precision="ieee")
        c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


def weights(w1: torch.Tensor | None, w3: torch.Tensor | None,
            w13: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w1, w3)``: the arguments themselves, or the two halves of ``w13`` (views)."""
    if w13 is None:
        return w1, w3
    n = w13.shape[0] // 2
    return w13[:n], w13[n:]


def output(x: torch.Tensor, w1: torch.Tensor | None, w3: torch.Tensor | None, rms_w: torch.Tensor,
           eps: float = 1e-6, w13: torch.Tensor | None = None) -> torch.Tensor:
    n = (w1 if w13 is None else w13).shape[0] // (1 if w13 is None else 2)
    return torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)


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


def _forward(args: tuple, config: Config, profile: DeviceProfile, out: torch.Tensor,
             gate: torch.Tensor | None = None, up: torch.Tensor | None = None,
             xn: torch.Tensor | None = None) -> tuple[list[KernelCall], tuple]:
    """The forward's launches and scratch into ``out`` (and the pre-activations ``gate`` and ``up``,
    and the normalised input ``xn``, the residuals of :func:`training_plan`). With ``xn`` the row
    kernel writes it, and the prefill GEMM reads it without a row scale; without, the row kernel
    writes ``x * rms_w`` and the GEMM scales its rows by ``rstd``."""
    x, w1, w3, rms_w, eps, w13 = args
    x2, out2 = as_rows(x), as_rows(out)
    gate2, up2 = (None, None) if gate is None else (as_rows(gate), as_rows(up))
    m, k = x2.shape
    if m <= config["BLOCK_M"]:
        calls, scratch = decode_calls(x2, rms_w, w1, w3, w13, out2, eps, config, profile, gate2, up2)
        if xn is None:
            return calls, scratch
        rstd = torch.empty(m, dtype=torch.float32, device=x.device)
        return [*calls, rms_scale_call(x2, rms_w, as_rows(xn), rstd, eps, normalise=True)], (*scratch, rstd)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    xs = torch.empty((m, k), dtype=x.dtype, device=x.device) if xn is None else as_rows(xn)
    gemm, scratch = prefill_calls(xs, w1, w3, None if xn is not None else rstd, out2, config, profile, w13, gate2, up2)
    counters = scratch[1] if scratch else None  # the pair kernel's split last wave (swiglu_pair.pair_tail)
    row = rms_scale_call(x2, rms_w, xs, rstd, eps, normalise=xn is not None, zero=counters)
    return [row, *gemm], (xs, rstd, *scratch) if xn is None else (rstd, *scratch)


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


def plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    """Weight streaming when one row block holds every row; otherwise the row kernel and the GEMM
    block's SwiGLU GEMM (:func:`dlblas_kernels.blocks.gemm.swiglu_calls`)."""
    out = output(*args)
    if out.numel() == 0:
        return LaunchPlan(calls=[], result=out)
    calls, scratch = _forward(args, config, profile, out)
    return LaunchPlan(calls=calls, result=out, scratch=scratch)


def training_outputs(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, gate, up, xn)``: the output and the pre-activations, each of the output's shape, and
    the normalised input ``xn`` of ``x``'s."""
    x = args[0]
    return output(*args), output(*args), output(*args), torch.empty(x.shape, dtype=x.dtype, device=x.device)


def training_plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    """:func:`plan`, the pre-activations and ``xn`` stored too (the custom op's body: autograd saves
    them). ``xn`` is what the prefill GEMM reads in place of ``x * rms_w`` (the same bytes written);
    the decode path writes it by one more row launch."""
    out, gate, up, xn = training_outputs(*args)
    if out.numel() == 0:
        return LaunchPlan(calls=[], result=(out, gate, up, xn))
    calls, scratch = _forward(args, config, profile, out, gate, up, xn)
    return LaunchPlan(calls=calls, result=(out, gate, up, xn), scratch=scratch)


def backward_outputs(dout: torch.Tensor, x: torch.Tensor, w1: torch.Tensor | None, w3: torch.Tensor | None,
                     rms_w: torch.Tensor, eps: float, w13: torch.Tensor | None, gate: torch.Tensor,
                     up: torch.Tensor, xn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dw13 [2N, K], drms_w)``: the weights' gradient in one buffer, w1's rows first."""
    w = w1 if w13 is None else w13
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device),
            torch.empty((2 * gate.shape[-1], x.shape[-1]), dtype=w.dtype, device=x.device),
            torch.empty(rms_w.shape, dtype=rms_w.dtype, device=x.device))


def backward_gemm_config(config: Config) -> Config:
    """The config of the backward's single-operand GEMMs: the forward's tile with both accumulators'
    columns in one (the default forward tile of 128 x 128 per weight is a 128 x 256 GEMM tile, the
    faster of the two for the backward's GEMMs)."""
    return {**config, "BLOCK_N": min(2 * config["BLOCK_N"], 256)}


def weight_grad_config(element_size: int, profile: DeviceProfile | None) -> Config:
    """The tile of ``dw13 = dh.T @ xn``, whatever the forward's: :data:`PREFILL_TILE`'s 128 x 256
    product (K slices of 32 for float32), its stages fitted to the device. Its output ``[2N, K]`` is
    as large at 16 tokens as at 16384 (only the reduction shrinks), so the few-row forward tiles,
    sized for a small output, do not serve it (``.ci/sweep_weight_grad.py`` compares them)."""
    config = backward_gemm_config(dict(PREFILL_TILE))
    if element_size > 2:
        config["BLOCK_K"] = 32
    return fit_stages(config, profile, element_size, operands=1)


def input_grad_splits(m: int, k: int, n: int, gemm: Config, profile: DeviceProfile | None) -> int:
    """Slices of the reduction over the 2N columns for ``dxn = dh @ [w1; w3]``: with few rows its
    output ``[M, K]`` has few tiles (LLaMA-3-8B at 16 tokens: 16 of 64 x 256 for 132 SMs, too few
    programs to stream the weights at the copy bandwidth), so as many slices as keep the tiles'
    programs within one wave of the device's cores, each at least MIN_SLICE_STEPS K steps long; one
    without a core count."""
    cores = profile.cores if profile is not None else 0
    tiles = cdiv(m, gemm["BLOCK_M"]) * cdiv(k, gemm["BLOCK_N"])
    if not cores or tiles * 2 > cores:
        return 1
    most = max(1, 2 * n // (MIN_SLICE_STEPS * gemm["BLOCK_K"]))
    return max(1, min(cores // tiles, most))


def input_grad_tma(dh: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, dxn: torch.Tensor, gemm: Config,
                   profile: DeviceProfile | None, splits: int) -> bool:
    """Whether :func:`ffn_input_grad_tma_kernel` computes ``dxn``: unsliced (``splits`` 1), ``gemm``'s
    ``TMA`` not 0, on a device whose copy engine takes the operands (sm_90, its core count known):
    dh, its second half, the weights and dxn as :func:`dlblas_kernels.blocks.gemm.tma_aligned` asks."""
    if (splits > 1 or not gemm.get("TMA", 1) or profile is None or profile.arch not in gemm_block.TMA_ARCHS
            or profile.cores <= 0):
        return False
    return all(gemm_block.tma_aligned(t) for t in (dh, dh[:, w1.shape[0]:], w1, w3, dxn))


def input_grad_calls(dh: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, dxn: torch.Tensor, gemm: Config,
                     splits: int, profile: DeviceProfile | None = None) -> tuple[list[KernelCall], tuple]:
    """``dxn = dh[:, :N] @ w1 + dh[:, N:] @ w3`` without concatenating the weights, over ``splits``
    slices of the reduction (float32 partial sums added up by the GEMM block's split-K reduce); on
    sm_90, unsliced, the persistent descriptor kernel (:func:`input_grad_tma`)."""
    (m, k), n = dxn.shape, w1.shape[0]
    if input_grad_tma(dh, w1, w3, dxn, gemm, profile, splits):
        ensure_allocator()
        size = dh.element_size()  # the pipelined tiles beside the output tile staged for its store
        stages = gemm_block.fit_stages({**gemm, "TMA": 1, "SPLIT_K": 1}, profile.shared_memory_per_program,
                                       lambda c: gemm_block.shared_memory_bytes(c, size))["num_stages"]
        tiles = cdiv(m, gemm["BLOCK_M"]) * cdiv(k, gemm["BLOCK_N"])
        return [KernelCall(ffn_input_grad_tma_kernel, (min(tiles, profile.cores),), (
            dh, w1, w3, dxn, m, k, n, dh.stride(0), w1.stride(0), w3.stride(0), dxn.stride(0),
        ), {"BLOCK_M": gemm["BLOCK_M"], "BLOCK_N": gemm["BLOCK_N"], "BLOCK_K": gemm["BLOCK_K"],
            "GROUP_M": gemm["GROUP_M"], "num_warps": gemm["num_warps"], "num_stages": stages})], ()
    k_per_split = cdiv(cdiv(2 * n, splits), gemm["BLOCK_K"]) * gemm["BLOCK_K"]
    splits = cdiv(2 * n, k_per_split)
    tile = {"BLOCK_M": gemm["BLOCK_M"], "BLOCK_N": gemm["BLOCK_N"], "BLOCK_K": gemm["BLOCK_K"],
            "GROUP_M": gemm["GROUP_M"], "num_warps": gemm["num_warps"], "num_stages": gemm["num_stages"]}
    grid = (cdiv(m, gemm["BLOCK_M"]) * cdiv(k, gemm["BLOCK_N"]), splits)
    common = (m, k, n, k_per_split, dh.stride(0), dh.stride(1), w1.stride(0), w1.stride(1), w3.stride(0), w3.stride(1))
    if splits == 1:
        return [KernelCall(ffn_input_grad_kernel, grid, (dh, w1, w3, dxn, *common, dxn.stride(0), dxn.stride(1), 0),
                           tile)], ()
    work = torch.empty(splits, m, k, dtype=torch.float32, device=dxn.device)
    block_m, block_n = 32, 128
    return [
        KernelCall(ffn_input_grad_kernel, grid, (dh, w1, w3, work, *common, k, 1, m * k), tile),
        KernelCall(gemm_block.splitk_reduce_kernel, (cdiv(m, block_m), cdiv(k, block_n)), (
            work, dxn, dxn, dxn, dxn, dxn, m, k, dxn.stride(0), dxn.stride(1), 0, 0,
        ), {"BLOCK_M": block_m, "BLOCK_N": block_n, "SPLIT_K": splits, "HAS_BIAS": False, "HAS_SCALE": False,
            "HAS_COL_SCALE": False, "ACTIVATION": None, "ACT_GRAD": False, "num_warps": 4}),
    ], (work,)


def backward_plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    """Launches for ``(dx, dw13, drms_w)`` from ``args = (dout, x, w1, w3, rms_w, eps, w13, gate, up,
    xn)``: ``dh`` from the saved pre-activations; ``dxn`` from ``dh`` and both weights (the forward
    config's tile, both weights' columns in one); ``dw13 = dh.T @ xn`` from the saved ``xn``
    (:func:`weight_grad_config`'s tile); rms_norm's backward of ``dxn``."""
    dout, x, w1, w3, rms_w, eps, w13, gate, up, xn = args
    dx, dw13, drms_w = backward_outputs(*args)
    n = gate.shape[-1]
    x2 = as_rows(x)
    m, k = x2.shape
    if m == 0 or n == 0:
        return LaunchPlan(calls=[], result=(dx.zero_(), dw13.zero_(), drms_w.zero_()))
    gemm = fit_stages(backward_gemm_config(config), profile, x.element_size(), operands=1)
    new = lambda *shape: torch.empty(shape, dtype=x.dtype, device=x.device)  # noqa: E731
    # dout comes from autograd in any layout (even expanded); reshape copies only when it must.
    dout2, gate2, up2 = dout.reshape(m, n), as_rows(gate), as_rows(up)
    xn2, dh, dxn = as_rows(xn), new(m, 2 * n), new(m, k)
    block = min(next_power_of_2(n), SWIGLU_BLOCK)
    calls = [
        KernelCall(
            swiglu_backward_kernel, (m, cdiv(n, block)),
            (gate2, up2, dout2, dh, n, gate2.stride(0), gate2.stride(1), up2.stride(0), up2.stride(1),
             dout2.stride(0), dout2.stride(1), dh.stride(0)),
            {"BLOCK_N": block, "num_warps": min(max(block // 256, 1), 4)},
        ),
    ]
    splits = input_grad_splits(m, k, n, gemm, profile)
    if w13 is not None:
        calls_x, scratch_x = gemm_calls(dh, w13, dxn, {**gemm, "SPLIT_K": splits}, profile)
    else:
        calls_x, scratch_x = input_grad_calls(dh, w1, w3, dxn, gemm, splits, profile)
    calls_w, scratch_w = gemm_calls(dh.T, xn2, dw13, weight_grad_config(x.element_size(), profile), profile)
    norm = rms_norm.backward_plan((dxn, x2, rms_w, None, eps), rms_norm.heuristic_config(m, k), profile)
    dx_rows, drms = norm.result
    return LaunchPlan(calls=[*calls, *calls_x, *calls_w, *norm.calls], result=(dx_rows.view(x.shape), dw13, drms),
                      scratch=(dh, dxn, *scratch_x, *scratch_w, *norm.scratch))


def _composite(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, rms_w: torch.Tensor, eps: float
               ) -> tuple[torch.Tensor, ...]:
    """``(xf, rstd, xn, gate, up)`` in float32 (or wider)."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute)
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    xn = xf * rstd * rms_w.to(compute)
    return xf, rstd, xn, xn @ w1.to(compute).T, xn @ w3.to(compute).T


def ffn_reference(x: torch.Tensor, w1: torch.Tensor | None, w3: torch.Tensor | None, rms_w: torch.Tensor,
                  eps: float = 1e-6, w13: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm, gate and up projections and SwiGLU, in float32 (or wider), returned in ``x``'s dtype."""
    return ffn_training_reference(x, w1, w3, rms_w, eps, w13)[0]


def ffn_training_reference(x: torch.Tensor, w1: torch.Tensor | None, w3: torch.Tensor | None, rms_w: torch.Tensor,
                           eps: float = 1e-6, w13: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, gate, up, xn)``: :func:`ffn_reference`, the pre-activations and the normalised input,
    in ``x``'s dtype."""
    _, _, xn, gate, up = _composite(x, *weights(w1, w3, w13), rms_w, eps)
    return tuple(t.to(x.dtype) for t in (torch.nn.functional.silu(gate) * up, gate, up, xn))


def ffn_backward_reference(dout: torch.Tensor, x: torch.Tensor, w1: torch.Tensor | None, w3: torch.Tensor | None,
                           rms_w: torch.Tensor, eps: float, w13: torch.Tensor | None, gate: torch.Tensor,
                           up: torch.Tensor, xn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward formulas of the module docstring in torch, in float32 (or wider), from the
    saved pre-activations (``xn`` recomputed from ``x``: the saved one is its rounding)."""
    w1, w3 = weights(w1, w3, w13)
    xf, rstd, xn, _, _ = _composite(x, w1, w3, rms_w, eps)
    compute = xf.dtype
    d, gate, up = dout.to(compute), gate.to(compute), up.to(compute)
    s = torch.sigmoid(gate)
    d_gate = d * up * s * (1 + gate * (1 - s))
    d_up = d * gate * s
    dxn = d_gate @ w1.to(compute) + d_up @ w3.to(compute)
    k, n = x.shape[-1], w1.shape[0]
    dw13 = torch.cat([d_gate.reshape(-1, n).T, d_up.reshape(-1, n).T]) @ xn.reshape(-1, k)
    xhat = xf * rstd
    g = dxn * rms_w.to(compute)
    dx = rstd * (g - xhat * (g * xhat).mean(dim=-1, keepdim=True))
    drms_w = (dxn * xhat).reshape(-1, k).sum(dim=0)
    return dx.to(x.dtype), dw13.to(w1.dtype), drms_w.to(rms_w.dtype)


#: the prefill tile above 128 rows: BLOCK_N columns of each weight, so a [128, 256] product per
#: tile for the pair-tile kernel (JOINT), the matmul's 128 x 256 tile
PREFILL_TILE = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, JOINT=1, num_warps=8, num_stages=4)


def _columns(sig: Signature) -> int:
    """N, the columns of each weight."""
    w1 = sig.optional("w1")
    return w1.shape[0] if w1 is not None else sig.tensor("w13").shape[0] // 2


def few_rows_block_n(m: int, n: int, cores: int) -> int:
    """The columns of each weight per 64-row tile for 65 to 128 rows: 64 (K slices of 128) where
    those tiles fill the multiprocessors at least once (or no core count is known), else 32: with
    fewer tiles than cores, narrower ones put more of the cores to work."""
    if not cores or cdiv(m, 64) * cdiv(n, 64) >= cores:
        return 64
    return 32


def default_config(sig: Signature, profile: DeviceProfile) -> Config:
    """By the row count (rounded up to a power of two), from sweeps at LLaMA-3-8B's shape (K 4096,
    N 14336, bfloat16; docs/performance.md, ffn):

    - up to DECODE_ROWS: weight streaming (:mod:`dlblas_kernels.blocks.ffn_decode`), at most 128 columns
      of each weight per program, spread over whole waves of the multiprocessors
      (``decode_columns``), 64-wide K slices four stages deep; on sm_90, where the programs'
      columns nearly fill the tile and K is not sliced, the weights through tensor descriptors in
      128-wide K slices three deep (``decode_tma``). Deeper pipelines, 256 or 64 columns, 32-wide
      K slices and, for 1 row, products on the cores without tl.dot are slower;
    - up to 128: the GEMM with 64-row tiles (128-row tiles, or streaming with 128 rows, leave
      multiprocessors idle or spill), 64 columns of each weight by K slices of 128, 32 where 64
      leave multiprocessors idle (:func:`few_rows_block_n`);
    - more: :data:`PREFILL_TILE`, 128 x 128 tiles of each weight (a 128 x 256 output tile).

    On sm_90 the pair-tile kernel splits its last, partial wave over K
    (:func:`dlblas_kernels.blocks.swiglu_pair.pair_tail`), so that the wave's SMs are not left idle.

    The GEMM takes the pair-tile kernel (``JOINT``) where the copy engine takes the operands;
    float32 inputs take K slices half as wide. Pipelining stages are dropped while the tiles
    overflow the device's shared memory (the profile's bound; none where it knows none)."""
    m = sig.tensor("x").shape[0]
    if m <= DECODE_ROWS:
        config = {"BLOCK_M": DECODE_ROWS, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 4,
                  "JOINT": 1}
    elif m <= 128:
        block_n = few_rows_block_n(m, _columns(sig), profile.cores if profile is not None else 0)
        config = {"BLOCK_M": 64, "BLOCK_N": block_n, "BLOCK_K": 128, "GROUP_M": 8,
                  "num_warps": 4, "num_stages": 4, "JOINT": 1}
    else:
        config = dict(PREFILL_TILE)
    if sig.dtype.itemsize > 2 and m > DECODE_ROWS:
        config["BLOCK_K"] = 32
    return fit_stages(config, profile, sig.dtype.itemsize)


def fit_stages(config: Config, profile: DeviceProfile | None, element_size: int, operands: int = 2) -> Config:
    """``config`` with pipelining stages dropped (down to 2) while the tiles of ``element_size``-byte
    elements (float32: 4) overflow the profile's shared memory; ``operands``: the B tiles per stage."""
    shared = profile.shared_memory_per_program if profile is not None else 0
    return gemm_block.fit_stages(config, shared, lambda c: _shared_memory_bytes(c, element_size, operands))


# Declared for 16-bit inputs; a float32 config that overflows shared memory fails to compile and the
# tuner records it as failed.
SPACE_ELEMENT_BYTES = 2


def _shared_memory_bytes(c: Config, element_size: int = SPACE_ELEMENT_BYTES, operands: int = 2) -> int:
    # The pipelined tiles per stage: the x (or xs) tile and the w1 and w3 tiles (one B tile for the
    # backward's GEMMs), as the GEMM block counts them for its pointer kernel.
    return gemm_block.shared_memory_bytes({**c, "TMA": 0}, element_size, second_operand=operands == 2)


def _accumulators_per_thread(c: Config) -> float:
    # Two float32 accumulators (gate and up), BLOCK_M x BLOCK_N each.
    return 2 * c["BLOCK_M"] * c["BLOCK_N"] / (32 * c["num_warps"])


def space(profile: DeviceProfile) -> SearchSpace:
    """Tile shapes, program order, warps and pipelining depth of both paths, and the prefill GEMM's
    kernel (``JOINT``: 1 the pair-tile kernel where the copy engine takes the operands, 0 the GEMM
    block's two accumulators); the pipelined tiles within the shared memory a program may use on
    the device (no bound where the profile knows none). BLOCK_M at or above the row count selects
    weight streaming (see the module docstring)."""
    shared = profile.shared_memory_per_program
    fits = [Constraint(
        f"num_stages * (BLOCK_M + 2 * BLOCK_N) * BLOCK_K * {SPACE_ELEMENT_BYTES} bytes <= {shared} "
        f"(the pipelined x, w1 and w3 tiles fit in shared memory)",
        lambda c: _shared_memory_bytes(c) <= shared,
    )] if shared else []
    return SearchSpace(
        [
            PowerOfTwo("BLOCK_M", 16, 256),
            PowerOfTwo("BLOCK_N", 16, 256),
            PowerOfTwo("BLOCK_K", 32, 256),
            Choice("GROUP_M", (1, 8)),
            Choice("JOINT", (0, 1)),
            num_warps(4, 8),
            num_stages(2, 3, 4, 5),
        ],
        [
            *fits,
            Constraint("2 * BLOCK_M * BLOCK_N / (32 * num_warps) <= 128 (both float32 accumulators fit in registers)",
                       lambda c: _accumulators_per_thread(c) <= 128),
            Constraint("2 * BLOCK_M * BLOCK_N / (32 * num_warps) >= 8 (every warp has enough of the tile to work on)",
                       lambda c: _accumulators_per_thread(c) >= 8),
        ],
    )


def check(op: Op, args: dict[str, Any]) -> None:
    x, w1, w3, w13 = args["x"], args["w1"], args["w3"], args["w13"]
    k = x.shape[-1]
    if k == 0:
        raise InvalidInputError(op.name, "x", f"has an empty last dimension (shape {tuple(x.shape)})",
                                "x with at least one feature to normalise")
    if w13 is not None:
        for name in ("w1", "w3"):
            if args[name] is not None:
                raise InvalidInputError(op.name, name, "is given together with w13",
                                        "either w1 and w3, or w13 alone (w1 = w3 = None)")
        if w13.shape[0] % 2:
            raise InvalidInputError(op.name, "w13", f"has an odd number of rows (shape {tuple(w13.shape)})",
                                    "[2N, K]: w1's N rows, then w3's")
        op.expect_shape("w13", w13, (w13.shape[0], k), "[2N, K], K being x's last dimension")
    else:
        for name in ("w1", "w3"):
            if args[name] is None:
                raise InvalidInputError(op.name, name, "is None and w13 is not given",
                                        "w1 and w3 of shape [N, K], or w13 of shape [2N, K]")
        op.expect_shape("w1", w1, (w1.shape[0], k), "nn.Linear layout [N, K], K being x's last dimension")
        op.expect_shape("w3", w3, tuple(w1.shape), "the shape of w1")
    op.expect_shape("rms_w", args["rms_w"], (k,), "one scale per feature of x's last dimension")


def example(sizes: dict[str, int], dtype: torch.dtype, device: torch.device,
            generator: torch.Generator) -> tuple:
    """Random ``x [tokens, hidden]``, ``w1, w3 [inter, hidden]`` scaled like trained layers
    (variance 1/hidden), and a norm weight near 1."""
    tokens, hidden, inter = sizes["tokens"], sizes["hidden"], sizes["inter"]
    x = torch.randn(tokens, hidden, generator=generator)
    w1 = torch.randn(inter, hidden, generator=generator) / hidden**0.5
    w3 = torch.randn(inter, hidden, generator=generator) / hidden**0.5
    rms_w = 1 + 0.2 * torch.randn(hidden, generator=generator)
    return (*(t.to(device=device, dtype=dtype) for t in (x, w1, w3, rms_w)), 1e-6, None)


def cost(args: tuple, mode: str = "fwd") -> tuple[int, int]:
    """Forward: read x, the weights and rms_w, write the output; two GEMMs of 2*M*N*K flops each.
    Backward: read dout, x, the weights and rms_w, write dx, the weights' gradient and drms_w;
    ``dh @ w13`` and ``dh.T @ xn``, 4*M*N*K flops each (the pre-activations are saved)."""
    x, w1, w3, rms_w, _, w13 = args
    w1, w3 = weights(w1, w3, w13)
    m, k, n = x.numel() // max(x.shape[-1], 1), x.shape[-1], w1.shape[0]
    size = x.element_size()
    moved = (x.numel() * size + (w1.numel() + w3.numel()) * w1.element_size()
             + rms_w.numel() * rms_w.element_size() + m * n * size)
    if mode == "bwd":
        return moved + (x.numel() + w1.numel() + w3.numel()) * size + rms_w.numel() * rms_w.element_size(), \
            8 * m * n * k
    return moved, 4 * m * n * k


def torch_ffn(x: torch.Tensor, w1: torch.Tensor | None, w3: torch.Tensor | None, rms_w: torch.Tensor,
              eps: float = 1e-6, w13: torch.Tensor | None = None) -> torch.Tensor:
    """What a model runs in eager torch: LlamaRMSNorm, then LlamaMLP's ``act_fn(gate_proj(h)) * up_proj(h)``."""
    w1, w3 = weights(w1, w3, w13)
    h = x.to(torch.float32)
    h = rms_w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return torch.nn.functional.silu(h @ w1.T) * (h @ w3.T)


def ffn_w13_composite(x: torch.Tensor, w13: torch.Tensor, rms_w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The best composite (``dlcore bench``'s ``compile`` baseline): ``F.rms_norm``, one GEMM over
    ``[w1; w3]`` concatenated once (as vLLM and SGLang keep it), SwiGLU."""
    gate, up = (torch.nn.functional.rms_norm(x, (x.shape[-1],), rms_w, eps) @ w13.T).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def concatenate_w13(args: tuple) -> tuple:
    """``(x, w1, w3, rms_w, eps, w13)`` -> ``(x, w13, rms_w, eps)``, ``w13 = [w1; w3]`` unless given."""
    x, w1, w3, rms_w, eps, *rest = args
    w13 = rest[0] if rest and rest[0] is not None else torch.cat([w1, w3])
    return x, w13, rms_w, eps


ffn_w13_composite.prepare = concatenate_w13  # type: ignore[attr-defined]


OP = Op(
    name="ffn",
    args=(
        TensorArg("x", DTYPES, bucket="rows"),
        TensorArg("w1", DTYPES, min_rank=2, max_rank=2, same_dtype_as="x", optional=True),
        TensorArg("w3", DTYPES, min_rank=2, max_rank=2, same_dtype_as="x", optional=True),
        TensorArg("rms_w", DTYPES, max_rank=1),
        ScalarArg("eps", (float, int), default=1e-6, finite=True, minimum=0.0),
        TensorArg("w13", DTYPES, min_rank=2, max_rank=2, same_dtype_as="x", optional=True),
    ),
    reference=ffn_reference,
    doc="silu(rms_norm(x) @ w1.T) * (rms_norm(x) @ w3.T): fused RMSNorm + gate/up projections + SwiGLU; "
        "w13 [2N, K] (w1's rows, then w3's) may replace w1 and w3",
    check=check,
    example=example,
    example_sizes={"tokens": 37, "hidden": 256, "inter": 96},
    example_paths={"decode": {"tokens": 1, "hidden": 2048, "inter": 512},
                   "prefill": {"tokens": 300, "hidden": 256, "inter": 512}},
    cost=cost,
    baselines={"torch": lambda: torch_ffn, "compile": lambda: ffn_w13_composite},
)


def _gradients(backward, saved, grads, needs) -> dict:
    dx, dw13, drms_w = backward(grads[0], saved.x, saved.w1, saved.w3, saved.rms_w, saved.eps, saved.w13,
                                saved.gate, saved.up, saved.xn)
    if saved.w13 is not None:
        return {"x": dx, "w13": dw13, "rms_w": drms_w}
    n = saved.w1.shape[0]
    return {"x": dx, "w1": dw13[:n], "w3": dw13[n:], "rms_w": drms_w}


KERNEL = define_kernel(
    OP, plan,
    kernels=(*DECODE_KERNELS, rms_scale_kernel, swiglu_backward_kernel,
             ffn_input_grad_kernel, ffn_input_grad_tma_kernel, *gemm_block.KERNELS, *swiglu_pair.KERNELS,
             rms_norm.rms_norm_backward_kernel, rms_norm.column_sum_kernel),
    results=output,
    default_config=default_config,
    space=space,
    backward=Backward(_gradients, saved=("x", "w1", "w3", "rms_w", "eps", "w13", "gate", "up", "xn"),
                      plan=backward_plan, reference=ffn_backward_reference, results=backward_outputs,
                      residuals=Residuals(("gate", "up", "xn"), training_plan, training_outputs,
                                          ffn_training_reference)),
    doc="weight streaming for a few rows; else x * rms_w and rstd, then one GEMM over both weights (on sm_90 "
        "their tiles side by side in one product), rstd and SwiGLU in its epilogue; backward: dh from the saved "
        "pre-activations, the input and weight GEMMs (the latter over the saved xn), rms_norm's backward",
)
ffn = KERNEL.function
dlcore_ops, dlcore_implementations = KERNEL.dlcore_ops, KERNEL.dlcore_implementations
