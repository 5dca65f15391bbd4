"""How fast the H200 streams a decode's K and V ([B, Sk, Hk, D], bf16) by the tile shape a program reads.

    python3 .ci/probe_decode_read.py [SK ...]          (default 65536 16384)

A probe, not the kernel: each program sums the tiles it loads (so that nothing is optimised away)
over its share of the keys, the programs filling one wave of the SMs as flash decoding's splits do.
``heads=H``: a program reads H adjacent kv heads' columns of each key row (H * D * 2 contiguous
bytes of every row's Hk * D * 2); ``heads=1`` is the decode kernel's access (256 of every 2048
bytes at Hk 8, D 128). Beside them: the decode kernel itself (flash_attention_v2, Sq 1, GQA 32/8),
SDPA's cuDNN backend, and a copy of the same bytes.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl


@triton.jit
def read_kernel(k_ptr, v_ptr, out_ptr, Sk, keys_per_split, stride_s,
                HEADS: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
    split = tl.program_id(0)
    group = tl.program_id(1)
    cols = group * HEADS * D + tl.arange(0, HEADS * D)
    offs_n = tl.arange(0, BLOCK_N)
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, Sk)
    acc = tl.zeros((HEADS * D,), tl.float32)
    for n in range(start, end, BLOCK_N):
        keys = (n + offs_n).to(tl.int64)
        mask = (keys < end)[:, None]
        ptrs = keys[:, None] * stride_s + cols[None, :]
        k = tl.load(k_ptr + ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
        v = tl.load(v_ptr + ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
        acc += tl.sum(k.to(tl.float32) * v.to(tl.float32), axis=0)
    tl.store(out_ptr + (split * tl.num_programs(1) + group), tl.sum(acc))


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3


def probe(sk: int) -> None:
    from dlblas_kernels.blocks.sdpa import sdpa_attention
    from dlblas_kernels.kernels.flash_attention_v2 import flash_attention_v2
    from torch.nn.attention import SDPBackend

    hk, hq, d = 8, 32, 128
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    k = torch.randn(1, sk, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(1, 1, hq, d, device="cuda", dtype=torch.bfloat16)
    nbytes = 2 * k.numel() * 2
    block = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    rows = [("copy of the same bytes (read + write counted)", bench(block.clone), 2)]
    rows.append(("decode kernel (flash_attention_v2)", bench(lambda: flash_attention_v2(q, k, v)), 1))
    rows.append(("sdpa cudnn", bench(lambda: sdpa_attention(q, k, v, False, None, SDPBackend.CUDNN_ATTENTION)), 1))
    for heads in (1, 2, 4, 8):
        for elements, warps, stages in ((8192, 4, 3), (8192, 4, 4), (16384, 8, 3), (16384, 8, 2)):
            block_n = elements // (heads * d)
            groups = hk // heads
            for per_sm in (1, 2, 4):
                splits = max(1, sms * per_sm // groups)
                kps = triton.cdiv(triton.cdiv(sk, splits), block_n) * block_n
                splits = triton.cdiv(sk, kps)
                out = torch.empty(splits * groups, device="cuda")

                def run(splits=splits, groups=groups, kps=kps, heads=heads, block_n=block_n, warps=warps,
                        stages=stages, out=out):
                    read_kernel[(splits, groups)](k, v, out, sk, kps, k.stride(1), HEADS=heads, D=d,
                                                  BLOCK_N=block_n, num_warps=warps, num_stages=stages)
                try:
                    us = bench(run)
                except Exception as error:  # noqa: BLE001 - a tile the chip refuses is reported
                    print(f"Sk={sk} heads={heads} block_n={block_n}: {type(error).__name__} {str(error)[:80]}")
                    continue
                rows.append((f"read heads={heads} BLOCK_N={block_n} warps={warps} stages={stages} "
                             f"programs={splits * groups}", us, 1))
    for name, us, factor in rows:
        print(f"Sk={sk:6d} {us:8.1f} us {nbytes * factor / us / 1e3:7.0f} GB/s  {name}", flush=True)


def main() -> None:
    for sk in [int(s) for s in sys.argv[1:]] or [65536, 16384]:
        probe(sk)


if __name__ == "__main__":
    main()
