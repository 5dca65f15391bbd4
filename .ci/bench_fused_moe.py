"""fused_moe on the GPU against the grouped_mm composite at issue #19's shapes (bf16).

    python3 .ci/bench_fused_moe.py OUT.json [TOKENS ...]      (BACKWARD=1: forward + backward too)

Mixtral-8x7B (E 8, k 2, H 4096, I 14336) and DeepSeek-V3's routed experts (E 256, k 8, H 7168,
I 2048); a softmax top-k routing of random logits. Each shape: the heuristic config and the
alternatives of its regime, timed by triton.testing.do_bench (median of the runs), through the
replaying runner a bound op uses; the composite likewise; the output checked against the
composite's. Up to 64 tokens, the activated experts' weights read per second against a device
copy's bandwidth.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys

import torch
import triton
from dlblas_kernels import vendor
from dlblas_kernels.kernels import fused_moe as moe

from dlcore.runtime.runner import runner
from dlcore.runtime.template import device_profile

MODELS = {"mixtral-8x7b": (8, 2, 4096, 14336), "deepseek-v3": (256, 8, 7168, 2048)}
# Alternatives per regime of the heuristic: (BLOCK_M, (up BLOCK_N, BLOCK_K, warps, stages), (down ...))
ALTERNATIVES = {
    16: [(16, (128, 128, 4, 4), (128, 128, 4, 4)), (16, (64, 256, 4, 3), (64, 256, 4, 3))],
    64: [(64, (128, 64, 8, 3), (128, 64, 4, 4)), (32, (64, 128, 4, 4), (64, 128, 4, 4))],
    128: [(128, (128, 64, 8, 4), (128, 64, 8, 4)), (64, (128, 64, 8, 3), (256, 64, 8, 3)),
          (128, (128, 64, 8, 3), (256, 64, 8, 4)), (128, (64, 64, 4, 4), (256, 64, 8, 3)),
          (128, (128, 128, 8, 2), (256, 128, 8, 2))],
}


def median_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def backward_times(args: tuple) -> dict:
    """Forward and backward (gradients of hidden, w13, w2, topk_weights) of the public function
    and of the composite under autograd, from the same output gradient."""
    leaves = [a.detach().requires_grad_() for a in args[:4]]
    dout = torch.randn_like(args[0])
    found = {}
    for name, fn in (("fused_moe", moe.fused_moe), ("composite", vendor.fused_moe)):
        def step(fn=fn) -> None:
            torch.autograd.grad(fn(*leaves, args[4]), leaves, dout)
        try:
            found[f"{name}_fwd_bwd_us"] = median_ms(step) * 1e3
        except Exception as exc:  # noqa: BLE001 - reported, the forward numbers stand
            found[f"{name}_fwd_bwd_error"] = repr(exc)[:300]
    return found


def main() -> None:
    out_path = sys.argv[1]
    tokens_list = [int(t) for t in sys.argv[2:]] or [1, 64, 4096, 16384]
    device = torch.device("cuda")
    profile = device_profile(device)
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_bw = 2 * src.numel() / (median_ms(functools.partial(dst.copy_, src)) * 1e-3)
    del src, dst
    results = {"copy_GBps": copy_bw / 1e9, "shapes": []}
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s", flush=True)
    gen = torch.Generator(device=device).manual_seed(0)
    for model, (experts, topk, h, inter) in MODELS.items():
        w13 = (torch.randn(experts, 2 * inter, h, device=device, generator=gen, dtype=torch.bfloat16) * h**-0.5)
        w2 = (torch.randn(experts, h, inter, device=device, generator=gen, dtype=torch.bfloat16) * inter**-0.5)
        for tokens in tokens_list:
            x = torch.randn(tokens, h, device=device, generator=gen, dtype=torch.bfloat16)
            logits = torch.randn(tokens, experts, device=device, generator=gen)
            weights, ids = torch.softmax(logits, -1).topk(topk, -1)
            ids = ids.to(torch.int32)
            args = (x, w13, w2, weights, ids, None, None)
            moved, flops = moe.cost(args)
            active = int(torch.unique(ids).numel())
            weight_bytes = active * (w13[0].numel() + w2[0].numel()) * 2
            expected = vendor.fused_moe(*args[:5])
            composite_ms = median_ms(functools.partial(vendor.fused_moe, *args[:5]))
            base = moe.heuristic(tokens, experts, topk, 2, profile)
            regime = 16 if base["BLOCK_M"] == 16 else (64 if base["BLOCK_M"] <= 64 else 128)
            configs = [base] + [moe.tile_config(bm, up, down) for bm, up, down in ALTERNATIVES[regime]]
            timed = []
            for config in configs:
                run = runner(moe.KERNEL.implementation, config)
                try:
                    got = run(args)
                    err = ((got.float() - expected.float()).norm() / expected.float().norm()).item()
                    ms = median_ms(functools.partial(run, args))
                except Exception as exc:  # noqa: BLE001 - a config that fails is reported, the others run
                    timed.append({"config": config, "error": repr(exc)[:300]})
                    continue
                timed.append({"config": config, "ms": ms, "rel_err": err})
            ok = [t for t in timed if "ms" in t]
            best = min(ok, key=lambda t: t["ms"]) if ok else None
            row = {
                "model": model, "tokens": tokens, "active_experts": active, "flops": flops, "bytes": moved,
                "composite_us": composite_ms * 1e3, "composite_TFLOPs": flops / composite_ms / 1e9,
                "default_us": ok[0]["ms"] * 1e3 if ok and ok[0]["config"] is base else None,
                "best_us": best["ms"] * 1e3 if best else None, "best_config": best["config"] if best else None,
                "configs": timed,
            }
            if best:
                row["speedup_best"] = composite_ms / best["ms"]
                row["TFLOPs_best"] = flops / best["ms"] / 1e9
                row["weight_bw_fraction"] = weight_bytes / (best["ms"] * 1e-3) / copy_bw
            if os.environ.get("BACKWARD"):
                row.update(backward_times(args))
            results["shapes"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "configs"}), flush=True)
            for t in timed:
                print("   ", t, flush=True)
            del x, logits, weights, ids, args, expected
        del w13, w2
        torch.cuda.empty_cache()
    speedups = [r["composite_us"] / r["default_us"] for r in results["shapes"] if r["default_us"]]
    best = [r["speedup_best"] for r in results["shapes"] if r.get("speedup_best")]
    results["geomean_default"] = math.exp(sum(map(math.log, speedups)) / len(speedups)) if speedups else None
    results["geomean_best"] = math.exp(sum(map(math.log, best)) / len(best)) if best else None
    print("geomean speedup vs composite: default", results["geomean_default"], "best", results["geomean_best"])
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
