"""Time flash attention's backward kernels (dlblas_kernels.blocks.attention_grad) over tile configs on the
GPU, next to SDPA's flash and cuDNN backward, bfloat16, BSHD: B 2, S 8192, D 128 and 64, heads 16/16
and GQA 32/8, causal and not. Each kernel alone (do_bench medians, alternating nothing else on the
GPU); the block's time is preprocess + dkdv + dq, the default (backward_config) and the best of the
sweep. TFLOP/s counts 2.5 * 4 * B * Hq * S^2 * D, halved under the causal mask. The configs are
compiled first by worker processes (Triton's disk cache), then timed one by one.

    python3 .ci/sweep_attention_backward.py [OUT_JSON]

SWEEP_SHAPES (e.g. "d128,d128-causal") picks shapes; SWEEP_PHASE=compile only compiles,
SWEEP_PHASE=time only times (what a compile run left in Triton's cache), SWEEP_PHASE=default times
SDPA and the default block alone.
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
from dlblas_kernels.blocks import attention_grad as ag
from torch.nn.attention import SDPBackend, sdpa_kernel

from dlcore.runtime.template import device_profile

B, S = 2, 8192
SHAPES = {  # name: (Hq, Hk, D, causal)
    "d128": (16, 16, 128, False), "d128-causal": (16, 16, 128, True),
    "gqa": (32, 8, 128, False), "gqa-causal": (32, 8, 128, True),
    "d64": (16, 16, 64, False), "d64-causal": (16, 16, 64, True),
}
# (resident block, streamed block, warps, stages) per kernel and D; each with TMA 0 and 1
CANDIDATES = {
    128: {"DKDV": [(128, 32, 8, 2), (128, 32, 8, 3), (128, 64, 8, 2), (64, 32, 4, 2), (64, 32, 4, 3), (128, 16, 8, 4)],
          "DQ": [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 2), (128, 32, 8, 3), (64, 64, 4, 2), (64, 32, 4, 3)]},
    64: {"DKDV": [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 4),
                  (128, 128, 8, 2)],
         "DQ": [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (128, 32, 8, 4), (128, 32, 4, 3), (64, 64, 4, 3),
                (64, 32, 4, 4)]},
}
KERNEL = {"DKDV": "attention_dkdv_kernel", "DQ": "attention_dq_kernel"}


def config_of(kind: str, tile: tuple, tma: int) -> dict:
    resident, streamed, warps, stages = tile
    blocks = ("BLOCK_N", "BLOCK_M") if kind == "DKDV" else ("BLOCK_M", "BLOCK_N")
    return {f"{kind}_{blocks[0]}": resident, f"{kind}_{blocks[1]}": streamed, f"{kind}_WARPS": warps,
            f"{kind}_STAGES": stages, f"{kind}_TMA": tma}


def tensors(shape: str, random: bool = True):
    """The inputs of ``shape`` on the GPU (random, or left uninitialised for compiling)."""
    hq, hk, d, causal = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(0)

    def new(*size, dtype=torch.bfloat16):
        if not random:
            return torch.empty(*size, device="cuda", dtype=dtype)
        return torch.randn(*size, device="cuda", generator=gen).to(dtype)

    q, k, v, dout, out = new(B, S, hq, d), new(B, S, hk, d), new(B, S, hk, d), new(B, S, hq, d), new(B, S, hq, d)
    lse = new(B, hq, S, dtype=torch.float32)
    return q, k, v, dout, out, lse, causal, d


def calls_for(shape: str, kind: str, tile: tuple, tma: int, inputs=None):
    q, k, v, dout, out, lse, causal, d = inputs if inputs is not None else tensors(shape, random=False)
    profile = device_profile(torch.device("cuda"))
    config = {**ag.backward_config(q, causal, profile), **config_of(kind, tile, tma)}
    grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    calls = ag.backward_calls(dout, q, k, v, out, lse, None, *grads, causal=causal, scale=d ** -0.5, profile=profile,
                              config=config)
    return calls, grads


def compile_one(job: tuple) -> str:
    """In a worker: compile (warm up) one config's kernel into Triton's cache."""
    shape, kind, tile, tma = job
    start = time.time()
    try:
        calls, _ = calls_for(shape, kind, tile, tma)
        for call in calls:
            if call.kernel.__name__ == KERNEL[kind]:
                call.kernel.warmup(*call.args, grid=call.grid, **call.kwargs)
        return f"compiled {job} in {time.time() - start:.1f}s"
    except Exception as error:  # noqa: BLE001 - reported, the sweep goes on
        return f"failed {job}: {type(error).__name__}: {str(error)[:200]}"


def compile_default(shape: str) -> str:
    """In a worker: compile (warm up) the launches of the default config at ``shape``."""
    q, k, v, dout, out, lse, causal, d = tensors(shape, random=False)
    grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    for call in ag.backward_calls(dout, q, k, v, out, lse, None, *grads, causal=causal, scale=d ** -0.5,
                                  profile=device_profile(q.device)):
        call.kernel.warmup(*call.args, grid=call.grid, **call.kwargs)
    return f"compiled the default of {shape}"


def precompile(jobs: list, work=compile_one) -> None:
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(15, len(jobs)), mp_context=context) as pool:
        for line in pool.map(work, jobs):
            if line.startswith("failed"):
                print(line, flush=True)


def flops(shape: str) -> float:
    hq, _, d, causal = SHAPES[shape]
    return 2.5 * 4 * B * hq * S * S * d * (0.5 if causal else 1.0)


def reference_grads(inputs):
    """SDPA flash's bfloat16 gradients of the same inputs (k and v repeated over each GQA group, their
    gradients summed back), for an error per config."""
    q, k, v, dout, *_ = inputs
    group = q.shape[2] // k.shape[2]
    dq, dk, dv = sdpa_grads(q, k.repeat_interleave(group, 2), v.repeat_interleave(group, 2), dout, inputs[6], "flash")
    b, s, hk, d = k.shape
    return dq, dk.view(b, s, hk, group, d).sum(3), dv.view(b, s, hk, group, d).sum(3)


def sdpa_grads(q, k, v, dout, causal, backend, timed=False):
    which = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(which):
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves), is_causal=causal,
                                             enable_gqa=q.shape[2] != k.shape[2])
        grad = dout.transpose(1, 2)
        grads = torch.autograd.grad(out, leaves, grad, retain_graph=True)
        if not timed:
            return grads
        return triton.testing.do_bench(lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True),
                                       warmup=25, rep=100)


def forward_stats(inputs):
    """out and lse of the inputs from SDPA flash's forward (k, v repeated for GQA)."""
    q, k, v, dout, out, lse, causal, d = inputs
    group = q.shape[2] // k.shape[2]
    o, stats = torch.ops.aten._scaled_dot_product_flash_attention(
        q.transpose(1, 2), k.repeat_interleave(group, 2).transpose(1, 2), v.repeat_interleave(group, 2).transpose(1, 2),
        0.0, causal)[:2]
    out.copy_(o.transpose(1, 2))
    lse.copy_(stats)


def relative_error(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def main() -> None:
    results_path = sys.argv[1] if len(sys.argv) > 1 else None
    names = os.environ.get("SWEEP_SHAPES", ",".join(SHAPES)).split(",")
    results: dict = {"shapes": {}}

    def save():
        if results_path:
            with open(results_path, "w") as f:
                json.dump(results, f, indent=1)

    start = time.time()
    phase = os.environ.get("SWEEP_PHASE")
    if phase == "default":
        precompile(names, compile_default)
    elif os.environ.get("SWEEP_PHASE", "compile") == "compile":
        jobs = [(name, kind, tile, tma) for name in names for kind in ("DKDV", "DQ")
                for tile in CANDIDATES[SHAPES[name][2]][kind] for tma in (0, 1)]
        precompile(jobs)
        print(f"precompiled {len(jobs)} in {time.time() - start:.0f}s", flush=True)
    if phase == "compile":
        return

    for name in names:
        try:
            sweep(name, results, start, candidates=phase != "default")
        except Exception as error:  # noqa: BLE001 - the other shapes go on
            print(f"{name}: failed {type(error).__name__}: {str(error)[:300]}", flush=True)
        save()
        torch.cuda.empty_cache()


def sweep(name: str, results: dict, start: float, candidates: bool = True) -> None:
    """Time every candidate of both kernels at shape ``name`` (unless not ``candidates``), SDPA's
    backends and the default block."""
    hq, hk, d, causal = SHAPES[name]
    inputs = tensors(name)
    forward_stats(inputs)
    want = reference_grads(inputs)
    entry = results["shapes"][name] = {"tflop": flops(name) / 1e12, "kernels": {}}
    for backend in ("flash", "cudnn"):
        try:
            ms = sdpa_grads(*inputs[:4], causal, backend, timed=True)
            entry[f"sdpa_{backend}_ms"] = ms
            print(f"{name}: sdpa {backend} {ms:.3f} ms {flops(name) / ms / 1e9:.0f} TFLOP/s", flush=True)
        except Exception as error:  # noqa: BLE001 - a backend that declines is reported
            entry[f"sdpa_{backend}_ms"] = None
            print(f"{name}: sdpa {backend} failed: {str(error)[:120]}", flush=True)
    if candidates:
        sweep_candidates(name, inputs, want, entry)
    default_block(name, inputs, want, entry, start)


def sweep_candidates(name: str, inputs: tuple, want: tuple, entry: dict) -> None:
    d = inputs[7]
    candidates = {kind: [(tile, tma) for tile in CANDIDATES[d][kind] for tma in (0, 1)] for kind in ("DKDV", "DQ")}
    timings = {}
    for kind, tiles in candidates.items():
        for tile, tma in tiles:
            calls, grads = calls_for(name, kind, tile, tma, inputs)
            for call in calls[:1]:
                call.launch()  # the preprocess: stats for the kernel timed
            call = next(c for c in calls if c.kernel.__name__ == KERNEL[kind])
            try:
                call.launch()
                torch.cuda.synchronize()
                errors = [relative_error(g, w) for g, w in zip(grads, want)]
                errors = errors[1:] if kind == "DKDV" else errors[:1]
                ms = triton.testing.do_bench(call.launch, warmup=25, rep=80)
            except Exception as error:  # noqa: BLE001 - a config that fails is reported
                print(f"  {kind} {tile} tma={tma}: failed {type(error).__name__}: {str(error)[:150]}", flush=True)
                continue
            timings[(kind, tile, tma)] = ms
            entry["kernels"][f"{kind} {tile} tma={tma}"] = {"ms": ms, "errors": errors}
            print(f"  {kind} {tile} tma={tma}: {ms:.3f} ms, error vs flash {max(errors):.2e}", flush=True)
    ranked = {kind: sorted(((tile, tma) for (k, tile, tma) in timings if k == kind),
                           key=lambda t, kind=kind: timings[(kind, *t)]) for kind in ("DKDV", "DQ")}
    calls, _ = calls_for(name, "DKDV", ranked["DKDV"][0][0], ranked["DKDV"][0][1], inputs)
    pre = triton.testing.do_bench(calls[0].launch, warmup=10, rep=30)
    total = pre + timings[("DKDV", *ranked["DKDV"][0])] + timings[("DQ", *ranked["DQ"][0])]
    entry.update(preprocess_ms=pre, best={k: [list(t[0]), t[1]] for k, t in ((k, r[0]) for k, r in ranked.items())},
                 best_ms=total, best_tflops=flops(name) / total / 1e9)
    print(f"{name}: best {total:.3f} ms {entry['best_tflops']:.0f} TFLOP/s {entry['best']}", flush=True)


def default_block(name: str, inputs: tuple, want: tuple, entry: dict, start: float) -> None:
    """The block as backward_calls runs it by default (backward_config's tiles)."""
    q, k, v, dout, out, lse, causal, d = inputs
    grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    default = ag.backward_calls(dout, q, k, v, out, lse, None, *grads, causal=causal, scale=d ** -0.5,
                                profile=device_profile(q.device))

    def run_default(calls=default):
        for call in calls:
            call.launch()

    ms = triton.testing.do_bench(run_default, warmup=25, rep=100)
    entry.update(default_ms=ms, default_tflops=flops(name) / ms / 1e9,
                 default_errors=[relative_error(g, w) for g, w in zip(grads, want)])
    print(f"{name}: default {ms:.3f} ms {entry['default_tflops']:.0f} TFLOP/s, error vs flash "
          f"{max(entry['default_errors']):.2e} ({time.time() - start:.0f}s)", flush=True)


if __name__ == "__main__":
    main()
