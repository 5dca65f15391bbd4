"""The first runs of new copy-engine fused_moe plans (blocks/grouped_tma.py) at Mixtral-8x7B's size, 4096 tokens,
each run poisoned first (probe_moe_tma.poison): which buffer still holds NaN after the first and the second run
of a plan, and how many output rows are off.

    python3 .ci/probe_moe_first.py [MODE ...]      (default: graph timing empty none)

Before each new plan the pointer kernels' plan runs and is timed by MODE: ``graph`` (do_bench_cudagraph, as
probe_moe_tma.py times), ``timing`` (do_bench, no graph), ``empty`` (no timing: torch.cuda.empty_cache() alone,
which torch.cuda.graph calls as a capture starts, so that the plan after a graph bench gets memory fresh from
cudaMalloc), ``none``; ``keep`` as ``none`` with fresh scratch for every launch (probe_moe_tma.keep_scratch, for
the rest of the process). Four plans per MODE and variant: fp8 weights with the heuristic's 16 warps, with 8
warps, and bf16 weights, the loop flattened and not in turn.
"""

from __future__ import annotations

import json
import sys

import probe_moe_tma as P
import torch
import triton.testing
from dlblas_kernels.blocks import grouped_tma, moe_tiles
from dlblas_kernels.kernels import fused_moe as M
from dlblas_kernels.kernels.fused_moe_fp8 import quantise_weight

from dlcore.runtime.profile import device_profile

TOKENS = 4096


def _nan_rows(t: torch.Tensor) -> int:
    return int(t.float().isnan().any(1).sum())


def _run(plan, want: torch.Tensor) -> dict:
    P.poison(plan)
    out = plan.run().float()
    up, down = (c for c in plan.calls if c.kernel is grouped_tma.grouped_tma_gemm_kernel)
    used = int(up.args[6][P.E].item())
    return {"bad": P._bad((out - want).abs(), 0.02 * want.abs().max()), "rows_nan": _nan_rows(up.args[0][:used]),
            "act_nan": _nan_rows(up.args[2][:used]), "y_nan": _nan_rows(down.args[2]), "out_nan": _nan_rows(out)}


def main(modes: list[str]) -> None:
    profile = device_profile(torch.device(P.DEVICE))
    gen = torch.Generator(device=P.DEVICE).manual_seed(0)
    w13 = torch.randn(P.E, 2 * P.INTER, P.H, device=P.DEVICE, dtype=torch.bfloat16, generator=gen) * P.H ** -0.5
    w2 = torch.randn(P.E, P.H, P.INTER, device=P.DEVICE, dtype=torch.bfloat16, generator=gen) * P.INTER ** -0.5
    x = torch.randn(TOKENS, P.H, device=P.DEVICE, dtype=torch.bfloat16, generator=gen)
    weights, ids = torch.randn(TOKENS, P.E, device=P.DEVICE, generator=gen).softmax(-1).topk(P.K)
    (q13, s13), (q2, s2) = quantise_weight(w13), quantise_weight(w2)
    layers = {"fp8": ((x, q13, q2, weights, ids.to(torch.int32), s13, s2),
                      moe_tiles.heuristic(TOKENS, P.E, P.K, 1, profile, fp8=True)),
              "bf16": ((x, w13, w2, weights, ids.to(torch.int32), None, None),
                       M.heuristic(TOKENS, P.E, P.K, 2, profile))}
    wants = {name: M.plan(args, base, profile).run().float() for name, (args, base) in layers.items()}
    variants = {"fp8 16 warps": ("fp8", {}), "fp8 8 warps": ("fp8", {"num_warps": 8, "num_stages": 3}),
                "bf16": ("bf16", {"DOWN_STAGES": 3})}
    for mode in modes:
        if mode == "keep":
            P.keep_scratch()
        for variant, (layer, extra) in variants.items():
            args, base = layers[layer]
            for i in range(4):
                pointer = M.plan(args, base, profile)
                pointer.run()
                if mode == "graph":
                    triton.testing.do_bench_cudagraph(pointer.run, rep=30)
                elif mode == "timing":
                    triton.testing.do_bench(pointer.run, rep=30)
                elif mode == "empty":
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
                plan = M.plan(args, {**base, "TMA": 1, "FLATTEN": i % 2, **extra}, profile)
                first = _run(plan, wants[layer])
                print(json.dumps({"mode": mode, "variant": variant, "flatten": i % 2, "first": first,
                                  "second": _run(plan, wants[layer])}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["graph", "timing", "empty", "none"])
