#!/usr/bin/env python3
"""Render docs/performance.md from the JSON results beside this file (standard library only).

    python3 docs/results/render.py                 write docs/performance.md
    python3 docs/results/render.py --check         exit 1 if docs/performance.md is not what the JSON gives
    python3 docs/results/render.py import-overhead FILE.txt
                                                   turn the output of `python3 -m dlcore.bench.overhead
                                                   warm hot cold first` into docs/results/overhead.json

Inputs, all in this folder:
- ``OP_MODE.json``: ``dlcore bench ... --json`` (``bash .ci/gpu.sh bench``), one per op and mode;
- ``overhead.json``: dlcore's own costs per call (``import-overhead`` above);
- ``first_call.json``: ``python3 .ci/first_call.py all --json docs/results/first_call.json``;
- ``e2e/PRESET.json``: the end-to-end benchmark of a transformers model (``dlcore bench-model``,
  ``bash .ci/e2e_bench.sh`` on a CUDA GPU).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PAGE = os.path.join(os.path.dirname(HERE), "performance.md")
OWN = "dlcore"
#: the order of the sections; ops not listed here follow in name order
OP_ORDER = ("rms_norm", "add_rms_norm", "silu_and_mul", "apply_rotary_pos_emb", "partial_rotary_emb", "matmul", "ffn",
            "flash_attention_v2", "fused_rotary_and_fa", "softmax")
MODE_ORDER = ("fwd", "bwd", "fwd+bwd")
BASELINE_NAMES = {"torch": "eager PyTorch", "compile": "torch.compile", "liger": "Liger-Kernel",
                  "dequant": "dequantise to bf16, then torch.matmul",
                  "bf16": "bf16 cuBLAS on operands dequantised beforehand",
                  "scaled_mm_tensor": "cuBLAS fp8, one scale per tensor (torch._scaled_mm)"}
#: the SDPA baselines of the attention ops: F.scaled_dot_product_attention with one backend each
SDPA = ("sdpa_flash", "sdpa_cudnn")
#: working sets from which the fraction of the copy bandwidth is summarized
LARGE_MIB = 64

OP_NOTES = {
    "rms_norm": "`rms_norm(x, w, eps)`: x `[tokens, hidden]`; backward: dx and dw.",
    "add_rms_norm": "`add_rms_norm(x, residual, w, eps)`: the residual add fused with the norm.",
    "silu_and_mul": "`silu_and_mul(x)`: x `[tokens, 2 * inter]`, SwiGLU of its two halves.",
    "apply_rotary_pos_emb": "`apply_rotary_pos_emb(q, k, cos, sin)`: rotary embedding of q `[tokens, heads, head_dim]` "
                            "and k `[tokens, kv_heads, head_dim]` (GQA models).",
    "partial_rotary_emb": "`partial_rotary_emb`: MLA's rotary part (the 64 rope dimensions of each query head and of "
                          "the shared key head; DeepSeek models).",
    "fp8_gemm": "`fp8_gemm(a, b, a_scale, b_scale)`: float8_e4m3fn a `[tokens, hidden]` @ b `[inter, hidden]`.T with "
                "DeepSeek-V3's block scales (1x128 of a, 128x128 of b), bf16 out, at DeepSeek-V3's shapes "
                "(`--shapes deepseek-fp8 --vs dequant,bf16,scaled_mm_tensor`). `dequant`: both operands dequantised "
                "to bf16, then a bf16 GEMM; `bf16`: that GEMM alone (the operands dequantised once, untimed); "
                "`scaled_mm_tensor`: cuBLAS fp8 on the operands quantised again with one scale per tensor (once, "
                "untimed), the fp8 rate without block scales. `vendor` is cuBLASLt's blockwise GEMM where torch "
                "reaches it.",
    "matmul": "`matmul(a, b, bias=None, activation=None, allow_tf32=False)`: a `[tokens, hidden]` @ b, b the `w.T` "
              "view of an nn.Linear weight `w [inter, hidden]` (no copy; M = tokens, K = hidden, N = inter), no bias "
              "or activation. A model marked (down) is its MLP's down projection: `hidden` (K) is then the model's "
              "intermediate size and `inter` (N) its hidden size. `torch` is cuBLAS (`torch.matmul`); `dlcore[torch]` "
              "is the same call as get_op's vendor candidate.",
    "ffn": "`ffn(x, w1, w3, rms_w, eps=1e-6, w13=None)`: RMSNorm, the gate and up projections and SwiGLU in one op "
           "(here with w1 and w3 `[inter, hidden]`). `dlcore[triton]` is the fused kernels (weight streaming up to 64 "
           "rows, on sm_90 through tensor descriptors where each program's columns nearly fill its tile; else a row "
           "kernel and one GEMM, on sm_90 w1's and w3's tiles side by side in one product, SwiGLU in its epilogue, "
           "the last partial wave of tiles split over K), `dlcore[torch]` "
           "the vendor candidate (F.rms_norm, two cuBLAS GEMMs, SwiGLU), `compile` the best composite (one GEMM over "
           "`[w1; w3]`). The backward times dlcore's from saved pre-activations and normalised input `xn` (the "
           "forward under autograd stores them, its row kernel writing `xn` in place of `x * rms_w`; dxn through "
           "descriptors on sm_90 where its reduction is not sliced). The weight "
           "streaming splits K where its column blocks leave more than a quarter of the "
           "multiprocessors idle (Qwen2.5-7B and DeepSeek-V3's shared expert at 1 and 16 tokens: 8 K slices each, "
           "and a second launch adding them); in the backward table get_op is asked for a training call, whose "
           "candidates it times forward and backward.",
    "fused_moe": "`fused_moe(hidden, w13, w2, topk_weights, topk_ids, w13_scale=None, w2_scale=None)`: routed SwiGLU "
                 "experts, Mixtral-8x7B's (E 8, k 2, H 4096, I 14336) and DeepSeek-V3's (E 256, k 8, H 7168, I 2048), "
                 "a softmax top-k routing of random logits. `torch` is the grouped_mm composite (sort by expert, "
                 "gather, `torch._grouped_mm` for w13, SwiGLU, `torch._grouped_mm` for w2, weighted `index_add_`), "
                 "also get_op's vendor candidate; the backward computes the gradients of hidden, w13, w2 and "
                 "topk_weights. The fp8 table (`fused_moe_fp8_fwd.json`, `--shapes moe-fp8`) gives the layer "
                 "float8_e4m3fn weights with 128x128 block scales; `bf16` is this library's own 16-bit path on "
                 "the same weights dequantised (once, untimed), what issue #19's 1.5x target is measured against, "
                 "and `torch` the composite dequantising the weights in each call.",
    "flash_attention_v2": "`flash_attention_v2(q, k, v, causal=False, softmax_scale=None, return_lse=False)`: "
                          "q `[B, Sq, Hq, D]`, k and v `[B, Sk, Hk, D]`. The attention preset: B 2, H 16, D 128, "
                          "S 2048 to 16384, causal or not (flop counts halved by the mask); decode: one query (Sq 1, "
                          "GQA 32/8) against Sk 1024 to 65536 keys, memory-bound. `sdpa_flash` and `sdpa_cudnn` are "
                          "`F.scaled_dot_product_attention` with the flash or the cuDNN backend alone, which are also "
                          "get_op's vendor candidates; `dlcore[triton]` is the Triton kernel alone. The backward "
                          "computes dq, dk and dv.",
    "fused_rotary_and_fa": "`fused_rotary_and_fa(q, k, v, cos, sin, causal=False)`: the rotary embedding applied to "
                           "q and k inside the attention kernel (the rotated q and k never written). `composite` is "
                           "dlblas `apply_rotary_pos_emb` then the fastest SDPA backend that accepts the inputs.",
    "softmax": "`softmax(x, dim=-1)`: x `[tokens, vocab]`, rows of 4096 to 131072 (vocabulary sizes); rows up to 16384 "
               "are held whole in registers, longer ones take an online pass and a normalising pass that re-reads "
               "the row last block first, its loads and stores marked evict-first so that the blocks still to be "
               "re-read stay in L2 (1024 x 32768: 49.3 -> 44.4 us, 256 x 131072: 54.5 -> 48.4 us against the "
               "2026-12-01 table). Reading a long row once needs it held on chip across SMs (a cluster's "
               "distributed shared memory, which Triton does not expose); splitting it over programs that wait "
               "for each other, and a grid of 2 to 8 programs an SM taking rows in turn, were measured no faster "
               "(below). The backward table is from 2026-12-01; the backward "
               "at 4096 x 4096 re-measured on a later lease of the H200 host (2026-12-02, `python3 "
               ".ci/backward_host.py softmax:triton`): do_bench 65.7 us with autograd's device threads on (the "
               "default; host 79 us a call), 30.0 us with them off (host 48 us), the GPU alone 26.4 us (a CUDA "
               "graph), against the 178 us of the table: the time there is the host's (the engine handing the "
               "backward to its device thread), not the kernel's.",
}


#: measurements behind each op's heuristics and design choices, from the sweeps that chose them
#: (not regenerated by this script; each gives its device and command): a list under each op's notes
OP_MEASURED = {
    "flash_attention_v2": [
        "The default blocks by the head's tile width (H200, bf16, B 2, H 16, S 8192, descriptor loads; TFLOP/s "
        "non-causal / causal, SDPA flash 359 / 303 and cuDNN 684 / 557 at D 128): up to 64, 128 x 128 blocks, "
        "4 warps, 3 stages: 430 / 406 (8 warps: 359 / 322); up to 128, 128 x 128 blocks, 8 warps, 3 stages: "
        "512 / 447 (128 x 64, 8 warps, 3 stages: 464 / 438; 2 stages: 447 / 395; 64-row blocks with 4 warps: "
        "440 / 362); wider, 128 x 64 blocks, 8 warps, 2 stages (what fits): 528 / 488 (64 x 64, 4 warps, 3 "
        "stages: 487 / 403).",
        "Decoding's split count (`attention_decode.default_config`; H200, bf16, GQA 32/8, D 128, Sq 1, "
        "`.ci/profile_decode.py sweep`, GPU time, 2026-12-04): Sk 1024 11.2 us in 16 splits against 11.65 in "
        "8, Sk 8192 20.9 in 16 against 22.0 in 22 (176 programs on 132 multiprocessors), Sk 16384 31.5 in 16 "
        "or 33, Sk 65536 79.5 in 33 against 80.2 in 16: at B 1, Sk 1024 to 16384 fastest at one program a "
        "multiprocessor, 65536 at two (`LONG_CACHE`). A decode plan that does not declare its scratch plans "
        "and launches through the slow path on every call: about 100 us of host time on the H200's host, "
        "more than the kernels' own time below Sk 16384.",
        "The backward (`attention_grad.py`; H200, bf16, B 2, H 16, S 8192, D 128): 6.90 ms (398 TFLOP/s at 2.5 x "
        "the forward's 4 B H S^2 D; causal 3.68 ms, 373) against SDPA's flash backward 8.89 ms (309) and "
        "cuDNN's 5.18 ms (531).",
        "The backward's tiles (`HOPPER_TILES`; H200, bf16, B 2, S 8192, heads 16/16 and 32/8, "
        "`.ci/sweep_attention_backward.py`, each kernel timed alone, tensor descriptors on): D 128 dkdv (64, "
        "32, 4, 3) 4.09 ms against 4.36 for (128, 64, 8, 2) without the mask, 2.39 against 2.22 with it (GQA "
        "8.16 / 9.01 and 4.87 / 4.56 ms); dq (128, 64, 8, 3) best of six either way (2.65 ms, causal 1.39). "
        "D 64: dkdv (128, 32, 4, 3) 2.24 ms (causal 1.38); dq (128, 64, 8, 3) 1.32 ms, causal (64, 64, 4, 3) "
        "0.75 against 0.90.",
    ],
    "fp8_gemm": [
        "The heuristic (H200, DeepSeek-V3's shapes, `python3 .ci/sweep_fp8_gemm.py`, bf16 out): up to 128 rows "
        "under block scales, split-K in two where the column tiles fill under 1.15 waves: N 2112 and 4096 at K "
        "7168 +38% and +35%; block scales with more rows, 128 x 128 x 128 tiles, 8 warps, 4 stages: 800 "
        "TFLOP/s at 4096 x 7168 x 16384 (5 stages 3% slower, 256 x 128 and 64-row tiles 15% and more); "
        "per-row and per-tensor scales, 128 x 128 where N is no multiple of 256: N 2112 5% faster than "
        "128 x 256.",
        "Block scales at fp8 speed (H200, torch 2.11 with CUDA 13.0, `SWEEP_M=128,4096 python3 "
        ".ci/sweep_fp8_gemm.py block tensor`, 2026-12-06). At 4096 rows cuBLASLt's blockwise GEMM (1x128 and "
        "128x128 scales, `torch._scaled_mm`, get_op's vendor candidate) runs 948 to 1096 TFLOP/s, 1.22x to 1.38x "
        "the Triton kernel's 690 to 805 and 1.40x to 1.59x bf16 cuBLAS's 636 to 689 (the same products "
        "dequantised). At 128 rows each wins some shapes (Triton 213 to 527, cuBLAS 167 to 633 TFLOP/s). Tiles "
        "of 256 columns under block scales (two b-scales a step) are correct and slower: 465 to 590 TFLOP/s at "
        "4096 rows against 690 to 805 for 128 x 128 (they spill: 255 registers). The Triton loop waits for each "
        "128-deep product before scaling it (`wgmma.wait_group 0` in every K step: the scaled sum is not a dot "
        "accumulator, so Triton 3.6 cannot keep two wgmma groups in flight); with per-tensor scales the same "
        "kernel reaches 1047 to 1314 TFLOP/s, 0.93x to 1.11x cuBLAS's per-tensor 1041 to 1188.",
        "Two persistent programs a multiprocessor (`OCCUPANCY` 2: one program's wgmma runs while the other "
        "scales its last product; H100, 2026-12-07, `SWEEP_M=4096 python3 .ci/sweep_fp8_gemm.py block` with "
        "`SWEEP_CONFIGS`): 64 x 128 x 128 tiles, 4 warps, 3 stages (167 registers and 88 KiB each) ran 812, "
        "798, 810, 809 and 589 TFLOP/s at N x K = 7168 x 2048, 24576 x 1536, 7168 x 16384, 4096 x 7168 and "
        "2112 x 7168, against one program of 128 x 128 tiles (the heuristic's) at 794, 776, 821, 817 and "
        "687: +2% to +3% on two shapes, -1% to -14% on the others. 4 stages, 128 x 64 tiles and the "
        "pointer kernel's 64 x 128 tiles were slower still. It stays in the space for the tuner; the "
        "heuristic keeps one program.",
        "Two other loop shapes, compiled for sm_90 with Triton 3.6.0 and 3.9.0 and read in the PTX (no GPU, "
        "`python3 .ci/fp8_loop_waits.py`): "
        "two K blocks a step (two products, then one promotion of both) and the promotion lagged a step (the "
        "last step's product scaled after this step's wgmma is issued). Each emits `wgmma.wait_group 0` right "
        "after every product, as the plain loop does: Triton keeps a wgmma in flight only where its result is "
        "another wgmma's accumulator, and a scaled sum is not one.",
        "A Gluon kernel for block scales (`GLUON` 1, blocks/fp8_wgmma.py; H100, torch 2.11, Triton 3.6.0, "
        "`python3 .ci/probe_fp8_wgmma.py`, 2026-12-07): Gluon places the wgmma waits by hand, so each 128-deep "
        "product runs while the one before it is scaled (`wgmma.wait_group 1`). At 4096 rows and N x K = 7168 x "
        "2048, 2112 x 7168, 24576 x 1536, 7168 x 16384 and 4096 x 7168 it ran 903, 797, 854, 946 and 938 TFLOP/s "
        "with 8 K blocks a loop step (the default; 4 a step: 853, 727, 862, 891, 898), against the Triton "
        "loop's 788, 665, 788, 755 and 768 (1.08x to 1.25x) and cuBLASLt's blockwise 1086, 1021, 952, 1138 and "
        "1088 (0.78x to 0.90x). One program per tile instead of persistent programs: 533 to 830. 3 stages 8% to "
        "11% slower than 4; 5 no faster. Its 27 checks against the float64 product (odd shapes, K tails, padded "
        "rows of a, bf16, fp16 and fp32 out, output poisoned) all passed. get_op still takes cuBLASLt's "
        "candidate at these shapes; the heuristic gives the Triton implementation the Gluon kernel.",
        "The bench above (H100, 2026-12-07, the Gluon kernel in the Triton implementation): at 4096 and 16384 rows "
        "get_op takes cuBLASLt's blockwise candidate at every shape: 1.32x to 1.58x bf16 cuBLAS (geometric mean "
        "1.48x; the candidate alone 1.34x to 1.69x, 1.54x). The Triton implementation (Gluon) runs 790 to 923 "
        "TFLOP/s there, 1.05x to 1.31x bf16 cuBLAS (1.17x), 0.73x to 0.83x the candidate; its second round ran up "
        "to 9% slower than its first (1193 against 1091 us at 4096 x 7168 x 16384: the card's clock under "
        "sustained fp8 load), where the probe's short runs saw 946 TFLOP/s at that shape.",
        "What keeps the Gluon kernel from cuBLASLt's rate, read in its PTX: about three CTA barriers per K block "
        "(one after the wait, so that both warpgroups are done with the slot, and two that Triton's shared-memory "
        "analysis puts before each copy into it), which hold the two warpgroups in step; and one promotion in 8 "
        "not overlapped. A warp-specialised candidate drops the barriers: a copy warp fills the slots and the two "
        "warpgroups give a slot back by an mbarrier arrival each (`.ci/probe_fp8_ws.py`). Compiled for sm_90a "
        "with Triton 3.6.0 and 3.9.0 it needs 232 registers a warpgroup thread and 40 for the copy warp, with no "
        "spill, and keeps only warpgroup barriers in its K loop. It has not run on a GPU yet.",
    ],
    "apply_rotary_pos_emb": [
        "The default step of 2048 elements with one warp (`TILE`; H200, bf16, 4096 and 16384 tokens of "
        "LLaMA-3-8B and Qwen2.5-7B): within 3% of the best of the whole space; 4096 with 8 warps took 17% "
        "longer at 16384 tokens.",
        "Few tokens (H200, bf16, `.ci/sweep_rotary_small.py`, CUDA-graph time): all of q's heads in one step "
        "took 1.7 to 2.1 us at 1 to 64 tokens of LLaMA-3-8B/70B and Qwen2.5-7B, against 2.0 to 3.3 us in steps "
        "of the tile; steps of twice the tile 2.4 to 3.3 us at 256 tokens, against 2.6 to 3.7 us.",
    ],
    "partial_rotary_emb": [
        "The forward's 128 heads a program with 8 warps (H200, bf16, 4096 tokens of DeepSeek-V2): the best of "
        "the space's configs measured, 7% faster than 16 heads with 8 warps (0.2835 against 0.3051 ms).",
        "The backward's 32 heads a step and 32 elements a thread (H200, bf16, `.ci/sweep_partial_backward.py`, "
        "CUDA graphs): within 4% of the best at 128 heads and 4096 tokens; at DeepSeek-V2-Lite's 16 heads, two "
        "steps of 8 with 2 warps took 37.1 us at 4096 tokens against 38.5 for one step of 16 with 4 warps, and "
        "134.4 against 133.9 at 16384 tokens.",
    ],
    "fused_moe": [
        "The copy-engine path for few large experts (`blocks/grouped_tma.py`, a config's `TMA` 1; off by "
        "default), Mixtral-8x7B's experts, 4096 tokens, H100, torch 2.11 and triton 3.6.0, 2026-12-07, "
        "`python3 .ci/probe_moe_tma.py 4096`: its rows are wrong in some calls and right in others. In two "
        "runs of the probe 946 to 987 of 4096 token rows were off in the first two calls of a new plan (2820 "
        "to 3242 with the persistent loop unflattened); in a third run, and in 23 calls of new plans in two "
        "other processes, none. Each stage (the gathered rows, the SwiGLU product, the down GEMM's rows), "
        "checked against its own inputs after a later call of the same plans, was right. Speed (bf16): 533 "
        "to 548 TFLOP/s (unflattened 613 to 638) against the pointer kernels' 504 to 515, grouped_mm's 453 "
        "to 466 and the dense GEMM's 707 to 739. fp8 weights through the copy engine (block-scaled "
        "descriptor loops, the SwiGLU output quantised by place): 642 to 663 TFLOP/s with 16 gate/up warps "
        "and 420 with 8, against the pointer kernels' 708 to 710; some calls wrong here too (2305 and 2708 "
        "rows in two of six first calls). An earlier H100 run (2026-12-06): 975 rows off, 551 TFLOP/s.",
        "The same probe with its buffers poisoned first (`PROBE_POISON=1`: a tile a call leaves unwritten "
        "stays NaN; H100, 2026-12-07, two processes): bf16 right in every call (2 x 2 first runs, 9 new plans), "
        "630 to 638 TFLOP/s unflattened (0.87x to 0.89x the dense GEMM's 716 to 722, 1.36x to 1.38x "
        "grouped_mm's 462), the pointer kernels 512 to 513. fp8 weights with 16 gate/up warps: the first run "
        "of a new plan, right after the pointer kernels' CUDA-graph bench, left 2148 rows NaN (1584 "
        "unflattened): a tile never written somewhere in the chain; its second run, poisoned again, was right, "
        "and so were both runs with 8 warps. New plans without a bench before them "
        "(`.ci/probe_moe_first.py`'s modes none and keep, fp8 with 16 and 8 warps, 16 "
        "plans): right, also with fresh scratch for every launch. A CUDA-graph capture starts with "
        "torch.cuda.empty_cache(); `.ci/probe_moe_first.py` separates that from the graph bench (not run yet).",
        "The bf16 heuristic (H200, Mixtral-8x7B's and DeepSeek-V3's experts, `.ci/bench_fused_moe.py`): at one "
        "row per expert or fewer, K steps of 256 in 3 stages, 200 against 207 us for Mixtral's token; decoding "
        "streams each activated expert's weights at 83 to 93% of the copy bandwidth, 128-column tiles 1 to 5% "
        "slower. Above 64 rows per expert: 128 x 256 down tiles in 4 stages 1 to 2% faster than 3; 4 gate/up "
        "stages with 128-column down tiles 3 to 7% slower, 64-column gate/up tiles or K steps of 128 about 15%, "
        "64-row blocks 18 to 50%.",
        "fp8 weights (H200, `.ci/bench_fused_moe_fp8.py`, against bf16 weights): 1.41x and 1.32x for "
        "Mixtral-8x7B at 4096 and 16384 tokens (720 TFLOP/s), 1.35x and 1.31x for DeepSeek-V3, 1.70x and "
        "1.88x at 64 tokens; 64-row blocks or 64-column gate/up tiles 10 to 28% slower. The weight tiles "
        "through a tensor descriptor over every expert's rows (K-major, made on the device): 0.92x to 0.98x "
        "the bf16 path at 4096 and 16384 tokens, against 1.32x to 1.41x by pointers. The gate/up GEMM on 16 "
        "warps and 3 stages from `FP8_WIDE_ROWS` rows per expert (2026-12-05, "
        "`docs/results/fp8_moe/fused_moe_fp8_warps.json`): Mixtral-8x7B at 4096 tokens 4060 -> 3890 us, at "
        "16384 16360 -> 15484 (1.33x and 1.43x bf16's); DeepSeek-V3 at 16384 tokens (512 rows an expert) "
        "19391 -> 19296; at 128 rows an expert (4096 tokens) 16 warps 0.7% slower, and so the down GEMM on 16 "
        "warps everywhere.",
    ],
    "ffn": [
        "The pair-tile kernel (`JOINT`; H200, LLaMA-3-8B, 4096 tokens): 751 TFLOP/s, against 480 for two "
        "accumulators fed from the same `xs` tile (`gemm.swiglu_calls`). Its last partial wave split over K "
        "(`swiglu_pair.pair_tail`; `.ci/sweep_ffn.py`, 2026-12-04): at 128 tokens LLaMA-3-8B 88.4 -> 87.1 us, "
        "LLaMA-3-70B 270.4 -> 268.5 us (the 4096-token figures are under Other measurements).",
        "The weight streaming (1 and 16 rows, of the copy bandwidth; H200, bf16): LLaMA-3-8B 75%, 77% through "
        "descriptors (112 programs; cuBLAS's GEMM over [w1; w3] 80%), LLaMA-3-70B 89%, 94% through descriptors "
        "(264 programs of 109 columns; 83% in 224 blocks of 128), Qwen2.5-7B 72% (264 of 72; 71% in 148 blocks "
        "over 8 K slices), DeepSeek-V3's shared expert 46-48% (16 blocks over 8 K slices; cuBLAS 52%). Products "
        "on the cores without tl.dot for 1 row, at best 8 columns by 512-wide K slices: 70%, 79%, 72%, 42%. "
        "DeepSeek-V3's shared expert's 16 column blocks of 128 stream at 16% of the copy bandwidth unsliced, "
        "46% in 8 K slices (`decode_splits`), and at 1 row in 8 K slices take 30.0 us through pointers, 31.2 "
        "through descriptors (`decode_tma`; `.ci/sweep_ffn.py`, 2026-12-04).",
        "65 to 128 rows (`few_rows_block_n`; H200, 128 rows, bf16, `.ci/sweep_ffn.py`, 2026-12-04; 64-row "
        "tiles of 64 columns by K slices of 128, 128 columns by K slices of 64 in brackets): LLaMA-3-8B's "
        "4096 -> 14336 87.3 us (86.9; cuBLAS's GEMM over [w1; w3] 74.5), Qwen2.5-7B's 3584 -> 18944 93.7 "
        "(104.1: 296 tiles, 2.2 waves of 132 SMs; cuBLAS 80.4), LLaMA-3-70B's 8192 -> 28672 261.8 (281.2; "
        "cuBLAS 250.8); DeepSeek-V3's shared expert 7168 -> 2048: 32 tiles of 128 columns 60.9 us, 64 tiles of "
        "64 42.4, 128 tiles of 32 41.3 (cuBLAS 53.5).",
        "The backward (H200, LLaMA-3-8B's shape, 4096 tokens): recomputing the pre-activations costs a third "
        "GEMM of the forward's size, 1.32 ms of a 4.19 ms backward (the composite's whole backward: 3.06 ms); "
        "that backward took 4.19 ms in 128 x 256 GEMM tiles (`backward_gemm_config`) against 4.80 in 128 x "
        "128. `dxn` at 16 tokens unsliced (`input_grad_splits`): 16 tiles of 64 x 256 for 132 SMs streamed the "
        "weights at 1.3 TB/s, 185 us where cuBLAS's split-K takes 75.",
    ],
    "softmax": [
        "The looped kernel's block (`loop_block`; H200, 132 SMs, bf16, the second pass evict-first): 1024 rows "
        "of 32768 take 4096 with 8 warps (44.0 us, 84% of a same-size copy; 8192 with 16 warps: 46.6, with 8: "
        "50.1; 16384: 60 to 62), 256 rows of 131072 take 16384 with 32 warps (47.1 us, 78%; 16 warps: 47.7, "
        "8192: 53.5 to 58.9). Rows held whole reach 97-100% of a same-size copy at 4096 and 91% at 16384.",
        "Not used, H200, bf16: a grid of 2 to 8 programs an SM taking the rows in turn (a variant of the looped "
        "kernel looping over its rows): 44.4 to 52.7 us at 1024 x 32768 against 44.0 with one program a row. "
        "A row split over programs that each hold a block in registers and exchange their maxima and sums "
        "through global memory: blocks of 2048 to 16384 elements, rows of 16384 to 131072 at 58-79% of a "
        "same-size copy (their best: 4096-element blocks, 4 warps), no faster than the re-read; the zeroing "
        "launch its counters need costs 3.5 us, a start ticket per program 4 us, and the time spent waiting is "
        "not the spinning (a backoff changed nothing).",
        "The second pass's evict-first loads and stores: 1024 x 32768 about 50 -> 44 us.",
    ],
}


# -- reading -------------------------------------------------------------------------------------

def load_benches(folder: str) -> list[dict]:
    reports = []
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path) as f:
            data = json.load(f)
        if isinstance(data, dict) and "shapes" in data and "op" in data:
            data["_file"] = os.path.basename(path)
            reports.append(data)

    def order(r):
        op, mode = r["op"], r["mode"]
        return (OP_ORDER.index(op) if op in OP_ORDER else len(OP_ORDER), op,
                MODE_ORDER.index(mode) if mode in MODE_ORDER else len(MODE_ORDER), variant(r))
    return sorted(reports, key=order)


def load_optional(folder: str, name: str) -> dict | None:
    path = os.path.join(folder, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


# -- numbers ----------------------------------------------------------------------------------------

def geomean(values: list[float]) -> float | None:
    values = [v for v in values if v]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def us(ms: float | None) -> str:
    if ms is None:
        return "-"
    value = ms * 1e3
    return f"{value:.0f}" if value >= 1000 else f"{value:.3g}" if value < 10 else f"{value:.4g}"


def ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def pct(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.0f}%" if x >= 0.01 else f"{100 * x:.2g}%"


def num(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def mib(nbytes: int | None) -> str:
    if not nbytes:
        return "-"
    value = nbytes / 2**20
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def shape_label(shape: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in shape["sizes"].items())


#: ops whose products run at a multiple of the bf16 matrix-product rate: fp8 e4m3 operands take
#: Hopper's tensor cores at twice it
PEAK_SCALE = {"fp8_gemm": 2.0}


def matmul_peak(reports: list[dict]) -> tuple[float, str] | None:
    """The best bf16 matrix-product rate of any implementation in the matmul results, and where."""
    best = None
    for r in reports:
        if r["op"] != "matmul" or r["dtype"] != "bfloat16":
            continue
        for s in r["shapes"]:
            if s.get("bound") != "compute":
                continue
            for name, res in s["results"].items():
                if res.get("tflops") and (best is None or res["tflops"] > best[0]):
                    label = "cuBLAS through torch.matmul" if name == "torch" else name
                    best = (res["tflops"], f"{label} at M x N x K = {s['sizes']['tokens']} x "
                                           f"{s['sizes']['inter']} x {s['sizes']['hidden']}")
    return best


def limit_fraction(shape: dict, name: str, peak: float | None) -> float | None:
    """GB/s over the copy bandwidth for memory-bound shapes; TFLOP/s over the matmul peak for compute-bound."""
    res = shape["results"].get(name) or {}
    if shape.get("bound") == "compute":
        return res["tflops"] / peak if peak and res.get("tflops") else None
    return res.get("copy_fraction")


def rate(shape: dict, name: str) -> str:
    res = shape["results"].get(name) or {}
    if shape.get("bound") == "compute" and res.get("tflops"):
        return f"{num(res['tflops'])} TFLOP/s"
    return f"{num(res['gbps'])} GB/s" if res.get("gbps") else "-"


# -- markdown -------------------------------------------------------------------------------------------

def md_table(header: list[str], rows: list[list[str]], align: str | None = None) -> list[str]:
    align = align or "l" * len(header)
    rule = ["---:" if a == "r" else "---" for a in align]
    return ["| " + " | ".join(header) + " |", "| " + " | ".join(rule) + " |",
            *("| " + " | ".join(row) + " |" for row in rows)]


def chosen_impl(shape: dict) -> str:
    """The implementation get_op chose for a shape (older results: the first word of ``chosen``)."""
    return shape.get("chosen_impl") or (shape.get("chosen") or "-").split(" ", 1)[0]


def bench_table(report: dict, peak: float | None) -> list[str]:
    """One row per shape: dlcore (get_op) with the implementation it chose where that says something,
    each ``dlcore[NAME]`` column (an implementation alone), each baseline with every dlcore column's
    speedup over it, and ``vs best`` (the fastest dlcore[NAME] over get_op) with dlcore columns;
    geometric means and the lowest below, and per token range where the results give them."""
    columns = report.get("dlcore_columns", [])
    baselines = report.get("baselines") or [b for b in report["implementations"] if b != OWN and b not in columns]
    own_columns = [OWN, *columns]
    with_models = any(s["models"] for s in report["shapes"])
    show_chosen = bool(columns) or len({chosen_impl(s) for s in report["shapes"]}) > 1
    header = (["model"] if with_models else []) + ["shape", "MiB", "dlcore us", "dlcore rate", "% of limit"]
    header += ["chosen"] if show_chosen else []
    for c in columns:
        header += [f"{c} us", f"{c} rate"]
    lead = len(header)
    for b in baselines:
        header += [f"{b} us"] + [f"vs {b}" if of == OWN else f"{of} vs {b}" for of in own_columns]
    header += ["vs best"] if columns else []
    rows = []
    for s in report["shapes"]:
        own = s["results"].get(OWN, {})
        row = ([", ".join(s["models"])] if with_models else []) + [
            shape_label(s), mib(s["bytes"]), us(own.get("ms")), rate(s, OWN), pct(limit_fraction(s, OWN, peak))]
        row += [chosen_impl(s)] if show_chosen else []
        for c in columns:
            row += [us((s["results"].get(c) or {}).get("ms")), rate(s, c)]
        for b in baselines:
            row += [us((s["results"].get(b) or {}).get("ms")), ratio(s["speedup"].get(b))]
            row += [ratio((s.get("speedup_of", {}).get(c) or {}).get(b)) for c in columns]
        row += [ratio(s.get("speedup_vs_best"))] if columns else []
        rows.append(row)
    summaries = [("geometric mean", report.get("geomean_speedup_of"), report["geomean_speedup"]),
                 ("lowest", report.get("min_speedup_of"), report["min_speedup"])]
    summaries += [(f"geometric mean, {label}", values, values.get(OWN, {}))
                  for label, values in report.get("geomean_speedup_by_tokens", {}).items()]
    for label, values, own_values in summaries:
        row = [""] * lead
        row[0 if not with_models else 1] = f"**{label}**"
        for b in baselines:
            row += [""] + [bold(own_values.get(b) if of == OWN else ((values or {}).get(of) or {}).get(b))
                           for of in own_columns]
        row += [bold(((values or {}).get(OWN) or {}).get("best"))] if columns else []
        rows.append(row)
    align = (("l" if with_models else "") + "lr" + "rrr" + ("l" if show_chosen else "") + "rr" * len(columns)
             + ("r" + "r" * len(own_columns)) * len(baselines) + ("r" if columns else ""))
    return md_table(header, rows, align)


def bold(value: float | None) -> str:
    return f"**{ratio(value)}**" if value else "-"


def slower_than(report: dict) -> list[str]:
    """Shapes where a baseline is faster than dlcore."""
    found = []
    for s in report["shapes"]:
        worse = [f"{b} {ratio(v)}" for b, v in s["speedup"].items() if v is not None and v < 1.0]
        if worse:
            found.append(f"{shape_label(s)} ({', '.join(worse)})")
    return found


def copy_range(report: dict) -> str:
    fractions = [s["results"][OWN]["copy_fraction"] for s in report["shapes"]
                 if s.get("bound") == "memory" and (s["bytes"] or 0) >= LARGE_MIB * 2**20
                 and s["results"].get(OWN, {}).get("copy_fraction")]
    if not fractions:
        return "-"
    low, high = min(fractions), max(fractions)
    return pct(low) if pct(low) == pct(high) else f"{pct(low)} to {pct(high)}"


def variant(report: dict) -> str:
    """What a results file holds besides its op and mode: ``fused_moe_fp8_fwd.json`` -> ``fp8``
    (the same op and mode on other inputs); ``""`` for ``OP_MODE.json``."""
    stem = report["_file"].removesuffix(".json")
    op, mode = report["op"], report["mode"]
    if stem == f"{op}_{mode}":
        return ""
    return stem.removeprefix(f"{op}_").removesuffix(f"_{mode}")


def summary(reports: list[dict]) -> list[str]:
    rows = []
    for r in reports:
        g = r["geomean_speedup"]
        tokens = sorted({s["sizes"].get("tokens") for s in r["shapes"] if "tokens" in s["sizes"]})
        others = ", ".join(f"{b} {ratio(v)}" for b, v in g.items() if b not in BASELINE_NAMES and v)
        mode = r["mode"] + (f", {variant(r)}" if variant(r) else "")
        rows.append([f"[{r['op']}](#{r['op']})", mode, str(len(r["shapes"])),
                     ", ".join(map(str, tokens)) or "-",
                     ratio(g.get("torch")), ratio(g.get("compile")), ratio(g.get("liger")),
                     ratio(r["min_speedup"].get("compile")), others or "-", copy_range(r)])
    return md_table(["op", "mode", "shapes", "tokens", "vs eager", "vs compile", "vs Liger", "lowest vs compile",
                     "vs other baselines", f"dlcore % of copy, >= {LARGE_MIB} MiB"], rows, "llrlrrrrll")


def setup(reports: list[dict], overhead: dict | None, peak: tuple[float, str] | None) -> list[str]:
    gpus = sorted({r.get("gpu") or r["device"].get("name", "?") for r in reports})
    versions: dict[str, set] = {}
    for r in reports:
        for k, v in r.get("versions", {}).items():
            if v:
                versions.setdefault(k, set()).add(v)
    dates = sorted(r["date"][:10] for r in reports)
    copies = [c for r in reports for c in r.get("copy_bandwidth_runs_gbps", []) if c]
    device = reports[0]["device"] if reports else {}
    lines = [f"- GPU: {', '.join(gpus)} ({device.get('arch', '?')}, {device.get('cores', '?')} SMs"
             + (f", driver {overhead['driver']}" if overhead and overhead.get("driver") else "") + ")."]
    lines.append("- Versions: " + ", ".join(f"{k} {' / '.join(sorted(v))}" for k, v in versions.items()) + ".")
    if dates:
        lines.append(f"- Measured: {dates[0]}" + (f" to {dates[-1]}" if dates[-1] != dates[0] else "") + ".")
    if copies:
        lines.append(f"- Copy bandwidth (1 GiB device-to-device copy, bytes read + written, measured at the start and "
                     f"end of every run): {min(copies):.0f} to {max(copies):.0f} GB/s.")
    if peak:
        lines.append(f"- bf16 matrix-product peak: {peak[0]:.0f} TFLOP/s, the best rate in the matmul results "
                     f"({peak[1]}); compute-bound shapes are reported against it "
                     f"({', '.join(f'{op} against {scale:g} times it' for op, scale in PEAK_SCALE.items())}: "
                     f"fp8 tensor-core rate).")
    envs = sorted({f"{k}={v}" for r in reports for k, v in r.get("environment", {}).items()
                   if k != "DLCORE_CACHE_DIR"})
    tune = [e for e in envs if e.startswith("DLCORE_TUNE=")]
    lines.append("- dlcore: `get_op` with " + (", ".join(f"`{e}`" for e in envs) if envs else "no DLCORE_* setting")
                 + ("" if tune else ", so tuning is off: every kernel runs its heuristic config, untuned") + ".")
    return lines


METHOD = """\
Each table is one `dlcore bench` run (its command is under the table). For each shape the op's example
inputs are built once; dlcore (through `get_op`) and each baseline run on the same inputs and are
checked against each other, then timed in rounds: a round times every implementation once, starting
one further along each round, and a time is the median of its rounds. One round is
`triton.testing.do_bench`'s median (L2 flushed before each call); it counts the host's launch time
wherever that exceeds the GPU's, which is the case for most ops at 1 and 64 tokens and for every
backward below about 0.3 ms (the autograd engine's host work). `dlcore bench --timer cudagraph`
replays CUDA graphs instead and gives GPU time alone (its copies stay timed with do_bench: a copy
captured in a graph runs at about 2.7 TB/s on the H200 against 4.2 eagerly). Hosts of the same GPU
differ: runs since 2026-12-04 record the host's time for one small torch op at their start and end
(**Host**, under the table), the floor under every timed call; rows within a few times it time the
host's launches.

- **vs X**: X's time over dlcore's; above 1, dlcore is faster. The geometric mean and the lowest are
  over the table's shapes (and, where some shape is compute-bound, over its shapes of at most 128 and
  of at least 1024 tokens). dlcore is `get_op`'s choice; with `dlcore bench --impls NAME` a table
  also times implementation NAME alone (`get_op(..., impl=NAME)`) in a column **dlcore[NAME]**, with
  its own **dlcore[NAME] vs X**, names the implementation `get_op` **chose** per shape, and gives
  **vs best**: the fastest dlcore[NAME] column's time over dlcore's (1.00x: selection picked the
  fastest at no cost).
- **rate, % of limit**: bytes moved (each input read once, each output written once, as the op's
  `cost` counts them) over time, against the copy bandwidth of the same run, for memory-bound shapes;
  for compute-bound shapes (more than 100 flop per byte) TFLOP/s against the bf16 matrix-product peak
  above. A memory-bound op cannot pass 100% by much; small shapes stay far below it, since a launch
  costs microseconds whatever it moves.
- **bwd**: the forward runs once, untimed; each timed call is `torch.autograd.grad` of the inputs the
  op declares differentiable, for a fixed output gradient.
- **Baselines**: `torch` the op written in eager PyTorch (what a model runs), `compile` the same
  function through `torch.compile` (compiled afresh for each shape, `dynamic=False`), or the
  composite the op declares for it (ffn's: one GEMM over `[w1; w3]` concatenated once per shape,
  untimed, as a caller that keeps `w13` does), `liger` Liger-Kernel's kernel where it has one. Where
  the results name them, the notes under a table say what each baseline runs. Where a baseline
  writes into its inputs or output gradients, the table's notes say so: each of its timed calls
  then moves fewer bytes."""

OTHER_TEMPLATE = """\
## Other measurements

These are not regenerated by `render.py`; each gives its command.

- **fused_linear_cross_entropy's chunk** (issue #42; H100, 2026-12-06, `bash .ci/gpu.sh bench-loss`):
  the tables above were measured with the old default of 256 rows a chunk at 4096 tokens (Liger's rule:
  a chunk's logits as large as `hidden`), 16 chunks at LLaMA-3's head. Each chunk reads and writes the
  whole weight gradient (2.1 GB at LLaMA-3's head in bf16): about 11 ms of the 38.8 ms at 4096 tokens,
  where the eager composite takes 25.6 ms and Liger 62.0 ms. At 16384 tokens (1024-row chunks) the op is
  1.17x the composite at LLaMA-3's head and 0.99x at Qwen2.5's. The default is now 1024 rows (fewer
  rows: one chunk; at most 512 MiB of logits): 4 chunks at 4096 tokens, the traffic a quarter. The
  end-to-end LLaMA-3 table's dlcore training step (59.4 ms against eager's 51.1) ran with the old
  default, and its loss was planned again at every call (a replay bug, fixed): the loss's 13 ms over the
  composite is more than the whole gap. Not yet re-measured; `python3 .ci/sweep_flce_chunk.py` times
  each chunk beside the composite, with peak memory. The GPU test at LLaMA-3's head
  (`test_real_sizes_in_bfloat16_hold_one_chunk_of_logits_above_the_gradients`) holds the peak above the
  gradients to one chunk's logits; its first GPU run stopped on the replay warning before the check
  (since fixed), so it has not yet passed on a GPU. Three GEMMs for mean and sum (the gradients made in
  the forward), four for `reduction="none"` (recomputed); whether recomputing is ever faster is still to
  be timed.
- **Grid folding** (`bash .ci/gpu.sh compiler`, H200, 2026-11-30): folding a grid onto persistent
  programs gains 1.2x to 2.6x for one-warp programs over 1e4 to 1e6 blocks, and costs 3 to 10% for
  programs of 4 to 8 warps. So on cuda the pass `grid_folding_small_programs` folds only one-warp
  launches larger than the device; `grid_folding` is on by default for npu and mlu and opt-in on cuda
  (`DLCORE_ENABLE_PASSES=grid_folding`).
- **Tuning search quality** (`python -m dlcore.bench.landscape replay tests/data/landscape_matmul.json
  tests/data/landscape_ffn.json --seeds 10 --budget 60`, on the CPU, from landscapes recorded on the
  H200 with `LANDSCAPE_LIMIT=120 bash .ci/gpu.sh landscape-matmul` (2026-12-01) and `LANDSCAPE_LIMIT=100
  LANDSCAPE_SECONDS=90 bash .ci/gpu.sh landscape-ffn` (2026-12-02, the ffn space with `JOINT`, the
  pair-tile kernel or the GEMM block's loop), triton 3.6.0, bf16): median over 10 seeds of the
  evaluations a strategy needs to come within 5% of the best recorded config.

  | landscape | configs recorded | best | grid | random | tpe |
  | --- | ---: | --- | --- | --- | --- |
  | matmul 4096 x 4096 x 4096 | 120 of 1417 | 0.198 ms (694 TFLOP/s) | over 60 | over 60 | over 60 |
  | ffn 2048 tokens, 4096 -> 4096 | 100 of 1640 | 0.218 ms (631 TFLOP/s) | over 60 | 49.5 | over 60 |

  Device time bounded both recordings to a seeded uniform sample of the space, and in each sample
  one config alone lies within 5% of the best (ffn's: 128 x 64 x 128 tiles, `JOINT` 1, 4 warps,
  3 stages; the next is 13% slower; the median config takes 1.03 ms): "within 5%" then means
  finding that one config. Over the whole ffn sample (no budget) grid needs 83 evaluations and
  random 49.5. TPE proposes from the whole space, of which the sample holds 6%: its 2000 proposals
  reach only 19 to 34 of the 100 recorded configs, and it finds the best in 3 of 10 seeds (at 2, 8
  and 18 evaluations), so a replay on a sample understates it (in a tuning run every config is
  measurable). The previous ffn sample (820 configs, no `JOINT`) gave TPE a median 23.5; the
  earlier kernels' whole-space landscapes (396 and 368 configs) gave random 41 and 26, TPE 36.5
  and 19.5. Each sample took about two minutes of H200 time; the whole spaces are 12 and 16 times
  larger.
- **The compute-bound targets** (from `matmul_fwd.json`, `ffn_fwd.json` and `ffn_bwd.json` above,
  H200, bf16, `matmul_fwd.json`, `ffn_fwd.json` and `ffn_bwd.json` 2026-12-04; `torch` =
  cuBLAS, `compile` = the best composite):

{targets}

  The Triton GEMM runs at 690 to 720 TFLOP/s at large M; what it loses is at M = 128 (too few
  output tiles for 132 SMs; split-K's float32 round trip costs more than it recovers) and M = 1024
  (wave quantisation: 448 tiles of 128 x 256 are 3.4 waves), where stream-K is the likely cure. The
  fused ffn prefill reads w1's and w3's tiles as the two planes of one tensor descriptor and runs
  one 128 x 256 product per K step, the matmul's loop: 631 to 690 TFLOP/s at 1024 tokens and more
  (751 at LLaMA-3-8B's 4096 tokens in `.ci/sweep_ffn.py`; the two-accumulator loop before it: 490 to
  565), level with compile's one cuBLAS GEMM and its round trip of the `[M, 2N]` pre-activations
  through memory (1.01x there). Its last, partial wave of tiles is split over K (`swiglu_pair.pair_tail`:
  the slices meet through per-tile counters that the row kernel before it zeroes; the last to
  arrive adds the others and runs the epilogue): in `.ci/sweep_ffn.py` (2026-12-04) LLaMA-3-8B at
  4096 tokens 1412.6 -> 1337.7 us, LLaMA-3-70B at 4096 tokens 5707.8 -> 5337.2 us, at 128 tokens
  1 to 2%. The decode kernel reads the weights through tensor descriptors in 128-wide K slices
  where its programs' columns nearly fill the tile and K is not sliced (`decode_tma`): LLaMA-3-8B
  74.0 -> 71.4 us at 1 token, LLaMA-3-70B 248.3 -> 234.0 us; Qwen2.5-7B's 72-column programs
  (89.0 -> 94.0) and the K-sliced DeepSeek-V3 shared expert keep the pointer loads. For a call
  whose inputs require grad, `get_op` times each candidate's forward and backward together, and
  keys the choice apart from the inference call's. The weight streaming kernel splits K only where
  its column blocks leave more than a quarter of their waves' SMs idle (`decode_splits`): sliced,
  LLaMA-3-8B streamed at 68% of the copy bandwidth against 74% unsliced, Qwen2.5-7B at 71% against
  63% (`.ci/sweep_ffn.py` with `SWEEP_SHAPES` at 1 and 16 rows).
- **ffn backward at 16 and 128 tokens, where the time goes** (LLaMA-3-70B, `python3
  .ci/backward_host.py ffn:triton:tokens=128,hidden=8192,inter=28672` and the same for `ffn:torch`
  and 16 tokens, H200, 2026-12-04; GPU time from a CUDA graph, per kernel from torch.profiler). At
  128 tokens the Triton backward's GPU time is 734.5 us against 687.8 for the vendor composite's:
  dw13 (`gemm_tma_kernel`, `[57344, 8192]` over a reduction of 128) takes 393.8 us where cuBLAS's
  takes 336.4 (two 192 x 192 launches), dxn through descriptors 241.3 against cuBLAS's split-K
  261.6. At 16 tokens the GPU time is 517.2 us (dw13 269.4, dxn sliced four ways 216.1: both at the
  bandwidth of their 940 MiB of weights or gradients). The rest of the gap at these sizes is the
  host's (autograd's device thread on: host 467 to 630 us a backward, do_bench 645 to 737). dw13
  then took the prefill tile at every row count (`weight_grad_config`; `.ci/sweep_weight_grad.py`:
  LLaMA-3-70B 128 tokens 372.2 -> 312.3 us against cuBLAS's 318.4, LLaMA-3-8B 128 tokens 101.1 ->
  82.4 against 82.9, LLaMA-3-70B 16 tokens 273.5 -> 268.9 against 265.0), and LLaMA-3-70B's
  backward at 128 tokens went from 0.88x to 1.01x compile's in `ffn_bwd.json`.
- **Warp specialisation** (`bash .ci/gpu.sh warp-specialize`, H200, triton 3.6.0, torch 2.11,
  2026-12-05; `WARP_SPECIALIZE`: a producer warp feeding two 4-warp consumer warpgroups). The bf16
  GEMM (`SWEEP_SET=ws SWEEP_M=4096,16384 python3 .ci/sweep_gemm.py sweep`, up and down projections
  of the four preset models, 16 shapes, the best of six specialised tiles against the best of the
  default 128 x 256 x 64, 8 warps, 3 stages and 128 x 128 x 64, 4 warps, 4 stages): the specialised
  loop is faster at 4 of 16 shapes, by 1 to 3% (Qwen2.5-7B's up and down projections at 4096
  tokens, 1.025x and 1.014x; LLaMA-3-70B's down projection and DeepSeek-V3's shared expert's at
  16384, 1.011x and 1.033x), slower at the other 12 (0.915x to 0.999x), geometric mean 0.976x;
  every config matched the float64 product to 1.7e-3. The default stays unspecialised; the
  specialised tiles stay in matmul's space, for the tuner. fp8_gemm's specialised configs gave
  wrong products at every DeepSeek-V3 shape (`python3 .ci/sweep_fp8_gemm.py block tensor` as of
  commit 2d19c10, which still held them; relative error 0.78 to 1.0, or NaN; block and tensor
  scales), so its space leaves them out and the GEMM block never specialises a loop over 8-bit
  operands (`gemm.loop_flags`). In the same run fp8_gemm's heuristic
  config came within 3.3% of the best unspecialised config at 28 of 30 shapes (block and tensor
  scales); the two others are tensor scales at 128 tokens (5.8% and 6.4%), where
  `torch._scaled_mm`, get_op's vendor candidate for tensor scales, is 1.3x to 1.4x faster still.
  On an H100 (sm_90, triton 3.6.0) the GPU tests of the specialised paths pass: the GEMM block's
  epilogues (bias, each activation, SwiGLU, the activation gradient, a stored transposed) and
  flash_attention_v2's single masked loop against their float64 references (`pytest -k "specialis
  or warp" tests/kernels/test_gemm.py tests/kernels/test_flash_attention_v2.py
  tests/kernels/test_matmul.py`: 41 passed). flash_attention_v2's specialised loop is right at
  those small shapes and wrong at B 2, H 16, S 8192, D 128 on the same H100 (`SWEEP_D=128 python3
  .ci/sweep_attention.py sweep`): NaN with 64-row key blocks, relative error 0.19 with 128-row
  ones under the causal mask; the one right config (128 x 128, not causal) ran at 503 TFLOP/s
  against the plain default's 505 (cuDNN 685). Its search space no longer offers it.
- **fused_rotary_and_fa's backward and its training selection** (H100, bf16, B 2, H 16, D 128,
  2026-12-05). The backward rotates q and k into scratch around flash_attention_v2's backward
  where it used to rotate every streamed tile inside its loops (`python3 .ci/rotary_backward.py` at
  34d6caa; the rotation in the loops, kept then for Sq != Sk, has since given way to the same
  plan at any Sq, the queries rotated with the tables' last rows):
  1.80x, 1.96x, 1.78x and 1.79x faster at S 2048, 4096, 8192 and 16384, causal 1.41x to 1.51x
  (S 2048 causal 418 against 591 us); the tables above predate it. On the same H100 the bwd
  bench (`BENCH_SPECS=fused_rotary_and_fa:bwd:attention::composite:triton bash .ci/gpu.sh
  bench-attention`) puts the Triton kernel at 0.72x to 0.80x the composite's backward (1.31x to
  1.42x its time), where the H200 table above has 0.38x to 0.53x. The bwd table's S 2048 causal
  row, where get_op chose the Triton kernel at 0.48x the composite, is the host's: get_op times a
  training call (forward and backward), and there the composite's step is host-bound
  (`python3 .ci/training_step_host.py`). Its
  training step took 1.03 ms in do_bench and 1.06 ms of host time a step, against 0.40 ms of GPU
  time alone (a CUDA graph of the step); the Triton kernel's 0.78, 0.82 and 0.61 (with the new
  backward). On this host a small torch op takes 6 to 10 us and a Triton launch about 28 us, and
  the composite's cuDNN forward and backward through autograd cost about 1 ms of host time a
  step. So in eager mode the Triton kernel is the faster step at that shape, and under CUDA
  graphs the composite would be. The bwd table times the backward alone."""


#: the compute-bound targets (issue: the compute-bound core) against the results above: (target, measured, met)
TARGETS = [
    ('Triton matmul alone, geomean vs cuBLAS, M >= 1024: >= 0.95x',
     '0.99x (lowest 0.80x: 1024 x 2048 x 7168, M x N x K)',
     'yes'),
    ('Triton matmul alone, geomean vs cuBLAS, M <= 128: >= 0.90x',
     '0.94x (lowest 0.73x: 128 x 18944 x 3584)',
     'yes'),
    ("`get_op('matmul')` >= 0.98x the faster of Triton and cuBLAS, every shape",
     '47 of 48 (16 x 2048 x 7168, 0.96x the run before, now 1.00x: a near tie takes more rounds); 0.97x at '
     '16384 x 28672 x 8192 (the down projection), where get_op chose the Triton kernel and its column, the same '
     'kernel timed apart, measured 10891 us against 11205 (the GPU slowing under sustained load at the '
     'largest shape; cuBLAS 12201)',
     'no, by 1% on one shape, the chosen kernel against itself'),
    ("`get_op('ffn')` vs the best composite, geomean >= 1.05x",
     '1.26x (1.49x at 128 tokens and fewer, 1.07x at 1024 and more)',
     'yes'),
    ("`get_op('ffn')` vs the best composite, every shape >= 1.0x",
     'lowest 0.99x; below 1.0x at 2 of 24 shapes, both by 1%: LLaMA-3-8B at 16384 tokens (5935 against '
     "5873 us; `dlcore[triton]`, the same kernel timed apart, 5835: the GPU slowing under sustained load) "
     'and LLaMA-3-70B at 128 tokens (265.1 against 263.3 us). Up from 0.87x: the decode through tensor '
     "descriptors, the prefill's last wave split over K (`swiglu_pair.pair_tail`), 64 x 64 tiles per weight at "
     "65 to 128 rows (Qwen2.5-7B at 128 tokens 1.15x, was 0.87x)",
     'no, by 1% on two shapes'),
    ('ffn at 1 to 16 tokens: w1 and w3 read at >= 85% of the copy bandwidth',
     "LLaMA-3-70B 96 to 97% (through tensor descriptors; 83% in 224 blocks of 128 columns before "
     "`decode_columns` spread its 28672 columns over 264 programs of 109), LLaMA-3-8B 79% (through "
     "descriptors, 112 programs, fewer than the SMs; cuBLAS's GEMM over [w1; w3] 80% in `.ci/sweep_ffn.py`), "
     "Qwen2.5-7B 73% (264 programs of 72 columns; descriptors 68%, 64-column tiles 50%), DeepSeek-V3's shared "
     "expert 48% (56 MiB in 16 column blocks over 8 K slices and a second launch adding them; cuBLAS 52%). "
     "Tried and not kept: the products on the CUDA cores without tl.dot (best 70%, 79%, 72%, 42%), deeper "
     "pipelines, 256 or 64 columns, 32-wide K slices, 8 warps, 128-wide K slices through pointers (54%); "
     "in `.ci/sweep_ffn.py` on 2026-12-04: every SM streaming (LLaMA-3-8B's 132 programs of 109 columns, "
     "72.1 us against 71.5), one wave of 256-column programs (Qwen2.5-7B's 132 of 144 columns, 90.7 us "
     "against 88.3), and 16- or 32-column programs over a wave with K unsliced (DeepSeek-V3's shared "
     "expert: 128 programs of 16 columns, one launch, 56 to 69 us against 29.3: a program streaming "
     "16 weight rows reaches a quarter of its share of the bandwidth), and pipelines two or three deep so "
     "that two programs share a multiprocessor and Qwen2.5-7B's two waves of 72-column programs run at once "
     "(89.0 us against 88.7; LLaMA-3-8B 78.8 against 71.4)",
     'no'),
    ("ffn backward vs compile's, >= 1.0x",
     "`get_op` (training-aware selection) geomean 1.09x (1.04x at 1024 tokens and more, 1.14x at 128 and "
     "fewer), lowest 0.86x (`ffn_bwd.json`, 2026-12-04, the training forward saving `xn` for the backward). "
     "At 4096 and 16384 tokens every shape is at 1.03x or more: DeepSeek-V3's shared expert, 0.95x and "
     "0.99x the run before, is 1.03x at both (763.7 against 790.0 us, 2930 against 3026: its backward no "
     "longer writes `xn` again, about 28 us of 790 at 4096 tokens). The rows below 1.0x are at 1 to 1024 "
     "tokens, where do_bench times the host (autograd's device thread: 260 to 560 us a backward on this "
     "lease's slower host, against about 200 of GPU time at 1024 DeepSeek-V3 tokens, where get_op chose the "
     "vendor composite and the Triton backward alone measured 487.7 us against compile's 531.4) and rows "
     "move from run to run: LLaMA-3-8B at 16 tokens 2.10x the run before, 1.45x this run; Qwen2.5-7B at "
     "16 tokens 0.84x before, 1.23x now. LLaMA-3-70B at 128 tokens, where the GPU's time decides, went "
     "from 0.88x to 1.01x with dw13's tile (Other measurements, below), 1.08x this run",
     'no: the GPU-bound rows (1024 tokens and more) yes; host-bound rows at 1 to 1024 tokens move both ways'),
]
OTHER = OTHER_TEMPLATE.replace("{targets}", "\n".join(
    ["  | target | measured | met |", "  | --- | --- | --- |"] + [f"  | {t} | {m} | {ok} |" for t, m, ok in TARGETS]))


# -- issue #14's targets, from the results ---------------------------------------------------------------

ANCHOR = {"batch": 2, "seq": 8192, "heads": 16, "kv_heads": 16, "head_dim": 128}


def find(reports: list[dict], op: str, mode: str) -> dict | None:
    return next((r for r in reports if r["op"] == op and r["mode"] == mode), None)


def shapes_where(report: dict | None, **sizes: int) -> list[dict]:
    """The shapes of ``report`` whose sizes include ``sizes``."""
    if report is None:
        return []
    return [s for s in report["shapes"] if all(s["sizes"].get(k) == v for k, v in sizes.items())]


def ms_of(shape: dict, name: str) -> float | None:
    return (shape["results"].get(name) or {}).get("ms")


def triton_tflops(report: dict | None, causal: int) -> tuple[float | None, str]:
    """The Triton kernel's TFLOP/s at the anchor shape (its dlcore[triton] column, else dlcore's),
    and SDPA's beside it."""
    found = shapes_where(report, **ANCHOR, causal=causal)
    if not found:
        return None, "not measured"
    res = found[0]["results"]
    own = (res.get("dlcore[triton]") or res.get("dlcore") or {}).get("tflops")
    sdpa = ", ".join(f"{name} {num(res[name]['tflops'])}" for name in SDPA if (res.get(name) or {}).get("tflops"))
    return own, f"{num(own)} TFLOP/s" + (f" ({sdpa})" if sdpa else "")


def lowest(pairs: list[tuple[float, str]]) -> tuple[float | None, str]:
    """The lowest ratio of ``(ratio, shape label)`` pairs, in words."""
    if not pairs:
        return None, "not measured"
    value, where = min(pairs)
    return value, f"lowest {ratio(value)} ({where})"


def ratio_to(shapes: list[dict], names: tuple[str, ...], of: str = OWN) -> list[tuple[float, str]]:
    """Per shape, the fastest of ``names`` (present ones) over column ``of``: above 1, ``of`` is faster."""
    pairs = []
    for s in shapes:
        mine, theirs = ms_of(s, of), [ms_of(s, n) for n in names if ms_of(s, n)]
        if mine and theirs:
            pairs.append((min(theirs) / mine, shape_label(s)))
    return pairs


def met(value: float | None, goal: float) -> str:
    return "-" if value is None else "yes" if value >= goal else "no"


def attention_targets(reports: list[dict]) -> list[list[str]]:
    """Rows (target, measured, met) of issue #14's targets, from the results of `bash .ci/gpu.sh bench-attention`."""
    fwd, bwd = find(reports, "flash_attention_v2", "fwd"), find(reports, "flash_attention_v2", "bwd")
    rows = []
    for label, report, causal, goal in (("forward", fwd, 0, 450), ("forward, causal", fwd, 1, 400),
                                        ("backward", bwd, 0, 330)):
        value, text = triton_tflops(report, causal)
        rows.append([f"Triton {label}, B 2, H 16, S 8192, D 128: >= {goal} TFLOP/s", text, met(value, goal)])
    prefill = [s for r in (fwd, bwd) for s in shapes_where(r) if s["sizes"].get("seq", 0) > 1]
    value, text = lowest(ratio_to(prefill, tuple(n for n in ("dlcore[triton]", *SDPA))))
    rows.append(["`get_op('flash_attention_v2')` >= 0.98x the best of Triton and SDPA, every shape", text,
                 met(value, 0.98)])
    decode = shapes_where(fwd, seq=1)
    value, text = lowest(ratio_to(decode, SDPA))
    rows.append(["Decode (Sq 1, Sk 1024 to 65536, GQA 32/8): >= 1.0x SDPA every Sk", text, met(value, 1.0)])
    longest = shapes_where(fwd, seq=1, kv_seq=65536)
    own = (longest[0]["results"].get(OWN) or {}) if longest else {}
    fraction, same = own.get("copy_fraction"), own.get("same_size_copy_fraction")
    measured = "not measured"
    if longest:
        measured = pct(fraction) + (f" ({pct(same)} of a copy of the same bytes)" if same else "")
    rows.append(["Decode at Sk 65536: >= 85% of the copy bandwidth", measured, met(fraction, 0.85)])
    for mode in ("fwd", "bwd"):
        shapes = shapes_where(find(reports, "fused_rotary_and_fa", mode))
        value, text = lowest(ratio_to(shapes, ("composite",)))
        rows.append([f"fused_rotary_and_fa {mode} >= 1.15x apply_rotary_pos_emb + the best SDPA, S 2048 to 16384",
                     text, met(value, 1.15)])
    softmax = [s for s in shapes_where(find(reports, "softmax", "fwd"))
               if 4096 <= s["sizes"].get("vocab", 0) <= 131072]
    fractions = [((s["results"].get(OWN) or {}).get("same_size_copy_fraction"), shape_label(s)) for s in softmax]
    fractions = [(f, where) for f, where in fractions if f]
    value = min(fractions)[0] if fractions else None
    rows.append(["softmax forward >= 90% of a copy of the same bytes, rows 4096 to 131072",
                 f"lowest {pct(value)} ({min(fractions)[1]})" if fractions else "not measured", met(value, 0.9)])
    return rows


def targets_section(reports: list[dict]) -> list[str]:
    lines = ["## Attention and softmax targets", "",
             "Issue #14's targets (H200, bf16), read from `flash_attention_v2_*.json`, `fused_rotary_and_fa_*.json` "
             "and `softmax_fwd.json` above (`bash .ci/gpu.sh bench-attention`). The Triton rates are its "
             "`dlcore[triton]` column; SDPA's are beside them. A copy fraction counts the op's bytes (each input "
             "read once, each output written once).", ""]
    lines += md_table(["target", "measured", "met"], attention_targets(reports), "lll")
    lines += ["", DECODE_GAP, ""]
    return lines


#: what the decode target's miss is made of (measured apart from the bench)
DECODE_GAP = (
    "Decode at Sk 65536, where the time goes (`python3 .ci/profile_decode.py OUT.json sweep` and "
    "`python3 .ci/probe_decode_read.py`, H200, 2026-12-04): the split kernel's GPU time (a CUDA graph, the "
    "L2 flushed) is 79.5 us and cuDNN's 79.5 us: both read K and V at 80% of the copy bandwidth. A probe "
    "that only sums the same tiles takes 81.1 us at best in one kv head's 256-byte rows a program (the "
    "kernel's access), and 75.0 us (85%) in all eight kv heads' contiguous 2048-byte rows of each key, "
    "512 programs. The kernel taking 2, 4 or 8 kv heads a program (one tile of their rows a key step, a "
    "row's scores against the other heads' rows masked off) measured 79.4, 81.0 and 84.8 us at its best "
    "split counts: the masked scores cost what the longer runs save, so it was not kept. No other split "
    "count, tile, warp count or depth swept beat the default there (33 splits of 64-key steps, 3 stages, 4 "
    "warps). The same sweep set the split counts from 1024 to 16384 keys at one program a multiprocessor "
    "(`attention_decode.default_config`), where a cap of sqrt(Sk / 16) splits had left SMs idle or "
    "doubled up: GPU time at Sk 1024 11.65 -> 11.2 us, at Sk 8192 22.0 -> 20.9 us (cuDNN 22.0). Replayed "
    "from CUDA graphs without the L2 flush (`dlcore bench flash_attention_v2 --shapes decode --vs "
    "sdpa_flash,sdpa_cudnn --impls triton --timer cudagraph`, the same day), where K and V stay partly or "
    "wholly in the L2 as a captured decode step may find them, the Triton kernel is 1.04x cuDNN on "
    "geometric mean, 0.92x at Sk 8192 (12.0 against 11.0 us: 32 MiB held in the L2, where cuDNN's "
    "kernel does better), 1.00x at 65536 (67.1 us). The flash_attention_v2 tables above are of 2026-12-05, "
    "6 rounds (`BENCH_ROUNDS=6`), on a quiet host (one small torch op 6.9 to 7.4 us): decode at or above "
    "SDPA at every Sk (get_op takes cuDNN at 65536, 1.00x), where runs of 2026-12-04 had timed a slower "
    "host (SDPA 80 to 120 us a call). get_op's prefill choice is cuDNN at every shape, forward and "
    "backward; its rows below 0.98x of the best are cuDNN against its own column, whose rounds spread "
    "by 5 to 20% at S 4096 and more (forward S 8192: 1619 to 1797 us over six rounds; 16384 causal: 3375 "
    "to 4152), the GPU's clock under sustained tensor-core load: a gap of 2 to 6% between two columns of "
    "one kernel is within that spread. A 2-round run the same day (the fused rotary and softmax tables) "
    "had the same rows at 0.89 to 1.00x.")


# -- the end-to-end benchmark ----------------------------------------------------------------------------

E2E_FOLDER = "e2e"
#: the columns of the end-to-end tables, in order; the two dlcore columns are what the targets measure
E2E_COLUMNS = ("eager", "compile", "liger", "grouped_mm", "dlcore", "dlcore+compile")
E2E_DLCORE = ("dlcore", "dlcore+compile")
#: issue #41's targets: (preset, phase, the baselines whose fastest dlcore is measured against, goal)
E2E_TARGETS = (("llama3-8b", "train", ("eager",), 1.15), ("llama3-8b", "train", ("liger", "compile"), 1.05),
               ("llama3-8b", "prefill", ("eager",), 1.1), ("llama3-8b", "decode_b1", ("eager",), 1.0),
               ("llama3-8b", "decode_b32", ("eager",), 1.0), ("qwen3-30b-a3b", "train", ("grouped_mm",), 1.3),
               ("qwen3-30b-a3b", "prefill", ("eager",), 1.1), ("qwen3-30b-a3b", "decode_b1", ("eager",), 1.0),
               ("qwen3-30b-a3b", "decode_b32", ("eager",), 1.0))
E2E_METHOD = (
    "`dlcore bench-model` (`python -m dlblas_kernels.integrations.transformers.bench`; `bash .ci/e2e_bench.sh` on "
    "the GPU host): a transformers model built from the named checkpoint's config (its layer shapes and "
    "vocabulary) with the given number of decoder layers and random weights, one column after the other in one "
    "process, each a fresh build from the same seed. `train`: one training step (forward, the model's own loss, "
    "backward; gradients set to None before each); `prefill`: a forward under no_grad filling a new cache, the "
    "last position's logits only; `decode bN`: one new token for each of N sequences against a cache of the "
    "given length (random keys and values), per token step. Each time is the median of the timed runs (CUDA "
    "events) after untimed warm-up runs, where torch.compile compiles and dlcore selects its kernels; peak "
    "memory is `torch.cuda.max_memory_allocated` over the timed training steps (weights, gradients, "
    "activations). `vs eager` is eager's time over the column's.")


def load_e2e(folder: str) -> list[dict]:
    """The end-to-end reports of ``folder/e2e/``, by preset name."""
    reports = []
    for path in sorted(glob.glob(os.path.join(folder, E2E_FOLDER, "*.json"))):
        with open(path) as f:
            data = json.load(f)
        if isinstance(data, dict) and data.get("benchmark") == "transformers":
            data["_file"] = f"{E2E_FOLDER}/{os.path.basename(path)}"
            reports.append(data)
    return reports


def e2e_phase(report: dict, column: str, phase: str) -> dict:
    """A column's result of a phase (``{}`` where the column or phase is absent)."""
    found = next((c for c in report["columns"] if c["name"] == column), {})
    return found.get("phases", {}).get(phase) or {}


def e2e_ms(report: dict, column: str, phase: str) -> float | None:
    """A phase's milliseconds (decode: per token step), None where it was not measured."""
    result = e2e_phase(report, column, phase)
    return result.get("ms_per_token", result.get("ms")) if result.get("status") == "ok" else None


def e2e_phases(report: dict) -> list[str]:
    decode = [f"decode_b{b}" for b in report.get("decode_batches", [])]
    return [p for p in ("train", "prefill", *decode) if any(p in c.get("phases", {}) for c in report["columns"])]


def e2e_table(report: dict) -> list[str]:
    """One row per column: each phase's ms and its speedup over eager, training's tokens/s and peak memory."""
    phases = e2e_phases(report)
    header = ["column"]
    for phase in phases:
        label = phase.replace("_b", " b")
        header += [f"{label} ms" + (" a token" if phase.startswith("decode") else ""), "vs eager"]
        if phase == "train":
            header += ["train tokens/s", "train peak GiB"]
    rows = []
    names = [n for n in E2E_COLUMNS if any(c["name"] == n for c in report["columns"])]
    names += [c["name"] for c in report["columns"] if c["name"] not in names]
    for name in names:
        column = next(c for c in report["columns"] if c["name"] == name)
        row = [f"**{name}**" if name in E2E_DLCORE else name]
        for phase in phases:
            ms, eager = e2e_ms(report, name, phase), e2e_ms(report, "eager", phase)
            status = e2e_phase(report, name, phase).get("status") or column["status"]
            row += [f"{ms:.3g}" if ms and ms < 10 else f"{ms:.1f}" if ms else status,
                    ratio(eager / ms) if ms and eager else "-"]
            if phase == "train":
                train = e2e_phase(report, name, "train")
                peak = train.get("peak_memory_bytes") if ms else None
                row += [f"{train['tokens_per_s']:.0f}" if ms else "-", f"{peak / 2**30:.1f}" if peak else "-"]
        rows.append(row)
    return md_table(header, rows, "l" + "r" * (len(header) - 1))


def e2e_notes(report: dict) -> list[str]:
    """Why each column or phase without numbers has none, and each column's description."""
    notes = []
    for column in report["columns"]:
        notes.append(f"`{column['name']}`: {column.get('description', '')}".rstrip(": "))
        if column["status"] == "skipped":
            notes[-1] += f"; skipped: {column.get('reason', '')}"
        elif column.get("error"):
            notes[-1] += f"; failed: {column['error']}"
        for phase, result in column.get("phases", {}).items():
            if result.get("status") == "failed":
                notes[-1] += f"; {phase} failed: {result.get('error', '')}"
            elif result.get("status") == "skipped":
                notes[-1] += f"; {phase} skipped: {result.get('reason', '')}"
    return notes


def e2e_targets(reports: list[dict]) -> list[list[str]]:
    """Rows (target, measured, met) of issue #41's targets, for the presets measured."""
    rows = []
    by_preset = {r["preset"]: r for r in reports}
    for preset, phase, baselines, goal in E2E_TARGETS:
        report = by_preset.get(preset)
        if report is None:
            continue
        label = f"{preset}, {phase.replace('_b', ' at batch ')}: >= {goal:g}x " + (
            baselines[0] if len(baselines) == 1 else f"the faster of {' and '.join(baselines)}")
        theirs = [(e2e_ms(report, b, phase), b) for b in baselines if e2e_ms(report, b, phase)]
        mine = [(e2e_ms(report, d, phase), d) for d in E2E_DLCORE if e2e_ms(report, d, phase)]
        if not theirs or not mine:
            rows.append([label, "not measured", "-"])
            continue
        (their_ms, their_name), (my_ms, my_name) = min(theirs), min(mine)
        value = their_ms / my_ms
        rows.append([label, f"{ratio(value)} ({my_name} against {their_name})", met(value, goal)])
        if preset == "llama3-8b" and phase == "train" and baselines == ("eager",):
            peak = e2e_phase(report, my_name, "train").get("peak_memory_bytes")
            eager = e2e_phase(report, "eager", "train").get("peak_memory_bytes")
            rows.append([f"{preset}, train: peak memory <= eager's",
                         f"{peak / 2**30:.1f} GiB ({my_name}) against {eager / 2**30:.1f} GiB" if peak and eager
                         else "not measured", "-" if not (peak and eager) else "yes" if peak <= eager else "no"])
    return rows


def e2e_section(reports: list[dict]) -> list[str]:
    if not reports:
        return []
    lines = ["## End to end: transformers models", "", E2E_METHOD, ""]
    targets = e2e_targets(reports)
    if targets:
        lines += ["Issue #41's targets (each dlcore figure the faster of its two columns):", ""]
        lines += md_table(["target", "measured", "met"], targets, "lll") + [""]
    for r in reports:
        versions = r.get("versions", {})
        lines += [f"### {r['preset']}", "",
                  f"{r['model']} config, {r['layers']} layers, {r['dtype']}, batch {r['batch']} x {r['tokens']} "
                  f"tokens (decode against {r['cache_tokens']} cached tokens); {r['gpu']}, torch "
                  f"{versions.get('torch')}, Triton {versions.get('triton')}, transformers "
                  f"{versions.get('transformers')}, Liger-Kernel {versions.get('liger-kernel') or '-'}; "
                  f"{r['date'][:10]}; warm-up {r['warmup']}, median of {r['iters']}.", ""]
        lines += e2e_table(r)
        lines += ["", f"`{r['command']}` ([`{r['_file']}`](results/{r['_file']}))", ""]
        lines += [f"- {n}" for n in e2e_notes(r)] + [""]
    return lines


def overhead_section(overhead: dict | None, first: dict | None) -> list[str]:
    lines = ["## dlcore's own costs", ""]
    if overhead:
        lines += [f"`{overhead['command']}` on the {overhead.get('gpu', 'GPU')} host ({overhead.get('date', '?')}). "
                  "Host time per call, median of 10^4 calls (silu_and_mul on one row of 256, float16), and for "
                  "a new process the median of five (rms_norm, float32, 8 x 256; torch and triton imported "
                  "first; the disk cache filled by a `dlcore tune`, the plugin index and the launch shelf by an "
                  "earlier process; Triton's cache warm).", ""]
        rows = [[row["name"], f"{row['value']:.2f} {row['unit']}"] for row in overhead["rows"]]
        lines += md_table(["what", "time"], rows, "lr")
        lines.append("")
        lines += [f"- {note}" for note in overhead.get("notes", [])]
        if overhead.get("notes"):
            lines.append("")
    if first:
        modes = first["modes"]
        lines += ["### The first call", "",
                  (f"Of {first['code']}: " if first.get("code") else "") +
                  f"`{first['command']}`: each step's milliseconds in a new process with Triton's cache warm "
                  f"(median of {len(next(iter(modes.values()))['runs_ms']['first_call'])}; {first['shape']}; "
                  f"{first.get('gpu', '')} {first.get('date', '')}). `dlcore` calls `dlcore.get_op` and its "
                  "result; `direct` calls `dlblas_kernels.rms_norm.rms_norm`; `triton` launches a trivial "
                  "`@triton.jit` add kernel with `kernel[grid](...)`: Triton's own floor.", ""]
        steps = {"get_op": "`get_op`", "first_call": "first call", "second_call": "second call"}
        rows = [[label] + [f"{modes[m]['median_ms'][step]:.1f}" if step in modes.get(m, {})
                                            .get("median_ms", {}) else "-" for m in ("dlcore", "direct", "triton")]
                for step, label in steps.items()]
        lines += md_table(["step, ms", "dlcore", "direct", "triton"], rows, "lrrr")
        key = modes.get("key", {}).get("median_ms", {})
        if key:
            lines += ["", f"Alone in a new process: Triton's `triton_key()` {key.get('triton_key', 0):.0f} ms, the "
                          f"CUDA backend's hash {key.get('backend_hash', 0):.1f} ms."]
        profile = first.get("profile")
        if profile:
            lines += ["", f"Where dlcore's first call goes: cProfile of {profile['what']} (read from the profile, "
                          "not written by the command above). Indented rows are parts of the unindented row "
                          "above them.", ""]
            lines += md_table(["part", "ms"], [[("&nbsp;&nbsp;&nbsp;&nbsp;" + name.strip()) if name.startswith(" ")
                                                else name, f"{ms:.0f}"] for name, ms in profile["rows"]], "lr")
        lines.append("")
    return lines


def render(folder: str) -> str:
    reports = load_benches(folder)
    overhead = load_optional(folder, "overhead.json")
    first = load_optional(folder, "first_call.json")
    peak = matmul_peak(reports)
    out = ["# Performance", "",
           "<!-- Generated by `python3 docs/results/render.py` from docs/results/*.json: edit those, not this. -->",
           "",
           "Current numbers, rendered by `python3 docs/results/render.py` from the JSON results in "
           "[`docs/results/`](results/). `bash .ci/gpu.sh bench` writes the benchmark JSON there (one "
           "`dlcore bench ... --json` per op and mode, on a CUDA GPU); `overhead.json` and "
           "`first_call.json` come from the commands in [dlcore's own costs](#dlcores-own-costs).", "",
           "## Setup", ""]
    out += setup(reports, overhead, peak)
    out += ["", "## Method", "", METHOD, "", "## Summary", "",
            f"Geometric means of the speedups over each table's shapes; the last column is dlcore's share of the "
            f"copy bandwidth at working sets of {LARGE_MIB} MiB and more.", ""]
    out += summary(reports)
    out.append("")
    current = None
    for r in reports:
        if r["op"] != current:
            current = r["op"]
            out += [f"## {current}", ""]
            if current in OP_NOTES:
                out += [OP_NOTES[current], ""]
            if current in OP_MEASURED:
                out += ["Measured for the kernel's choices:", ""] + [f"- {m}" for m in OP_MEASURED[current]] + [""]
        dtype = r["dtype"]
        extra = f", {variant(r)}" if variant(r) else ""
        out += [f"### {current} {r['mode']}{extra} ({dtype})", ""]
        out += bench_table(r, peak[0] * PEAK_SCALE.get(r["op"], 1.0) if peak else None)
        out += ["", f"`{r['command']}` ([`{r['_file']}`](results/{r['_file']}))"]
        if r.get("host_call_us"):
            out += ["", "Host: " + " and ".join(f"{t:.1f}" for t in r["host_call_us"])
                    + " us a small torch op at the run's start and end (`host_call_us`): rows within a few times "
                    "that time the host's launches, not the GPU."]
        notes = [f"`{name}`: {doc}" for name, doc in r.get("baseline_docs", {}).items()]
        notes += list(r.get("notes", []))
        per_shape: dict[str, list[str]] = {}
        for s in r["shapes"]:
            for n in s.get("notes", []):
                per_shape.setdefault(n, []).append(shape_label(s))
        notes += [f"{n} ({'; '.join(labels) if len(labels) <= 2 else f'{len(labels)} shapes'})"
                  for n, labels in per_shape.items()]
        slow = slower_than(r)
        if slow:
            notes.append("a baseline is faster at: " + "; ".join(slow))
        if notes:
            out += [""] + [f"- {n}" for n in notes]
        out.append("")
    out += targets_section(reports)
    out += e2e_section(load_e2e(folder))
    out += overhead_section(overhead, first)
    out += [OTHER, ""]
    return "\n".join(out)


# -- import-overhead -------------------------------------------------------------------------------------

_LINE = re.compile(r"^(?P<name>\S.*?|\s+\S.*?)\s+(?P<value>-?\d+(?:\.\d+)?)(?P<us> us)?\s*$")


def import_overhead(text_path: str, folder: str) -> int:
    """Parse `python3 -m dlcore.bench.overhead warm hot cold first` output into overhead.json (other keys kept)."""
    path = os.path.join(folder, "overhead.json")
    data = load_optional(folder, "overhead.json") or {}
    rows = []
    with open(text_path) as f:
        for line in f:
            m = _LINE.match(line.rstrip("\n"))
            if not m:
                continue
            name = m["name"].strip()
            unit = "us" if m["us"] else "ms"
            name = re.sub(r",\s*ms$", "", name)
            rows.append({"name": name, "value": float(m["value"]), "unit": unit})
    if not rows:
        print(f"no results found in {text_path}", file=sys.stderr)
        return 1
    data.update({"command": "python3 -m dlcore.bench.overhead warm hot cold first", "rows": rows})
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print(f"wrote {path} ({len(rows)} rows)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs="?", choices=("render", "import-overhead"), default="render")
    parser.add_argument("file", nargs="?", help="import-overhead: the text output of dlcore.bench.overhead")
    parser.add_argument("--results", default=HERE, help="the folder of the JSON results (default: this one)")
    parser.add_argument("--out", default=PAGE, help="the page to write (default docs/performance.md)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if the page is out of date")
    args = parser.parse_args(argv)
    if args.command == "import-overhead":
        if not args.file:
            parser.error("import-overhead needs the text file")
        return import_overhead(args.file, args.results)
    page = render(args.results)
    if args.check:
        current = open(args.out).read() if os.path.exists(args.out) else ""
        if current != page:
            print(f"{args.out} is out of date: run python3 docs/results/render.py", file=sys.stderr)
            return 1
        return 0
    with open(args.out, "w") as f:
        f.write(page)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
