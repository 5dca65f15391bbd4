"""The prefill ffn's pair tile: one product over w1's and w3's tiles side by side.

:func:`swiglu_pair_tma_kernel` is the sm_90 form of the GEMM block's SwiGLU epilogue
(:mod:`dlblas_kernels.blocks.gemm`) for ``ffn``'s prefill: persistent, w1's and w3's ``[BLOCK_N, BLOCK_K]``
tiles loaded as the two planes of one tensor descriptor, so each K step is ONE ``[BLOCK_M, 2 *
BLOCK_N]`` product, whose halves the epilogue takes as gate and up (each scaled by the row's
``rstd`` under ``ROW_SCALE``) through SwiGLU. Weights too far apart (or at one address) for one
descriptor's two planes take a two-accumulator loop in the same kernel (:data:`PAIR_STRIDE_LIMIT`).
The device's last, partial wave of tiles is split over K (:func:`pair_tail`), its slices summed
through a float32 workspace and per-tile counters (:func:`swiglu_pair_calls`).

It shares the GEMM block's tile order (:func:`~dlblas_kernels.blocks.gemm.grouped_tile`), epilogue
(:func:`~dlblas_kernels.blocks.gemm.epilogue`), copy-engine checks (:func:`~dlblas_kernels.blocks.gemm.takes_tma`)
and shared-memory fitting (:func:`~dlblas_kernels.blocks.gemm.fit_stages`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dlblas_kernels.blocks.gemm import (
    GROUP_M,
    Epilogue,
    epilogue,
    fit_stages,
    grouped_tile,
    shared_memory_bytes,
    takes_tma,
    transposed,
)
from dlcore.api import Config, DeviceProfile, KernelCall, cdiv, ensure_allocator

#: the copy engine's strides stay below 2**40 bytes: w1 and w3 farther apart than that (or at one
#: address) cannot be one descriptor's two planes, and :func:`swiglu_pair_tma_kernel` takes its
#: two-accumulator loop instead
PAIR_STRIDE_LIMIT = 2**40
#: the least K steps a slice of :func:`swiglu_pair_tma_kernel`'s split last wave takes (:func:`pair_tail`)
MIN_TAIL_STEPS = 4


@triton.jit
def _pair_store(acc, swapped, off_m, off_n, M, N, scale_ptr, stride_sm, c_desc, gate_desc, up_desc,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STORE_PRE: tl.constexpr, ROW_SCALE: tl.constexpr):
    """The pair tile's epilogue: ``acc [BLOCK_M, 2 * BLOCK_N]`` split into its planes' halves (w1's
    first unless ``swapped``), the row scale (ROW_SCALE) and SwiGLU, ``c`` (and the pre-activations)
    stored."""
    low, high = acc.reshape(BLOCK_M, 2, BLOCK_N).permute(0, 2, 1).split()
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    out, z, z3 = epilogue(tl.where(swapped, high, low), tl.where(swapped, low, high), low, offs_m, offs_n,
                          M, N, scale_ptr, scale_ptr, scale_ptr, stride_sm, 0, False, ROW_SCALE, False, None,
                          True, False)
    c_desc.store([off_m, off_n], out.to(c_desc.dtype))
    if STORE_PRE:
        gate_desc.store([off_m, off_n], z.to(gate_desc.dtype))
        up_desc.store([off_m, off_n], z3.to(up_desc.dtype))


@triton.jit
def swiglu_pair_tma_kernel(
    a_ptr, w1_ptr, w3_ptr, c_ptr, gate_ptr, up_ptr, scale_ptr, part_ptr, count_ptr,
    M, N, K, w3_offset, stride_a, stride_w, stride_cm, stride_sm, tail_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, FLATTEN: tl.constexpr, STORE_PRE: tl.constexpr, PAIR_LIMIT: tl.constexpr,
    TAIL: tl.constexpr = False, ROW_SCALE: tl.constexpr = True,
):
    """Persistent SwiGLU GEMM: ``c = silu(scale * (a @ w1.T)) * (scale * (a @ w3.T))`` (without
    ROW_SCALE, ``scale`` 1: ``scale_ptr`` is not read), ``a [M, K]``
    and the weights ``[N, K]`` (w3 from ``w3_offset`` elements past ``w3_ptr``) with unit K
    strides, ``c`` (and the pre-activations ``gate``, ``up`` under STORE_PRE) ``[M, N]`` row-major.

    The two weights are read as the two planes of one ``[2, N, K]`` tensor descriptor (plane
    stride: the distance from w1 to w3, taken on the device, so a replayed launch with other
    tensors stays right; w3 below w1 swaps the planes): each K step loads one ``[2, BLOCK_N,
    BLOCK_K]`` tile, seen as ``[2 * BLOCK_N, BLOCK_K]``, and runs ONE ``[BLOCK_M, 2 * BLOCK_N]``
    product, the matmul's loop (one wgmma per step, fed from the copy's buffer); the epilogue
    splits the accumulator's halves (in registers: each thread holds a gate column and its up
    column) and applies the row scale and SwiGLU. Weights the descriptor cannot span (at one
    address, or PAIR_LIMIT bytes apart or more) take the two-accumulator loop of
    :func:`gemm_tma_kernel`.

    TAIL (:func:`pair_tail`): the tiles of the last, partial wave are split over K instead, among
    ``tail_split`` programs each, so that wave's programs all work: each slice's float32 product goes
    to ``part`` (``[tail tiles, tail_split, BLOCK_M, 2 * BLOCK_N]``), and the program whose atomic
    increment of the tile's counter (``count``, int32, zero at launch: the caller zeroes it in the
    launch before) finds every other slice done adds them up and runs the epilogue."""
    elem: tl.constexpr = w1_ptr.dtype.element_ty.primitive_bitwidth // 8
    w3_ptr = w3_ptr + w3_offset
    apart = w3_ptr.to(tl.int64) - w1_ptr.to(tl.int64)  # bytes
    swapped = apart < 0
    span = tl.where(swapped, -apart, apart)
    joint = (span > 0) & (span < PAIR_LIMIT) & (span % 16 == 0)

    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_a, 1], block_shape=[BLOCK_M, BLOCK_K])
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[stride_cm, 1], block_shape=[BLOCK_M, BLOCK_N])
    gate_desc = c_desc  # unused without STORE_PRE
    up_desc = c_desc
    if STORE_PRE:
        gate_desc = tl.make_tensor_descriptor(gate_ptr, shape=[M, N], strides=[stride_cm, 1],
                                              block_shape=[BLOCK_M, BLOCK_N])
        up_desc = tl.make_tensor_descriptor(up_ptr, shape=[M, N], strides=[stride_cm, 1],
                                            block_shape=[BLOCK_M, BLOCK_N])
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    if joint:
        # plane 0 at the lower address
        base = tl.where(swapped, w3_ptr, w1_ptr)
        w_desc = tl.make_tensor_descriptor(base, shape=[2, N, K], strides=[span // elem, stride_w, 1],
                                           block_shape=[2, BLOCK_N, BLOCK_K])
        num_tiles = num_pid_m * num_pid_n
        full = num_tiles
        if TAIL:
            full = num_tiles - num_tiles % tl.num_programs(0)
        for tile in tl.range(tl.program_id(0), full, tl.num_programs(0), flatten=FLATTEN):
            pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
            for ki in range(k_steps):
                a = a_desc.load([off_m, ki * BLOCK_K])
                w = w_desc.load([0, off_n, ki * BLOCK_K]).reshape(2 * BLOCK_N, BLOCK_K)
                acc = tl.dot(a, w.T, acc, input_precision=INPUT_PRECISION)
            _pair_store(acc, swapped, off_m, off_n, M, N, scale_ptr, stride_sm, c_desc, gate_desc, up_desc,
                        BLOCK_M, BLOCK_N, STORE_PRE, ROW_SCALE)
        if TAIL:
            slot = tl.program_id(0) // tail_split
            part = tl.program_id(0) % tail_split
            tile = full + slot
            if tile < num_tiles:
                pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
                off_m = pid_m * BLOCK_M
                off_n = pid_n * BLOCK_N
                steps = tl.cdiv(k_steps, tail_split)
                acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
                for ki in range(part * steps, tl.minimum(part * steps + steps, k_steps)):
                    a = a_desc.load([off_m, ki * BLOCK_K])
                    w = w_desc.load([0, off_n, ki * BLOCK_K]).reshape(2 * BLOCK_N, BLOCK_K)
                    acc = tl.dot(a, w.T, acc, input_precision=INPUT_PRECISION)
                size: tl.constexpr = BLOCK_M * 2 * BLOCK_N
                inside = tl.arange(0, BLOCK_M)[:, None] * (2 * BLOCK_N) + tl.arange(0, 2 * BLOCK_N)[None, :]
                slices = part_ptr + slot.to(tl.int64) * tail_split * size
                tl.store(slices + part * size + inside, acc, cache_modifier=".cg")
                tl.debug_barrier()  # every thread's slice stored before the counter says so
                done = tl.atomic_add(count_ptr + slot, 1, sem="acq_rel", scope="gpu")
                if done == tail_split - 1:  # the last slice of the tile: add the others, finish it
                    for other in range(tail_split):
                        if other != part:
                            acc += tl.load(slices + other * size + inside, cache_modifier=".cg")
                    _pair_store(acc, swapped, off_m, off_n, M, N, scale_ptr, stride_sm, c_desc, gate_desc,
                                up_desc, BLOCK_M, BLOCK_N, STORE_PRE, ROW_SCALE)
    else:
        w1_desc = tl.make_tensor_descriptor(w1_ptr, shape=[N, K], strides=[stride_w, 1],
                                            block_shape=[BLOCK_N, BLOCK_K])
        w3_desc = tl.make_tensor_descriptor(w3_ptr, shape=[N, K], strides=[stride_w, 1],
                                            block_shape=[BLOCK_N, BLOCK_K])
        for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0), flatten=False):
            pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for ki in tl.range(k_steps, num_stages=2):
                a = a_desc.load([off_m, ki * BLOCK_K])
                acc = tl.dot(a, w1_desc.load([off_n, ki * BLOCK_K]).T, acc, input_precision=INPUT_PRECISION)
                acc3 = tl.dot(a, w3_desc.load([off_n, ki * BLOCK_K]).T, acc3, input_precision=INPUT_PRECISION)
            offs_m = off_m + tl.arange(0, BLOCK_M)
            offs_n = off_n + tl.arange(0, BLOCK_N)
            out, z, z3 = epilogue(acc, acc3, acc, offs_m, offs_n, M, N, scale_ptr, scale_ptr, scale_ptr, stride_sm, 0,
                                  False, ROW_SCALE, False, None, True, False)
            c_desc.store([off_m, off_n], out.to(c_desc.dtype))
            if STORE_PRE:
                gate_desc.store([off_m, off_n], z.to(gate_desc.dtype))
                up_desc.store([off_m, off_n], z3.to(up_desc.dtype))


KERNELS = (swiglu_pair_tma_kernel,)


def takes_swiglu_pair(profile: DeviceProfile, a: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, out: torch.Tensor,
                      gate: torch.Tensor | None = None, up: torch.Tensor | None = None) -> bool:
    """Whether :func:`swiglu_pair_calls` can run here: :func:`takes_tma` for ``a`` row-major, ``w1``
    and ``w3`` in nn.Linear layout (unit K stride) with one stride, the pre-activations as ``out``."""
    return (takes_tma(profile, a, w1.T, out, w3.T, Epilogue(pre=gate, pre3=up)) and transposed(a) is False
            and a.stride(1) == 1 and w1.stride() == w3.stride() and w1.stride(1) == 1)


def pair_tail(m: int, n: int, k: int, config: Config, profile: DeviceProfile) -> int:
    """K slices per tile of :func:`swiglu_pair_tma_kernel`'s last, partial wave (1: none). Where the
    tiles fill at least one wave of the device's cores and the last leaves at least half of them idle,
    that wave's ``R`` tiles are split ``cores // R`` ways over K (each slice at least MIN_TAIL_STEPS
    K steps), so its cores all work: LLaMA-3-8B's 448 tiles of 64 x 64 per weight at 128 tokens are
    3.4 waves of 132 SMs, 52 tiles in halves in the fourth. ``config['TAIL']`` 0 turns
    it off."""
    cores = profile.cores
    tiles = cdiv(m, config["BLOCK_M"]) * cdiv(n, config["BLOCK_N"])
    if not config.get("TAIL", 1) or cores <= 0 or tiles <= cores or tiles % cores == 0:
        return 1
    split = min(cores // (tiles % cores), cdiv(k, config["BLOCK_K"]) // MIN_TAIL_STEPS)
    return split if split >= 2 else 1


def swiglu_pair_calls(a: torch.Tensor, w1: torch.Tensor | None, w3: torch.Tensor | None, rstd: torch.Tensor | None,
                      out: torch.Tensor, config: Config, profile: DeviceProfile, *, w13: torch.Tensor | None = None,
                      gate: torch.Tensor | None = None, up: torch.Tensor | None = None
                      ) -> tuple[list[KernelCall], tuple]:
    """:func:`swiglu_calls` through :func:`swiglu_pair_tma_kernel` (where :func:`takes_swiglu_pair`):
    ``config``'s ``BLOCK_N`` columns of each weight per tile, one ``[BLOCK_M, 2 * BLOCK_N]``
    product; ``BLOCK_M``, ``BLOCK_K``, ``GROUP_M``, ``num_warps``, ``num_stages`` (dropped to fit
    beside the staged output tile), ``FLATTEN`` as :func:`gemm_calls`. ``w13`` is passed whole, w3
    as its rows from N on (an argument at offset zero: the launch replays). Returns the launch and
    its scratch: with a split last wave (:func:`pair_tail`) the slices' float32 products and the
    tiles' int32 counters, ``(part, count)``, ``count`` to be zeroed by the caller in an earlier
    launch on the stream (ffn's row kernel does: :func:`dlblas_kernels.kernels.ffn.rms_scale_call`)."""
    n = out.shape[1]
    if w13 is not None:
        w1 = w3 = w13
        w3_offset = n * w13.stride(0)
    else:
        w3_offset = 0
    if (gate is None) != (up is None):
        raise ValueError("gate and up are stored together or not at all")
    m, k = a.shape
    block_m, block_n = config["BLOCK_M"], config["BLOCK_N"]
    ensure_allocator()

    def footprint(c: Config) -> int:
        return shared_memory_bytes(c, a.element_size(), second_operand=True, out_element_size=out.element_size())

    stages = fit_stages({**config, "TMA": 1, "SPLIT_K": 1}, profile.shared_memory_per_program, footprint)["num_stages"]
    pre, pre3 = (out, out) if gate is None else (gate, up)
    tiles = cdiv(m, block_m) * cdiv(n, block_n)
    programs = min(tiles, profile.cores)
    split = pair_tail(m, n, k, config, profile)
    scratch: tuple = ()
    part = count = out
    if split > 1:
        part = torch.empty(tiles % programs * split * block_m * 2 * block_n, dtype=torch.float32, device=out.device)
        count = torch.empty(tiles % programs, dtype=torch.int32, device=out.device)
        scratch = (part, count)
    scale = out if rstd is None else rstd
    return [KernelCall(swiglu_pair_tma_kernel, (programs,), (
        a, w1, w3, out, pre, pre3, scale, part, count, m, n, k, w3_offset, a.stride(0), w1.stride(0), out.stride(0),
        0 if rstd is None else rstd.stride(0), split,
    ), {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": config["BLOCK_K"], "GROUP_M": config.get("GROUP_M", GROUP_M),
        "INPUT_PRECISION": "ieee", "FLATTEN": bool(config.get("FLATTEN", 1)), "STORE_PRE": gate is not None,
        "PAIR_LIMIT": PAIR_STRIDE_LIMIT, "TAIL": split > 1, "ROW_SCALE": rstd is not None,
        "num_warps": config["num_warps"], "num_stages": stages})
    ], scratch
