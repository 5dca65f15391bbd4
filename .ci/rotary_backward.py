"""fused_rotary_and_fa's backward on the GPU: q and k rotated into scratch around the attention
backward (``fused_rotary_and_fa.backward_plan``, Sq == Sk) against the rotation inside the
backward's loops (``attention_grad.rotary_backward_plan``), bf16, B 2, H 16, D 128, S 2048 to 16384,
causal and not; one JSON line per shape with both times (do_bench medians of the plans' launches)
and the largest relative difference between the two paths' gradients.

    python3 .ci/rotary_backward.py
"""
import json

import torch
from dlblas_kernels import attention_grad
from dlblas_kernels.kernels import fused_rotary_and_fa as F
from triton.testing import do_bench

from dlcore.declarations.signature import make_signature
from dlcore.runtime.template import device_profile

profile = device_profile(torch.device("cuda"))
for s in (2048, 4096, 8192, 16384):
    for causal in (False, True):
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(2, s, 16, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        cos, sin = (torch.randn(s, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        fargs = (q, k, v, cos, sin, causal, None, False)
        config = F.KERNEL.implementation.default_config(make_signature(F.OP, fargs, q.device), profile)
        fwd = F.training_plan(fargs, config, profile)
        out, lse = fwd.run()
        dout = torch.randn_like(out)
        args = (dout, q, k, v, cos, sin, out, lse, causal, None, False)
        row = {"seq": s, "causal": causal}
        grads = {}
        for name, make in (("scratch", F.backward_plan), ("in_loop", attention_grad.rotary_backward_plan)):
            plan = make(args, {}, profile)
            grads[name] = [t.float().clone() for t in plan.run()]
            ms = do_bench(lambda p=plan: p.run(), warmup=10, rep=60, return_mode="median")
            row[name + "_us"] = round(1000 * ms, 1)
        row["speedup"] = round(row["in_loop_us"] / row["scratch_us"], 3)
        row["max_rel_diff"] = max(float((a - b).norm() / b.norm()) for a, b in zip(grads["scratch"], grads["in_loop"]))
        print(json.dumps(row), flush=True)
