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


class VersionAction(argparse.Action):
    """``--version``: the versions, looked up only when asked for, then exit."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs):
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(versions())
        parser.exit()


def versions() -> str:
    """dlc-core's version, then each distribution that provides dlcore plugins (an entry point in a
    ``dlcore.`` group: dlcore's own four, any third party's), then torch's and Triton's."""
    from importlib.metadata import PackageNotFoundError, distributions, version

    found = {}
    for dist in distributions():
        if any(ep.group.startswith("dlcore.") for ep in dist.entry_points):
            found[dist.metadata["Name"]] = dist.version
    core = found.pop("dlc-core", None) or version("dlc-core")
    lines = [f"dlc-core {core}", *(f"{name} {found[name]}" for name in sorted(found, key=str.lower))]
    for name in ("torch", "triton", "triton-ascend"):
        try:
            lines.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            pass
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dlcore", description="Select, tune and lower Triton kernels.")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    parser.add_argument("--version", action=VersionAction,
                        help="the version of each installed dlcore distribution, torch and Triton")
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
