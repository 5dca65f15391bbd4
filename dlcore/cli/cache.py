"""`dlcore cache`: list, show, clear, export and import tuned selections."""

from __future__ import annotations

import argparse
import json

from dlcore.bench.table import table


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cache", help="the kernel cache: list | show KEY | clear | export FILE | import FILE")
    actions = p.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="every entry: key, op, implementation, config, time, how")
    show = actions.add_parser("show", help="one entry as JSON")
    show.add_argument("key")
    actions.add_parser("clear", help="delete every entry")
    export = actions.add_parser("export", help="write every entry to a JSON file (tune once, ship to a cluster)")
    export.add_argument("file")
    load = actions.add_parser("import", help="add the entries of an exported JSON file")
    load.add_argument("file")
    p.set_defaults(func=run_cache)


def run_cache(args: argparse.Namespace) -> int:
    from dlcore.dispatch.dispatcher import default

    cache = default().store
    if args.action == "list":
        rows = []
        for key, record in sorted(cache.items()):
            s = record["selection"]
            time_ms = f"{s['time_ms']:.4f}" if s.get("time_ms") is not None else "-"
            rows.append((key, record["parts"].get("signature", ""), s["impl"], s["config"], time_ms, s["how"]))
        print(table(rows, ("key", "signature", "implementation", "config", "ms", "how")))
        print(f"\n{len(rows)} entries in {cache.directory}")
    elif args.action == "show":
        record = cache.get_record(args.key)
        if record is None:
            print(f"no entry {args.key!r} in {cache.directory} (`dlcore cache list` shows the keys)")
            return 1
        print(json.dumps(record, indent=2, sort_keys=True))
    elif args.action == "clear":
        print(f"deleted {cache.clear()} entries from {cache.directory}")
    elif args.action == "export":
        print(f"exported {cache.export(args.file)} entries to {args.file}")
    else:
        imported, rejected = cache.import_(args.file)
        print(f"imported {imported} entries into {cache.directory}" + (f"; rejected {rejected}" if rejected else ""))
    return 0
