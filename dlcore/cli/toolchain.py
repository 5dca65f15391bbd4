"""`dlcore toolchain`: the external compilers of every installed backend, and fetching them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dlcore.bench.table import table
from dlcore.compiler.toolchain import FetchRequest, Found, Health, Source, State, Tool, Toolchain, check, find, origin
from dlcore.errors import DlcoreError, ToolchainMissingError

HEADER = ("toolchain", "tool", "stage", "status", "version", "from", "source", "path")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("toolchain", help="the backends' external compilers: found or not, where, which version; "
                                         "`fetch NAME` fills a toolchain's tool cache")
    actions = p.add_subparsers(dest="action")
    actions.add_parser("list", help="every installed backend's toolchains and their tools (the default)")
    fetch = actions.add_parser("fetch", help="download a toolchain's fetchable tools into its per-user tool cache "
                                             "(`dlcore toolchain` says which)")
    fetch.add_argument("name", help="the toolchain, e.g. ascend")
    fetch.add_argument("--wheel", type=Path, metavar="PATH",
                       help="take the tools from this local copy of what would be downloaded (offline hosts); "
                            "its sha256 is checked all the same")
    fetch.add_argument("--force", action="store_true", help="download again even when the cache holds the very file")
    p.set_defaults(func=run_toolchain)


def installed() -> list[Toolchain]:
    """The toolchains the installed backends declare, in the order of the backends."""
    from dlcore.plugins.registry import registry

    return [t for backend in registry().backends.values() for t in backend.toolchains]


def run_toolchain(args: argparse.Namespace) -> int:
    if args.action == "fetch":
        return _fetch(args)
    toolchains = installed()
    if not toolchains:
        print("no installed backend declares a toolchain (dlc-ascend does: pip install dlc-ascend)")
        return 0
    _show(toolchains)
    return 0


def _say(line: str) -> None:
    print(line, flush=True)  # before the output of what the fetcher runs (pip)


def _fail(message: str, code: int) -> int:
    print(f"dlcore: error: {message}", file=sys.stderr)
    return code


def _fetch(args: argparse.Namespace) -> int:
    toolchains = {t.name: t for t in installed()}
    toolchain = toolchains.get(args.name)
    if toolchain is None:
        known = ", ".join(toolchains) or "none (is dlc-ascend installed?)"
        return _fail(f"no toolchain {args.name!r}; the installed backends declare: {known}", 2)
    if toolchain.fetch is None:
        return _fail(f"toolchain {toolchain.name!r} has nothing to fetch; `dlcore toolchain` says how to get "
                     "each of its tools", 2)
    print(f"{toolchain.name}: {toolchain.fetches}" if toolchain.fetches else toolchain.name)
    request = FetchRequest(local=args.wheel, force=args.force, say=_say)
    try:
        fetched = toolchain.fetch(toolchain, request)
    except DlcoreError as exc:
        return _fail(str(exc), 1)
    for record in fetched:
        tool = toolchain.tool(record.tool)
        cached = toolchain.cache_dir() / tool.name
        health = check(Found(tool, cached, Source.CACHE))
        if health.state is State.BROKEN:
            return _fail(f"{tool.name} fetched to {cached} does not work here: {health.reason}", 1)
        used = _found(toolchain, tool)[0]
        if isinstance(used, Found) and used.path != cached:
            print(f"note: {tool.name} from the {used.source.value} ({used.path}) comes first and is the one used; "
                  f"{cached} serves when it is gone")
    print()
    _show([toolchain])
    return 0


def _found(toolchain: Toolchain, tool: Tool) -> tuple[Found | None, Health | None, str]:
    """Where ``tool`` is, what its probe said, and the error its variable raised (``""`` if none)."""
    try:
        found = find(toolchain, tool.name)
    except ToolchainMissingError as exc:
        return None, None, str(exc)
    return found, (check(found) if found is not None else None), ""


def _show(toolchains: list[Toolchain]) -> None:
    rows, todo = [], []
    for toolchain in toolchains:
        for tool in toolchain.tools:
            found, health, error = _found(toolchain, tool)
            if found is None or health is None:
                rows.append((toolchain.name, tool.name, tool.stage, "broken" if error else "missing", "", "", "", ""))
                todo.append(f"{tool.name}: {error}" if error else f"{tool.name}: get it: {tool.how_to_get}")
                continue
            if health.state is State.BROKEN:
                todo.append(f"{tool.name}: broken ({health.reason}); replace it: {tool.how_to_get}")
            source = f"{found.source.value} {found.package}" if found.package else found.source.value
            rows.append((toolchain.name, tool.name, tool.stage, health.state.value, health.version,
                         origin(found), source, str(found.path)))
    print(table(rows, HEADER))
    for toolchain in toolchains:
        fetch = f"; `dlcore toolchain fetch {toolchain.name}` fills it" if toolchain.fetch is not None else ""
        print(f"\n{toolchain.name} tool cache: {toolchain.cache_dir()}{fetch}")
    if todo:
        print()
        print("\n".join(todo))
