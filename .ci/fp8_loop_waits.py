"""Block-scaled fp8 loop shapes: compiled for sm_90 here (no GPU needed) with the wgmma waits in their
PTX, or timed on a GPU.

    python3 .ci/fp8_loop_waits.py VARIANT,BLOCK_M,BLOCK_N,BLOCK_K,WARPS,STAGES ...
    e.g. python3 .ci/fp8_loop_waits.py 0,128,128,128,8,4 1,128,128,128,8,3 2,128,128,128,8,4
    python3 .ci/fp8_loop_waits.py --bench M,N,K ... [-- SPEC ...]     (on the GPU host)

VARIANT 0: each K block's product scaled and added (fp8_gemm's loop); 1: two K blocks a step, two
products, one promotion; 2: the promotion lagged a step (the last product scaled after this step's
wgmma is issued); 3: each step's scales loaded a step ahead. A JSON line each: registers and spills
(ptxas), shared memory, the wgmma count and each ``wgmma.wait_group`` operand. A wait of 0 right after
each product means no wgmma stays in flight while the last product is scaled (docs/performance.md,
fp8_gemm). ``--bench``: each spec's TFLOP/s (median) and its largest error relative to a float32
product of the dequantised operands, per shape (M and N multiples of 128, K of 256).
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys

import triton
import triton.language as tl
import triton.testing
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def _scale(sa_ptr, sb_ptr, offs_m, pid_n, ki, ksteps):
    """K block ``ki``'s per-row scale: a's row scale times b's block scale."""
    return tl.load(sa_ptr + offs_m * ksteps + ki) * tl.load(sb_ptr + pid_n * ksteps + ki)


@triton.jit
def _scaled(a_desc, b_desc, sa_ptr, sb_ptr, off_m, off_n, offs_m, pid_n, ki, ksteps, BLOCK_K: tl.constexpr):
    """The K block ``ki``'s operands and its per-row scale (a's row scale times b's block scale)."""
    a = a_desc.load([off_m, ki * BLOCK_K])
    b = b_desc.load([off_n, ki * BLOCK_K]).T
    return a, b, _scale(sa_ptr, sb_ptr, offs_m, pid_n, ki, ksteps)


@triton.jit
def loop_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, M, N, K, VARIANT: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
    num_m = tl.cdiv(M, BLOCK_M)
    ksteps = tl.cdiv(K, BLOCK_K)
    for unit in tl.range(tl.program_id(0), num_m * tl.cdiv(N, BLOCK_N), tl.num_programs(0), flatten=True):
        pid_m = unit % num_m
        pid_n = unit // num_m
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        offs_m = off_m + tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if VARIANT == 0:
            for ki in range(ksteps):
                a, b, s = _scaled(a_desc, b_desc, sa_ptr, sb_ptr, off_m, off_n, offs_m, pid_n, ki, ksteps, BLOCK_K)
                acc += tl.dot(a, b) * s[:, None]
        elif VARIANT == 1:
            for kj in range(ksteps // 2):
                a0, b0, s0 = _scaled(a_desc, b_desc, sa_ptr, sb_ptr, off_m, off_n, offs_m, pid_n, 2 * kj, ksteps,
                                     BLOCK_K)
                a1, b1, s1 = _scaled(a_desc, b_desc, sa_ptr, sb_ptr, off_m, off_n, offs_m, pid_n, 2 * kj + 1, ksteps,
                                     BLOCK_K)
                p0 = tl.dot(a0, b0)
                p1 = tl.dot(a1, b1)
                acc += p0 * s0[:, None] + p1 * s1[:, None]
        elif VARIANT == 3:
            a_scale = _scale(sa_ptr, sb_ptr, offs_m, pid_n, 0, ksteps)
            for ki in range(ksteps):
                a = a_desc.load([off_m, ki * BLOCK_K])
                b = b_desc.load([off_n, ki * BLOCK_K]).T
                s = a_scale
                ahead = tl.minimum(ki + 1, ksteps - 1)
                a_scale = _scale(sa_ptr, sb_ptr, offs_m, pid_n, ahead, ksteps)
                acc += tl.dot(a, b) * s[:, None]
        else:
            last = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            last_scale = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for ki in range(ksteps):
                a, b, s = _scaled(a_desc, b_desc, sa_ptr, sb_ptr, off_m, off_n, offs_m, pid_n, ki, ksteps, BLOCK_K)
                product = tl.dot(a, b)
                acc += last * last_scale[:, None]
                last = product
                last_scale = s
            acc += last * last_scale[:, None]
        c_desc.store([off_m, off_n], acc.to(tl.bfloat16))


SIGNATURE = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "c_ptr": "*bf16", "sa_ptr": "*fp32", "sb_ptr": "*fp32",
             "M": "i32", "N": "i32", "K": "i32", "VARIANT": "constexpr", "BLOCK_M": "constexpr",
             "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def main(specs: list[str]) -> None:
    for spec in specs:
        variant, bm, bn, bk, warps, stages = map(int, spec.split(","))
        source = ASTSource(loop_kernel, SIGNATURE, {"VARIANT": variant, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk})
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": warps, "num_stages": stages})
        ptx = compiled.asm["ptx"]
        with open("/tmp/fp8_loop.ptx", "w") as f:
            f.write(ptx)
        log = subprocess.run([PTXAS, "-arch=sm_90a", "-v", "/tmp/fp8_loop.ptx", "-o", "/tmp/fp8_loop.cubin"],
                             capture_output=True, text=True).stderr
        print(json.dumps({"spec": spec, "triton": triton.__version__,
                          "registers": re.findall(r"Used (\d+) registers", log),
                          "spill_bytes": re.findall(r"(\d+) bytes spill stores", log),
                          "shared": compiled.metadata.shared, "wgmma": ptx.count("wgmma.mma_async"),
                          "waits": re.findall(r"wgmma.wait_group.sync.aligned (\d+)", ptx)}))


def bench(shapes: list[str], specs: list[str]) -> None:
    import torch

    from dlcore.runtime.allocator import ensure_allocator

    ensure_allocator()
    cores = torch.cuda.get_device_properties(0).multi_processor_count
    for shape in shapes:
        m, n, k = map(int, shape.split(","))
        gen = torch.Generator(device="cuda").manual_seed(0)
        a = torch.randn(m, k, device="cuda", generator=gen).to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device="cuda", generator=gen).to(torch.float8_e4m3fn)
        a_scale = torch.rand(m, k // 128, device="cuda", generator=gen) + 0.5
        b_scale = torch.rand(triton.cdiv(n, 128), k // 128, device="cuda", generator=gen) + 0.5
        want = ((a.float().view(m, -1, 128) * a_scale[:, :, None]).view(m, k)
                @ (b.float().view(-1, 128, k // 128, 128) * b_scale[:, None, :, None]).view(n, k).T)
        row: dict = {"shape": [m, n, k]}
        for spec in specs:
            variant, bm, bn, bk, warps, stages = map(int, spec.split(","))
            c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            grid = (min(cores, triton.cdiv(m, bm) * triton.cdiv(n, bn)),)
            launch = functools.partial(loop_kernel[grid], a, b, c, a_scale, b_scale, m, n, k, variant, bm, bn, bk,
                                       num_warps=warps, num_stages=stages)
            launch()
            error = ((c.float() - want).abs().max() / want.abs().max()).item()
            ms = triton.testing.do_bench(launch, rep=100, return_mode="median")
            row[spec] = {"tflops": round(2 * m * n * k / ms / 1e9, 1), "relative_error": round(error, 4)}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    arguments = sys.argv[1:]
    default = ["0,128,128,128,8,4", "1,128,128,128,8,3", "2,128,128,128,8,4", "3,128,128,128,8,4"]
    if arguments[:1] == ["--bench"]:
        shapes = arguments[1:arguments.index("--")] if "--" in arguments else arguments[1:]
        bench(shapes, arguments[arguments.index("--") + 1:] if "--" in arguments else default)
    else:
        main(arguments or default)
