"""fused_moe's launches over the grouped GEMMs (:mod:`dlblas_kernels.blocks.grouped`) with weights in
the inputs' dtype: the forward (alignment, gate/up GEMM with SwiGLU, down GEMM, the sum over
choices), the backward from the saved pre-activations, and the two kernels of their own, the sum over
choices (:func:`moe_sum_kernel`) and the SwiGLU backward (:func:`moe_swiglu_backward_kernel`). The
formulas are :mod:`dlblas_kernels.kernels.fused_moe`'s module doc.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from dlblas_kernels.blocks import grouped, grouped_tma
from dlcore.api import Config, DeviceProfile, KernelCall, cdiv, next_power_of_2

# Widest column slice of the backward's elementwise programs, and the rows each takes.
SWIGLU_BLOCK = 256
SWIGLU_ROWS = 16
# Widest column slice of the sum over choices.
SUM_BLOCK = 1024
# float32 inputs multiply exactly (no tf32)
PRECISION = "ieee"


@triton.jit
def moe_sum_kernel(y_ptr, ids_ptr, out_ptr, dw_ptr, experts, H, stride_ym, stride_it, stride_ij, stride_ot, stride_oh,
                   TOPK: tl.constexpr, BLOCK_H: tl.constexpr, ZERO_DROPPED: tl.constexpr):
    """``out[t] = sum_j y[t * TOPK + j]`` over the routed choices of token ``t`` (program axis 0),
    in float32. ZERO_DROPPED: ``dw[t, j] = 0`` (``dw`` contiguous ``[T, TOPK]``) for the dropped ones."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        e = tl.load(ids_ptr + t * stride_it + j * stride_ij)
        routed = (e >= 0) & (e < experts)
        # where, not mask & routed: Triton 3.9's interpreter rejects a vector mask and-ed with a loaded scalar
        y = tl.load(y_ptr + (t * TOPK + j) * stride_ym + cols, mask=tl.where(routed, mask, False), other=0.0)
        acc += y.to(tl.float32)
        if ZERO_DROPPED:
            tl.store(dw_ptr + t * TOPK + j, 0.0, mask=((e < 0) | (e >= experts)) & (tl.program_id(1) == 0))
    tl.store(out_ptr + t * stride_ot + cols * stride_oh, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def moe_swiglu_backward_kernel(r_ptr, gate_ptr, up_ptr, weights_ptr, dh_ptr, wa_ptr, dw_ptr, sorted_ptr, starts_ptr,
                               n_slots, experts, inter, stride_rp, stride_gm, stride_um, stride_hp, stride_ap,
                               BLOCK_P: tl.constexpr, BLOCK_I: tl.constexpr):
    """For places ``p`` in expert order below the padded total, slot ``n = sorted[p]``: from
    ``r[p]`` (``dout @ w2[e]``, float32), the saved ``gate[n]``, ``up[n]`` and the weight ``w[n]``:
    ``dh[p] = [dg | du]``, ``wa[p] = w * a`` and ``dw[n] = <r, a>``; padding places get zeros."""
    total = tl.load(starts_ptr + experts)
    places = (tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)).to(tl.int64)
    live = places < total
    slots = tl.load(sorted_ptr + places, mask=live, other=n_slots).to(tl.int64)
    real = slots < n_slots
    w = tl.load(weights_ptr + slots, mask=real, other=0.0)
    dw = tl.zeros((BLOCK_P,), dtype=tl.float32)
    for i in range(0, inter, BLOCK_I):
        cols = i + tl.arange(0, BLOCK_I)
        mask_i = (cols < inter)[None, :]
        mask = real[:, None] & mask_i
        r = tl.load(r_ptr + places[:, None] * stride_rp + cols[None, :], mask=mask, other=0.0)
        g = tl.load(gate_ptr + slots[:, None] * stride_gm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + slots[:, None] * stride_um + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        a = g * s * u
        dw += tl.sum(r * a, axis=1)
        da = w[:, None] * r
        # d silu(g) / dg = s * (1 + g * (1 - s))
        dh_ptrs = dh_ptr + places[:, None] * stride_hp + cols[None, :]
        store = live[:, None] & mask_i
        tl.store(dh_ptrs, (da * u * s * (1 + g * (1 - s))).to(dh_ptr.dtype.element_ty), mask=store)
        tl.store(dh_ptrs + inter, (da * g * s).to(dh_ptr.dtype.element_ty), mask=store)
        tl.store(wa_ptr + places[:, None] * stride_ap + cols[None, :], (w[:, None] * a).to(wa_ptr.dtype.element_ty),
                 mask=store)
    tl.store(dw_ptr + slots, dw.to(dw_ptr.dtype.element_ty), mask=real)


def dims(hidden: torch.Tensor, w13: torch.Tensor, topk_ids: torch.Tensor) -> tuple[int, int, int, int, int]:
    """``(T, H, E, I, k)``."""
    (tokens, h), (experts, two_i) = hidden.shape, w13.shape[:2]
    return tokens, h, experts, two_i // 2, topk_ids.shape[1]


def output(hidden: torch.Tensor, *_: Any) -> torch.Tensor:
    return torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)


def training_outputs(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, *_: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, gate, up)``: the output and each slot's pre-activations ``[T * k, I]``."""
    tokens, _, _, inter, topk = dims(hidden, w13, topk_ids)
    pre = lambda: torch.empty(tokens * topk, inter, dtype=hidden.dtype, device=hidden.device)  # noqa: E731
    return output(hidden), pre(), pre()


def up_config(config: Config) -> Config:
    return {k: config[k] for k in ("BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")}


def down_config(config: Config) -> Config:
    return {"BLOCK_N": config["DOWN_BLOCK_N"], "BLOCK_K": config["DOWN_BLOCK_K"], "GROUP_M": config["GROUP_M"],
            "num_warps": config["DOWN_WARPS"], "num_stages": config["DOWN_STAGES"]}


def sum_call(y: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor, experts: int,
             dw: torch.Tensor | None = None) -> KernelCall:
    tokens, h = out.shape
    block = min(next_power_of_2(max(h, 1)), SUM_BLOCK)
    return KernelCall(moe_sum_kernel, (tokens, cdiv(h, block)), (
        y, topk_ids, out, out if dw is None else dw, experts, h, y.stride(0), topk_ids.stride(0), topk_ids.stride(1),
        out.stride(0), out.stride(1),
    ), {"TOPK": topk_ids.shape[1], "BLOCK_H": block, "ZERO_DROPPED": dw is not None, "num_warps": 4})


def copy_engine_gemms(align: grouped.Alignment, rows: torch.Tensor, w13: torch.Tensor, act: torch.Tensor,
                      w2: torch.Tensor, y: torch.Tensor, config: Config, profile: DeviceProfile, *,
                      up_scales: tuple[torch.Tensor, torch.Tensor] | None = None, act_scale: torch.Tensor | None = None,
                      down_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[KernelCall]:
    """The gate/up and down GEMMs through the copy engine (:mod:`dlblas_kernels.blocks.grouped_tma`),
    16-bit or fp8: ``rows`` (sorted order) -> SwiGLU ``act`` by place -> each slot's row of ``y``,
    scaled by its routing weight. fp8: ``up_scales`` and ``down_scales`` are each GEMM's ``(a, b)``
    block scales, ``act_scale`` the SwiGLU output's 1x128 scales. A config's optional ``FLATTEN``
    (default 1) flattens both persistent loops."""
    flatten = {"FLATTEN": config.get("FLATTEN", 1)}
    return [
        grouped_tma.grouped_tma_call(align, rows, w13, act, {**up_config(config), **flatten}, profile.cores,
                                     swiglu=True, scatter=False, scale=False, block_scales=up_scales,
                                     c_scale=act_scale),
        grouped_tma.grouped_tma_call(align, act, w2, y, {**down_config(config), **flatten}, profile.cores,
                                     swiglu=False, scatter=True, scale=True, block_scales=down_scales),
    ]


def forward_calls(args: tuple, config: Config, out: torch.Tensor, gate: torch.Tensor | None = None,
                  up: torch.Tensor | None = None,
                  profile: DeviceProfile | None = None) -> tuple[list[KernelCall], tuple]:
    """The forward's launches and scratch with 16-bit or float32 weights into ``out`` (and the
    pre-activations ``gate`` and ``up``, where the training plan stores them). A config with
    ``TMA`` 1 runs the inference forward's GEMMs through the copy engine
    (:mod:`dlblas_kernels.blocks.grouped_tma`) where the device and the weights let it."""
    hidden, w13, w2, topk_weights, topk_ids = args[:5]
    tokens, h, experts, inter, topk = dims(hidden, w13, topk_ids)
    calls, align, scratch = grouped.align_calls(topk_ids, topk_weights, experts, config["BLOCK_M"])
    y = torch.empty(tokens * topk, h, dtype=hidden.dtype, device=hidden.device)
    if gate is None and config.get("TMA", 0) and grouped_tma.fits(profile, w13, w2, config):
        rows = torch.empty(align.places, h, dtype=hidden.dtype, device=hidden.device)
        act = torch.empty(align.places, inter, dtype=hidden.dtype, device=hidden.device)
        gemms = [grouped.gather_call(align, hidden, rows, topk),
                 *copy_engine_gemms(align, rows, w13, act, w2, y, config, profile)]
        held: tuple = (rows, act)
    else:
        act = torch.empty(tokens * topk, inter, dtype=hidden.dtype, device=hidden.device)
        gemms = [
            grouped.grouped_call(align, hidden, w13, act, up_config(config), gather=True, scatter=True, a_div=topk,
                                 swiglu=True, pre=gate, pre3=up, input_precision=PRECISION),
            grouped.grouped_call(align, act, w2, y, down_config(config), gather=True, scatter=True, scale=True,
                                 input_precision=PRECISION),
        ]
        held = (act,)
    calls += [*gemms, sum_call(y, topk_ids, out, experts)]
    return calls, (*scratch, *align.scratch(), *held, y)


def backward_outputs(dout: torch.Tensor, hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(d hidden, d w13, d w2, d topk_weights)``, contiguous, in the inputs' dtypes."""
    new = lambda t: torch.empty(t.shape, dtype=t.dtype, device=t.device)  # noqa: E731
    return new(hidden), new(w13), new(w2), new(topk_weights)


def weight_grad_config(m: int, n: int) -> Config:
    """The tiles of the reductions over an expert's rows (``[m, n]`` outputs, K a multiple of 16)."""
    return {"BLOCK_M": min(128, max(16, next_power_of_2(m))), "BLOCK_N": min(128, max(16, next_power_of_2(n))),
            "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}


def backward_calls(args: tuple, config: Config, dh: torch.Tensor, dw13: torch.Tensor, dw2: torch.Tensor,
                   dtw: torch.Tensor) -> tuple[list[KernelCall], tuple]:
    """Launches into ``(dh, dw13, dw2, dtw)`` from ``args = (dout, hidden, w13, w2, topk_weights,
    topk_ids, gate, up)`` and their scratch; ``config`` is the forward's."""
    dout, hidden, w13, w2, topk_weights, topk_ids, gate, up = args
    tokens, h, experts, inter, topk = dims(hidden, w13, topk_ids)
    calls, align, scratch = grouped.align_calls(topk_ids, topk_weights, experts, config["BLOCK_M"])
    new = lambda *shape: torch.empty(shape, dtype=hidden.dtype, device=hidden.device)  # noqa: E731
    places = align.places
    dout_sorted, hidden_sorted, wa, dh13, dh_slots = new(places, h), new(places, h), new(places, inter), \
        new(places, 2 * inter), new(tokens * topk, h)
    # r = dout @ w2[e] in float32: d topk_weights sums its products with a over I
    r = torch.empty(places, inter, dtype=torch.float32, device=hidden.device)
    wide = {**up_config(config), "BLOCK_N": min(2 * config["BLOCK_N"], 256)}
    calls += [
        grouped.gather_call(align, dout, dout_sorted, topk),
        grouped.gather_call(align, hidden, hidden_sorted, topk),
        grouped.grouped_call(align, dout_sorted, w2.transpose(1, 2), r, wide, gather=False, scatter=False,
                             input_precision=PRECISION),
        KernelCall(moe_swiglu_backward_kernel, (cdiv(places, SWIGLU_ROWS),), (
            r, gate, up, align.weights, dh13, wa, dtw, align.sorted_ids, align.starts, align.n_slots, experts, inter,
            r.stride(0), gate.stride(0), up.stride(0), dh13.stride(0), wa.stride(0),
        ), {"BLOCK_P": SWIGLU_ROWS, "BLOCK_I": min(next_power_of_2(inter), SWIGLU_BLOCK), "num_warps": 4}),
        grouped.expert_gemm_call(align, dout_sorted, wa, dw2, weight_grad_config(h, inter), PRECISION),
        grouped.expert_gemm_call(align, dh13, hidden_sorted, dw13, weight_grad_config(2 * inter, h), PRECISION),
        grouped.grouped_call(align, dh13, w13.transpose(1, 2), dh_slots, down_config(config), gather=False,
                             scatter=True, input_precision=PRECISION),
        sum_call(dh_slots, topk_ids, dh, experts, dw=dtw),
    ]
    return calls, (*scratch, *align.scratch(), dout_sorted, hidden_sorted, r, wa, dh13, dh_slots)
