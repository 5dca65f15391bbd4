#!/usr/bin/env bash
# Run on the GPU host (device tool), from the repository root, with .whl/ carried (stevedore,
# diskcache, hyperopt, liger-kernel). Stages, in the order given:
#   tests      the suite natively on CUDA (bfloat16 included) and the compile checks
#   tests-quick  the GPU tests of get_op, tuning, rms_norm and silu_and_mul only
#   launch     the warm launch path (dlcore/runtime/launch.py, shelf.py, replay.py) against real kernels, once per
#              Triton version the host has: the installed one, then each site folder named in
#              TRITON_SITES (pip install --target DIR triton==X). The GPU host has only triton 3.6.0.
#   overhead   dlcore's own per-call costs (warm launch, training step, in-process hit, cold disk hit)
#   landscape-matmul, landscape-ffn
#              every config of a space timed (ffn: a random sample within LANDSCAPE_SECONDS)
#   bench      dlcore bench of every op against torch, torch.compile and Liger: docs/results/*.json
#              (bench-ops then bench-gemm: about 11 minutes on the H200, more than one device call
#              may take: run the two apart)
#   bench-ops  the memory-bound ops alone (about 6 minutes)
#   bench-gemm matmul (up and down projections, 48 shapes) and ffn (24 shapes) on the gemm preset, with
#              the Triton and vendor implementations timed alone beside get_op's choice (about 5
#              minutes: 4 to 5 s a shape, most of it torch.compile and the example inputs)
#   bench-gemm-bwd  ffn's backward on the gemm preset, the same columns (2.5 to 4 minutes on the H200,
#              more where the host is slow: give its call 5 minutes); not part of bench
#   bench-attention  issue #14: flash_attention_v2 forward on the attention preset (B 2, H 16, D 128, S 2048 to
#              16384, causal and not) and the decode preset (Sq 1 against Sk 1024 to 65536, GQA 32/8), its
#              backward on the attention preset, each beside SDPA flash and cuDNN with the Triton kernel alone
#              in dlcore[triton]; fused_rotary_and_fa forward and backward against apply_rotary_pos_emb + the
#              best SDPA (the Triton kernel alone in dlcore[triton]); softmax forward and backward at rows of
#              4096 to 131072 against torch and torch.compile. docs/results/*.json as bench; not part of bench (not measured whole yet)
#   bench-moe  issues #18 and #19: fp8_gemm (deepseek-fp8 preset, vs the dequantise path, bf16 cuBLAS and per-tensor cuBLAS fp8), topk_gating
#              forward + backward (gating preset, vs its torch reference), fused_moe forward and backward
#              (moe preset, vs the grouped_mm composite, the Triton kernel alone beside get_op's choice), and
#              fused_moe with fp8 weights (moe-fp8 preset, vs its own bf16 path): about 4 minutes
#   bench-loss fused_linear_cross_entropy (vs the eager composite and Liger-Kernel) and cross_entropy (vs torch and
#              torch.compile), forward + backward, lm-head preset (issue #42)
#   warp-specialize  the warp-specialised kernels (WARP_SPECIALIZE configs) against the defaults: the bf16 GEMM
#              at M 4096 and 16384, the attention forward at D 128 (S 8192, causal and not); JSON lines in
#              $OUT/ws_*.jsonl, each written as it goes (fp8_gemm never specialises: its space says why)
#   rotary     fused_rotary_and_fa's backward against the attention backward alone (.ci/rotary_backward.py) and its training
#              step's host and GPU time against the composite's (.ci/training_step_host.py): $OUT/rotary_*.jsonl
#   first-call the first call in new processes with Triton's cache warm: docs/results/first_call.json
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
      # test_gpu.py first: get_op, launch replays and the launcher on CUDA, before the long kernel files
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
      # docs/results/overhead.json: python3 docs/results/render.py import-overhead overhead.txt
      python3 -m dlcore.bench.overhead warm train hot cold first 2>&1 | tee "$OUT/overhead.txt" ;;
    landscape-matmul)
      # matmul's space (1417 configs on an H200 when landscape_matmul.json was recorded, before WARP_SPECIALIZE):
      # a seeded sample of LANDSCAPE_LIMIT, compiled and timed
      python3 -m dlcore.bench.landscape record matmul --shape tokens=4096,hidden=4096,inter=4096 \
          --dtype bfloat16 --workers 14 --limit "${LANDSCAPE_LIMIT:-400}" --out "$OUT/landscape_matmul.json" \
          2>&1 | tail -1 ;;
    landscape-ffn)
      python3 -m dlcore.bench.landscape record ffn --shape tokens=2048,hidden=4096,inter=4096 \
          --dtype bfloat16 --workers 15 --limit "${LANDSCAPE_LIMIT:-400}" --seconds "${LANDSCAPE_SECONDS:-150}" \
          --out "$OUT/landscape_ffn.json" \
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
    bench|bench-ops|bench-gemm|bench-gemm-bwd|bench-attention|bench-moe|bench-loss)
      # Every op's docs/results JSON (docs/performance.md is rendered from them):
      # OP:MODE:SHAPES:TOKENS:VS[:IMPLS] specs, one `dlcore bench` each, bf16, do_bench, 2 rounds;
      # results.tgz is rewritten after each, so what is done survives a time-out. BENCH_SPECS replaces the list,
      # BENCH_ROUNDS the 2 rounds (more where a baseline's time drifts between rounds, as cuDNN's does).
      ops=(rms_norm:fwd:gqa,deepseek-v3:1,64,4096,16384: rms_norm:bwd:gqa,deepseek-v3:1,64,4096,16384:
           add_rms_norm:fwd:gqa,deepseek-v3:1,64,4096,16384: add_rms_norm:bwd:gqa,deepseek-v3:1,64,4096,16384:
           silu_and_mul:fwd:gqa,deepseek-v3:1,64,4096,16384: silu_and_mul:bwd:gqa,deepseek-v3:1,64,4096,16384:
           apply_rotary_pos_emb:fwd:gqa:1,64,4096,16384: apply_rotary_pos_emb:bwd:gqa:1,64,4096,16384:
           partial_rotary_emb:fwd:mla:1,64,4096,16384: partial_rotary_emb:bwd:mla:1,64,4096,16384:)
      # the gemm preset: M in 1,16,128,1024,4096,16384 on LLaMA-3-8B, LLaMA-3-70B, Qwen2.5-7B and
      # DeepSeek-V3's shared expert; matmul both projections (gemm: K = hidden, N = inter; gemm-down:
      # K = inter, N = hidden), 48 shapes; ffn 24 shapes
      gemm=(matmul:fwd:gemm,gemm-down::torch,compile:triton,vendor ffn:fwd:gemm::torch,compile:triton,vendor)
      # issue #14: the presets' own lengths (attention: S 2048 to 16384; decode: Sk 1024 to 65536)
      rows=4096x4096,2048x16384,1024x32768,256x131072
      attention=(flash_attention_v2:fwd:attention,decode::sdpa_flash,sdpa_cudnn:triton
                 flash_attention_v2:bwd:attention::sdpa_flash,sdpa_cudnn:triton
                 fused_rotary_and_fa:fwd:attention::composite:triton fused_rotary_and_fa:bwd:attention::composite:triton
                 softmax:fwd:$rows::torch,compile softmax:bwd:$rows::torch,compile)
      # issues #18 and #19: fp8_gemm on DeepSeek-V3's shapes against the dequantise-then-bf16 path,
      # topk_gating forward + backward against its torch reference, fused_moe against the grouped_mm composite
      # (forward and backward), and with fp8 weights against its own bf16 path
      moe=(fp8_gemm:fwd:deepseek-fp8::dequant,bf16,scaled_mm_tensor:triton,vendor topk_gating:fwd+bwd:gating::torch
           fused_moe:fwd:moe:1,64,4096,16384:torch:triton fused_moe:bwd:moe:1,64,4096,16384:torch:triton
           fused_moe:fwd:moe-fp8:64,4096,16384:bf16,torch:triton)
      # issue #42: the LM head's loss on LLaMA-3-8B and Qwen2.5-7B at 4096 and 16384 tokens, forward + backward (the
      # fused op refuses a second backward through one forward: its gradients are scaled in place)
      loss=(fused_linear_cross_entropy:fwd+bwd:lm-head::torch,liger cross_entropy:fwd+bwd:lm-head::torch,compile)
      case $stage in
        bench) specs=("${ops[@]}" "${gemm[@]}") ;;
        bench-ops) specs=("${ops[@]}") ;;
        bench-gemm) specs=("${gemm[@]}") ;;
        bench-attention) specs=("${attention[@]}") ;;
        bench-moe) specs=("${moe[@]}") ;;
        bench-loss) specs=("${loss[@]}") ;;
        *) specs=(ffn:bwd:gemm::torch,compile:triton,vendor) ;;
      esac
      [ -n "$BENCH_SPECS" ] && read -r -a specs <<< "$BENCH_SPECS"
      python3 .ci/bench_group.py /tmp/results "$OUT/results.tgz" "${specs[@]}" 2>&1 | tee -a "$OUT/bench.log" | grep -E '^== |geomean' ;;
    warp-specialize)
      SWEEP_SET=ws SWEEP_M=4096,16384 python3 .ci/sweep_gemm.py sweep "$OUT/ws_gemm.jsonl" 2>&1 | tail -3
      SWEEP_D=128 python3 .ci/sweep_attention.py sweep "$OUT/ws_attention.jsonl" 2>&1 | tail -3 ;;
    rotary)
      python3 .ci/rotary_backward.py 2>&1 | tee "$OUT/rotary_backward.jsonl" | tail -8
      python3 .ci/training_step_host.py 2>&1 | tee "$OUT/rotary_training_step.jsonl" | tail -3 ;;
    first-call)
      # the first call in new processes, Triton's cache warm: docs/results/first_call.json
      python3 .ci/first_call.py all --runs 3 --json "$OUT/first_call.json" 2>&1 | tail -20 ;;
    compiler)
      OUT=/tmp/compiler bash .ci/gpu_compiler.sh 2>&1 | tee "$OUT/compiler.log" | tail -25
      tar czf "$OUT/compiler.tgz" -C /tmp/compiler . ;;
  esac
done
