"""Time fused_rotary_and_fa, forward and backward, against the composite (dlblas apply_rotary_pos_emb,
then SDPA with the cuDNN backend, or the flash one) on the GPU: bfloat16, B 2, D 128, LLaMA's
tables, causal or not, at each sequence length; do_bench medians, the implementations alternating
in one process. Prints one line per (shape, mode) and writes the rows as JSON to $OUT.

    python3 .ci/bench_fused_rotary.py          # BENCH_SEQ=2048,8192,16384 BENCH_HEADS=16/16
"""

import json
import os

import torch
import triton
from dlblas_kernels import apply_rotary_pos_emb
from dlblas_kernels.blocks.sdpa import sdpa_attention as sdpa
from dlblas_kernels.kernels.fused_rotary_and_fa import OP, fused_rotary_and_fa
from torch.nn.attention import SDPBackend

SEQ = [int(s) for s in os.environ.get("BENCH_SEQ", "2048,8192,16384").split(",")]
HEADS = [tuple(int(h) for h in pair.split("/")) for pair in os.environ.get("BENCH_HEADS", "16/16").split(",")]
REP = int(os.environ.get("BENCH_REP", "60"))


def composite(backend):
    def run(q, k, v, cos, sin, causal, scale, interleaved):
        q, k = apply_rotary_pos_emb(q, k, cos, sin, interleaved)
        return sdpa(q, k, v, causal, scale, backend)
    return run


IMPLS = {"fused": fused_rotary_and_fa, "cudnn": composite(SDPBackend.CUDNN_ATTENTION),
         "flash": composite(SDPBackend.FLASH_ATTENTION)}


def timings(args, dout):
    leaves = [t.detach().requires_grad_() for t in args[:3]]
    fwd, bwd = {}, {}
    for _ in range(int(os.environ.get("BENCH_ROUNDS", "2"))):  # alternating rounds; the best median of each
        for name, fn in IMPLS.items():
            try:
                f = triton.testing.do_bench(lambda fn=fn: fn(*args), warmup=10, rep=REP)
                out = fn(*leaves, *args[3:])
                b = triton.testing.do_bench(
                    lambda out=out: torch.autograd.grad(out, leaves, dout, retain_graph=True), warmup=10, rep=REP)
            except Exception as exc:  # noqa: BLE001 - a backend refusing a shape is a result
                print(f"  {name}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            fwd[name] = min(fwd.get(name, f), f)
            bwd[name] = min(bwd.get(name, b), b)
    return fwd, bwd


rows = []
for hq, hk in HEADS:
    for seq in SEQ:
        for causal in (False, True):
            sizes = {"batch": 2, "seq": seq, "kv_seq": 0, "heads": hq, "kv_heads": hk, "head_dim": 128,
                     "causal": int(causal), "interleaved": 0}
            args = OP.example(sizes, torch.bfloat16, torch.device("cuda"), torch.Generator().manual_seed(0))
            dout = torch.randn_like(args[0])
            fwd, bwd = timings(args, dout)
            for mode, times in (("fwd", fwd), ("bwd", bwd)):
                flops = OP.cost(args, mode)[1]
                best = min((t for n, t in times.items() if n != "fused"), default=float("nan"))
                row = {"heads": hq, "kv_heads": hk, "seq": seq, "causal": causal, "mode": mode,
                       "ms": times, "tflops": {n: flops / t / 1e9 for n, t in times.items()},
                       "speedup_vs_best_composite": best / times["fused"] if "fused" in times else None}
                rows.append(row)
                print(f"H{hq}/{hk} S{seq} {'causal' if causal else 'full  '} {mode}: "
                      + "  ".join(f"{n} {t * 1e3:.0f} us ({flops / t / 1e9:.0f} TFLOP/s)" for n, t in times.items())
                      + f"  fused vs best composite {row['speedup_vs_best_composite'] or float('nan'):.3f}x",
                      flush=True)
with open(os.path.join(os.environ.get("OUT", "/tmp"), "bench_fused_rotary.json"), "w") as f:
    json.dump(rows, f, indent=1)
