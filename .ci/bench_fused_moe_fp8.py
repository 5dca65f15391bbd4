"""fused_moe with fp8 weights (128x128 block scales) against bf16 weights on the GPU, at issue #19's shapes.

    python3 .ci/bench_fused_moe_fp8.py OUT.json [TOKENS ...]          (default 64 4096 16384)

Mixtral-8x7B (E 8, k 2, H 4096, I 14336) and DeepSeek-V3's routed experts (E 256, k 8, H 7168,
I 2048); random bf16 weights (variance 1/fan-in) and their fp8 quantisation (one scale per 128x128
block, as the checkpoints hold them); a softmax top-k routing of random logits. Each shape: the
bf16 heuristic config, the fp8 heuristic config and the fp8 alternatives below, timed by
triton.testing.do_bench (median) through the replaying runner a bound op uses; each output's error
(norm of the difference over the norm) against a float32 loop over the experts on the weights the
call was given (the fp8 ones dequantised, the activations unquantised), and the fp8 output's
against the float64 loop that quantises the activations as the kernels do. The H200's numbers:
docs/results/fp8_moe/fused_moe_fp8_vs_bf16.json.
"""

from __future__ import annotations

import functools
import json
import sys

import torch
import triton
from dlblas_kernels.kernels import fused_moe as moe

from dlcore.runtime.runner import runner
from dlcore.runtime.template import device_profile

MODELS = {"mixtral-8x7b": (8, 2, 4096, 14336), "deepseek-v3": (256, 8, 7168, 2048)}
#: fp8 alternatives per row block of the heuristic: (BLOCK_M, (up BLOCK_N, BLOCK_K, warps, stages), (down ...))
#: (64-column gate/up tiles: the SwiGLU output stored in float32 and quantised by a launch of its own)
ALTERNATIVES = {
    16: [],
    64: [],
    128: [(64, (128, 128, 8, 4), (128, 128, 8, 4)), (128, (64, 128, 8, 4), (128, 128, 8, 4)),
          (128, (128, 128, 16, 4), (128, 128, 16, 4)), (128, (128, 128, 16, 3), (128, 128, 8, 4)),
          (128, (128, 128, 16, 4), (128, 128, 8, 4)), (128, (128, 128, 8, 4), (128, 128, 16, 4)),
          (64, (128, 128, 8, 4), (128, 128, 16, 4))],
}


def median_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def loop_reference(x, w13, w2, weights, ids, w13_scale=None, w2_scale=None, dtype=torch.float32):
    """The loop over the experts in ``dtype``, fp8 weights dequantised expert by expert."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=dtype, device=x.device)
    flat, xs, ws = ids.reshape(-1), x.to(dtype), weights.reshape(-1).to(dtype)
    for e in range(w13.shape[0]):
        slots = (flat == e).nonzero().squeeze(1)
        if not slots.numel():
            continue
        a, b = w13[e:e + 1], w2[e:e + 1]
        if w13_scale is not None:
            a = moe.dequantise_weight(a, w13_scale[e:e + 1], dtype)
            b = moe.dequantise_weight(b, w2_scale[e:e + 1], dtype)
        a, b = a[0].to(dtype), b[0].to(dtype)
        h = xs[slots // ids.shape[1]]
        if dtype == torch.float64 and w13_scale is not None:
            h = moe.quantised(h)
        act = torch.nn.functional.silu(h @ a[:inter].T) * (h @ a[inter:].T)
        if dtype == torch.float64 and w13_scale is not None:
            act = moe.quantised(act)
        out.index_add_(0, slots // ids.shape[1], (act @ b.T) * ws[slots, None])
    return out


def rel(got, expected) -> float:
    return ((got.double() - expected.double()).norm() / expected.double().norm()).item()


def timed(args, config, references):
    run = runner(moe.KERNEL.implementation, config)
    try:
        got = run(args)
        errors = {name: rel(got, ref) for name, ref in references.items()}
        return {"config": config, "us": median_ms(functools.partial(run, args)) * 1e3, **errors}
    except Exception as exc:  # noqa: BLE001 - a config that fails is reported, the others run
        return {"config": config, "error": repr(exc)[:300]}


def main() -> None:
    out_path = sys.argv[1]
    tokens_list = [int(t) for t in sys.argv[2:]] or [64, 4096, 16384]
    device = torch.device("cuda")
    profile = device_profile(device)
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for model, (experts, topk, h, inter) in MODELS.items():
        w13 = torch.randn(experts, 2 * inter, h, device=device, generator=gen, dtype=torch.bfloat16) * h**-0.5
        w2 = torch.randn(experts, h, inter, device=device, generator=gen, dtype=torch.bfloat16) * inter**-0.5
        (q13, s13), (q2, s2) = moe.quantise_weight(w13), moe.quantise_weight(w2)
        for tokens in tokens_list:
            x = torch.randn(tokens, h, device=device, generator=gen, dtype=torch.bfloat16)
            weights, ids = torch.softmax(torch.randn(tokens, experts, device=device, generator=gen), -1).topk(topk, -1)
            ids = ids.to(torch.int32)
            bf16 = (x, w13, w2, weights, ids, None, None)
            fp8 = (x, q13, q2, weights, ids, s13, s2)
            base16 = timed(bf16, moe.heuristic(tokens, experts, topk, 2, profile),
                           {"rel_err_fp32": loop_reference(*bf16[:5])})
            refs = {"rel_err_fp32": loop_reference(*fp8), "rel_err_quantised": loop_reference(*fp8, torch.float64)}
            base8 = moe.heuristic(tokens, experts, topk, 1, profile, fp8=True)
            configs = [base8] + [moe.tile_config(bm, up, down) for bm, up, down in ALTERNATIVES[base8["BLOCK_M"]]]
            found = [timed(fp8, c, refs) for c in configs]
            ok = [f for f in found if "us" in f]
            row = {"model": model, "tokens": tokens, "flops": moe.cost(bf16)[1], "bf16": base16, "fp8": found}
            if "us" in base16 and ok:
                row["speedup_default"] = base16["us"] / found[0]["us"] if "us" in found[0] else None
                row["speedup_best"] = base16["us"] / min(f["us"] for f in ok)
                row["fp8_TFLOPs_best"] = row["flops"] / min(f["us"] for f in ok) / 1e6
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(out_path, "w") as f:  # after every shape: a run cut short keeps what it measured
                json.dump({"device": torch.cuda.get_device_name(), "shapes": rows}, f, indent=1)
            del x, weights, ids, bf16, fp8, refs
        del w13, w2, q13, q2, s13, s2
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
