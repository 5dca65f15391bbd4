"""`dlcore check`: run an op on random inputs, compare with its reference, explain the choice."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from dlcore.cli.options import DTYPES, check_sizes, parse_sizes, resolve_device
from dlcore.declarations.op import Op
from dlcore.dispatch.dispatcher import get_op
from dlcore.plugins.registry import registry
from dlcore.tuning.verify import as_tuple, mismatch, reduce_dim_of, reference_result


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="run get_op on random inputs, compare with the reference, explain the choice")
    p.add_argument("op")
    p.add_argument("--shape", type=parse_sizes, default={}, help="named sizes, e.g. tokens=37,hidden=256")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", default=None, help="cuda when available, else cpu")
    p.add_argument("--impl", default=None, help="run this implementation instead of selecting one")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--training", action="store_true",
                   help="the differentiable inputs require grad: the call a training step makes (its candidates "
                        "timed forward and backward)")
    p.set_defaults(func=run_check)


def run_check(args: argparse.Namespace) -> int:
    op = registry().op(args.op)
    report = check_op(op, args.shape, DTYPES[args.dtype], resolve_device(args.device), impl=args.impl, seed=args.seed,
                      training=args.training)
    print(report.explanation)
    sizes = ", ".join(f"{k}={v}" for k, v in report.sizes.items())
    verdict = "OK" if report.ok else f"MISMATCH: {report.problem}"
    print(f"\ncheck {op.name} ({sizes}, {args.dtype}) against the float64 reference: "
          f"max abs error {report.max_abs_error:.3g}: {verdict}")
    return 0 if report.ok else 1


@dataclass
class CheckReport:
    op: str
    sizes: dict[str, int]
    dtype: torch.dtype
    explanation: str
    max_abs_error: float
    problem: str | None

    @property
    def ok(self) -> bool:
        return self.problem is None


def check_op(op: Op, sizes: dict[str, int], dtype: torch.dtype, device: str, impl: str | None = None,
             seed: int = 0, training: bool = False) -> CheckReport:
    """Run ``get_op`` on random inputs of ``sizes`` and compare with the float64 reference; with
    ``training`` the differentiable inputs require grad (get_op selects for a training step)."""
    check_sizes(op, sizes)
    full = {**op.example_sizes, **sizes}
    args = op.example_inputs(sizes, dtype, device, seed)
    if training:
        args = tuple(a.requires_grad_() if i in op.differentiable() else a for i, a in enumerate(args))
    bound = get_op(op.name, args, impl=impl)
    actual = as_tuple(bound(*args))
    expected = reference_result(op, args)
    reduce_dim = reduce_dim_of(args)
    worst = max(((a.double().cpu() - e.cpu()).abs().max().item() for a, e in zip(actual, expected)
                 if a.numel()), default=0.0)
    return CheckReport(op.name, full, dtype, bound.explain(), worst, mismatch(actual, expected, reduce_dim))
