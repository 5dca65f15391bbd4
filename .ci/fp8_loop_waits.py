"""Block-scaled fp8 loop shapes compiled for sm_90 here (no GPU needed): the wgmma waits in their PTX.

    python3 .ci/fp8_loop_waits.py VARIANT,BLOCK_M,BLOCK_N,BLOCK_K,WARPS,STAGES ...
    e.g. python3 .ci/fp8_loop_waits.py 0,128,128,128,8,4 1,128,128,128,8,3 2,128,128,128,8,4

VARIANT 0: each K block's product scaled and added (fp8_gemm's loop); 1: two K blocks a step, two
products, one promotion; 2: the promotion lagged a step (the last product scaled after this step's
wgmma is issued). A JSON line each: registers and spills (ptxas), shared memory, the wgmma count and
each ``wgmma.wait_group`` operand. A wait of 0 right after each product means no wgmma stays in flight
while the last product is scaled (docs/performance.md, fp8_gemm).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def _scaled(a_desc, b_desc, sa_ptr, sb_ptr, off_m, off_n, offs_m, pid_n, ki, ksteps, BLOCK_K: tl.constexpr):
    """The K block ``ki``'s operands and its per-row scale (a's row scale times b's block scale)."""
    a = a_desc.load([off_m, ki * BLOCK_K])
    b = b_desc.load([off_n, ki * BLOCK_K]).T
    scale = tl.load(sa_ptr + offs_m * ksteps + ki) * tl.load(sb_ptr + pid_n * ksteps + ki)
    return a, b, scale


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


if __name__ == "__main__":
    main(sys.argv[1:] or ["0,128,128,128,8,4", "1,128,128,128,8,3", "2,128,128,128,8,4"])
