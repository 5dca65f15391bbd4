"""fp8_gemm's block-scaled product on Hopper with the promotion overlapped: a Gluon kernel.

Under DeepSeek-V3's block scales each 128-deep product must leave the tensor cores to be scaled
(``acc += (a_blk @ b_blk) * a_scale * b_scale``). In Triton proper (:mod:`dlblas_kernels.blocks.gemm`'s
``BLOCK_SCALED`` loop) the scaled sum is no ``wgmma`` accumulator, so Triton 3.6 and 3.9 wait for
every product before scaling it (``wgmma.wait_group 0`` in each K step): the tensor cores idle
while the FMAs run. Gluon places the waits by hand. Here a program issues block ``k + 1``'s
product before it waits for block ``k``'s (``wgmma.wait_group 1``) and promotes it while ``k + 1``
runs: two product registers ``t0``, ``t1`` beside the float32 accumulator (three 64-register tiles a
thread, 8 warps, 128 x 128 tiles).

Three things the compilers do that the loop's shape answers:

- a product in flight across a loop's back edge is copied to the loop-carried registers there,
  and ptxas then serialises every ``wgmma`` (its C7514 warning): the K loop takes ``UNROLL`` blocks
  a step, straight-line, and waits for the last of them before the back edge (``UNROLL - 1`` of
  every ``UNROLL`` promotions overlap a product; 8, the default, holds 238 registers a thread with
  Triton 3.6 and 255 with an 8-byte spill with 3.9);
- LLVM sinks the promotion's FMAs below the next product's issue (they are pure arithmetic), which
  keeps every product register live at once and spills: a ``warpgroup_mma_wait`` taking the
  accumulator pins them;
- the slot a product read is refilled only after every warpgroup's product finished with it (a CTA
  barrier after the wait: a wait covers its own warpgroup only).

Persistent: ``min(tiles, cores)`` programs walk the tiles in the grouped order; the copy of a
program's block ``g + STAGES`` is issued when block ``g``'s product is done, across tile boundaries,
and a tile's output leaves through a staged copy-engine store that overlaps the next tile. The
descriptors are made in the kernel (global scratch from Triton's allocator), as the GEMM block's.

The operands as fp8_gemm takes them: ``a [M, K]`` and ``b [N, K]`` row-major, copy-engine aligned
(:func:`takes`), ``a_scale [M, ceil(K/128)]`` and ``b_scale [ceil(N/128), ceil(K/128)]`` of any
strides; M, N, K need not be multiples of 128 (the copy engine fills past the edges with zeros and
clips the store).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from dlblas_kernels.blocks.fp8_scales import BLOCK
from dlblas_kernels.blocks.gemm import grouped_tile, tma_aligned
from dlcore.api import Config, DeviceProfile, KernelCall, cdiv, ensure_allocator

# the copy engine's entry points and the CTA barrier were renamed after Triton 3.6
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

#: the architecture whose ``wgmma`` this kernel issues (Blackwell has none)
ARCH = "sm_90"
#: the tile: 128 x 128 outputs, 128-deep K steps (one scale block), two warpgroups
TILE = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8}


@gluon.jit
def _load(a_desc, b_desc, a_s, b_s, ready, g, nk, start, step, num_tiles, num_m, num_n, STAGES: gl.constexpr,
          GROUP_M: gl.constexpr):
    """The copy of this program's block ``g`` (its tile ``g // nk``, K block ``g % nk``) into slot ``g % STAGES``."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    tile = start + (g // nk) * step
    pid_m, pid_n = grouped_tile(tile, num_m, num_n, GROUP_M)
    k = (g % nk) * BLOCK_K
    s = g % STAGES
    pred = tile < num_tiles
    mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
    _tma_load(a_desc, [pid_m * BLOCK_M, k], ready.index(s), a_s.index(s), pred=pred)
    _tma_load(b_desc, [pid_n * BLOCK_N, k], ready.index(s), b_s.index(s), pred=pred)


@gluon.jit
def _issue(a_s, b_s, ready, g, t, STAGES: gl.constexpr):
    """Block ``g``'s product, issued once its copy landed, into ``t``'s registers (their old value unused)."""
    s = g % STAGES
    mbarrier.wait(ready.index(s), (g // STAGES) & 1)
    return warpgroup_mma(a_s.index(s), b_s.index(s).permute((1, 0)), t, use_acc=False, is_async=True)


@gluon.jit
def _retire(t, acc, g, kb, sa_ptrs, m_mask, stride_ask, sb_ptr, stride_bsk, a_desc, b_desc, a_s, b_s, ready, nk,
            start, step, num_tiles, num_m, num_n, OUTSTANDING: gl.constexpr, STAGES: gl.constexpr,
            GROUP_M: gl.constexpr):
    """Wait for block ``g``'s product (K block ``kb``; ``OUTSTANDING`` later ones run on), refill its slot
    with block ``g + STAGES``, add the product times its scales to ``acc``."""
    sa = gl.load(sa_ptrs + kb * stride_ask, mask=m_mask, other=0.0)
    sb = gl.load(sb_ptr + kb * stride_bsk)
    t = warpgroup_mma_wait(num_outstanding=OUTSTANDING, deps=(t,))
    _cta_barrier()  # both warpgroups' products have read the slot
    _load(a_desc, b_desc, a_s, b_s, ready, g + STAGES, nk, start, step, num_tiles, num_m, num_n, STAGES, GROUP_M)
    acc += t * (sa[:, None] * sb)
    # pins the FMAs above (see the module doc): no product leaves with it, OUTSTANDING stay in flight
    acc = warpgroup_mma_wait(num_outstanding=OUTSTANDING, deps=(acc,))
    return t, acc


@gluon.jit
def _retire_pair(t0, t1, acc, g0, kb, u: gl.constexpr, sa_ptrs, m_mask, stride_ask, sb_ptr, stride_bsk, a_desc,
                 b_desc, a_s, b_s, ready, nk, start, step, num_tiles, num_m, num_n, STAGES: gl.constexpr,
                 GROUP_M: gl.constexpr):
    """Step ``u`` of an unrolled K step: issue block ``kb + u + 1`` into the free product registers, then
    retire block ``kb + u`` from the others (``t0`` for even ``u``)."""
    if u % 2 == 0:
        t1 = _issue(a_s, b_s, ready, g0 + kb + u + 1, t1, STAGES)
        t0, acc = _retire(t0, acc, g0 + kb + u, kb + u, sa_ptrs, m_mask, stride_ask, sb_ptr, stride_bsk, a_desc,
                          b_desc, a_s, b_s, ready, nk, start, step, num_tiles, num_m, num_n, 1, STAGES, GROUP_M)
    else:
        t0 = _issue(a_s, b_s, ready, g0 + kb + u + 1, t0, STAGES)
        t1, acc = _retire(t1, acc, g0 + kb + u, kb + u, sa_ptrs, m_mask, stride_ask, sb_ptr, stride_bsk, a_desc,
                          b_desc, a_s, b_s, ready, nk, start, step, num_tiles, num_m, num_n, 1, STAGES, GROUP_M)
    return t0, t1, acc


@gluon.jit
def block_scaled_wgmma_kernel(a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, M, N, K, stride_am, stride_bn, stride_cm,
                              stride_asm, stride_ask, stride_bsn, stride_bsk,
                              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                              STAGES: gl.constexpr, GROUP_M: gl.constexpr, UNROLL: gl.constexpr,
                              num_warps: gl.constexpr):
    """``c = (a * a_scale) @ (b * b_scale).T`` in float32, stored in ``c``'s dtype (see the module doc)."""
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], a_ptr.dtype.element_ty)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], b_ptr.dtype.element_ty)
    c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], c_ptr.dtype.element_ty)
    a_desc = tma.make_tensor_descriptor(a_ptr, [M, K], [stride_am, 1], [BLOCK_M, BLOCK_K], a_layout)
    b_desc = tma.make_tensor_descriptor(b_ptr, [N, K], [stride_bn, 1], [BLOCK_N, BLOCK_K], b_layout)
    c_desc = tma.make_tensor_descriptor(c_ptr, [M, N], [stride_cm, 1], [BLOCK_M, BLOCK_N], c_layout)
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, 32])

    start = gl.program_id(0)
    step = gl.num_programs(0)
    num_m = gl.cdiv(M, BLOCK_M)
    num_n = gl.cdiv(N, BLOCK_N)
    num_tiles = num_m * num_n
    nk = gl.cdiv(K, BLOCK_K)

    a_s = gl.allocate_shared_memory(a_ptr.dtype.element_ty, [STAGES, BLOCK_M, BLOCK_K], a_layout)
    b_s = gl.allocate_shared_memory(b_ptr.dtype.element_ty, [STAGES, BLOCK_N, BLOCK_K], b_layout)
    c_s = gl.allocate_shared_memory(c_ptr.dtype.element_ty, [BLOCK_M, BLOCK_N], c_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
    for s in gl.static_range(STAGES):
        _load(a_desc, b_desc, a_s, b_s, ready, s, nk, start, step, num_tiles, num_m, num_n, STAGES, GROUP_M)

    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)
    t0 = zero
    t1 = zero
    g0 = 0  # this program's blocks before the tile's
    for tile in range(start, num_tiles, step):
        pid_m, pid_n = grouped_tile(tile, num_m, num_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_layout))
        m_mask = offs_m < M
        sa_ptrs = as_ptr + offs_m.to(gl.int64) * stride_asm
        sb_ptr = bs_ptr + pid_n * stride_bsn
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)
        for j in range(nk // UNROLL):
            kb = j * UNROLL
            t0 = _issue(a_s, b_s, ready, g0 + kb, t0, STAGES)
            for u in gl.static_range(UNROLL - 1):
                t0, t1, acc = _retire_pair(t0, t1, acc, g0, kb, u, sa_ptrs, m_mask, stride_ask, sb_ptr, stride_bsk,
                                           a_desc, b_desc, a_s, b_s, ready, nk, start, step, num_tiles, num_m, num_n,
                                           STAGES, GROUP_M)
            last = kb + UNROLL - 1
            if (UNROLL - 1) % 2 == 0:
                t0, acc = _retire(t0, acc, g0 + last, last, sa_ptrs, m_mask, stride_ask, sb_ptr, stride_bsk, a_desc,
                                  b_desc, a_s, b_s, ready, nk, start, step, num_tiles, num_m, num_n, 0, STAGES, GROUP_M)
            else:
                t1, acc = _retire(t1, acc, g0 + last, last, sa_ptrs, m_mask, stride_ask, sb_ptr, stride_bsk, a_desc,
                                  b_desc, a_s, b_s, ready, nk, start, step, num_tiles, num_m, num_n, 0, STAGES, GROUP_M)
        for kb in range(nk - nk % UNROLL, nk):  # the K blocks past the last whole step, one at a time
            t0 = _issue(a_s, b_s, ready, g0 + kb, t0, STAGES)
            t0, acc = _retire(t0, acc, g0 + kb, kb, sa_ptrs, m_mask, stride_ask, sb_ptr, stride_bsk, a_desc, b_desc,
                              a_s, b_s, ready, nk, start, step, num_tiles, num_m, num_n, 0, STAGES, GROUP_M)
        tma.store_wait(0)  # the last tile's store has read c_s
        _cta_barrier()
        c_s.store(acc.to(c_ptr.dtype.element_ty))
        fence_async_shared()
        _cta_barrier()
        _tma_store(c_desc, [pid_m * BLOCK_M, pid_n * BLOCK_N], c_s)
        g0 += nk
    tma.store_wait(0)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))


KERNELS = (block_scaled_wgmma_kernel,)


def takes(profile: DeviceProfile, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> bool:
    """Whether this kernel runs ``c = a @ b.T`` here: compiled (Gluon has no interpreter), on Hopper with
    its core count, ``a``, ``b`` and ``c`` row-major with copy-engine alignment."""
    return (not triton.knobs.runtime.interpret and profile.arch == ARCH and profile.cores > 0
            and tma_aligned(a) and tma_aligned(b) and tma_aligned(c))


def wgmma_call(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
               config: Config, profile: DeviceProfile) -> KernelCall:
    """The launch of :func:`block_scaled_wgmma_kernel`: ``config``'s ``num_stages`` (copies in flight),
    ``UNROLL`` (K blocks a loop step, default 8) and ``GROUP_M``; the tile is :data:`TILE`'s."""
    ensure_allocator()
    (m, k), n = a.shape, b.shape[0]
    tiles = cdiv(m, BLOCK) * cdiv(n, BLOCK)
    return KernelCall(block_scaled_wgmma_kernel, (max(1, min(tiles, profile.cores)),), (
        a, b, c, a_scale, b_scale, m, n, k, a.stride(0), b.stride(0), c.stride(0), a_scale.stride(0),
        a_scale.stride(1), b_scale.stride(0), b_scale.stride(1),
    ), {**{key: TILE[key] for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}, "STAGES": config["num_stages"],
        "GROUP_M": config.get("GROUP_M", 8), "UNROLL": config.get("UNROLL", 8), "num_warps": TILE["num_warps"]})
