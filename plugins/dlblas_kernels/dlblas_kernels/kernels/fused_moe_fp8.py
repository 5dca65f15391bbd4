"""fused_moe with fp8 weights (DeepSeek-V3's checkpoints, forward only): the weights' 128x128 block
scales (quantised, dequantised, expanded), the activations quantised per 1x128 as the kernels do,
the tiles fitted to the scale blocks, the forward's launches on fp8 tiles, and the checks of fp8
inputs. The layout and the rule are :mod:`dlblas_kernels.kernels.fused_moe`'s module doc.
"""

from __future__ import annotations

from typing import Any

import torch

from dlblas_kernels.blocks import grouped, grouped_tma
from dlblas_kernels.blocks.moe_launches import copy_engine_gemms, dims, down_config, sum_call, up_config
from dlblas_kernels.kernels import quantize_fp8 as Q
from dlcore.api import Config, DeviceProfile, InvalidInputError, KernelCall, Op, cdiv

FP8 = torch.float8_e4m3fn
#: the weights' other dtype: fp8 with DeepSeek-V3's 128x128 block scales (w13_scale, w2_scale)
FP8_DTYPES = (FP8,)
#: the rows and columns of a weight one block scale covers, and the columns of an activation's
SCALE_BLOCK = Q.GROUP
#: H and I must be multiples of this with fp8 weights (16-byte fp8 rows; a 16-column tile of the
#: up half then lies in one of w13's scale blocks)
FP8_MULTIPLE = 16


def expand_scale(scale: torch.Tensor, rows: int, cols: int, block_rows: int, block_cols: int) -> torch.Tensor:
    """``scale [..., ceil(rows / block_rows), ceil(cols / block_cols)]`` repeated over the elements
    each entry covers, cut to ``[..., rows, cols]``."""
    return scale.repeat_interleave(block_rows, -2)[..., :rows, :].repeat_interleave(block_cols, -1)[..., :cols]


def dequantise_weight(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``w [E, R, C] * scale`` (one scale per 128x128 block) in ``dtype``."""
    rows, cols = w.shape[1:]
    return w.to(dtype) * expand_scale(scale.to(dtype), rows, cols, SCALE_BLOCK, SCALE_BLOCK)


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



def quantise_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w_fp8, scale)`` of ``w [E, R, C]``: float8_e4m3fn with one float32 scale per 128x128 block
    (``amax / 448``, 1 for a block of zeros), as DeepSeek-V3's checkpoints hold the experts."""
    experts, rows, cols = w.shape
    if w.device.type == "meta":
        return (torch.empty(w.shape, dtype=FP8, device=w.device),
                torch.empty(experts, cdiv(rows, SCALE_BLOCK), cdiv(cols, SCALE_BLOCK), device=w.device))
    found = [Q.quantize_fp8_reference(w[e], "block_128x128") for e in range(experts)]
    return torch.stack([q for q, _ in found]), torch.stack([s for _, s in found])



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


def fp8_forward_calls(args: tuple, config: Config, out: torch.Tensor,
                      profile: DeviceProfile | None = None) -> tuple[list[KernelCall], tuple]:
    """fp8 weights: ``hidden`` quantised per 1x128 (one launch), the gate/up GEMM on fp8 tiles with
    the SwiGLU output quantised per 1x128 in its epilogue (where its column tile is 128: I a
    multiple of 128; else stored in float32 and quantised by a launch of its own), the down GEMM
    on fp8 tiles, the sum over choices. The weight tiles load by pointers: through a tensor
    descriptor over every expert's rows (K-major, made on the device) with the rows gathered by
    pointer the fp8 path is no faster than the bf16 one (docs/performance.md, fused_moe). A config
    with ``TMA`` 1 takes the copy-engine path where it fits (:func:`_copy_engine_calls`)."""
    hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale = args
    tokens, h, experts, inter, topk = dims(hidden, w13, topk_ids)
    config = fp8_tiles(config, inter)
    calls, align, scratch = grouped.align_calls(topk_ids, topk_weights, experts, config["BLOCK_M"])
    quantized, hidden_q, hidden_scale = _quantize(hidden)
    calls += quantized
    if config.get("TMA", 0) and grouped_tma.fits(profile, w13, w2, config):
        gemms, held = _copy_engine_calls(args, config, out, align, hidden_q, hidden_scale, profile)
        return calls + gemms, (*scratch, *align.scratch(), hidden_q, hidden_scale, *held)
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


def _copy_engine_calls(args: tuple, config: Config, out: torch.Tensor, align: grouped.Alignment,
                       hidden_q: torch.Tensor, hidden_scale: torch.Tensor,
                       profile: DeviceProfile) -> tuple[list[KernelCall], tuple]:
    """Both GEMMs through the copy engine (:mod:`dlblas_kernels.blocks.grouped_tma`): the quantised
    rows and their scales gathered into sorted order, the gate/up GEMM storing its SwiGLU output
    quantised per 1x128 by place, the down GEMM storing each slot's row; the sum over choices."""
    hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale = args
    tokens, h, experts, inter, topk = dims(hidden, w13, topk_ids)
    new = lambda *shape, dtype=FP8: torch.empty(shape, dtype=dtype, device=hidden.device)  # noqa: E731
    rows, rows_scale = new(align.places, h), new(align.places, cdiv(h, SCALE_BLOCK), dtype=torch.float32)
    act, act_scale = new(align.places, inter), new(align.places, inter // SCALE_BLOCK, dtype=torch.float32)
    y = new(tokens * topk, h, dtype=hidden.dtype)
    calls = [
        grouped.gather_call(align, hidden_q, rows, topk),
        grouped.gather_call(align, hidden_scale, rows_scale, topk),
        *copy_engine_gemms(align, rows, w13, act, w2, y, config, profile, up_scales=(rows_scale, w13_scale),
                           act_scale=act_scale, down_scales=(act_scale, w2_scale)),
        sum_call(y, topk_ids, out, experts),
    ]
    return calls, (rows, rows_scale, act, act_scale, y)


def check_fp8(op: Op, args: dict[str, Any]) -> None:
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
