"""The ``dlcore`` command line: one module per subcommand family, each adding its parsers."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

#: the subcommand modules of dlcore.cli, in help order; each has ``add_parsers(subparsers)``.
#: Imported when the parser is built, so that other modules may import dlcore.bench.table freely.
COMMANDS = ("inventory", "check", "tune", "cache", "bench", "lower", "toolchain")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dlcore", description="Select, tune and lower Triton kernels.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"dlcore.cli.{name}").add_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
