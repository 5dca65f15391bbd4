"""Time apply_rotary_pos_emb's kernel, forward and backward, over (rows per step, warps) at 1 to 256
tokens of LLaMA-3 and Qwen2.5 on the GPU, CUDA-graph replays (GPU time only), next to Liger's rope
forward timed the same way; prints one line per config, the current default marked.

    python3 .ci/sweep_rotary_small.py
"""

import importlib
import itertools
import os

import torch
import triton

from dlcore.declarations.signature import make_signature
from dlcore.plugins.registry import registry
from dlcore.runtime.template import device_profile

m = importlib.import_module("dlblas_kernels.kernels.apply_rotary_pos_emb")

op = registry().op("apply_rotary_pos_emb")
DEVICE = torch.device(os.environ.get("SWEEP_DEVICE", "cuda"))  # cpu (TRITON_INTERPRET=1): a dry run
MODELS = {"llama3-8b": (32, 8), "llama3-70b": (64, 8), "qwen2.5-7b": (28, 4)}
TOKENS = [int(t) for t in os.environ.get("SWEEP_TOKENS", "1,16,64,256").split(",")]


def timed(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=20) if DEVICE.type == "cuda" else 1.0


liger = m.liger_apply_rotary_pos_emb()
for (model, (heads, kv_heads)), tokens in itertools.product(MODELS.items(), TOKENS):
    sizes = {"tokens": tokens, "heads": heads, "kv_heads": kv_heads, "head_dim": 128}
    args = op.example(sizes, torch.bfloat16, DEVICE, torch.Generator().manual_seed(0))
    q, k, cos, sin = args[:4]
    dq_out, dk_out = torch.randn_like(q), torch.randn_like(k)
    expected = m.apply_rotary_pos_emb_reference(q.double(), k.double(), cos.double(), sin.double())
    default = m.default_config(make_signature(op, args, DEVICE), device_profile(DEVICE))
    line = f"{model} tokens={tokens}: default {default}"
    if liger is not None and DEVICE.type == "cuda":
        # Liger rotates in place: each replay clones first; the clones' own time is taken off
        fwd = timed(lambda: liger(q.clone(), k.clone(), cos, sin))  # noqa: B023 - timed at once
        copies = timed(lambda: (q.clone(), k.clone()))  # noqa: B023 - timed at once
        line += f"; liger fwd {(fwd - copies) * 1e3:.2f} us (less its clones)"
    print(line, flush=True)
    for block_h, warps in itertools.product((4, 8, 16, 32, 64, 128), (1, 2, 4, 8)):
        config = {"BLOCK_H": block_h, "num_warps": warps}
        forward = m.plan(args, config, device_profile(DEVICE))
        backward = m.backward_plan((dq_out, dk_out, cos, sin, False), config, device_profile(DEVICE))
        if forward.calls[0].kwargs["num_warps"] != warps:
            continue  # capped to fewer warps: the same launch as a smaller config
        got = forward.run()
        ok = all(torch.allclose(g.double(), e, atol=2e-2, rtol=2e-2) for g, e in zip(got, expected))
        fwd_ms, bwd_ms = timed(forward.run), timed(backward.run)
        mark = " <- default" if config == default else ""
        print(f"  BLOCK_H={block_h:4d} warps={warps:2d} programs={forward.calls[0].grid[0]:6d} "
              f"fwd {fwd_ms * 1e3:7.2f} us bwd {bwd_ms * 1e3:7.2f} us correct={ok}{mark}", flush=True)
