"""What get_op chose for one op at one size, and the times it measured (its ``explain()``).

    python3 .ci/explain_choice.py OP SIZE=VALUE,... [--dtype bf16] [--training]

The inputs are the op's example inputs at those sizes on the GPU; with ``--training`` the
differentiable ones require grad (the call a training step makes). A disk store that already holds
the selection (``DLCORE_CACHE_DIR`` of an earlier ``dlcore bench``) answers without measuring again.
"""

from __future__ import annotations

import argparse

import torch

import dlcore
from dlcore.plugins.registry import registry

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("op")
    parser.add_argument("sizes")
    parser.add_argument("--dtype", default="bf16", choices=DTYPES)
    parser.add_argument("--training", action="store_true")
    ns = parser.parse_args()
    op = registry().op(ns.op)
    sizes = {**op.example_sizes, **{k: int(v) for k, v in (p.split("=") for p in ns.sizes.split(","))}}
    args = op.example(sizes, DTYPES[ns.dtype], torch.device("cuda"), torch.Generator().manual_seed(0))
    if ns.training:
        args = tuple(a.requires_grad_() if i in op.differentiable() else a for i, a in enumerate(args))
    print(dlcore.get_op(ns.op, args).explain())


if __name__ == "__main__":
    main()
