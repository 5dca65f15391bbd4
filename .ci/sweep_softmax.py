"""softmax on a CUDA GPU, and the SDPA candidates: one JSON line per result, on stdout and in $OUT/softmax.jsonl.

    python3 .ci/sweep_softmax.py [correct] [sweep] [backward] [sdpa]    (default: all four)

- correct: bfloat16 and float16 outputs against float32 torch.softmax, rows of 4096 to 131072 and other
  dims (the looped kernel, (outer, inner) rows);
- sweep: forward configs (BLOCK_M, BLOCK_N, num_warps) per row length, each timed by do_bench (median)
  beside get_op's choice, torch.softmax and a copy of the same bytes (x read, y written), in
  alternating rounds; GB/s count bytes read + written;
- backward: the backward plan's default config against torch's softmax backward, and dx against float32;
- sdpa: dlblas_kernels.vendor's sdpa_flash and sdpa_cudnn (bf16) against a float32 reference, forward and
  gradients, GQA, causal both ways, Sq != Sk.
"""

from __future__ import annotations

import json
import os
import sys

import dlblas_kernels
import torch
from dlblas_kernels import vendor
from dlblas_kernels.kernels import softmax as sm
from triton.testing import do_bench

import dlcore
from dlcore.runtime.template import device_profile

OUT = os.environ.get("OUT", "/tmp")
LOG = open(os.path.join(OUT, "softmax.jsonl"), "a")
SHAPES = [(4096, 4096), (2048, 16384), (1024, 32768), (256, 131072)]
#: row length -> BLOCK_MxBLOCK_N/num_warps configs tried besides get_op's choice
SWEEP = {
    4096: ["1x4096/4"],
    16384: ["1x16384/32", "1x4096/8", "1x8192/8", "1x8192/16"],
    32768: ["1x32768/32", "1x4096/8", "1x8192/8", "1x8192/16", "1x16384/16", "1x16384/32"],
    131072: ["1x4096/4", "1x4096/8", "1x8192/8", "1x8192/16", "1x16384/16", "1x16384/32"],
}


def emit(**record) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    LOG.write(line + "\n")
    LOG.flush()


def bench(fn) -> float:
    return float(do_bench(fn, warmup=5, rep=25, return_mode="median"))


def logits(rows: int, n: int, dtype=torch.bfloat16) -> torch.Tensor:
    return (4 * torch.randn(rows, n, device="cuda")).to(dtype)


def error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.float() - ref.float()).abs().max().item()


def correct() -> None:
    for dtype in (torch.bfloat16, torch.float16):
        for rows, n in [*(SHAPES if dtype == torch.bfloat16 else SHAPES[:1]), (37, 1000), (5, 70000)]:
            x = logits(rows, n, dtype)
            emit(what="correct", dtype=str(dtype), shape=[rows, n], dim=-1,
                 max_abs=error(dlblas_kernels.softmax(x), torch.softmax(x.float(), -1)))
    for shape, dim in (((64, 4096), 0), ((8, 512, 64), 1), ((8, 512, 64), 0)):
        x = (4 * torch.randn(*shape, device="cuda")).bfloat16()
        emit(what="correct", dtype="bfloat16", shape=list(shape), dim=dim,
             max_abs=error(dlblas_kernels.softmax(x, dim), torch.softmax(x.float(), dim)))
    x = logits(300, 50000)
    looped = sm.KERNEL.implementation.plan((x, -1), {"BLOCK_M": 2, "BLOCK_N": 1024, "num_warps": 4},
                                           device_profile(x.device)).run()
    emit(what="correct", dtype="bfloat16", shape=[300, 50000], dim=-1, config="2x1024 looped",
         max_abs=error(looped, torch.softmax(x.float(), -1)))


def sweep() -> None:
    impl = sm.KERNEL.implementation
    for rows, n in SHAPES:
        x = logits(rows, n)
        moved = 2 * x.numel() * x.element_size()
        dst = torch.empty_like(x)
        ref = torch.softmax(x.float(), -1)
        bound = dlcore.get_op("softmax", (x, -1))
        emit(what="correct", shape=[rows, n], config=bound.config, max_abs=error(bound(x, -1), ref))
        work = {f"get_op {bound.config}": lambda x=x, bound=bound: bound(x, -1),
                "torch": lambda x=x: torch.softmax(x, -1), "copy": lambda x=x, dst=dst: dst.copy_(x)}
        for name in SWEEP[n]:
            tile, warps = name.split("/")
            block_m, block_n = map(int, tile.split("x"))
            config = {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": int(warps)}
            plan = impl.plan((x, -1), config, device_profile(x.device))
            err = error(plan.run(), ref)
            work[name] = plan.run
            if err > 0.02:
                emit(what="sweep-wrong", shape=[rows, n], config=config, max_abs=err)
        times = {name: [] for name in work}
        for r in range(2):
            names = list(work)[r:] + list(work)[:r]
            for name in names:
                times[name].append(bench(work[name]))
        copy = min(times["copy"])
        for name, ts in times.items():
            ms = min(ts)
            emit(what="sweep", shape=[rows, n], impl=name, us=round(ms * 1e3, 2), gbps=round(moved / ms / 1e6),
                 of_copy=round(copy / ms, 3))


def backward() -> None:
    for rows, n in ((4096, 4096), (2048, 16384), (1024, 32768), (256, 131072)):
        x = logits(rows, n)
        y = dlblas_kernels.softmax(x)
        dy = torch.randn_like(y)
        config = sm.heuristic_config(rows, n, device_profile(x.device).cores)
        plan = sm.backward_plan((dy, y, -1), config, device_profile(x.device))
        dx = plan.run()
        yf, dyf = y.float(), dy.float()
        ref = yf * (dyf - (dyf * yf).sum(-1, keepdim=True))
        ours = bench(plan.run)
        theirs = bench(lambda dy=dy, y=y: torch._softmax_backward_data(dy, y, -1, y.dtype))
        moved = 3 * x.numel() * x.element_size()
        emit(what="backward", shape=[rows, n], max_abs=error(dx, ref), us=round(ours * 1e3, 2),
             gbps=round(moved / ours / 1e6), torch_us=round(theirs * 1e3, 2))


def attention_reference(q, k, v, causal):
    q, k, v = (t.float() for t in (q, k, v))
    sq, sk, group = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    if causal:
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        scores = scores.masked_fill(~keep, -float("inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, -1).nan_to_num(0.0), v)


def sdpa() -> None:
    cases = [(256, 256, 8, 2, 128, True), (256, 256, 8, 8, 64, False), (128, 384, 8, 2, 128, True),
             (384, 128, 8, 2, 96, True), (1, 1024, 32, 8, 128, False), (200, 200, 4, 4, 256, True)]
    for sq, sk, hq, hk, d, causal in cases:
        q = torch.randn(2, sq, hq, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(2, sk, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        leaves = [t.float().requires_grad_() for t in (q, k, v)]
        ref = attention_reference(*leaves, causal)
        grad = torch.randn_like(ref)
        ref_grads = torch.autograd.grad(ref, leaves, grad)
        for name in ("sdpa_flash", "sdpa_cudnn"):
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            record = {"what": "sdpa", "impl": name, "sq": sq, "sk": sk, "hq": hq, "hk": hk, "d": d, "causal": causal}
            try:
                out = getattr(vendor, name)(*inputs, causal)
                grads = torch.autograd.grad(out, inputs, grad.to(out.dtype))
            except Exception as exc:  # noqa: BLE001 - a refusal is a result here
                emit(**record, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
                continue
            emit(**record, out_max_abs=error(out, ref), nan=bool(torch.isnan(out).any()),
                 contiguous=out.is_contiguous(),
                 grad_max_abs=[round(error(g, r), 4) for g, r in zip(grads, ref_grads)])


if __name__ == "__main__":
    steps = sys.argv[1:] or ["correct", "sweep", "backward", "sdpa"]
    for step in steps:
        try:
            globals()[step]()
        except Exception as exc:  # noqa: BLE001 - one step failing must not lose the others
            emit(what=step, error=f"{type(exc).__name__}: {exc}"[:500])
