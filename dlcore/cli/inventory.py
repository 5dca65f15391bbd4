"""`dlcore plugins` and `dlcore ops`: what is installed and what it provides."""

from __future__ import annotations

import argparse

from dlcore.bench.table import table
from dlcore.declarations.op import REQUIRED, TensorArg


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plugins", help="every plugin: group, name, distribution, version, status or load error")
    p.add_argument("-v", "--verbose", action="store_true", help="show the traceback of each failed plugin")
    p.set_defaults(func=run_plugins)
    p = sub.add_parser("ops", help="ops and their implementations: kind, backends, dtypes, plugin, library; "
                                   "with OP: its arguments, dtypes, layouts, example sizes, implementations and spaces")
    p.add_argument("op", nargs="?", default=None, help="show this op in full")
    p.set_defaults(func=run_ops)


def run_plugins(args: argparse.Namespace) -> int:
    from dlcore.plugins.discovery import unread_groups
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
        if r.empty:
            status += f" (provides nothing: {r.value} defines no dlcore_* hook function; see docs/plugins.md)"
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
    unread = unread_groups()
    if unread:
        print("\nentry points in groups dlcore does not read (never loaded):")
        for line in unread:
            print(f"  {line}")
    return 0


def run_ops(args: argparse.Namespace) -> int:
    from dlcore.plugins.registry import registry

    reg = registry()
    if args.op is not None:
        print(describe_op(reg, args.op))
        return 0
    rows, limits = [], []
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
            limits.extend(f"  {impl.qualname}: {limit.describe()}" for limit in impl.limits)
    print(table(rows, ("op", "implementation", "kind", "backends", "dtypes", "plugin", "library")))
    if limits:
        print("\nkernels a backend cannot lower (declared beside them):")
        print("\n".join(limits))
    return 0


def _dtype_names(dtypes) -> str:
    return ",".join(str(d).removeprefix("torch.") for d in dtypes)


def describe_op(reg, name: str) -> str:
    """One op in full: what a caller passes and what a second implementation must accept."""
    op = reg.op(name)
    lines = [f"op {op.name} (declared by {reg.op_plugin.get(op.name, '?')})", "", "arguments:"]
    rows = []
    for a in op.args:
        if isinstance(a, TensorArg):
            rank = f"{a.min_rank}..{a.max_rank}" if a.max_rank != a.min_rank else str(a.min_rank)
            notes = [f"rank {rank if a.max_rank is not None else f'{a.min_rank}+'}"]
            notes += [f"same dtype as {a.same_dtype_as}"] if a.same_dtype_as else []
            notes += ["optional"] if a.optional else []
            notes += ["not differentiable"] if not a.differentiable else []
            notes += [f"bucket {a.bucket}"] if a.bucket else []
            rows.append((a.name, "tensor", _dtype_names(a.dtypes), ",".join(a.layouts), "; ".join(notes)))
        else:
            kinds = ",".join(t.__name__ for t in a.types)
            notes = [] if a.default is REQUIRED else [f"default {a.default!r}"]
            notes += [f"one of {', '.join(map(repr, a.choices))}"] if a.choices else []
            notes += ["finite"] if a.finite else []
            notes += [f">= {a.minimum!r}"] if a.minimum is not None else []
            notes += ["keyed (its value selects the kernel)"] if a.keyed else []
            rows.append((a.name, "scalar", kinds, "", "; ".join(notes)))
    lines.append(table(rows, ("name", "kind", "dtypes / types", "layouts", "notes")))
    sizes = ", ".join(f"{k}={v}" for k, v in op.example_sizes.items())
    lines += ["", f"example sizes (--shape): {sizes}" if op.example is not None
              else "example sizes: none declared (dlcore check, tune, bench and lower cannot make its inputs)"]
    lines += ["", "implementations:"]
    rows = []
    for impl in reg.implementations_of(op.name):
        space = impl.space()
        described = "; ".join(f"{p.name}: {p.describe()}" for p in space.params) if space is not None else "-"
        rows.append((impl.name, impl.kind, _dtype_names(impl.dtypes or op.dtypes()), impl.plugin, described))
    lines.append(table(rows, ("name", "kind", "dtypes", "plugin", "search space")))
    limits = [f"  {impl.qualname}: {limit.describe()}"
              for impl in reg.implementations_of(op.name) for limit in impl.limits]
    if limits:
        lines += ["", "kernels a backend cannot lower (declared beside them):", *limits]
    return "\n".join(lines)
