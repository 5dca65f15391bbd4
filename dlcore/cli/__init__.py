"""The ``dlcore`` command line: one module per subcommand family, each adding its parsers."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

#: the subcommand modules of dlcore.cli, in help order; each has ``add_parsers(subparsers)``.
#: Imported when the parser is built, so that other modules may import dlcore.bench.table freely.
COMMANDS = ("inventory", "check", "tune", "cache", "bench", "lower", "toolchain")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dlcore", description="Select, tune and lower Triton kernels.")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"dlcore.cli.{name}").add_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. A :class:`~dlcore.errors.DlcoreError` (bad input, a missing tool, a
    read-only cache) ends it with one line on stderr and exit status 2; ``--debug`` raises it
    instead, with its traceback. A closed pipe (``dlcore ... | head``) ends it quietly; Ctrl-C with
    one line and status 130 (what the disk cache holds is whole: it is written entry by entry)."""
    from dlcore.errors import DlcoreError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except DlcoreError as exc:
        if args.debug:
            raise
        print(f"dlcore: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("dlcore: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # Python would complain again when it flushes stdout at exit: point it at nothing
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
