"""fused_rotary_and_fa's backward on the GPU (``attention_grad.rotary_backward_plan``: q and k
rotated into scratch, flash attention's backward, dq' and dk' rotated back) against flash
attention's backward alone on the rotated q and k (``attention_grad.backward_plan``): what the two
rotation passes cost. bf16, B 2, H 16, D 128, Sk 2048 to 16384, Sq = Sk and Sq = Sk / 2 (the
queries the tables' last rows), causal and not; one JSON line per shape (do_bench medians of the
plans' launches). The rotation inside the backward's loops, which this plan replaced, was timed
against it by this script at 34d6caa.

    python3 .ci/rotary_backward.py
"""
import json

import torch
from dlblas_kernels.blocks import attention_grad
from dlblas_kernels.blocks.rotary import rotation_calls
from dlblas_kernels.kernels import fused_rotary_and_fa as F
from triton.testing import do_bench

from dlcore.declarations.implementation import LaunchPlan
from dlcore.declarations.signature import make_signature
from dlcore.runtime.template import device_profile

profile = device_profile(torch.device("cuda"))
for sk in (2048, 4096, 8192, 16384):
    for sq in (sk, sk // 2):
        for causal in (False, True):
            g = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(2, sq, 16, 128, device="cuda", dtype=torch.bfloat16, generator=g)
            k, v = (torch.randn(2, sk, 16, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
            cos, sin = (torch.randn(sk, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
            fargs = (q, k, v, cos, sin, causal, None, False)
            config = F.KERNEL.implementation.default_config(make_signature(F.OP, fargs, q.device), profile)
            out, lse = F.training_plan(fargs, config, profile).run()
            dout = torch.randn_like(out)
            q_rot, k_rot = torch.empty_like(q), torch.empty_like(k)
            LaunchPlan(rotation_calls(q, k, q_rot, k_rot, cos, sin, False, profile), (q_rot, k_rot)).run()
            plans = {
                "rotary_backward": attention_grad.rotary_backward_plan(
                    (dout, q, k, v, cos, sin, out, lse, causal, None, False), {}, profile),
                "attention_backward": attention_grad.backward_plan(
                    (dout, q_rot, k_rot, v, out, lse, None, causal, None), {}, profile),
            }
            row = {"sq": sq, "sk": sk, "causal": causal}
            for name, plan in plans.items():
                ms = do_bench(lambda p=plan: p.run(), warmup=10, rep=60, return_mode="median")
                row[name + "_us"] = round(1000 * ms, 1)
            row["rotation_share"] = round(1 - row["attention_backward_us"] / row["rotary_backward_us"], 3)
            print(json.dumps(row), flush=True)
