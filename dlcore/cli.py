"""The ``dlcore`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def table(rows: list[Sequence[str]], header: Sequence[str]) -> str:
    """A plain-text table with aligned columns."""
    cells = [list(map(str, header))] + [list(map(str, r)) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def cmd_plugins(args: argparse.Namespace) -> int:
    from dlcore.registry import registry

    reg = registry()
    records = reg.plugins.records
    availability = {plugin: backend.available() for backend in reg.backends.values()
                    for plugin in [reg.backend_plugin[backend.name]]}
    rows = []
    for r in records:
        status = f"{r.status}: {r.error}" if r.error else r.status
        if r.id in availability:
            a = availability[r.id]
            status += " (available)" if a else f" (unavailable: {a.reason})"
        rows.append((r.group.removeprefix("dlcore."), r.name, r.distribution, r.version, status))
    print(table(rows, ("group", "name", "distribution", "version", "status")))
    for r in records:
        if r.traceback and args.verbose:
            print(f"\n{r.id} ({r.distribution}):\n{r.traceback}")
    if any(r.traceback for r in records) and not args.verbose:
        print("\n(run `dlcore plugins -v` for the tracebacks)")
    return 0


def cmd_ops(args: argparse.Namespace) -> int:
    from dlcore.registry import registry

    reg = registry()
    rows = []
    for name in sorted(reg.ops):
        op = reg.ops[name]
        for impl in reg.implementations_of(name):
            backends = [b.name for b in reg.backends.values() if impl.kind in b.kinds]
            dtypes = impl.dtypes or op.dtypes()
            rows.append((
                name,
                impl.name + (" (fallback)" if getattr(impl, "fallback_only", False) else ""),
                impl.kind,
                ",".join(backends),
                ",".join(str(d).removeprefix("torch.") for d in dtypes),
                impl.plugin,
            ))
    print(table(rows, ("op", "implementation", "kind", "backends", "dtypes", "plugin")))
    return 0


def parse_sizes(text: str) -> dict[str, int]:
    """``tokens=37,hidden=256`` -> ``{"tokens": 37, "hidden": 256}``."""
    sizes = {}
    for part in filter(None, text.split(",")):
        key, sep, value = part.partition("=")
        if not sep or not value.strip().isdigit():
            raise argparse.ArgumentTypeError(f"bad size {part!r}: expected NAME=INTEGER, e.g. tokens=37")
        sizes[key.strip()] = int(value)
    return sizes


DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16"}


def cmd_check(args: argparse.Namespace) -> int:
    import torch

    from dlcore.registry import registry
    from dlcore.verify import check_op

    op = registry().op(args.op)
    report = check_op(op, args.shape, getattr(torch, DTYPES[args.dtype]), args.device, impl=args.impl, seed=args.seed)
    print(report.explanation)
    sizes = ", ".join(f"{k}={v}" for k, v in report.sizes.items())
    verdict = "OK" if report.ok else f"MISMATCH: {report.problem}"
    print(f"\ncheck {op.name} ({sizes}, {args.dtype}) against the float64 reference: "
          f"max abs error {report.max_abs_error:.3g}: {verdict}")
    return 0 if report.ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dlcore", description="Select, tune and lower Triton kernels.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plugins", help="every plugin: group, name, distribution, version, status or load error")
    p.add_argument("-v", "--verbose", action="store_true", help="show the traceback of each failed plugin")
    p.set_defaults(func=cmd_plugins)
    p = sub.add_parser("ops", help="ops, their implementations, backends and dtypes")
    p.set_defaults(func=cmd_ops)
    p = sub.add_parser("check", help="run get_op on random inputs, compare with the reference, explain the choice")
    p.add_argument("op")
    p.add_argument("--shape", type=parse_sizes, default={}, help="named sizes, e.g. tokens=37,hidden=256")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", default="cuda" if _cuda_available() else "cpu")
    p.add_argument("--impl", default=None, help="run this implementation instead of selecting one")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_check)
    return parser


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
