"""`dlcore plugins` and `dlcore ops`: what is installed and what it provides."""

from __future__ import annotations

import argparse

from dlcore.bench.table import table


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plugins", help="every plugin: group, name, distribution, version, status or load error")
    p.add_argument("-v", "--verbose", action="store_true", help="show the traceback of each failed plugin")
    p.set_defaults(func=run_plugins)
    p = sub.add_parser("ops", help="ops and their implementations: kind, backends, dtypes, plugin, library")
    p.set_defaults(func=run_ops)


def run_plugins(args: argparse.Namespace) -> int:
    from dlcore.plugins.registry import registry

    reg = registry()
    reg.load_all()  # plugins deferred by the index are loaded too, so that each shows its true status
    records = reg.plugins.records
    availability = {plugin: backend.available() for backend in reg.backends.values()
                    for plugin in [reg.backend_plugin[backend.name]]}
    rows = []
    for r in records:
        status = f"{r.status}: {r.error}" if r.error else str(r.status)
        if r.ignored:
            status += f" (ignored {'; '.join(r.ignored)})"
        if r.clashes:
            status += f" (name also used by {'; '.join(r.clashes)}: rename one entry point)"
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


def run_ops(args: argparse.Namespace) -> int:
    from dlcore.plugins.registry import registry

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
                getattr(impl, "library", ""),
            ))
    print(table(rows, ("op", "implementation", "kind", "backends", "dtypes", "plugin", "library")))
    return 0
