"""fused_moe's copy-engine path (blocks/grouped_tma.py, a config's TMA 1) at Mixtral-8x7B's size on the GPU:
its output and speed beside the pointer kernels', the grouped_mm composite's and the dense GEMM rate, flattened
persistent loop and not. Off by default (moe_tiles.TMA_BY_DEFAULT) while its rows come out wrong in some calls.

    python3 .ci/probe_moe_tma.py [TOKENS ...]   (default 4096 16384)

A JSON line per token count: each path's TFLOP/s (CUDA-graph replays, medians), its largest error against the
composite and its rows off by more than 5% of the composite's largest output. The copy-engine paths also say
which stage's rows are off (``stages``): the gathered rows against the tokens, the SwiGLU product against
float32 products of those rows, the down GEMM's rows against float32 products of that SwiGLU product. A second
line (PROBE_FP8=0 leaves it out): the layer with fp8 weights, by the pointer kernels and through the copy
engine (rows off by more than 2% against the pointer kernels, which quantise alike). A third line: how many
first calls of new copy-engine plans were wrong in PROBE_REPEATS tries, and the stages of each wrong call,
checked right after it.

Stages off are also broken down by row block of the SwiGLU product (``act_blocks_off``: block, expert,
rows off, first and last column off), which tells one expert's tiles from scattered ones. Two knobs
test what a wrong call depends on:

- PROBE_KEEP_SCRATCH=1: Triton's allocator never hands out an address twice, so no two kernels build
  their tensor descriptors in the same global scratch (a stale descriptor at a reused address);
- PROBE_SYNC=1: the correctness runs synchronise the device after each launch (an order between
  launches);
- PROBE_POISON=1: before each correctness run, the copy-engine path's own buffers (the gathered rows,
  the SwiGLU product, the rows by slot) are filled with NaN. A plan keeps its buffers from call to
  call, so a tile that one call leaves unwritten still holds the last call's right values, and the
  same inputs hide it; with the poison, such a tile is NaN (rows with a NaN count as off).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton.testing
from dlblas_kernels import vendor
from dlblas_kernels.blocks import grouped_tma, moe_tiles
from dlblas_kernels.kernels import fused_moe as M
from dlblas_kernels.kernels.fused_moe_fp8 import quantise_weight

from dlcore.runtime.profile import device_profile

H, INTER, E, K = 4096, 14336, 8, 2
DEVICE = "cuda"
PATHS = {"pointer": (0, True), "tma": (1, True), "tma_unflattened": (1, False)}
#: fp8 weights through the copy engine: the fp8 heuristic's tiles, and others
FP8_PATHS = {"fp8_tma": {}, "fp8_tma_unflattened": {"FLATTEN": 0}, "fp8_tma_8warps": {"num_warps": 8, "num_stages": 3}}


def keep_scratch() -> None:
    """PROBE_KEEP_SCRATCH: descriptor scratch from fresh memory, at an offset that cycles, on every launch."""
    import triton

    kept: list[torch.Tensor] = []

    def allocate(size: int, alignment: int, stream) -> torch.Tensor:
        kept.append(torch.empty(size + 4096 * (len(kept) % 7), dtype=torch.int8, device=DEVICE))
        return kept[-1]

    triton.set_allocator(allocate)


def poison(plan) -> None:
    """PROBE_POISON: NaN in the buffers the copy-engine path writes (the gathered rows, and each GEMM's output)."""
    for call in plan.calls:
        if call.kernel is grouped_tma.grouped_tma_gemm_kernel:
            call.args[0].fill_(float("nan"))
            call.args[2].fill_(float("nan"))


def run(plan) -> torch.Tensor:
    """A correctness run of ``plan``: with PROBE_SYNC, the device synchronised after each launch; with
    PROBE_POISON, :func:`poison` first."""
    if os.environ.get("PROBE_POISON") == "1":
        poison(plan)
    if os.environ.get("PROBE_SYNC") != "1":
        return plan.run()
    from dlcore.runtime.launch import launch
    for call in plan.calls:
        launch(call)
        torch.cuda.synchronize()
    return plan.result


def bench(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median")


def _over(error: torch.Tensor, limit) -> torch.Tensor:
    """Where ``error`` is above ``limit`` or NaN."""
    return ~(error <= limit)


def _bad(error: torch.Tensor, limit) -> int:
    """Rows of ``error`` with an entry above ``limit`` or NaN."""
    return int(_over(error, limit).any(1).sum())


def _largest(error: torch.Tensor) -> float:
    """The largest entry of ``error``, a NaN as infinity."""
    return round(error.nan_to_num(float("inf")).max().item(), 5)


def _off(got: torch.Tensor, want: torch.Tensor) -> int:
    """Rows of ``got`` off by more than 2% of ``want``'s largest value (or NaN)."""
    return _bad((got.float() - want).abs(), 0.02 * want.abs().max().clamp_min(1e-6))


def stages(plan, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> dict:
    """Rows off in each stage of a copy-engine plan, from its launches' own tensors (after a run)."""
    up, down = (c for c in plan.calls if c.kernel is grouped_tma.grouped_tma_gemm_kernel)
    rows, _, act, _, sorted_ids, block_expert, starts = up.args[:7]
    y, weights = down.args[2], down.args[3]
    slots_total = y.shape[0]  # the down GEMM's output holds a row per slot
    block_m, used = up.kwargs["BLOCK_M"], int(starts[E].item())
    slot = sorted_ids[:used].long()
    valid = slot < slots_total
    want_rows = torch.zeros(used, H, device=DEVICE)
    want_rows[valid] = x[slot[valid] // K].float()
    found = {"used": used, "rows_off": _off(rows[:used], want_rows), "act_off": 0, "y_off": 0}
    expert_of = block_expert[: used // block_m].long().repeat_interleave(block_m)
    found["act_blocks_off"] = []
    for e in range(E):
        at = (expert_of == e).nonzero().squeeze(1)
        if not len(at):
            continue
        r = rows[at].float()
        want_act = torch.nn.functional.silu(r @ w13[e, :INTER].float().T) * (r @ w13[e, INTER:].float().T)
        off = _over((act[at].float() - want_act).abs(), 0.02 * want_act.abs().max().clamp_min(1e-6))  # as _off
        found["act_off"] += int(off.any(1).sum())
        for block in (at[off.any(1)] // block_m).unique().tolist():
            inside = off[at // block_m == block]
            cols = inside.any(0).nonzero().squeeze(1)
            found["act_blocks_off"].append([block, e, int(inside.any(1).sum()), int(cols.min()), int(cols.max())])
        live = at[valid[at]]
        want_y = (act[live].float() @ w2[e].float().T) * weights.view(-1)[slot[live]][:, None]
        found["y_off"] += _off(y[slot[live]], want_y)
    return found


def main(token_counts: list[int]) -> None:
    profile = device_profile(torch.device("cuda"))
    if os.environ.get("PROBE_KEEP_SCRATCH") == "1":
        keep_scratch()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    w13 = torch.randn(E, 2 * INTER, H, device=DEVICE, dtype=torch.bfloat16, generator=gen) * H ** -0.5
    w2 = torch.randn(E, H, INTER, device=DEVICE, dtype=torch.bfloat16, generator=gen) * INTER ** -0.5
    for tokens in token_counts:
        x = torch.randn(tokens, H, device=DEVICE, dtype=torch.bfloat16, generator=gen)
        weights, ids = torch.randn(tokens, E, device=DEVICE, generator=gen).softmax(-1).topk(K)
        args = (x, w13, w2, weights, ids.to(torch.int32), None, None)
        flops = 6 * tokens * K * H * INTER
        base = M.heuristic(tokens, E, K, 2, profile)
        reference = vendor.fused_moe(*args).float()
        row: dict = {"tokens": tokens, "config": base}
        for name, (tma, flatten) in PATHS.items():
            plan = M.plan(args, base if not tma else {**base, "TMA": 1, "DOWN_STAGES": 3, "FLATTEN": int(flatten)},
                          profile)
            error = (run(plan).float() - reference).abs()
            first_stages = stages(plan, x, w13, w2) if tma else None
            again = (run(plan).float() - reference).abs()
            row[name] = {"tflops": round(flops / bench(plan.run) / 1e9, 1), "max_error": _largest(error),
                         "bad_rows": _bad(error, 0.05 * reference.abs().max()),
                         "bad_rows_second_run": _bad(again, 0.05 * reference.abs().max())}
            if tma:
                row[name]["stages_first_run"] = first_stages
                plan.run()
                row[name]["stages"] = stages(plan, x, w13, w2)
        row["grouped_mm_tflops"] = round(flops / triton.testing.do_bench(lambda args=args: vendor.fused_moe(*args),
                                                                         rep=30, return_mode="median") / 1e9, 1)
        a = torch.randn(tokens * K, H, device=DEVICE, dtype=torch.bfloat16, generator=gen)
        act = torch.randn(tokens * K, INTER, device=DEVICE, dtype=torch.bfloat16, generator=gen)
        dense = lambda a=a, act=act: (a @ w13[0].T, act @ w2[0].T)  # noqa: E731 - the same FLOPs, one expert's weights
        row["dense_tflops"] = round(flops / bench(dense) / 1e9, 1)
        print(json.dumps(row), flush=True)
        if os.environ.get("PROBE_FP8", "1") != "0":
            print(json.dumps(fp8_row(args, tokens, flops, profile)), flush=True)
        print(json.dumps(repeated(args, base, reference, profile)), flush=True)


def repeated(args: tuple, base: dict, reference: torch.Tensor, profile) -> dict:
    """The copy-engine path's first call in PROBE_REPEATS (default 8) new plans, each after the pointer
    kernels' plan and its timing (the order in which the probe saw wrong rows), the loop flattened and
    not in turn: how many calls were wrong, and each wrong call's stages checked right after it."""
    x, w13, w2 = args[:3]
    count = int(os.environ.get("PROBE_REPEATS", "8"))
    wrong = []
    for i in range(count):
        pointer = M.plan(args, base, profile)
        pointer.run()
        bench(pointer.run)
        plan = M.plan(args, {**base, "TMA": 1, "DOWN_STAGES": 3, "FLATTEN": i % 2}, profile)
        bad = _bad((run(plan).float() - reference).abs(), 0.05 * reference.abs().max())
        if bad:
            wrong.append({"call": i, "flatten": i % 2, "bad_rows": bad, "stages": stages(plan, x, w13, w2)})
    return {"tokens": x.shape[0], "repeats": count, "wrong_calls": len(wrong), "wrong": wrong}


def fp8_row(args: tuple, tokens: int, flops: int, profile) -> dict:
    """The same layer with the weights in fp8 (128x128 block scales): the pointer kernels and the
    copy-engine path (rows off against the pointer kernels' output, which quantises alike)."""
    x, w13, w2, weights, ids = args[:5]
    (q13, s13), (q2, s2) = quantise_weight(w13), quantise_weight(w2)
    fp8_args = (x, q13, q2, weights, ids, s13, s2)
    base = moe_tiles.heuristic(tokens, E, K, 1, profile, fp8=True)
    row: dict = {"tokens": tokens, "fp8_config": base}
    pointer = M.plan(fp8_args, base, profile)
    want = pointer.run().float()
    row["fp8_pointer_tflops"] = round(flops / bench(pointer.run) / 1e9, 1)
    for name, extra in FP8_PATHS.items():
        plan = M.plan(fp8_args, {**base, "TMA": 1, **extra}, profile)
        if not any(c.kernel is grouped_tma.grouped_tma_gemm_kernel for c in plan.calls):
            row[name] = "declined"
            continue
        error = (run(plan).float() - want).abs()
        again = (run(plan).float() - want).abs()
        row[name] = {"tflops": round(flops / bench(plan.run) / 1e9, 1), "max_error": _largest(error),
                     "bad_rows": _bad(error, 0.02 * want.abs().max()),
                     "bad_rows_second_run": _bad(again, 0.02 * want.abs().max())}
    return row


if __name__ == "__main__":
    main([int(t) for t in sys.argv[1:]] or [4096, 16384])
