"""fused_moe: the routed experts of a mixture-of-experts layer, with SwiGLU experts, and its backward.

    g, u  = split(w13[e] @ hidden[t])                      w13: [E, 2I, H] (gate rows, then up rows)
    out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(g) * u),    e = topk_ids[t, j],  w2: [E, H, I]

``hidden [T, H]``; ``topk_weights [T, k]`` (float32, or the hidden dtype) and ``topk_ids [T, k]``
(int32 or int64; -1 drops a choice, which then contributes nothing). Every tensor may have any
strides. Validation reads the range of ``topk_ids`` (one read back from the device: the public function
and ``get_op``'s bound ops pay it at the first call of each exact input metadata, ``get_op`` when
it binds); the kernels treat ids outside ``[0, E)`` as dropped all the same.

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
from torch._subclasses.fake_tensor import is_fake  # torch's own test for fake tensors; no public one

from dlblas_kernels.blocks import grouped, grouped_tma
from dlblas_kernels.blocks.moe_launches import (
    backward_calls,
    backward_outputs,
    dims,
    forward_calls,
    moe_sum_kernel,
    moe_swiglu_backward_kernel,
    output,
    sum_call,
    training_outputs,
)
from dlblas_kernels.blocks.moe_tiles import fit_unified_buffer as fit_unified_buffer
from dlblas_kernels.blocks.moe_tiles import heuristic, space
from dlblas_kernels.blocks.moe_tiles import overflows_unified_buffer as overflows_unified_buffer
from dlblas_kernels.blocks.moe_tiles import tile_config as tile_config
from dlblas_kernels.kernels import quantize_fp8 as Q
from dlblas_kernels.kernels.fused_moe_fp8 import (
    FP8,
    FP8_DTYPES,
    check_fp8,
    dequantise_weight,
    fp8_forward_calls,
    quantise_weight,
)
from dlblas_kernels.kernels.fused_moe_fp8 import SCALE_BLOCK as SCALE_BLOCK
from dlblas_kernels.kernels.fused_moe_fp8 import fp8_tiles as fp8_tiles
from dlblas_kernels.kernels.fused_moe_fp8 import quantised as quantised
from dlblas_kernels.kernels.fused_moe_reference import (
    fused_moe_backward_reference,
    fused_moe_reference,
    fused_moe_training_reference,
)
from dlblas_kernels.kernels.fused_moe_reference import fused_moe_fp8_reference as fused_moe_fp8_reference
from dlcore.api import (
    Backward,
    Config,
    DeviceProfile,
    InvalidInputError,
    KernelCall,
    LaunchPlan,
    LoweringLimit,
    Op,
    Residuals,
    Signature,
    TensorArg,
    define_kernel,
)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ID_DTYPES = (torch.int32, torch.int64)
ANY_LAYOUT = ("contiguous", "rows", "strided")


# --- plans ---------------------------------------------------------------------------------------------

def _forward(args: tuple, config: Config, out: torch.Tensor, gate: torch.Tensor | None = None,
             up: torch.Tensor | None = None, profile: DeviceProfile | None = None) -> tuple[list[KernelCall], tuple]:
    if args[1].dtype == FP8:
        return fp8_forward_calls(args, config, out, profile)
    return forward_calls(args, config, out, gate, up, profile)


def _empty(args: tuple) -> bool:
    """Nothing to compute: no tokens, no choices, or no hidden or intermediate features."""
    tokens, h, _, inter, topk = dims(args[0], args[1], args[4])
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
    calls, scratch = _forward(args, config, out, profile=profile)
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


def backward_plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    """Launches for ``(d hidden, d w13, d w2, d topk_weights)`` from ``args = (dout, hidden, w13,
    w2, topk_weights, topk_ids, gate, up)`` (the module doc); ``config`` is the forward's."""
    _forward_only(args[2])
    dh, dw13, dw2, dtw = backward_outputs(*args)
    if _empty(args[1:]):
        return LaunchPlan(calls=[], result=(dh.zero_(), dw13.zero_(), dw2.zero_(), dtw.zero_()))
    calls, scratch = backward_calls(args, config, dh, dw13, dw2, dtw)
    return LaunchPlan(calls=calls, result=(dh, dw13, dw2, dtw), scratch=scratch)


# --- config --------------------------------------------------------------------------------------------

def default_config(sig: Signature, profile: DeviceProfile) -> Config:
    tokens = sig.tensor("hidden").shape[0]  # rounded up to a power of two
    w13 = sig.tensor("w13")
    fp8 = w13.dtype == FP8
    return heuristic(tokens, w13.shape[0], sig.tensor("topk_ids").shape[1], 1 if fp8 else sig.dtype.itemsize,
                     profile, fp8)


# --- declaration ---------------------------------------------------------------------------------------

def _values_known(t: torch.Tensor) -> bool:
    """Whether ``t`` holds data to read (not a meta tensor, nor torch.compile's fake)."""
    return t.device.type != "meta" and not is_fake(t)


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
    check_fp8(op, args)
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


def cost(args: tuple, mode: str = "fwd") -> tuple[int, int]:
    """Forward: the activated experts' weights read once, ``hidden``, the routing read, the output
    written; per routed choice ``2 * (2I * H + H * I)`` flops (the gate/up and the down GEMMs).
    Backward: ``dout``, ``hidden``, the activated weights and the routing read, every expert's
    weight gradient and ``d hidden`` written; twice the forward's flops (an input and a weight
    gradient per GEMM; the pre-activations are saved)."""
    hidden, w13, w2, topk_weights, topk_ids = args[:5]
    tokens, h, experts, inter, topk = dims(hidden, w13, topk_ids)
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
    kernels=(*grouped.KERNELS, *grouped.FP8_KERNELS, *grouped_tma.KERNELS, Q.block_quantize_kernel, moe_sum_kernel,
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
