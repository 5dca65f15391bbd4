#!/usr/bin/env bash
# The compiler side on the GPU host, after the install step (.ci/gpu.sh) put the distributions on
# PYTHONPATH. Writes under $OUT:
#   folding.md / folding.json   grid folding on cuda, folded vs as launched, side by side
#                               (triton.testing.do_bench medians; results checked bit for bit)
#   lower_report_cuda90.txt     `dlcore lower --all --report --target cuda:90` (and with grid_folding)
#   dump/                       DLC_DUMP_IR=1 on a real launch: every stage of the kernels it compiled
# Runs in about two minutes on an H200; each step has its own time limit.
#
# Locally, without a GPU, the benchmark's logic can be checked in the interpreter:
#   TRITON_INTERPRET=1 OUT=/tmp/out SMALL=1 bash .ci/gpu_compiler.sh
set -o pipefail
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
WORK=$(mktemp -d)
# @triton.jit needs its kernel in a file: the benchmark is written out, then run.
cat > "$WORK/bench_folding.py" <<'PY'
"""Grid folding on CUDA: each case launched as planned and folded onto P programs, side by side."""

import json
import math
import os
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

from dlcore.compiler import folding
from dlcore.declarations.implementation import KernelCall, LaunchPlan
from dlcore.plugins.registry import registry
from dlcore.declarations.signature import make_signature

SMALL = os.environ.get("SMALL") == "1"  # interpreter check of the logic: tiny sizes
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SIZES = (10, 30, 100) if SMALL else (10_000, 100_000, 1_000_000)  # logical programs (blocks)


@triton.jit
def axpb_kernel(x_ptr, out_ptr, n, a, b, BLOCK: tl.constexpr):
    # out = a * x + b over one block of BLOCK elements
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * a + b, mask=mask)


def elementwise(blocks, block, warps):
    n = blocks * block
    x = torch.randn(n, device=DEVICE)
    out = torch.empty_like(x)
    return LaunchPlan([KernelCall(axpb_kernel, (blocks,), (x, out, n, 2.0, 1.0),
                                  {"BLOCK": block, "num_warps": warps})], out)


def op_plan(name, args):
    """The op's plan with its default config; inputs drawn on the device (the op's example draws on
    the host, far too slowly for billions of elements)."""
    reg = registry()
    op = reg.op(name)
    impl = next(i for i in reg.implementations_of(name) if i.kind == "triton")
    return impl.plan(args, impl.default_config(make_signature(op, args, DEVICE), None), reg.device_profile(DEVICE))


def randn(*shape):
    return torch.randn(*shape, device=DEVICE, dtype=torch.float16)


def silu_and_mul(tokens, inter):
    return op_plan("silu_and_mul", (randn(tokens, 2 * inter),))


def rms_norm(tokens, hidden):
    return op_plan("rms_norm", (randn(tokens, hidden), 1 + 0.1 * randn(hidden), 1e-6))


def cases():
    """(case, plan factory) for 1e4, 1e5 and 1e6 logical programs each."""
    for g in SIZES:
        yield f"axpb BLOCK=128 1 warp, {g} blocks", lambda g=g: elementwise(g, 128, 1)
    for g in SIZES:
        yield f"axpb BLOCK=1024 4 warps, {g} blocks", lambda g=g: elementwise(g, 1024, 4)
    for g in SIZES:
        yield f"silu_and_mul inter=128 tokens={g}", lambda g=g: silu_and_mul(g, 128)
    for g in SIZES:
        tokens = max(g // 4, 1)  # 4 column blocks of 1024 per row
        yield f"silu_and_mul inter=4096 tokens={tokens}", lambda t=tokens: silu_and_mul(t, 4096)
    for g in SIZES:
        yield f"rms_norm hidden=4096 tokens={g}", lambda g=g: rms_norm(g, 4096)
    for g in SIZES:
        tokens = g * 16  # the default config packs 16 short rows per program
        yield f"rms_norm hidden=128 tokens={tokens}", lambda t=tokens: rms_norm(t, 128)


def timer(fn):
    if DEVICE.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=10, rep=60, return_mode="median"))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def folded(plan, programs, loop_stages=None):
    return LaunchPlan([folding.fold_call(c, programs, loop_stages) for c in plan.calls], plan.result)


def main():
    reg = registry()
    backend = reg.backends["cuda" if DEVICE.type == "cuda" else "cpu"]
    profile = reg.profile(backend, DEVICE)
    sms = profile.cores if DEVICE.type == "cuda" else 4
    rows = []
    for case, make in cases():
        plan = make()
        call = plan.calls[0]
        logical = math.prod(call.grid)
        policy = folding.programs_for(call, profile) if DEVICE.type == "cuda" else 16
        reference = plan.run().clone()
        row = {"case": case, "kernel": call.kernel.fn.__name__, "G": logical,
               "num_warps": call.kwargs.get("num_warps", 4), "unfolded_ms": timer(plan.run), "folded": {}}
        # "unpipelined": the folded loop as tl.range(..., num_stages=1), which Triton does not pipeline
        variants = (("P=SMs", sms, None), ("P=4xSMs", 4 * sms, None), ("P=policy", policy, None),
                    ("P=policy unpipelined", policy, 1))
        for label, programs, loop_stages in variants:
            programs = min(programs, logical)
            variant = folded(plan, programs, loop_stages)
            plan.result.fill_(float("nan")) if plan.result.is_floating_point() else plan.result.fill_(-1)
            exact = torch.equal(variant.run(), reference)
            row["folded"][label] = {"P": programs, "ms": timer(variant.run), "bit_exact": exact}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
        del plan, reference
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
    return rows, profile


def markdown(rows, profile):
    lines = [f"Grid folding on {profile.describe()}: median ms (triton.testing.do_bench); speedup = unfolded / folded.",
             "",
             "| case | kernel | G | warps | unfolded ms | P=SMs ms | P=4xSMs ms | P=policy (P) ms "
             "| P=policy unpipelined ms | best speedup | bit-exact |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = r["folded"]
        best = min(v["ms"] for v in f.values())
        exact = all(v["bit_exact"] for v in f.values())
        lines.append(
            f"| {r['case']} | {r['kernel']} | {r['G']} | {r['num_warps']} | {r['unfolded_ms']:.4f} "
            f"| {f['P=SMs']['ms']:.4f} | {f['P=4xSMs']['ms']:.4f} "
            f"| {f['P=policy']['ms']:.4f} ({f['P=policy']['P']}) | {f['P=policy unpipelined']['ms']:.4f} "
            f"| {r['unfolded_ms'] / best:.2f}x | {exact} |")
    return "\n".join(lines)


if __name__ == "__main__":
    out = sys.argv[1]
    rows, profile = main()
    text = markdown(rows, profile)
    print(text)
    with open(os.path.join(out, "folding.json"), "w") as f:
        json.dump({"device": profile.describe(), "rows": rows}, f, indent=1)
    with open(os.path.join(out, "folding.md"), "w") as f:
        f.write(text + "\n")
PY

status=0
echo "== grid folding: folded vs as launched" | tee "$OUT/compiler.log"
(cd "$WORK" && timeout 170 python3 bench_folding.py "$OUT") 2>>"$OUT/compiler.log" || status=1

echo "== dlcore lower --all --report --target cuda:90"
{
  # lowering compiles for real: never under the interpreter
  TRITON_INTERPRET=0 timeout 60 python3 -m dlcore.cli lower --all --report --target cuda:90
  echo
  echo "with --pass grid_folding (example shapes with tokens=65536):"
  TRITON_INTERPRET=0 timeout 60 python3 -m dlcore.cli lower --all --report --target cuda:90 --pass grid_folding \
      --shape tokens=65536
} 2>>"$OUT/compiler.log" | tee "$OUT/lower_report_cuda90.txt" || status=1

if [ -z "$SMALL" ]; then
  echo "== DLC_DUMP_IR=1 on a real launch"
  DLC_DUMP_IR=1 DLC_DUMP_DIR="$OUT/dump" timeout 60 python3 - <<'PY' 2>>"$OUT/compiler.log" || status=1
import torch
from dlcore.compiler.rewrite import apply_launch_passes
from dlcore.plugins.registry import registry
from dlcore.declarations.signature import make_signature

reg = registry()
device = torch.device("cuda")
profile = reg.profile(reg.backends["cuda"], device)
for name in ("silu_and_mul", "rms_norm"):
    op = reg.op(name)
    impl = next(i for i in reg.implementations_of(name) if i.kind == "triton")
    args = op.example(op.example_sizes, torch.float16, device, torch.Generator().manual_seed(0))
    plan = impl.plan(args, impl.default_config(make_signature(op, args, device), profile))
    result = apply_launch_passes(plan, profile).run()
    torch.cuda.synchronize()
    torch.testing.assert_close(result, op.reference(*args), atol=2e-2, rtol=2e-2)
print("dumped and checked")
PY
  (cd "$OUT/dump" && find . -type f | sort) | tee "$OUT/dump_files.txt"
fi
rm -rf "$WORK"
exit $status
