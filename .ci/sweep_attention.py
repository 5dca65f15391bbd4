"""Time the attention block's forward configs against SDPA (flash and cuDNN backends) in bfloat16, B 2,
H 16, S 8192 (SWEEP_SHAPE=B,H,S to change), for head dimensions 64, 128 and 256 (SWEEP_D), causal and
not; do_bench medians, the SDPA backends timed before and after the configs of each case. Each
config's output is checked against SDPA flash's first.

    python3 .ci/sweep_attention.py sweep [OUT.jsonl]    the candidates of each head dimension
    python3 .ci/sweep_attention.py bench [OUT.jsonl]    flash_attention_v2's default config and the public function,
                                                        beside a few alternatives

Compiles run first, in parallel processes that fill Triton's cache (on a small problem of the same
specialisation).
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import sys
import time

import torch
import triton


def cfg(bm, bn, w, s, **extra):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s, **extra}


# WARP_SPECIALIZE: the one warp-specialised loop (a producer, two 64-row consumer warpgroups of 4 warps)
WS = {"WARP_SPECIALIZE": 1}
CANDIDATES = {
    64: [cfg(128, 128, 8, 3), cfg(128, 64, 4, 4), cfg(128, 64, 8, 4), cfg(128, 128, 4, 3), cfg(64, 64, 4, 4),
         cfg(128, 64, 4, 4, TMA=0), cfg(128, 128, 4, 3, **WS), cfg(128, 128, 4, 4, **WS), cfg(128, 64, 4, 5, **WS)],
    128: [cfg(128, 128, 8, 3), cfg(128, 128, 8, 2), cfg(128, 64, 8, 3), cfg(128, 64, 8, 4), cfg(64, 128, 4, 3),
          cfg(64, 64, 4, 4), cfg(128, 128, 8, 3, TMA=0), cfg(128, 64, 8, 4, TMA=0), cfg(128, 128, 4, 2, **WS),
          cfg(128, 64, 4, 3, **WS), cfg(128, 64, 4, 4, **WS), cfg(128, 64, 4, 5, **WS)],
    256: [cfg(128, 64, 8, 2), cfg(64, 64, 4, 2), cfg(128, 32, 8, 3), cfg(64, 32, 4, 3), cfg(64, 64, 4, 3),
          cfg(128, 32, 4, 2, **WS), cfg(128, 32, 4, 3, **WS)],
}


ALTERNATIVES = {
    64: [cfg(128, 128, 4, 4), cfg(256, 128, 8, 3), cfg(256, 64, 8, 3), cfg(128, 128, 4, 3, TMA=0)],
    128: [cfg(128, 128, 8, 3, TMA=0), cfg(128, 64, 8, 3), cfg(128, 128, 8, 3, rotary=1), cfg(128, 64, 8, 3, rotary=1)],
    256: [cfg(128, 64, 8, 2, TMA=0)],
}


def tensors(batch, heads, seq, d, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed + d)
    return [torch.randn(batch, seq, heads, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3)]


def calls_for(config, q, k, v, out, lse, causal):
    """The launches of ``config``; with ``"rotary": 1`` in it, the q and k tiles rotated by LLaMA's
    tables (rotate-half) after loading."""
    from dlblas_kernels.blocks.attention import forward_calls
    from dlblas_kernels.kernels.apply_rotary_pos_emb import llama_cos_sin

    from dlcore.runtime.template import device_profile
    config = dict(config)
    rotary = None
    if config.pop("rotary", 0):
        cos, sin = llama_cos_sin(1, k.shape[1], k.shape[-1], k.dtype, k.device)
        rotary = (cos[0], sin[0], False)
    return forward_calls(q, k, v, out, lse, causal=causal, scale=q.shape[-1] ** -0.5, config=config,
                         profile=device_profile(q.device), rotary=rotary)


def compile_one(job: tuple) -> str:
    """Run one (heads, d, causal, config) once on a short sequence, in a worker: the same
    specialisation as the long one, so its compile lands in Triton's cache."""
    heads, d, causal, config = job
    try:
        q, k, v = tensors(1, heads, 512, d)
        out, lse = torch.empty_like(q), torch.empty(1, heads, 512, device="cuda")
        for call in calls_for(config, q, k, v, out, lse, causal):
            call.launch()
        torch.cuda.synchronize()
        return ""
    except Exception as error:  # a config the chip cannot take: reported, not fatal
        return f"{type(error).__name__}: {str(error)[:300]}"


def precompile(jobs: list[tuple]) -> dict:
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(14, len(jobs)), mp_context=context) as pool:
        return dict(zip([repr(j) for j in jobs], pool.map(compile_one, jobs)))


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3  # us


def baselines(q, k, v, causal) -> dict:
    from dlblas_kernels.blocks.sdpa import sdpa_attention as sdpa
    from torch.nn.attention import SDPBackend

    found = {}
    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            sdpa(q, k, v, causal, None, backend)
            found[name] = bench(lambda backend=backend: sdpa(q, k, v, causal, None, backend))
        except RuntimeError as error:
            print(f"{name}: {str(error)[:120]}", flush=True)
    return found


def main() -> None:
    from dlblas_kernels.blocks.sdpa import sdpa_attention as sdpa
    from dlblas_kernels.kernels.flash_attention_v2 import OP, cost, default_config
    from torch.nn.attention import SDPBackend

    from dlcore.declarations.signature import make_signature
    from dlcore.runtime import launch as warm
    from dlcore.runtime.template import device_profile

    mode = sys.argv[1]
    out_file = open(sys.argv[2], "a") if len(sys.argv) > 2 else None
    batch, heads, seq = (int(x) for x in os.environ.get("SWEEP_SHAPE", "2,16,8192").split(","))
    ds = [int(x) for x in os.environ.get("SWEEP_D", "128,64,256").split(",")]
    profile = device_profile(torch.device("cuda"))
    plan = []
    for d in ds:
        for causal in (False, True):
            if mode == "sweep":
                configs = CANDIDATES[d]
            else:
                q = torch.empty(batch, seq, heads, d, device="meta", dtype=torch.bfloat16)
                default = default_config(make_signature(OP, (q, q, q, causal, None, False), q.device), profile)
                configs = [{**default, "default": 1}] + [c for c in ALTERNATIVES[d] if c != default]
            plan += [(heads, d, causal, c) for c in configs]
    t0 = time.time()
    failed = {key: err for key, err in precompile([(h, d, c, {k: v for k, v in cf.items() if k != "default"})
                                                   for h, d, c, cf in plan]).items() if err}
    print(f"compiled {len(plan)} in {time.time() - t0:.0f}s; failed: {failed}", flush=True)
    for d in ds:
        q, k, v = tensors(batch, heads, seq, d)
        for causal in (False, True):
            _, flops = cost((q, k, v, causal, None, False))
            want = sdpa(q, k, v, causal, None, SDPBackend.FLASH_ATTENTION).float()
            before = baselines(q, k, v, causal)
            rows = []
            for _, pd, pc, config in plan:
                clean = {k: v for k, v in config.items() if k != "default"}
                if (pd, pc) != (d, causal) or repr((heads, pd, pc, clean)) in failed:
                    continue
                out = torch.full_like(q, float("nan"))
                lse = torch.empty(batch, heads, seq, device="cuda")
                calls = calls_for(clean, q, k, v, out, lse, causal)
                for call in calls:
                    warm.launch(call)
                err = ((out.float() - want).norm() / want.norm()).item() if "rotary" not in config else 0.0
                us = bench(lambda calls=calls: [warm.launch(call) for call in calls])
                rows.append((us, config, err))
                if config.get("default"):
                    from dlblas_kernels import flash_attention_v2
                    public = bench(lambda q=q, k=k, v=v, causal=causal: flash_attention_v2(q, k, v, causal))
                    rows.append((public, {"public function": 1}, err))
            after = baselines(q, k, v, causal)
            base = {name: min(us, after.get(name, us)) for name, us in before.items()}
            for us, config, err in sorted(rows, key=lambda r: r[0]):
                record = {"batch": batch, "heads": heads, "seq": seq, "d": d, "causal": causal, "us": round(us, 1),
                          "tflops": round(flops / us / 1e6, 1), "rel_err": float(f"{err:.2e}"), "config": config,
                          **{f"{name}_tflops": round(flops / t / 1e6, 1) for name, t in base.items()}}
                if out_file:
                    out_file.write(json.dumps(record) + "\n")
                    out_file.flush()
            anchors = " ".join(f"{name} {flops / t / 1e6:.0f}" for name, t in base.items())
            print(f"D={d} causal={causal}: {anchors} TFLOP/s", flush=True)
            for us, config, err in sorted(rows, key=lambda r: r[0]):
                print(f"    {flops / us / 1e6:6.1f} TFLOP/s {us:9.1f} us err {err:.1e} {config}", flush=True)


if __name__ == "__main__":
    main()
