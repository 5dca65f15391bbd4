"""flash_attention_v2's split-KV decode with K and V through tensor descriptors (TMA, the default on
sm_90) against pointer loads (``TMA=0``), on the GPU: Sq 1, GQA 32/8, D 128, B 1, bfloat16; each
output checked against the float32 formula first; do_bench medians (L2 flushed), alternating.

    python3 .ci/sweep_decode_tma.py            # DECODE_SK=1024,8192,32768,65536
"""

from __future__ import annotations

import os

import torch
import triton
from dlblas_kernels import attention_decode as decode

from dlcore.runtime import launch as warm
from dlcore.runtime.template import device_profile

SK = [int(s) for s in os.environ.get("DECODE_SK", "1024,8192,32768,65536").split(",")]


def main() -> None:
    profile = device_profile(torch.device("cuda"))
    block = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    copy = 2 * block.numel() / triton.testing.do_bench(block.clone, return_mode="median") / 1e6  # GB/s
    print(f"copy bandwidth {copy:.0f} GB/s")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for sk in SK:
        q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(1, sk, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        ref = torch.softmax((q.float().transpose(1, 2) @ k.float().repeat_interleave(4, 2).permute(0, 2, 3, 1))
                            * 128 ** -0.5, -1) @ v.float().repeat_interleave(4, 2).transpose(1, 2)
        times: dict[str, list[float]] = {}
        for _ in range(3):
            for tma in (1, 0):
                out = torch.full_like(q, float("nan"))
                lse = torch.empty(1, 32, 1, device="cuda")
                calls, scratch = decode.decode_calls(q, k, v, out, lse, causal=False, scale=128 ** -0.5,
                                                     profile=profile, config={"TMA": tma})
                for call in calls:
                    call.launch()
                err = ((out.float().transpose(1, 2) - ref).norm() / ref.norm()).item()
                assert err < 2e-2, (sk, tma, err)
                us = triton.testing.do_bench(lambda calls=calls: [warm.launch(c) for c in calls], warmup=10, rep=40,
                                             return_mode="median") * 1e3
                times.setdefault(f"TMA={tma}", []).append(us)
        nbytes = 2 * k.numel() * k.element_size()
        row = {name: min(ts) for name, ts in times.items()}
        print(f"Sk={sk:6d} splits={calls[0].grid[0]:3d} " + "  ".join(
            f"{name} {us:7.1f} us {nbytes / us / 1e3 / copy:.0%} of copy" for name, us in row.items()), flush=True)


if __name__ == "__main__":
    main()
