"""Time partial_rotary_emb's backward kernel over its launch choices (heads per step, elements per
thread) at DeepSeek-V2 and V2-Lite sizes on the GPU, CUDA-graph replays; prints one line each.

    python3 .ci/sweep_partial_backward.py
"""

import importlib
import itertools
import os

import torch
import triton

from dlcore.registry import registry

m = importlib.import_module("dlblas_kernels.partial_rotary_emb")

op = registry().op("partial_rotary_emb")
DEVICE = torch.device(os.environ.get("SWEEP_DEVICE", "cuda"))  # cpu (TRITON_INTERPRET=1): a dry run
TOKENS = int(os.environ.get("SWEEP_TOKENS", 4096))
for heads in (128, 16):
    sizes = {"tokens": TOKENS, "heads": heads, "nope_dim": 128, "rope_dim": 64, "v_dim": 128}
    args = op.example(sizes, torch.bfloat16, DEVICE, torch.Generator().manual_seed(0))
    q, k_pe, kv, cos, sin, nope, rope, v = args
    q_out, out_kv = m.plan(args, m.default_config(m.make_signature(op, args, q.device), None)).run()
    dq_out, dout_kv = torch.randn_like(q_out), torch.randn_like(out_kv)
    bwd = (dq_out, dout_kv, cos, sin, k_pe, kv, nope, rope, v)
    nbytes = m.cost(args, "bwd")[0]
    expected = m.partial_rotary_emb_backward_reference(dq_out, dout_kv, cos, sin, nope, rope, v)
    for cap, per_thread in itertools.product((4, 8, 16, 32, 64, 128), (8, 16, 32, 64, 128)):
        if cap > heads:
            continue
        m.BACKWARD_HEADS, m.BACKWARD_PER_THREAD = cap, per_thread
        plan = m.backward_plan(bwd, {"BLOCK_H": 128, "num_warps": 8})
        try:
            got = plan.run()
            ok = all(torch.allclose(g.float(), e.float(), atol=5e-2, rtol=2e-2) for g, e in zip(got, expected))
            ms = triton.testing.do_bench_cudagraph(plan.run, rep=40) if DEVICE.type == "cuda" else 1.0
        except Exception as exc:  # noqa: BLE001
            print(f"heads={heads} cap={cap} per_thread={per_thread} failed: {type(exc).__name__}: {exc}"[:200])
            continue
        print(f"heads={heads:4d} cap={cap:4d} per_thread={per_thread:4d} warps={plan.calls[0].kwargs['num_warps']:3d} "
              f"{ms * 1e3:8.2f} us {nbytes / ms / 1e6:7.0f} GB/s correct={ok}", flush=True)
