"""`dlcore check`: run an op on random inputs, compare with its reference, explain the choice."""

from __future__ import annotations

import argparse

from dlcore.cli.options import DTYPES, default_device, parse_sizes


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="run get_op on random inputs, compare with the reference, explain the choice")
    p.add_argument("op")
    p.add_argument("--shape", type=parse_sizes, default={}, help="named sizes, e.g. tokens=37,hidden=256")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", default=None, help="cuda when available, else cpu")
    p.add_argument("--impl", default=None, help="run this implementation instead of selecting one")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run_check)


def run_check(args: argparse.Namespace) -> int:
    from dlcore.registry import registry
    from dlcore.verify import check_op

    op = registry().op(args.op)
    report = check_op(op, args.shape, DTYPES[args.dtype], default_device(args.device), impl=args.impl, seed=args.seed)
    print(report.explanation)
    sizes = ", ".join(f"{k}={v}" for k, v in report.sizes.items())
    verdict = "OK" if report.ok else f"MISMATCH: {report.problem}"
    print(f"\ncheck {op.name} ({sizes}, {args.dtype}) against the float64 reference: "
          f"max abs error {report.max_abs_error:.3g}: {verdict}")
    return 0 if report.ok else 1
