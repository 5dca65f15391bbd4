"""fused_linear_cross_entropy forward + backward per rows-per-chunk, beside the eager composite
(``F.cross_entropy((h @ w.T).float(), y)``): time (do_bench median) and peak memory above the
inputs and their gradients. One JSON line a case. On the GPU host (bash .ci/gpu.sh's install):

    python3 .ci/sweep_flce_chunk.py [CHUNK,...]        (default 256,512,1024,2048,4096)
"""

import json
import sys

import dlblas_kernels
import torch
import triton
from dlblas_kernels.kernels import fused_linear_cross_entropy as flce

import dlcore

SHAPES = [(4096, 4096, 128256), (16384, 4096, 128256), (4096, 3584, 152064)]  # rows, hidden, vocab


def measure(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, chunk: int | None) -> dict:
    """One case: ``chunk`` rows a chunk of the fused op, or None for the composite."""
    def step():
        h.grad = w.grad = None
        if chunk is None:
            torch.nn.functional.cross_entropy((h @ w.T).float(), y).backward()
        else:
            dlblas_kernels.fused_linear_cross_entropy(h, w, y).backward()

    step()
    torch.cuda.synchronize()
    h.grad = w.grad = None
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base - 2 * (h.numel() + w.numel())  # less the gradients
    ms = triton.testing.do_bench(step, warmup=25, rep=150)
    rows, width = h.shape
    return {"rows": rows, "hidden": width, "vocab": w.shape[0], "chunk": chunk or "composite",
            "ms": round(ms, 3), "peak_above_MiB": round(peak / 2**20)}


def main() -> None:
    chunks = [int(c) for c in sys.argv[1].split(",")] if len(sys.argv) > 1 else [256, 512, 1024, 2048, 4096]
    default = flce.default_chunk
    for rows, width, vocab in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        h = torch.randn(rows, width, device="cuda", generator=gen).bfloat16().requires_grad_()
        w = (torch.randn(vocab, width, device="cuda", generator=gen) / width ** 0.5).bfloat16().requires_grad_()
        y = torch.randint(0, vocab, (rows,), device="cuda", generator=gen)
        for chunk in [None, *chunks]:
            if chunk is not None:
                flce.default_chunk = lambda *args, c=chunk: c
                dlcore.reset()
            print(json.dumps(measure(h, w, y, chunk)), flush=True)
        flce.default_chunk = default


if __name__ == "__main__":
    main()
