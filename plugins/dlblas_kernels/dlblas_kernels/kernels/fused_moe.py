"""fused_moe: the routed experts of a mixture-of-experts layer, with SwiGLU experts, and its backward.

    g, u  = split(w13[e] @ hidden[t])                      w13: [E, 2I, H] (gate rows, then up rows)
    out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(g) * u),    e = topk_ids[t, j],  w2: [E, H, I]

``hidden [T, H]``; ``topk_weights [T, k]`` (float32, or the hidden dtype) and ``topk_ids [T, k]``
(int32 or int64; -1 drops a choice, which then contributes nothing). Every tensor may have any
strides. Validation reads the range of ``topk_ids`` (one read back from the device: the public function
pays it per call, ``get_op``'s bound ops when bound and at the first call of each exact input
metadata); the kernels treat ids outside ``[0, E)`` as dropped all the same.

The forward, six launches, none of them waiting on the host:

1. the alignment (:func:`dlblas_kernels.blocks.grouped.align_calls`): the ``T * k`` (token, choice)
   slots sorted by expert, each expert's slots padded to the row block ``BLOCK_M``, with the
   expert of every row block;
2. the gate/up GEMM (:func:`~dlblas_kernels.blocks.grouped.grouped_gemm_kernel`, the GEMM block's
   ``dot_range_pair``): each row block's tokens gathered from ``hidden`` by pointer (token =
   slot // k), both halves of its expert's ``w13`` in one pass over them, SwiGLU in the epilogue,
   ``act [T * k, I]`` written by slot;
3. the down GEMM (``dot_range``): ``act``'s rows gathered by slot against ``w2[e]``, the
   routing weight as the epilogue's row scale, ``y [T * k, H]`` by slot;
4. :func:`moe_sum_kernel`: ``out[t] = sum_j y[t * k + j]`` over the routed choices, in float32
   (deterministic: no atomics).

**fp8 weights** (DeepSeek-V3's checkpoints; forward only): ``w13`` and ``w2`` float8_e4m3fn with
float32 ``w13_scale [E, ceil(2I/128), ceil(H/128)]`` and ``w2_scale [E, ceil(H/128), ceil(I/128)]``,
each 128x128 block of a weight times its scale being the real weight (H and I multiples of 16).
The activations are quantised on the fly as DeepSeek-V3 does, one float32 scale ``amax / 448`` per
token and 128 columns (``quantize_fp8(x, 'block')``'s rule): ``hidden`` by a launch of
``quantize_fp8``'s kernel before the gate/up GEMM, the SwiGLU output (float32) in the gate/up GEMM's
epilogue where its column tile covers the 128-column group (I a multiple of 128: each tile *is*
one group, so its rows' maxima are local), else stored in float32 and quantised by a launch of its
own. Both GEMMs then run on fp8 tiles (:func:`~dlblas_kernels.blocks.grouped.grouped_fp8_gemm_kernel`,
the GEMM block's ``BLOCK_SCALED`` loops): each 128-deep K step's product is summed alone and added
scaled by its row's and its weight block's scales. The output is in ``hidden``'s dtype. The
tiles are fitted to the blocks (:func:`fp8_tiles`): K steps and column tiles within 128, and the
gate/up column tile dividing I (the up half's rows start at row I of w13, which need not be a block
boundary). fp8 ``tl.dot`` needs sm_89 or later (the cuda:80 limit is declared); a gradient asked
of a call with fp8 weights raises :class:`~dlcore.InvalidInputError` (the backward takes 16- and
32-bit weights). The composite candidate dequantises the weights to ``hidden``'s dtype first.

Decoding (a few tokens) reads each activated expert's weights once: thin row blocks (16 rows) and
narrow column tiles, so the weights stream through many programs.

Backward, with ``dout`` the output gradient, for each slot ``n = (t, j)`` routed to ``e``, ``w``
its weight and ``a = silu(g) * u``::

    r = dout[t] @ w2[e]          d topk_weights[t, j] = <r, a>          dw2[e] = sum_n (w dout[t])^T a
    da = w r      dg = da * u * silu'(g)      du = da * silu(g)         dw13[e] = sum_n [dg | du]^T hidden[t]
    d hidden[t] = sum_j [dg | du] @ w13[e]

The pre-activations ``g`` and ``u`` are **saved** by the forward (``[T * k, I]`` each, written by
the gate/up GEMM's epilogue into the template's residuals), not recomputed: recomputing them would
cost the backward a GEMM of the gate/up GEMM's size (two thirds of the forward's FLOPs); saving
costs the forward a write of ``2 T k I`` elements. The alignment is recomputed (three small
launches). Then: ``dout`` and ``hidden`` in expert order (a gather), ``r`` in float32 (a grouped
GEMM), ``dg``, ``du``, ``w a`` and the routing weights' gradient (:func:`moe_swiglu_backward_kernel`),
the weight gradients as reductions over each expert's rows (:func:`~dlblas_kernels.blocks.grouped.expert_gemm_kernel`),
``[dg | du] @ w13[e]`` by slot (a grouped GEMM) and its sum over the choices of each token.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake  # torch's own test for fake tensors; no public one

from dlblas_kernels.blocks import grouped
from dlblas_kernels.blocks.npu import on_npu
from dlblas_kernels.kernels import quantize_fp8 as Q
from dlcore.api import (
    Backward,
    Choice,
    Config,
    Constraint,
    DeviceProfile,
    InvalidInputError,
    KernelCall,
    LaunchPlan,
    LoweringLimit,
    Op,
    PowerOfTwo,
    Residuals,
    SearchSpace,
    Signature,
    TensorArg,
    cdiv,
    define_kernel,
    next_power_of_2,
    num_stages,
    num_warps,
)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8 = torch.float8_e4m3fn
#: the weights' other dtype: fp8 with DeepSeek-V3's 128x128 block scales (w13_scale, w2_scale)
FP8_DTYPES = (FP8,)
#: the rows and columns of a weight one block scale covers, and the columns of an activation's
SCALE_BLOCK = Q.GROUP
#: H and I must be multiples of this with fp8 weights (16-byte fp8 rows; a 16-column tile of the
#: up half then lies in one of w13's scale blocks)
FP8_MULTIPLE = 16
ID_DTYPES = (torch.int32, torch.int64)
ANY_LAYOUT = ("contiguous", "rows", "strided")

# Mean rows per expert up to which a call counts as decoding: 16-row blocks, weights streamed.
DECODE_ROWS = 16
# Mean rows per expert from which fp8 weights' gate/up GEMM runs 16 warps (its two 128 x 128 float32
# accumulators and each K step's scaled products in 128 registers a thread, where 8 warps spill).
FP8_WIDE_ROWS = 512
# Declared for 16-bit inputs; a float32 config that overflows shared memory fails to compile and the
# tuner records it as failed.
SPACE_ELEMENT_BYTES = 2
# Widest column slice of the backward's elementwise programs, and the rows each takes.
SWIGLU_BLOCK = 256
SWIGLU_ROWS = 16
# Widest column slice of the sum over choices.
SUM_BLOCK = 1024
# On npu a program's tiles live in the AI core's unified buffer. What bishengir-compile 1.2 asks of it
# for grouped_gemm_kernel, per element (fp16 and fp32 alike; measured on the Ascend 910B2's 192 KiB
# by lowering every power-of-two tile of 32 to 128 rows, 64 to 256 columns and 32 to 128 K steps):
# the gathered rows of a [BLOCK_M, BLOCK_K] step (128 x 64 asked 1712128 bits of 1572864), the
# gate/up pair's [BLOCK_M, BLOCK_N] accumulators and SwiGLU, and the down GEMM's accumulator.
UB_BYTES_PER_ROW_STEP_ELEMENT = 48
UB_BYTES_PER_PAIR_ELEMENT = 24
UB_BYTES_PER_DOWN_ELEMENT = 6
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


# --- sizes and outputs ---------------------------------------------------------------------------------

def _dims(hidden: torch.Tensor, w13: torch.Tensor, topk_ids: torch.Tensor) -> tuple[int, int, int, int, int]:
    """``(T, H, E, I, k)``."""
    (tokens, h), (experts, two_i) = hidden.shape, w13.shape[:2]
    return tokens, h, experts, two_i // 2, topk_ids.shape[1]


def output(hidden: torch.Tensor, *_: Any) -> torch.Tensor:
    return torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)


def training_outputs(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, *_: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, gate, up)``: the output and each slot's pre-activations ``[T * k, I]``."""
    tokens, _, _, inter, topk = _dims(hidden, w13, topk_ids)
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


def _forward(args: tuple, config: Config, out: torch.Tensor, gate: torch.Tensor | None = None,
             up: torch.Tensor | None = None) -> tuple[list[KernelCall], tuple]:
    hidden, w13, w2, topk_weights, topk_ids = args[:5]
    if w13.dtype == FP8:
        return _fp8_forward(args, config, out)
    tokens, h, experts, inter, topk = _dims(hidden, w13, topk_ids)
    calls, align, scratch = grouped.align_calls(topk_ids, topk_weights, experts, config["BLOCK_M"])
    act = torch.empty(tokens * topk, inter, dtype=hidden.dtype, device=hidden.device)
    y = torch.empty(tokens * topk, h, dtype=hidden.dtype, device=hidden.device)
    calls += [
        grouped.grouped_call(align, hidden, w13, act, up_config(config), gather=True, scatter=True, a_div=topk,
                             swiglu=True, pre=gate, pre3=up, input_precision=PRECISION),
        grouped.grouped_call(align, act, w2, y, down_config(config), gather=True, scatter=True, scale=True,
                             input_precision=PRECISION),
        sum_call(y, topk_ids, out, experts),
    ]
    return calls, (*scratch, *align.scratch(), act, y)


def _largest_tile(block: int, size: int) -> int:
    """The largest power of two up to ``block`` (and 128) dividing 128 and ``size`` (16 at least:
    ``size`` is a multiple of 16)."""
    block = min(block, SCALE_BLOCK)
    while block > 16 and size % block:
        block //= 2
    return block


def fp8_tiles(config: Config, inter: int) -> Config:
    """``config`` as the fp8 GEMMs run it: column tiles and K steps within one scale block (at most
    128), the gate/up column tile dividing I too (each tile of the up half, whose rows start at I
    in w13, in one block)."""
    return {**config, "BLOCK_N": _largest_tile(config["BLOCK_N"], inter), "BLOCK_K": min(config["BLOCK_K"], 128),
            "DOWN_BLOCK_N": min(config["DOWN_BLOCK_N"], 128), "DOWN_BLOCK_K": min(config["DOWN_BLOCK_K"], 128)}


def _quantize(x: torch.Tensor) -> tuple[list[KernelCall], torch.Tensor, torch.Tensor]:
    """The launch quantising ``x`` per 1x128 (``quantize_fp8(x, 'block')``), and its outputs."""
    found = Q.plan((x, "block"), Q.heuristic(*x.shape, "block"), None)
    return found.calls, *found.result


def _fp8_forward(args: tuple, config: Config, out: torch.Tensor) -> tuple[list[KernelCall], tuple]:
    """fp8 weights: ``hidden`` quantised per 1x128 (one launch), the gate/up GEMM on fp8 tiles with
    the SwiGLU output quantised per 1x128 in its epilogue (where its column tile is 128: I a
    multiple of 128; else stored in float32 and quantised by a launch of its own), the down GEMM
    on fp8 tiles, the sum over choices. The weight tiles load by pointers: through a tensor
    descriptor over every expert's rows (K-major, made on the device) the fp8 path is no faster
    than the bf16 one (docs/performance.md, fused_moe)."""
    hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale = args
    tokens, h, experts, inter, topk = _dims(hidden, w13, topk_ids)
    config = fp8_tiles(config, inter)
    calls, align, scratch = grouped.align_calls(topk_ids, topk_weights, experts, config["BLOCK_M"])
    quantized, hidden_q, hidden_scale = _quantize(hidden)
    calls += quantized
    slots = tokens * topk
    up_tiles = up_config(config)
    gate_up = {"gather": True, "scatter": True, "a_div": topk, "swiglu": True,
               "block_scales": (hidden_scale, w13_scale)}
    if config["BLOCK_N"] == SCALE_BLOCK:
        act = torch.empty(slots, inter, dtype=FP8, device=hidden.device)
        act_scale = torch.empty(cdiv(inter, SCALE_BLOCK), slots, dtype=torch.float32, device=hidden.device).T
        calls.append(grouped.grouped_call(align, hidden_q, w13, act, up_tiles, c_scale=act_scale, **gate_up))
        staged: tuple = ()
    else:
        act32 = torch.empty(slots, inter, dtype=torch.float32, device=hidden.device)
        calls.append(grouped.grouped_call(align, hidden_q, w13, act32, up_tiles, **gate_up))
        quantized, act, act_scale = _quantize(act32)
        calls += quantized
        staged = (act32,)
    y = torch.empty(slots, h, dtype=hidden.dtype, device=hidden.device)
    calls += [
        grouped.grouped_call(align, act, w2, y, down_config(config), gather=True, scatter=True, scale=True,
                             block_scales=(act_scale, w2_scale)),
        sum_call(y, topk_ids, out, experts),
    ]
    return calls, (*scratch, *align.scratch(), hidden_q, hidden_scale, *staged, act, act_scale, y)


def _empty(args: tuple) -> bool:
    """Nothing to compute: no tokens, no choices, or no hidden or intermediate features."""
    tokens, h, _, inter, topk = _dims(args[0], args[1], args[4])
    return tokens * topk * h * inter == 0


def _zeros_call(out: torch.Tensor, topk_ids: torch.Tensor) -> list[KernelCall]:
    """``out`` zeroed by the sum over choices when there is nothing to sum (no K, no choices)."""
    if out.numel() == 0:
        return []
    none = torch.full((out.shape[0], 0), -1, dtype=topk_ids.dtype, device=topk_ids.device)
    return [sum_call(out, none, out, 0)]


def plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    """The alignment, the gate/up and the down grouped GEMMs, the sum over choices (module doc)."""
    out = output(*args)
    if _empty(args):
        return LaunchPlan(calls=_zeros_call(out, args[4]), result=out)
    calls, scratch = _forward(args, config, out)
    return LaunchPlan(calls=calls, result=out, scratch=scratch)


def _forward_only(w13: torch.Tensor) -> None:
    """fp8 weights take no backward (nor the forward that saves its pre-activations)."""
    if w13.dtype == FP8:
        raise InvalidInputError("fused_moe", "w13", "is float8_e4m3fn and a gradient is asked for",
                                "bfloat16, float16 or float32 weights: with fp8 weights fused_moe is forward only")


def training_plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    """:func:`plan`, the pre-activations stored too (the custom op's body: autograd saves them)."""
    out, gate, up = training_outputs(*args)
    _forward_only(args[1])
    if _empty(args):
        return LaunchPlan(calls=_zeros_call(out, args[4]), result=(out, gate, up))
    calls, scratch = _forward(args, config, out, gate, up)
    return LaunchPlan(calls=calls, result=(out, gate, up), scratch=scratch)


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


def backward_plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    """Launches for ``(d hidden, d w13, d w2, d topk_weights)`` from ``args = (dout, hidden, w13,
    w2, topk_weights, topk_ids, gate, up)`` (the module doc); ``config`` is the forward's."""
    dout, hidden, w13, w2, topk_weights, topk_ids, gate, up = args
    _forward_only(w13)
    dh, dw13, dw2, dtw = backward_outputs(*args)
    if _empty(args[1:]):
        return LaunchPlan(calls=[], result=(dh.zero_(), dw13.zero_(), dw2.zero_(), dtw.zero_()))
    tokens, h, experts, inter, topk = _dims(hidden, w13, topk_ids)
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
    return LaunchPlan(calls=calls, result=(dh, dw13, dw2, dtw),
                      scratch=(*scratch, *align.scratch(), dout_sorted, hidden_sorted, r, wa, dh13, dh_slots))


# --- references --------------------------------------------------------------------------------------

def expand_scale(scale: torch.Tensor, rows: int, cols: int, block_rows: int, block_cols: int) -> torch.Tensor:
    """``scale [..., ceil(rows / block_rows), ceil(cols / block_cols)]`` repeated over the elements
    each entry covers, cut to ``[..., rows, cols]``."""
    return scale.repeat_interleave(block_rows, -2)[..., :rows, :].repeat_interleave(block_cols, -1)[..., :cols]


def dequantise_weight(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``w [E, R, C] * scale`` (one scale per 128x128 block) in ``dtype``."""
    rows, cols = w.shape[1:]
    return w.to(dtype) * expand_scale(scale.to(dtype), rows, cols, SCALE_BLOCK, SCALE_BLOCK)


#: float32 elements per slice of experts :func:`dequantised` takes at once (1 GiB)
DEQUANTISE_SLICE = 1 << 28


def dequantised(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`dequantise_weight` into a 16-bit ``dtype`` through float32 a slice of experts at a
    time (DeepSeek-V3's 256 experts of w13 whole would be 28 GiB of float32)."""
    out = torch.empty(w.shape, dtype=dtype, device=w.device)
    step = max(1, DEQUANTISE_SLICE // max(1, w[0].numel()))
    for e in range(0, w.shape[0], step):
        out[e:e + step] = dequantise_weight(w[e:e + step], scale[e:e + step], torch.float32)
    return out


def quantised(x: torch.Tensor, cast: Any = None) -> torch.Tensor:
    """``x [M, K]`` quantised per 1x128 as the kernels do (float32 arithmetic, ``quantize_fp8``'s
    rule) and dequantised again, in float64. ``cast``: the float32 -> float8_e4m3fn conversion
    (default torch's, which the GPU's matches; tests pass the interpreter's)."""
    x = x.float()
    q, scale = Q.quantize_fp8_reference(x, "block")
    full = expand_scale(scale, *x.shape, 1, SCALE_BLOCK)
    if cast is not None:
        q = cast((x / full).clamp(-Q.FP8_MAX, Q.FP8_MAX))
    return q.double() * full.double()


def _per_expert(hidden: torch.Tensor, w13: torch.Tensor, topk_ids: torch.Tensor, x: torch.Tensor | None = None):
    """``(e, slots, tokens, x, g, u)`` per expert with routed slots, in float32 (or wider); ``x``:
    the hidden rows to multiply (default ``hidden`` in that dtype)."""
    compute = torch.promote_types(hidden.dtype, torch.float32) if x is None else x.dtype
    _, _, experts, inter, topk = _dims(hidden, w13, topk_ids)
    flat = topk_ids.reshape(-1)
    h = hidden.to(compute) if x is None else x
    for e in range(experts):
        slots = (flat == e).nonzero().squeeze(1)
        if slots.numel():
            x = h[slots // topk]
            w = w13[e].to(compute)
            yield e, slots, slots // topk, x, x @ w[:inter].T, x @ w[inter:].T


def fused_moe_training_reference(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                                 topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                                 w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, gate, up)``: a loop over the experts in float32 (or wider), in ``hidden``'s dtype;
    the pre-activations of dropped slots are zero. fp8 weights: dequantised (float64), the
    activations as they are (:func:`fused_moe_fp8_reference` quantises them as the kernels do)."""
    if w13_scale is not None:
        w13, w2 = dequantise_weight(w13, w13_scale, torch.float64), dequantise_weight(w2, w2_scale, torch.float64)
    tokens, h, _, inter, topk = _dims(hidden, w13, topk_ids)
    compute = torch.promote_types(torch.promote_types(hidden.dtype, w13.dtype), torch.float32)
    out = torch.zeros(tokens, h, dtype=compute, device=hidden.device)
    gate = torch.zeros(tokens * topk, inter, dtype=compute, device=hidden.device)
    up = torch.zeros_like(gate)
    weights = topk_weights.reshape(-1).to(compute)
    for e, slots, token, _, g, u in _per_expert(hidden, w13, topk_ids, hidden.to(compute)):
        y = (torch.nn.functional.silu(g) * u) @ w2[e].to(compute).T
        out.index_add_(0, token, y * weights[slots, None])
        gate[slots], up[slots] = g, u
    return out.to(hidden.dtype), gate.to(hidden.dtype), up.to(hidden.dtype)


def fused_moe_fp8_reference(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                            topk_ids: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor,
                            cast: Any = None) -> torch.Tensor:
    """What the fp8 kernels compute, in float64: the weights dequantised, ``hidden`` and each
    slot's SwiGLU output (rounded to float32 first) quantised per 1x128 and dequantised
    (:func:`quantised`, ``cast`` its conversion), the loop over the experts; in ``hidden``'s dtype."""
    w13, w2 = dequantise_weight(w13, w13_scale, torch.float64), dequantise_weight(w2, w2_scale, torch.float64)
    out = torch.zeros(hidden.shape, dtype=torch.float64, device=hidden.device)
    weights = topk_weights.reshape(-1).double()
    for e, slots, token, _, g, u in _per_expert(hidden, w13, topk_ids, quantised(hidden, cast)):
        act = quantised(torch.nn.functional.silu(g) * u, cast)
        out.index_add_(0, token, (act @ w2[e].T) * weights[slots, None])
    return out.to(hidden.dtype)


def fused_moe_reference(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
                        w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts' output, by a loop over the experts in float32 (or wider), in ``hidden``'s
    dtype; with fp8 weights what the kernels compute (:func:`fused_moe_fp8_reference`)."""
    if w13_scale is not None:
        return fused_moe_fp8_reference(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    return fused_moe_training_reference(hidden, w13, w2, topk_weights, topk_ids)[0]


def fused_moe_backward_reference(dout: torch.Tensor, hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                                 topk_weights: torch.Tensor, topk_ids: torch.Tensor, gate: torch.Tensor,
                                 up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward formulas of the module doc by a loop over the experts, in float32 (or wider),
    from the saved pre-activations (as the kernel takes them); in the inputs' dtypes."""
    compute = torch.promote_types(hidden.dtype, torch.float32)
    d = dout.to(compute)
    dh = torch.zeros(hidden.shape, dtype=compute, device=hidden.device)
    dw13 = torch.zeros(w13.shape, dtype=compute, device=hidden.device)
    dw2 = torch.zeros(w2.shape, dtype=compute, device=hidden.device)
    dtw = torch.zeros(topk_weights.numel(), dtype=compute, device=hidden.device)
    weights = topk_weights.reshape(-1).to(compute)
    for e, slots, token, x, _, _ in _per_expert(hidden, w13, topk_ids):
        g, u = gate[slots].to(compute), up[slots].to(compute)
        s = torch.sigmoid(g)
        a = g * s * u
        w = weights[slots, None]
        r = d[token] @ w2[e].to(compute)
        dtw[slots] = (r * a).sum(1)
        dw2[e] = (w * d[token]).T @ a
        da = w * r
        dh13 = torch.cat([da * u * s * (1 + g * (1 - s)), da * g * s], dim=1)
        dw13[e] = dh13.T @ x
        dh.index_add_(0, token, dh13 @ w13[e].to(compute))
    return (dh.to(hidden.dtype), dw13.to(w13.dtype), dw2.to(w2.dtype),
            dtw.view(topk_weights.shape).to(topk_weights.dtype))


# --- config --------------------------------------------------------------------------------------------

def _config(block_m: int, up: tuple[int, int, int, int], down: tuple[int, int, int, int]) -> Config:
    return {"BLOCK_M": block_m, "BLOCK_N": up[0], "BLOCK_K": up[1], "GROUP_M": 8, "num_warps": up[2],
            "num_stages": up[3], "DOWN_BLOCK_N": down[0], "DOWN_BLOCK_K": down[1], "DOWN_WARPS": down[2],
            "DOWN_STAGES": down[3]}


def _up_bytes(c: Config, element_size: int = SPACE_ELEMENT_BYTES) -> int:
    return c["num_stages"] * (c["BLOCK_M"] + 2 * c["BLOCK_N"]) * c["BLOCK_K"] * element_size


def _down_bytes(c: Config, element_size: int = SPACE_ELEMENT_BYTES) -> int:
    return c["DOWN_STAGES"] * (c["BLOCK_M"] + c["DOWN_BLOCK_N"]) * c["DOWN_BLOCK_K"] * element_size


def heuristic(tokens: int, experts: int, topk: int, element_size: int, profile: DeviceProfile | None,
              fp8: bool = False) -> Config:
    """By the mean rows per expert ``tokens * k / E``, from sweeps of Mixtral-8x7B's and
    DeepSeek-V3's experts (bf16, ``.ci/bench_fused_moe.py``; docs/performance.md, fused_moe):

    - up to DECODE_ROWS (decoding): 16-row blocks, 64-column tiles, K steps of 128 (256, 3 stages,
      at one row per expert or fewer): the weights of each activated expert stream through many
      programs once, near the copy bandwidth; 128-column tiles are slower;
    - up to 64: 64-row blocks, 64 columns per gate/up accumulator, 128 for the down GEMM;
    - more: 128-row blocks, 128 x 128 per gate/up accumulator (8 warps, 3 stages), 128 x 256 down
      tiles in 4 stages; 4 gate/up stages with 128-column down tiles, 64-column gate/up tiles, K
      steps of 128 and 64-row blocks are slower.

    float32 halves the K step; pipelining stages are dropped while the tiles overflow the device's
    shared memory (no bound where the profile knows none).

    fp8 weights (``fp8``; ``element_size`` that of the fp8 tiles, 1): 128-column gate/up tiles (the
    SwiGLU output's 1x128 groups quantised in the epilogue) and K steps of 128 (one scale block),
    16-row blocks when decoding, 64 up to 64 rows per expert, else 128 rows with 8 warps and 4
    stages for both GEMMs (:func:`fp8_tiles` then fits the tiles to I); 64-row blocks or 64-column
    gate/up tiles, which spill no registers where 128 x 128 spills 24 bytes, are slower. From
    FP8_WIDE_ROWS rows per expert the gate/up GEMM runs 16 warps and 3 stages (128 registers, no
    spill); with fewer rows per expert, and for the down GEMM, 16 warps are slower."""
    rows = tokens * topk / max(experts, 1)
    if fp8:
        if rows <= DECODE_ROWS:
            config = _config(16, (128, 128, 4, 4), (64, 128, 4, 4))
        elif rows <= 64:
            config = _config(64, (128, 128, 4, 4), (128, 128, 4, 4))
        elif rows < FP8_WIDE_ROWS:
            config = _config(128, (128, 128, 8, 4), (128, 128, 8, 4))
        else:
            config = _config(128, (128, 128, 16, 3), (128, 128, 8, 4))
    elif rows <= 1:
        config = _config(16, (64, 256, 4, 3), (64, 256, 4, 3))
    elif rows <= DECODE_ROWS:
        config = _config(16, (64, 128, 4, 4), (64, 128, 4, 4))
    elif rows <= 64:
        config = _config(64, (64, 64, 4, 4), (128, 64, 4, 4))
    else:
        config = _config(128, (128, 64, 8, 3), (256, 64, 8, 4))
    if element_size > 2:
        config["BLOCK_K"] //= 2
        config["DOWN_BLOCK_K"] //= 2
    limit = profile.shared_memory_per_program if profile is not None else 0
    while limit and config["num_stages"] > 2 and _up_bytes(config, element_size) > limit:
        config["num_stages"] -= 1
    while limit and config["DOWN_STAGES"] > 2 and _down_bytes(config, element_size) > limit:
        config["DOWN_STAGES"] -= 1
    if on_npu(profile) and limit:
        fit_unified_buffer(config, limit)
    return config


def overflows_unified_buffer(c: Config, buffer: int) -> bool:
    """Whether grouped_gemm_kernel's tiles of ``c`` ask more of an npu's unified buffer (``buffer``
    bytes) than it has (the ``UB_BYTES_PER_*`` measures)."""
    return (c["BLOCK_M"] * max(c["BLOCK_K"], c["DOWN_BLOCK_K"]) * UB_BYTES_PER_ROW_STEP_ELEMENT > buffer
            or c["BLOCK_M"] * c["BLOCK_N"] * UB_BYTES_PER_PAIR_ELEMENT > buffer
            or c["BLOCK_M"] * c["DOWN_BLOCK_N"] * UB_BYTES_PER_DOWN_ELEMENT > buffer)


def fit_unified_buffer(c: Config, buffer: int) -> Config:
    """``c``'s tiles narrowed in place until they fit an npu's unified buffer: row blocks to 64,
    then each GEMM's K step, then its column tile (to 32), then the row block to 16. The prefill's
    128-row blocks (128 x 128 gate/up, 128 x 256 down, K steps of 64) take 64-row ones on the
    Ascend 910B; decoding's 16-row blocks fit as they are."""
    def halve(key: str, floor: int, too_big) -> None:
        while c[key] > floor and too_big():
            c[key] //= 2

    halve("BLOCK_M", 64, lambda: overflows_unified_buffer(c, buffer))
    halve("BLOCK_K", 32, lambda: c["BLOCK_M"] * c["BLOCK_K"] * UB_BYTES_PER_ROW_STEP_ELEMENT > buffer)
    halve("DOWN_BLOCK_K", 32, lambda: c["BLOCK_M"] * c["DOWN_BLOCK_K"] * UB_BYTES_PER_ROW_STEP_ELEMENT > buffer)
    halve("BLOCK_N", 32, lambda: c["BLOCK_M"] * c["BLOCK_N"] * UB_BYTES_PER_PAIR_ELEMENT > buffer)
    halve("DOWN_BLOCK_N", 32, lambda: c["BLOCK_M"] * c["DOWN_BLOCK_N"] * UB_BYTES_PER_DOWN_ELEMENT > buffer)
    halve("BLOCK_M", 16, lambda: overflows_unified_buffer(c, buffer))
    return c


def default_config(sig: Signature, profile: DeviceProfile) -> Config:
    tokens = sig.tensor("hidden").shape[0]  # rounded up to a power of two
    w13 = sig.tensor("w13")
    fp8 = w13.dtype == FP8
    return heuristic(tokens, w13.shape[0], sig.tensor("topk_ids").shape[1], 1 if fp8 else sig.dtype.itemsize,
                     profile, fp8)


def space(profile: DeviceProfile) -> SearchSpace:
    """The row block (shared by both GEMMs: the alignment pads to it), each GEMM's column tile, K
    step, warps and pipelining depth, the grouped program order; the pipelined tiles within the
    shared memory a program may use on the device (no bound where the profile knows none)."""
    shared = profile.shared_memory_per_program
    fits = [
        Constraint(f"num_stages * (BLOCK_M + 2 * BLOCK_N) * BLOCK_K * {SPACE_ELEMENT_BYTES} bytes <= {shared} "
                   f"(the gate/up GEMM's tiles fit in shared memory)", lambda c: _up_bytes(c) <= shared),
        Constraint(f"DOWN_STAGES * (BLOCK_M + DOWN_BLOCK_N) * DOWN_BLOCK_K * {SPACE_ELEMENT_BYTES} bytes <= "
                   f"{shared} (the down GEMM's tiles fit in shared memory)", lambda c: _down_bytes(c) <= shared),
    ] if shared else []
    if on_npu(profile) and shared:
        fits = [*fits, Constraint(
            f"BLOCK_M * max(BLOCK_K, DOWN_BLOCK_K) * {UB_BYTES_PER_ROW_STEP_ELEMENT}, BLOCK_M * BLOCK_N * "
            f"{UB_BYTES_PER_PAIR_ELEMENT} and BLOCK_M * DOWN_BLOCK_N * {UB_BYTES_PER_DOWN_ELEMENT} bytes <= {shared} "
            "(the tiles fit the unified buffer)", lambda c: not overflows_unified_buffer(c, shared))]
    return SearchSpace(
        [
            PowerOfTwo("BLOCK_M", 16, 128),
            PowerOfTwo("BLOCK_N", 32, 256),
            PowerOfTwo("BLOCK_K", 32, 256),
            Choice("GROUP_M", (1, 8)),
            num_warps(4, 8, 16),
            num_stages(2, 3, 4, 5),
            PowerOfTwo("DOWN_BLOCK_N", 32, 256),
            PowerOfTwo("DOWN_BLOCK_K", 32, 256),
            Choice("DOWN_WARPS", (4, 8)),
            Choice("DOWN_STAGES", (2, 3, 4, 5)),
        ],
        [
            *fits,
            Constraint("2 * BLOCK_M * BLOCK_N / (32 * num_warps) <= 128 (both float32 accumulators fit in registers)",
                       lambda c: 2 * c["BLOCK_M"] * c["BLOCK_N"] / (32 * c["num_warps"]) <= 128),
            Constraint("BLOCK_M * DOWN_BLOCK_N / (32 * DOWN_WARPS) <= 128 (the down accumulator fits in registers)",
                       lambda c: c["BLOCK_M"] * c["DOWN_BLOCK_N"] / (32 * c["DOWN_WARPS"]) <= 128),
        ],
    )


# --- declaration ---------------------------------------------------------------------------------------

def _values_known(t: torch.Tensor) -> bool:
    """Whether ``t`` holds data to read (not a meta tensor, nor torch.compile's fake)."""
    return t.device.type != "meta" and not is_fake(t)


def _check_fp8(op: Op, args: dict[str, Any]) -> None:
    """fp8 weights come with their block scales, both fp8 or neither, H and I multiples of 16, and
    no gradient asked for; scales come only with fp8 weights."""
    hidden, w13, w2 = args["hidden"], args["w13"], args["w2"]
    for weight, name in (("w13", "w13_scale"), ("w2", "w2_scale")):
        fp8, scale = args[weight].dtype == FP8, args[name]
        if scale is not None and not fp8:
            raise InvalidInputError(op.name, name, f"is given but {weight} has dtype {args[weight].dtype}",
                                    f"{name} only with float8_e4m3fn {weight} (its 128x128 block scales)",
                                    f"Pass {name}=None, or {weight} quantised to float8_e4m3fn.")
        if fp8 and scale is None:
            raise InvalidInputError(op.name, name, f"is None but {weight} is float8_e4m3fn",
                                    f"{name}: float32 [E, ceil(rows/128), ceil(cols/128)], the scale of each 128x128 "
                                    f"block of {weight}", "Pass the weights' block scales (DeepSeek-V3's layout).")
    if (w13.dtype == FP8) != (w2.dtype == FP8):
        named = "w2" if w13.dtype == FP8 else "w13"
        raise InvalidInputError(op.name, named, f"has dtype {args[named].dtype} while "
                                f"{'w13' if named == 'w2' else 'w2'} is float8_e4m3fn",
                                "w13 and w2 both float8_e4m3fn (with their scales) or both in hidden's dtype")
    if w13.dtype != FP8:
        return
    (_, h), (experts, two_i) = hidden.shape, w13.shape[:2]
    if h % FP8_MULTIPLE or two_i % (2 * FP8_MULTIPLE):
        raise InvalidInputError(op.name, "w13", f"has shape {tuple(w13.shape)}",
                                f"H and I multiples of {FP8_MULTIPLE} with fp8 weights ([E, 2I, H]: 16-byte fp8 rows)")
    op.expect_shape("w13_scale", args["w13_scale"], (experts, cdiv(two_i, SCALE_BLOCK), cdiv(h, SCALE_BLOCK)),
                    "[E, ceil(2I/128), ceil(H/128)]: one scale per 128x128 block of w13 [E, 2I, H]")
    op.expect_shape("w2_scale", args["w2_scale"], (experts, cdiv(h, SCALE_BLOCK), cdiv(two_i // 2, SCALE_BLOCK)),
                    "[E, ceil(H/128), ceil(I/128)]: one scale per 128x128 block of w2 [E, H, I]")
    for name in ("hidden", "w13", "w2", "topk_weights"):
        if args[name].requires_grad:
            raise InvalidInputError(op.name, name, "requires a gradient, and the weights are float8_e4m3fn",
                                    "inputs that require no gradient: with fp8 weights fused_moe is forward only "
                                    "(the backward takes bfloat16, float16 or float32 weights)",
                                    "Run it under torch.no_grad(), or detach the inputs.")


def check(op: Op, args: dict[str, Any]) -> None:
    hidden, w13, w2, topk_weights, topk_ids = (args[n] for n in ("hidden", "w13", "w2", "topk_weights", "topk_ids"))
    for name, w in (("w13", w13), ("w2", w2)):
        if w.dtype != hidden.dtype and w.dtype != FP8:
            raise InvalidInputError(op.name, name, f"has dtype {w.dtype} but hidden has {hidden.dtype}",
                                    f"{name} with the dtype of hidden, or float8_e4m3fn with {name}_scale")
    tokens, h = hidden.shape
    experts, two_i = w13.shape[:2]
    if experts == 0:
        raise InvalidInputError(op.name, "w13", f"has no experts (shape {tuple(w13.shape)})", "[E, 2I, H], E >= 1")
    if two_i % 2:
        raise InvalidInputError(op.name, "w13", f"has an odd number of rows per expert (shape {tuple(w13.shape)})",
                                "[E, 2I, H]: each expert's I gate rows, then its I up rows")
    op.expect_shape("w13", w13, (experts, two_i, h), "[E, 2I, H], H being hidden's last dimension")
    op.expect_shape("w2", w2, (experts, h, two_i // 2), "[E, H, I], E and I those of w13 [E, 2I, H]")
    _check_fp8(op, args)
    if topk_ids.shape[0] != tokens:
        raise InvalidInputError(op.name, "topk_ids", f"has shape {tuple(topk_ids.shape)}",
                                f"topk_ids of shape [{tokens}, k] (one row per token of hidden)")
    op.expect_shape("topk_weights", topk_weights, tuple(topk_ids.shape),
                    "[T, k], the shape of topk_ids: one weight per choice")
    if topk_ids.numel() and _values_known(topk_ids):
        low, high = (int(v) for v in torch.aminmax(topk_ids))
        if low < -1 or high >= experts:
            raise InvalidInputError(op.name, "topk_ids", f"holds ids from {low} to {high}",
                                    f"expert ids in [0, {experts}) or -1 (a dropped choice)")


def example(sizes: dict[str, int], dtype: torch.dtype, device: torch.device, generator: torch.Generator) -> tuple:
    """Random ``hidden [tokens, hidden]``, expert weights scaled like trained layers (variance
    1/fan-in; drawn on the device from a seed of ``generator``: a large layer holds billions),
    and a softmax top-k routing of random logits. ``fp8`` 1: the weights quantised to
    float8_e4m3fn with 128x128 block scales (DeepSeek-V3's checkpoints)."""
    tokens, h, inter, experts, topk = (sizes[n] for n in ("tokens", "hidden", "inter", "experts", "topk"))
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    on_device = None if device.type == "meta" else torch.Generator(device=device).manual_seed(seed)

    def draw(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=on_device, device=device, dtype=dtype) * scale).to(dtype)

    logits = torch.randn(tokens, experts, generator=on_device, device=device)
    topk_weights, topk_ids = torch.softmax(logits, dim=-1).topk(topk, dim=-1)
    w13, w2 = draw(experts, 2 * inter, h, scale=h**-0.5), draw(experts, h, inter, scale=inter**-0.5)
    w13_scale = w2_scale = None
    if sizes.get("fp8", 0):
        (w13, w13_scale), (w2, w2_scale) = quantise_weight(w13), quantise_weight(w2)
    return (draw(tokens, h), w13, w2, topk_weights / topk_weights.sum(-1, keepdim=True), topk_ids.to(torch.int32),
            w13_scale, w2_scale)


def quantise_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w_fp8, scale)`` of ``w [E, R, C]``: float8_e4m3fn with one float32 scale per 128x128 block
    (``amax / 448``, 1 for a block of zeros), as DeepSeek-V3's checkpoints hold the experts."""
    experts, rows, cols = w.shape
    if w.device.type == "meta":
        return (torch.empty(w.shape, dtype=FP8, device=w.device),
                torch.empty(experts, cdiv(rows, SCALE_BLOCK), cdiv(cols, SCALE_BLOCK), device=w.device))
    found = [Q.quantize_fp8_reference(w[e], "block_128x128") for e in range(experts)]
    return torch.stack([q for q, _ in found]), torch.stack([s for _, s in found])


def cost(args: tuple, mode: str = "fwd") -> tuple[int, int]:
    """Forward: the activated experts' weights read once, ``hidden``, the routing read, the output
    written; per routed choice ``2 * (2I * H + H * I)`` flops (the gate/up and the down GEMMs).
    Backward: ``dout``, ``hidden``, the activated weights and the routing read, every expert's
    weight gradient and ``d hidden`` written; twice the forward's flops (an input and a weight
    gradient per GEMM; the pre-activations are saved)."""
    hidden, w13, w2, topk_weights, topk_ids = args[:5]
    tokens, h, experts, inter, topk = _dims(hidden, w13, topk_ids)
    routed_ids = topk_ids[(topk_ids >= 0) & (topk_ids < experts)]
    routed, active = routed_ids.numel(), int(torch.unique(routed_ids).numel())
    per_expert = (w13[0].numel() + w2[0].numel()) * w13.element_size() + sum(
        4 * s[0].numel() for s in args[5:7] if s is not None)
    routing = topk_ids.numel() * (topk_ids.element_size() + topk_weights.element_size())
    activations = 2 * hidden.numel() * hidden.element_size()
    flops = 2 * routed * 3 * inter * h
    if mode == "bwd":
        return active * per_expert + experts * per_expert + routing + 2 * activations, 2 * flops
    return active * per_expert + routing + activations, flops


def dequantised_inputs(args: tuple) -> tuple:
    """fp8 weights with their block scales as 16-bit weights in ``hidden``'s dtype (the scales
    dropped); 16-bit weights as they are."""
    hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale = (*args, None, None)[:7]
    if w13.dtype == FP8:
        w13 = dequantised(w13, w13_scale, hidden.dtype)
    if w2.dtype == FP8:
        w2 = dequantised(w2, w2_scale, hidden.dtype)
    return hidden, w13, w2, topk_weights, topk_ids


# --- the composite a model runs: the baseline, and the vendor candidate (dlblas_kernels.vendor) --------

#: rows per expert group that torch._grouped_mm's sm_90 kernel takes (its TMA copies 16-byte rows)
GROUPED_MM_ROWS = 16


def _grouped_mm_takes(hidden: torch.Tensor, w13: torch.Tensor) -> bool:
    """Whether this torch and device run ``torch._grouped_mm`` on these operands: bfloat16 on an
    sm_90 GPU, the hidden and intermediate sizes multiples of 8 (16-byte rows)."""
    if not hasattr(torch, "_grouped_mm") or hidden.device.type != "cuda" or hidden.dtype != torch.bfloat16:
        return False
    inter = w13.shape[1] // 2
    return torch.cuda.get_device_capability(hidden.device) == (9, 0) and hidden.shape[1] % 8 == 0 and inter % 8 == 0


def _expert_matmul(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, ends: list[int] | None) -> torch.Tensor:
    """``x[rows of e] @ w[e].T`` for each expert's rows (ending at ``offsets``): one grouped GEMM, or
    (``ends`` on the host) a loop of GEMMs, written in place, or concatenated where autograd
    records them (rows past the last group zero)."""
    if ends is None:
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offsets)
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        bounds = zip([0, *ends[:-1]], ends)
        pieces = [x[start:end] @ w[e].T for e, (start, end) in enumerate(bounds) if end > start]
        return torch.cat([*pieces, x.new_zeros(x.shape[0] - ends[-1], w.shape[1])])
    out = x.new_empty(x.shape[0], w.shape[1])
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            torch.matmul(x[start:end], w[e].T, out=out[start:end])
        start = end
    return out


def composite(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The grouped-GEMM composite: the (token, choice) slots sorted by expert, each expert's rows
    padded to :data:`GROUPED_MM_ROWS`, the tokens gathered, ``torch._grouped_mm`` for w13 (where this
    torch and device take it; else a loop over the experts with ``torch.matmul``), SwiGLU, the
    same for w2, then the weighted rows summed into their tokens with ``index_add_`` (float32).
    fp8 weights: dequantised to ``hidden``'s dtype first (each 128x128 block times its scale),
    what a user without an fp8 kernel runs; the activations stay unquantised."""
    if w13_scale is not None or w2_scale is not None:
        hidden, w13, w2, topk_weights, topk_ids = dequantised_inputs(
            (hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale))
    experts, two_i, _ = w13.shape
    topk = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()
    routed = (flat >= 0) & (flat < experts)
    # Dropped slots sort last, under a key no expert has.
    order = torch.argsort(torch.where(routed, flat, experts), stable=True)
    counts = torch.bincount(flat[routed], minlength=experts)
    padded = (counts + GROUPED_MM_ROWS - 1) // GROUPED_MM_ROWS * GROUPED_MM_ROWS
    offsets = torch.cumsum(padded, 0)
    starts = offsets - padded
    first = torch.cumsum(counts, 0) - counts  # each expert's first slot in sorted order
    expert_of = flat[order].clamp(0, experts - 1)
    place = starts[expert_of] + torch.arange(order.numel(), device=flat.device) - first[expert_of]
    rows = flat.numel() + GROUPED_MM_ROWS * experts  # the padded total's bound: no host sync
    # Dropped slots go to the last row, past every group: no GEMM reads it.
    kept = routed[order]
    place = torch.where(kept, place, rows - 1)
    x = hidden.new_zeros(rows, hidden.shape[1])
    x[place] = hidden[order // topk]
    grouped = _grouped_mm_takes(hidden, w13)
    ends = None if grouped else offsets.tolist()
    gate, up = _expert_matmul(x, w13, offsets.to(torch.int32), ends).chunk(2, dim=-1)
    y = _expert_matmul(F.silu(gate) * up, w2, offsets.to(torch.int32), ends)
    # Rows past the groups are never written: where, not a zero weight, keeps them out.
    weighted = torch.where(kept[:, None], y[place].float() * topk_weights.reshape(-1)[order, None].float(), 0.0)
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    out.index_add_(0, order // topk, weighted)
    return out.to(hidden.dtype)


def _sixteen_bit_path() -> Any:
    """The ``bf16`` baseline: this library's own choice for the same layer with 16-bit weights
    (the fp8 weights dequantised once, untimed), what fp8 weights are measured against."""
    from dlcore.api import get_op

    def sixteen_bit_path(*args: torch.Tensor) -> torch.Tensor:
        """get_op's fused_moe on 16-bit weights (the fp8 ones dequantised, once per shape)."""
        return get_op("fused_moe", args)(*args)  # an in-process hit: microseconds against milliseconds

    sixteen_bit_path.prepare = dequantised_inputs  # type: ignore[attr-defined]
    return sixteen_bit_path


OP = Op(
    name="fused_moe",
    args=(
        TensorArg("hidden", DTYPES, min_rank=2, max_rank=2, layouts=ANY_LAYOUT, bucket="rows"),
        TensorArg("w13", DTYPES + FP8_DTYPES, min_rank=3, max_rank=3, layouts=ANY_LAYOUT),
        TensorArg("w2", DTYPES + FP8_DTYPES, min_rank=3, max_rank=3, layouts=ANY_LAYOUT),
        TensorArg("topk_weights", DTYPES, min_rank=2, max_rank=2, layouts=ANY_LAYOUT, bucket="rows"),
        TensorArg("topk_ids", ID_DTYPES, min_rank=2, max_rank=2, layouts=ANY_LAYOUT, bucket="rows",
                  differentiable=False),
        TensorArg("w13_scale", (torch.float32,), layouts=ANY_LAYOUT, differentiable=False, optional=True),
        TensorArg("w2_scale", (torch.float32,), layouts=ANY_LAYOUT, differentiable=False, optional=True),
    ),
    reference=fused_moe_reference,
    doc="sum_j topk_weights[t, j] * w2[e] @ (silu(g) * u), g, u = split(w13[e] @ hidden[t]), e = topk_ids[t, j] "
        "(-1: dropped); w13 [E, 2I, H], w2 [E, H, I]",
    check=check,
    example=example,
    example_sizes={"tokens": 37, "hidden": 64, "inter": 96, "experts": 6, "topk": 2, "fp8": 0},
    example_paths={"decode": {"tokens": 1, "hidden": 256, "inter": 128, "experts": 8},
                   "prefill": {"tokens": 300, "hidden": 256, "inter": 128, "experts": 8},
                   "fp8": {"tokens": 300, "hidden": 256, "inter": 128, "experts": 8, "fp8": 1},
                   "fp8 decode": {"tokens": 5, "hidden": 256, "inter": 144, "experts": 8, "fp8": 1}},
    cost=cost,
    baselines={"torch": lambda: composite, "bf16": _sixteen_bit_path},
)


def _gradients(backward, saved, grads, needs) -> dict:
    dh, dw13, dw2, dtw = backward(grads[0], saved.hidden, saved.w13, saved.w2, saved.topk_weights, saved.topk_ids,
                                  saved.gate, saved.up)
    return {"hidden": dh, "w13": dw13, "w2": dw2, "topk_weights": dtw}


#: the kernels only fp8 weights launch: fp8 tl.dot and stores
FP8_KERNELS = (*(k.__name__ for k in grouped.FP8_KERNELS), "block_quantize_kernel")

KERNEL = define_kernel(
    OP, plan,
    kernels=(*grouped.KERNELS, *grouped.FP8_KERNELS, Q.block_quantize_kernel, moe_sum_kernel,
             moe_swiglu_backward_kernel),
    results=output,
    default_config=default_config,
    space=space,
    backward=Backward(_gradients, saved=("hidden", "w13", "w2", "topk_weights", "topk_ids", "gate", "up"),
                      plan=backward_plan, reference=fused_moe_backward_reference, results=backward_outputs,
                      residuals=Residuals(("gate", "up"), training_plan, training_outputs,
                                          fused_moe_training_reference)),
    doc="slots sorted by expert on the device, grouped gate/up GEMM with SwiGLU, grouped down GEMM with the "
        "routing weight as row scale, deterministic sum over choices; backward from the saved pre-activations; "
        "fp8 weights with 128x128 block scales (forward), the activations quantised per 1x128",
    limits=(
        LoweringLimit("cuda", FP8_KERNELS, "ttir",
                      "fp8 (e4m3) tl.dot and stores need sm_89 or later: Triton 3.6 rejects float8e4nv on sm_80",
                      archs=("80",)),
        LoweringLimit("npu", FP8_KERNELS, "ttir",
                      "float8_e4m3fn, which the Ascend 910B has no type for: upstream Triton 3.6, making the npu "
                      "pipeline's ttir at its sm_80 target, rejects it ('type fp8e4nv not supported in this "
                      "architecture')"),
    ),
)
fused_moe = KERNEL.function
dlcore_ops, dlcore_implementations = KERNEL.dlcore_ops, KERNEL.dlcore_implementations
