"""The ``dlcore`` command line: one module per subcommand family, each adding its parsers."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from dlcore.cli import bench, cache, check, inventory, tune

COMMANDS = (inventory, check, tune, cache, bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dlcore", description="Select, tune and lower Triton kernels.")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
