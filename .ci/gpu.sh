#!/usr/bin/env bash
# Run on the GPU host (device tool), from the repository root, with .whl/ carried (stevedore,
# diskcache, hyperopt, liger-kernel). Stages, in the order given:
#   tests      the suite natively on CUDA (bfloat16 included) and the compile checks
#   tests-quick  the GPU tests of get_op, tuning, rms_norm and silu_and_mul only
#   launch     the warm launch path (dlcore/runtime/launch.py) against real compiled kernels, once per
#              Triton version the host has: the installed one, then each site folder named in
#              TRITON_SITES (pip install --target DIR triton==X). The GPU host has only triton 3.6.0.
#   overhead   dlcore's own per-call costs (warm launch, in-process hit, cold disk hit)
#   landscape-matmul, landscape-ffn
#              every config of a space timed (ffn: a random sample within LANDSCAPE_SECONDS)
#   bench      dlcore bench of the memory-bound ops against torch, torch.compile and Liger
#   compiler   grid folding measurements and the `dlcore lower --all --report` table
# e.g. bash .ci/gpu.sh tests overhead. Results land under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ -z "$GPU_INSTALLED" ]; then  # set by a first run that installed, so later stages can skip it
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target /tmp/site \
      . plugins/dlc_cuda plugins/dlc_ascend plugins/dlc_mlu plugins/dlblas_kernels || exit 1
fi
export PYTHONPATH=/tmp/site DLCORE_CACHE_DIR=/tmp/dlcore-cache
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
} | tee "$OUT/versions.txt"

for stage in "$@"; do
  case $stage in
    tests)
      # test_gpu.py first: get_op, launch templates and the launcher on CUDA, before the long kernel files
      python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py tests/kernels tests/test_compile.py \
          tests/test_backends.py tests/test_tuning.py 2>&1 | tee "$OUT/tests.log" | tail -12 ;;
    tests-quick)
      python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py tests/test_tuning.py tests/kernels/test_rms_norm.py \
          tests/kernels/test_silu_and_mul.py 2>&1 | tee "$OUT/tests_quick.log" | tail -6 ;;
    launch)
      for site in "" $TRITON_SITES; do
        PYTHONPATH=${site:+$site:}$PYTHONPATH python3 -c "import triton; print('triton', triton.__version__)"
        PYTHONPATH=${site:+$site:}$PYTHONPATH python3 -m pytest -q -p no:cacheprovider -rs tests/test_replay.py \
            tests/test_gpu.py -k "real_kernel or shelf or replay or specialization" 2>&1 | tail -4
      done 2>&1 | tee "$OUT/launch.log" ;;
    overhead)
      python3 -m dlcore.bench.overhead warm hot cold first 2>&1 | tee "$OUT/overhead.txt" ;;
    landscape-matmul)
      python3 -m dlcore.bench.landscape record matmul --shape tokens=4096,hidden=4096,inter=4096 \
          --dtype bfloat16 --workers 14 --out "$OUT/landscape_matmul.json" 2>&1 | tail -1 ;;
    landscape-ffn)
      python3 -m dlcore.bench.landscape record ffn --shape tokens=2048,hidden=4096,inter=4096 \
          --dtype bfloat16 --workers 15 --seconds "${LANDSCAPE_SECONDS:-150}" --out "$OUT/landscape_ffn.json" \
          2>&1 | tail -1 ;;
    landscape-rotary)
      # the rotary kernels' whole spaces at large shapes (is any config at 90% of a copy?), each file
      # written to $OUT as soon as it is done; ROTARY_SECONDS bounds each (a random sample beyond)
      for shape in tokens=16384,heads=32,kv_heads=8,head_dim=128 tokens=4096,heads=28,kv_heads=4,head_dim=128; do
        python3 -m dlcore.bench.landscape record apply_rotary_pos_emb --shape $shape --dtype bfloat16 --workers 15 \
            --seconds "${ROTARY_SECONDS:-60}" --out "$OUT/rotary_${shape//[=,]/_}.json" 2>&1 | tail -1
      done
      for shape in tokens=4096,heads=128,nope_dim=128,rope_dim=64,v_dim=128; do
        python3 -m dlcore.bench.landscape record partial_rotary_emb --shape $shape --dtype bfloat16 --workers 15 \
            --seconds "${ROTARY_SECONDS:-60}" --out "$OUT/partial_${shape//[=,]/_}.json" 2>&1 | tail -1
      done ;;
    bench)
      # BENCH_OPS and BENCH_MODES narrow the runs (default: every memory-bound op, fwd and bwd);
      # BENCH_TIMER=cudagraph times CUDA-graph replays (no host time), BENCH_TOKENS the token counts
      mkdir -p /tmp/bench
      python3 - <<'PY' 2>&1 | tee -a /tmp/bench/bench.log | grep -v '^\['
import os
from dlcore.cli import main
shapes = {"rms_norm": "gqa,deepseek-v3", "add_rms_norm": "gqa,deepseek-v3", "silu_and_mul": "gqa,deepseek-v3",
          "apply_rotary_pos_emb": "gqa", "partial_rotary_emb": "mla"}
ops = os.environ.get("BENCH_OPS", " ".join(shapes)).split()
modes = os.environ.get("BENCH_MODES", "fwd bwd").split()
timer = os.environ.get("BENCH_TIMER", "do_bench")
tokens = os.environ.get("BENCH_TOKENS", "1,64,4096,16384")
for op in ops:
    for mode in modes:
        stem = f"/tmp/bench/{op}_{mode}_{timer}"
        main(["bench", op, "--mode", mode, "--dtype", "bf16", "--shapes", shapes[op],
              "--tokens", tokens, "--rounds", "2", "--timer", timer, "--json", stem + ".json", "--plot", stem + ".png"])
        os.system(f"tar czf {os.environ['OUT']}/bench.tgz -C /tmp/bench .")  # what is done survives a time-out
PY
      tar czf "$OUT/bench.tgz" -C /tmp/bench . ;;
    compiler)
      OUT=/tmp/compiler bash .ci/gpu_compiler.sh 2>&1 | tee "$OUT/compiler.log" | tail -25
      tar czf "$OUT/compiler.tgz" -C /tmp/compiler . ;;
  esac
done
