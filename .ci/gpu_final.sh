#!/usr/bin/env bash
# One device call: GPU tests of the rotary kernels, backward benches (CUDA-graph timer at the large
# shapes, do_bench at the small ones), rms_norm fwd under both timers at 64-128 MiB.
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
bash .ci/gpu.sh > "$OUT/install.txt" 2>&1
export PYTHONPATH=/tmp/site DLCORE_CACHE_DIR=/tmp/dlcore-cache
timeout 70 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_apply_rotary_pos_emb.py > "$OUT/rotary_tests.txt" 2>&1
tail -3 "$OUT/rotary_tests.txt"
b() { timeout "$1" python3 -m dlcore.cli bench "${@:2}" --dtype bf16 --rounds 2 2>/dev/null; }
{
for op in rms_norm add_rms_norm silu_and_mul apply_rotary_pos_emb; do
  b 50 $op --mode bwd --shapes gqa --tokens 4096,16384 --timer cudagraph
done
b 40 partial_rotary_emb --mode bwd --shapes mla --tokens 4096,16384 --timer cudagraph
for op in apply_rotary_pos_emb silu_and_mul; do
  b 40 $op --mode bwd --shapes gqa --tokens 1,64
done
b 40 rms_norm --mode fwd --shapes gqa --tokens 4096 --timer cudagraph
} > "$OUT/bench_final.txt" 2>&1
grep -E "on NVIDIA|geomean|^ +min" "$OUT/bench_final.txt"
