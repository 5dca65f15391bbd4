"""A candidate for fp8_gemm's block-scaled kernel on Hopper, not yet run on a GPU: the Gluon kernel of
blocks/fp8_wgmma.py warp-specialised. One copy warp fills the slots; two consumer warpgroups each take 64 rows
of the 128 x 128 tile and give a slot back by an mbarrier arrival (count 2), so no CTA barrier is left in the K
loop and the two warpgroups drift apart: one promotes while the other's product runs. Each warpgroup still keeps
one product in flight while it scales the last (UNROLL blocks a step, as in fp8_wgmma).

Compiled for sm_90a with Triton 3.6 (CPU): 232 registers a consumer thread (setmaxnreg), 40 for the copy warp,
no spill; in the K loop only warpgroup barriers (``bar.sync id, 128``) before each mbarrier wait and arrival.

    python3 .ci/probe_fp8_ws.py quick|check|bench

``quick``: four checks against the float64 product, then TFLOP/s at 4096 x 7168 x 16384 beside fp8_wgmma and
cuBLASLt. ``check``: the checks of probe_fp8_wgmma.py. ``bench``: its shapes, stages 4 to 6, 4 and 8 blocks a step.
"""


from __future__ import annotations

import dataclasses
import json
import sys

import probe_fp8_wgmma as P
import torch
from dlblas_kernels import vendor
from dlblas_kernels.blocks import fp8_wgmma
from dlblas_kernels.blocks.gemm import grouped_tile
from dlblas_kernels.kernels import fp8_gemm as F
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from dlcore.api import Config, DeviceProfile, KernelCall

# Triton 3.6's names or later ones, as fp8_wgmma picks them
_tma_load, _tma_store, _cta_barrier = fp8_wgmma._tma_load, fp8_wgmma._tma_store, fp8_wgmma._cta_barrier


@gluon.jit
def _producer(a_desc, b_desc, c_desc, a_s, b_s, c_s, ready, empty, as_ptr, bs_ptr, M, N, K, stride_asm, stride_ask,
              stride_bsn, stride_bsk, STAGES: gl.constexpr, GROUP_M: gl.constexpr, UNROLL: gl.constexpr):
    """The copy warp: every block of this program's tiles into slot ``g % STAGES`` once both consumers gave it back."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    start = gl.program_id(0)
    step = gl.num_programs(0)
    num_m = gl.cdiv(M, BLOCK_M)
    num_n = gl.cdiv(N, BLOCK_N)
    nk = gl.cdiv(K, BLOCK_K)
    g = 0
    for tile in range(start, num_m * num_n, step):
        pid_m, pid_n = grouped_tile(tile, num_m, num_n, GROUP_M)
        for kb in range(nk):
            s = g % STAGES
            mbarrier.wait(empty.index(s), ((g // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            _tma_load(a_desc, [pid_m * BLOCK_M, kb * BLOCK_K], ready.index(s), a_s.index(s))
            _tma_load(b_desc, [pid_n * BLOCK_N, kb * BLOCK_K], ready.index(s), b_s.index(s))
            g += 1


@gluon.jit
def _issue(a_s, b_s, ready, g, t, HALF: gl.constexpr, STAGES: gl.constexpr):
    """Block ``g``'s product over rows ``HALF`` of the slot's a tile, issued once the copy landed."""
    HALF_M: gl.constexpr = a_s.type.shape[1] // 2
    s = g % STAGES
    mbarrier.wait(ready.index(s), (g // STAGES) & 1)
    return warpgroup_mma(a_s.index(s).slice(HALF * HALF_M, HALF_M), b_s.index(s).permute((1, 0)), t, use_acc=False,
                         is_async=True)


@gluon.jit
def _retire(t, acc, g, kb, sa_ptrs, m_mask, stride_ask, sb_ptr, stride_bsk, empty, OUTSTANDING: gl.constexpr,
            STAGES: gl.constexpr):
    """Wait for block ``g``'s product, give its slot back (one arrival of two), add it times its scales."""
    sa = gl.load(sa_ptrs + kb * stride_ask, mask=m_mask, other=0.0)
    sb = gl.load(sb_ptr + kb * stride_bsk)
    t = warpgroup_mma_wait(num_outstanding=OUTSTANDING, deps=(t,))
    mbarrier.arrive(empty.index(g % STAGES), count=1)
    acc += t * (sa[:, None] * sb)
    acc = warpgroup_mma_wait(num_outstanding=OUTSTANDING, deps=(acc,))
    return t, acc


@gluon.jit
def _consumer(a_desc, b_desc, c_desc, a_s, b_s, c_s, ready, empty, as_ptr, bs_ptr, M, N, K, stride_asm, stride_ask,
              stride_bsn, stride_bsk, STAGES: gl.constexpr, GROUP_M: gl.constexpr, UNROLL: gl.constexpr,
              HALF: gl.constexpr):
    """A consumer warpgroup: rows ``HALF * 64`` on of each tile, K blocks as fp8_wgmma's loop, its own store."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    HALF_M: gl.constexpr = BLOCK_M // 2
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
    start = gl.program_id(0)
    step = gl.num_programs(0)
    num_m = gl.cdiv(M, BLOCK_M)
    num_n = gl.cdiv(N, BLOCK_N)
    nk = gl.cdiv(K, BLOCK_K)
    zero = gl.zeros([HALF_M, BLOCK_N], gl.float32, mma_layout)
    t0 = zero
    t1 = zero
    g0 = 0
    c_half = c_s.index(HALF)
    for tile in range(start, num_m * num_n, step):
        pid_m, pid_n = grouped_tile(tile, num_m, num_n, GROUP_M)
        row0 = pid_m * BLOCK_M + HALF * HALF_M
        offs_m = row0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, mma_layout))
        m_mask = offs_m < M
        sa_ptrs = as_ptr + offs_m.to(gl.int64) * stride_asm
        sb_ptr = bs_ptr + pid_n * stride_bsn
        acc = gl.zeros([HALF_M, BLOCK_N], gl.float32, mma_layout)
        for j in range(nk // UNROLL):
            kb = j * UNROLL
            t0 = _issue(a_s, b_s, ready, g0 + kb, t0, HALF, STAGES)
            for u in gl.static_range(UNROLL - 1):
                if u % 2 == 0:
                    t1 = _issue(a_s, b_s, ready, g0 + kb + u + 1, t1, HALF, STAGES)
                    t0, acc = _retire(t0, acc, g0 + kb + u, kb + u, sa_ptrs, m_mask, stride_ask, sb_ptr, stride_bsk,
                                      empty, 1, STAGES)
                else:
                    t0 = _issue(a_s, b_s, ready, g0 + kb + u + 1, t0, HALF, STAGES)
                    t1, acc = _retire(t1, acc, g0 + kb + u, kb + u, sa_ptrs, m_mask, stride_ask, sb_ptr, stride_bsk,
                                      empty, 1, STAGES)
            last = kb + UNROLL - 1
            if (UNROLL - 1) % 2 == 0:
                t0, acc = _retire(t0, acc, g0 + last, last, sa_ptrs, m_mask, stride_ask, sb_ptr, stride_bsk, empty, 0,
                                  STAGES)
            else:
                t1, acc = _retire(t1, acc, g0 + last, last, sa_ptrs, m_mask, stride_ask, sb_ptr, stride_bsk, empty, 0,
                                  STAGES)
        for kb in range(nk - nk % UNROLL, nk):
            t0 = _issue(a_s, b_s, ready, g0 + kb, t0, HALF, STAGES)
            t0, acc = _retire(t0, acc, g0 + kb, kb, sa_ptrs, m_mask, stride_ask, sb_ptr, stride_bsk, empty, 0, STAGES)
        tma.store_wait(0)
        _cta_barrier()
        c_half.store(acc.to(c_desc.dtype))
        fence_async_shared()
        _cta_barrier()
        _tma_store(c_desc, [row0, pid_n * BLOCK_N], c_half)
        g0 += nk
    tma.store_wait(0)


@gluon.jit
def _consumer_hi(a_desc, b_desc, c_desc, a_s, b_s, c_s, ready, empty, as_ptr, bs_ptr, M, N, K, stride_asm, stride_ask,
                 stride_bsn, stride_bsk, STAGES: gl.constexpr, GROUP_M: gl.constexpr, UNROLL: gl.constexpr):
    _consumer(a_desc, b_desc, c_desc, a_s, b_s, c_s, ready, empty, as_ptr, bs_ptr, M, N, K, stride_asm, stride_ask,
              stride_bsn, stride_bsk, STAGES, GROUP_M, UNROLL, 1)


@gluon.jit
def _consumer_lo(a_desc, b_desc, c_desc, a_s, b_s, c_s, ready, empty, as_ptr, bs_ptr, M, N, K, stride_asm, stride_ask,
                 stride_bsn, stride_bsk, STAGES: gl.constexpr, GROUP_M: gl.constexpr, UNROLL: gl.constexpr):
    _consumer(a_desc, b_desc, c_desc, a_s, b_s, c_s, ready, empty, as_ptr, bs_ptr, M, N, K, stride_asm, stride_ask,
              stride_bsn, stride_bsk, STAGES, GROUP_M, UNROLL, 0)


@gluon.jit
def block_scaled_ws_kernel(a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, M, N, K, stride_am, stride_bn, stride_cm,
                           stride_asm, stride_ask, stride_bsn, stride_bsk,
                           BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                           STAGES: gl.constexpr, GROUP_M: gl.constexpr, UNROLL: gl.constexpr,
                           CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr):
    HALF_M: gl.constexpr = BLOCK_M // 2
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], a_ptr.dtype.element_ty)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], b_ptr.dtype.element_ty)
    c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_M, BLOCK_N], c_ptr.dtype.element_ty)
    a_desc = tma.make_tensor_descriptor(a_ptr, [M, K], [stride_am, 1], [BLOCK_M, BLOCK_K], a_layout)
    b_desc = tma.make_tensor_descriptor(b_ptr, [N, K], [stride_bn, 1], [BLOCK_N, BLOCK_K], b_layout)
    c_desc = tma.make_tensor_descriptor(c_ptr, [M, N], [stride_cm, 1], [HALF_M, BLOCK_N], c_layout)
    a_s = gl.allocate_shared_memory(a_ptr.dtype.element_ty, [STAGES, BLOCK_M, BLOCK_K], a_layout)
    b_s = gl.allocate_shared_memory(b_ptr.dtype.element_ty, [STAGES, BLOCK_N, BLOCK_K], b_layout)
    c_s = gl.allocate_shared_memory(c_ptr.dtype.element_ty, [2, HALF_M, BLOCK_N], c_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)
    gl.warp_specialize([
        (_consumer_lo, (a_desc, b_desc, c_desc, a_s, b_s, c_s, ready, empty, as_ptr, bs_ptr, M, N, K, stride_asm,
                        stride_ask, stride_bsn, stride_bsk, STAGES, GROUP_M, UNROLL)),
        (_consumer_hi, (a_desc, b_desc, c_desc, a_s, b_s, c_s, ready, empty, as_ptr, bs_ptr, M, N, K, stride_asm,
                        stride_ask, stride_bsn, stride_bsk, STAGES, GROUP_M, UNROLL)),
        (_producer, (a_desc, b_desc, c_desc, a_s, b_s, c_s, ready, empty, as_ptr, bs_ptr, M, N, K, stride_asm,
                     stride_ask, stride_bsn, stride_bsk, STAGES, GROUP_M, UNROLL)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def ws_call(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
            config: Config, profile: DeviceProfile) -> KernelCall:
    """fp8_wgmma's launch (its arguments, grid and tile) of this kernel: one warpgroup in the default partition,
    ``config``'s register split (``CONSUMER_REGS``, ``PRODUCER_REGS`` under ``maxnreg``)."""
    call = fp8_wgmma.wgmma_call(a, b, c, a_scale, b_scale, config, profile)
    return dataclasses.replace(call, kernel=block_scaled_ws_kernel, kwargs={
        **call.kwargs, "num_warps": 4, "CONSUMER_REGS": config.get("CONSUMER_REGS", 232),
        "PRODUCER_REGS": config.get("PRODUCER_REGS", 40), "maxnreg": config.get("maxnreg", 168)})


def run_ws(args: tuple, out=None, **config) -> torch.Tensor:
    a, b, a_scale, b_scale, out_dtype = args
    c = out if out is not None else torch.empty(a.shape[0], b.shape[0], dtype=out_dtype, device=P.DEVICE)
    ws_call(a, b, c, a_scale, b_scale, {"num_stages": 4, **config}, P.PROFILE).launch()
    return c


def check(*shape, **variant) -> None:
    print(json.dumps(P.check(*shape, launch=run_ws, **variant)), flush=True)


VARIANTS = [{"num_stages": s, "UNROLL": u} for s, u in ((4, 8), (5, 8), (6, 8), (5, 4), (6, 4))]


def main(mode: str) -> None:
    if mode == "quick":
        for shape in ((300, 200, 272), (129, 384, 384), (4096, 7168, 2048)):
            check(*shape, num_stages=4, UNROLL=8)
        check(1000, 2112, 7184, num_stages=5, UNROLL=4)
        m, n, k = 4096, 7168, 16384
        args = P.inputs(m, n, k)
        for name, fn in (("ws_s5_u8", lambda: run_ws(args, num_stages=5, UNROLL=8)),
                         ("ws_s4_u8", lambda: run_ws(args, num_stages=4, UNROLL=8)),
                         ("gluon_s4_u8", lambda: P.gluon(args, 4, 8)),
                         ("cublaslt_block", lambda: vendor._blockwise_scaled_mm(*args))):
            print(name, P.tflops(2 * m * n * k, fn), flush=True)
    elif mode == "check":
        for shape in P.CHECKS:
            for stages, unroll in ((4, 8), (5, 4), (3, 2)):
                check(*shape, num_stages=stages, UNROLL=unroll)
        for out_dtype in (torch.float32, torch.float16):
            check(300, 200, 272, out_dtype)
        check(257, 384, 1024, padded=True)
    else:
        for m, n, k in P.SHAPES:
            args = P.inputs(m, n, k)
            flops = 2 * m * n * k
            row: dict = {"shape": [m, n, k]}
            for cfg in VARIANTS:
                name = f"ws_s{cfg['num_stages']}_u{cfg['UNROLL']}"
                row[name] = P.tflops(flops, lambda cfg=cfg, args=args: run_ws(args, **cfg))
            row["gluon_s4_u8"] = P.tflops(flops, lambda args=args: P.gluon(args, 4, 8))
            row["cublaslt_block"] = P.tflops(flops, lambda args=args: vendor._blockwise_scaled_mm(*args))
            a16, b16 = F.bf16_inputs(args)[:2]
            row["bf16"] = P.tflops(flops, lambda a16=a16, b16=b16: a16 @ b16.T)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "quick")
