"""get_op's selection for one op and shape made several times in one process, each from an empty
cache (fresh DLCORE_CACHE_DIR, dispatcher reset): whether a candidate's first calls in the process
(cuDNN's plan building, Triton's compile) bias the first selection against it.

    python3 .ci/selection_rounds.py OP SIZES [--dtype bfloat16] [--training] [--times 3]

e.g. python3 .ci/selection_rounds.py fused_rotary_and_fa seq=2048,heads=16,kv_heads=16,head_dim=128,causal=1 --training
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

import dlcore
from dlcore.bench.presets import parse_sizes
from dlcore.cli.options import DTYPES
from dlcore.dispatch.dispatcher import reset
from dlcore.plugins.registry import registry


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("op")
    p.add_argument("sizes", type=parse_sizes)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--training", action="store_true")
    p.add_argument("--times", type=int, default=3)
    a = p.parse_args()
    for time_ in range(a.times):
        os.environ["DLCORE_CACHE_DIR"] = tempfile.mkdtemp(prefix="dlcore-rounds-")
        reset()
        op = registry().op(a.op)
        args = op.example_inputs(a.sizes, DTYPES[a.dtype], "cuda", 0)
        if a.training:
            args = tuple(t.requires_grad_() if i in op.differentiable() else t for i, t in enumerate(args))
        bound = dlcore.get_op(a.op, args)
        measured = {name: round(ms * 1e3, 1) for name, ms in bound.selection.measured.items()}
        print(f"selection {time_ + 1}: chose {bound.impl.name}; measured (us) {measured}", flush=True)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
