"""Plugin discovery (stevedore) and the one pluggy ``PluginManager``.

Every plugin, built-in or third-party, arrives the same way: an entry point in one of
:data:`GROUPS`. Each is loaded by stevedore with load failures caught, registered with the
plugin manager, and validated against :mod:`dlcore.plugins.hookspecs`. A plugin that fails is recorded with
its traceback, warned about once, and left out; everything else works.

Selection by environment:

- ``DLCORE_DISABLE_PLUGINS=a,b``: never load these (names are entry-point names, or
  ``group:name``).
- ``DLCORE_PLUGINS=a,b``: load only these, besides dlcore's own built-ins; a plugin named here
  that is missing or fails to load raises :class:`~dlcore.errors.PluginLoadError`.

Entry-point names are meant to be unique in a group. When several distributions use one name (a
third party's ``rms_norm`` beside dlblas-kernels'), each of them is kept apart under an id
qualified by its distribution (``dlcore.kernels:rms_norm@dlblas-kernels``), loaded and reported on
its own, and a :class:`PluginWarning` names the distributions: a clash is never fatal, and one
plugin cannot take another's place.
"""

from __future__ import annotations

import enum
import functools
import os
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points

import pluggy
from stevedore import NamedExtensionManager

from dlcore.errors import PluginLoadError
from dlcore.plugins import hookspecs

GROUPS = ("dlcore.backends", "dlcore.kernels", "dlcore.passes", "dlcore.strategies")
#: entry points the command line runs, not plugins of the hook contract: a whole model's benchmark
#: (``NAME = "module:main"``, ``main(argv, prog) -> int``), run by ``dlcore bench-model``
MODEL_BENCHMARK_GROUP = "dlcore.model_benchmarks"
COMMAND_GROUPS = (MODEL_BENCHMARK_GROUP,)
#: the one group whose plugins may be loaded on first use (see :mod:`dlcore.plugins.index`)
DEFERRABLE_GROUP = "dlcore.kernels"
CORE_DISTRIBUTION = "dlc-core"


class PluginWarning(UserWarning):
    """A plugin failed to load or was rejected; ``dlcore plugins`` shows why."""


class PluginStatus(str, enum.Enum):
    """What became of an entry point."""

    PENDING = "pending"  # not looked at yet
    LOADED = "loaded"
    DEFERRED = "deferred"  # known to the plugin index: loaded when one of its ops is asked for
    FAILED = "failed"  # its import or a hook raised
    REJECTED = "rejected"  # loaded, but it breaks the hook contract
    DISABLED = "disabled"  # DLCORE_DISABLE_PLUGINS, or not in DLCORE_PLUGINS

    def __str__(self) -> str:
        return self.value


@dataclass
class PluginRecord:
    """One entry point and what became of it."""

    group: str
    name: str
    value: str
    status: PluginStatus = PluginStatus.PENDING
    error: str = ""
    traceback: str = ""
    #: what a loaded plugin provided and the registry left out, and why (e.g. an implementation of
    #: an op whose declaring plugin is disabled)
    ignored: list[str] = field(default_factory=list)
    #: the distribution that qualifies the id when other distributions use the same entry-point name
    qualifier: str = ""
    #: those other distributions' entry points, ``distribution version (value)``
    clashes: list[str] = field(default_factory=list)
    #: loaded, but its object implements no hook (a module that forgot its ``dlcore_*`` functions)
    empty: bool = False

    @property
    def id(self) -> str:
        return f"{self.group}:{self.name}" + (f"@{self.qualifier}" if self.qualifier else "")

    @property
    def builtin(self) -> bool:
        return self.value.split(".")[0].split(":")[0] == "dlcore"

    @property
    def distribution(self) -> str:
        return _distributions().get((self.group, self.name, self.value), ("?", "?"))[0]

    @property
    def version(self) -> str:
        return _distributions().get((self.group, self.name, self.value), ("?", "?"))[1]

    def fail(self, status: PluginStatus, exc: BaseException) -> None:
        self.status = status
        self.error = f"{type(exc).__name__}: {exc}"
        self.traceback = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


@dataclass
class PluginSet:
    """The loaded plugins: the plugin manager and a record for every entry point seen."""

    manager: pluggy.PluginManager
    records: list[PluginRecord]

    def record(self, plugin_id: str) -> PluginRecord:
        for r in self.records:
            if r.id == plugin_id:
                return r
        raise KeyError(plugin_id)

    def deferred(self) -> list[PluginRecord]:
        """The plugins held back until asked for."""
        return [r for r in self.records if r.status == PluginStatus.DEFERRED]

    def load(self, plugin_ids: set[str]) -> list[str]:
        """Load the deferred plugins among ``plugin_ids``; return the ids now registered."""
        records = [r for r in self.deferred() if r.id in plugin_ids]
        for group in GROUPS:
            self.load_records(group, [r for r in records if r.group == group])
        return [r.id for r in records if r.status == PluginStatus.LOADED]

    def load_records(self, group: str, records: list[PluginRecord]) -> None:
        """Load the entry points of ``records`` (all of ``group``) and register them, in their order.

        stevedore loads the entry points by name; one whose name other distributions share is loaded
        alone from its own entry point (stevedore would load every one of that name, and its conflict
        resolver fails on modules), so that it is imported only if it is itself allowed.
        """
        if not records:
            return
        by_name = {r.name: r for r in records if not r.qualifier}
        plugins: dict[str, object] = {}

        def on_failure(_manager, ep: EntryPoint, exc: Exception) -> None:
            record = by_name[ep.name]
            record.fail(PluginStatus.FAILED, exc)
            _warn(record)

        if by_name:
            extensions = NamedExtensionManager(
                group,
                names=list(by_name),
                on_load_failure_callback=on_failure,
                on_missing_entrypoints_callback=None,
            )
            plugins = {by_name[ext.name].id: ext.plugin for ext in extensions}
        for record in records:
            if record.qualifier:
                try:
                    plugins[record.id] = EntryPoint(record.name, record.value, group).load()
                except Exception as exc:  # noqa: BLE001 - a plugin that fails to import is only left out
                    record.fail(PluginStatus.FAILED, exc)
                    _warn(record)
        for record in records:
            if record.id in plugins:
                _register(self.manager, record, plugins[record.id])

    def fail(self, plugin_id: str, exc: BaseException) -> None:
        """A loaded plugin misbehaved in a hook: unregister it and report it once."""
        record = self.record(plugin_id)
        record.fail(PluginStatus.FAILED, exc)
        if self.manager.get_plugin(plugin_id) is not None:
            self.manager.unregister(name=plugin_id)
        _warn(record)


def _names_from_env(variable: str) -> set[str]:
    return {n.strip() for n in os.environ.get(variable, "").split(",") if n.strip()}


@functools.cache
def _distributions() -> dict[tuple[str, str, str], tuple[str, str]]:
    """(group, name, value) -> (distribution, version), for display only.

    stevedore's cached entry points do not know their distribution, and scanning every installed
    distribution costs milliseconds, so this runs only when a record is shown or warned about.
    """
    found = {}
    for group in GROUPS:
        for ep in entry_points(group=group):
            dist = getattr(ep, "dist", None)
            if dist is not None:
                found[(group, ep.name, ep.value)] = (dist.metadata["Name"], dist.version)
    return found


def unread_groups() -> list[str]:
    """Entry points in ``dlcore.*`` groups that dlcore does not read (a misspelt ``dlcore.kernel``,
    say), as ``group: name = value (distribution)``, each with the closest group it reads: for
    ``dlcore plugins``, since such a plugin is otherwise silently absent. Scans every installed
    distribution: for display only."""
    import difflib
    from importlib.metadata import distributions

    found = []
    for dist in distributions():
        for ep in dist.entry_points:
            if ep.group.startswith("dlcore.") and ep.group not in GROUPS + COMMAND_GROUPS:
                close = difflib.get_close_matches(ep.group, GROUPS, n=1)
                hint = f"; did you mean {close[0]}?" if close else f"; dlcore reads {', '.join(GROUPS)}"
                found.append(f"{ep.group}: {ep.name} = {ep.value} ({dist.metadata['Name']}){hint}")
    return sorted(set(found))


def _qualify_clashes(group: str, records: list[PluginRecord]) -> None:
    """Give the records of an entry-point name several distributions use ids of their own; warn once."""
    by_name: dict[str, list[PluginRecord]] = {}
    for record in records:
        by_name.setdefault(record.name, []).append(record)
    for name, same in by_name.items():
        if len(same) < 2:
            continue
        shown = [f"{r.distribution} {r.version} ({r.value})" for r in same]
        for record, other in zip(same, shown):
            record.qualifier = record.distribution if record.distribution != "?" else record.value
            record.clashes = [s for s in shown if s != other]
        warnings.warn(
            f"dlcore plugin name {group}:{name} is used by {len(same)} distributions: {', '.join(shown)}. "
            f"Each is loaded on its own as {', '.join(r.id for r in same)}; entry-point names must be "
            f"unique in a group, so the plugin's author should rename one (`dlcore plugins` lists them).",
            PluginWarning,
            stacklevel=3,
        )


def _warn(record: PluginRecord) -> None:
    warnings.warn(
        f"dlcore plugin {record.id} ({record.distribution} {record.version}) {record.status}: {record.error}. "
        f"Everything else still works; `dlcore plugins` shows the traceback.",
        PluginWarning,
        stacklevel=2,
    )


def new_manager() -> pluggy.PluginManager:
    manager = pluggy.PluginManager("dlcore")
    manager.add_hookspecs(hookspecs)
    return manager


def discover(defer: Callable[[PluginRecord], bool] | None = None) -> PluginSet:
    """Load, register and validate every allowed plugin of every group.

    ``defer(record)`` may hold back a kernel plugin: it is listed, and loaded only when
    :meth:`PluginSet.load` is asked for it (see :mod:`dlcore.plugins.index`). A plugin named in
    ``DLCORE_PLUGINS`` is never held back, so that its failure raises here.
    """
    only = _names_from_env("DLCORE_PLUGINS")
    disabled = _names_from_env("DLCORE_DISABLE_PLUGINS")
    plugins = PluginSet(new_manager(), [])
    requested_seen: set[str] = set()

    for group in GROUPS:
        allowed: list[PluginRecord] = []
        # A manager asked for no names loads nothing: it only lists the group (from stevedore's cache).
        listed = NamedExtensionManager(group, names=[], on_missing_entrypoints_callback=None).list_entry_points()
        # dlcore's own plugins register first, so no plugin can take over what a built-in owns.
        records = [PluginRecord(group, ep.name, ep.value)
                   for ep in sorted(listed, key=lambda ep: not PluginRecord(group, ep.name, ep.value).builtin)]
        _qualify_clashes(group, records)
        for record in records:
            plugins.records.append(record)
            wanted = {record.name, record.id}
            requested_seen |= wanted & only
            if wanted & disabled:
                record.status = PluginStatus.DISABLED
                record.error = f"disabled by DLCORE_DISABLE_PLUGINS={os.environ.get('DLCORE_DISABLE_PLUGINS', '')}"
            elif only and not record.builtin and not wanted & only:
                record.status = PluginStatus.DISABLED
                record.error = f"left out: DLCORE_PLUGINS={os.environ.get('DLCORE_PLUGINS', '')} does not name it"
            elif group == DEFERRABLE_GROUP and defer is not None and not wanted & only and defer(record):
                record.status = PluginStatus.DEFERRED
            else:
                allowed.append(record)
        plugins.load_records(group, allowed)

    missing = only - requested_seen
    if missing:
        raise PluginLoadError(
            f"DLCORE_PLUGINS names {', '.join(sorted(missing))}, which no installed distribution provides; "
            f"installed: {', '.join(sorted(r.id for r in plugins.records)) or 'none'}"
        )
    broken = [r for r in plugins.records
              if r.status in (PluginStatus.FAILED, PluginStatus.REJECTED) and {r.name, r.id} & only]
    if broken:
        r = broken[0]
        raise PluginLoadError(f"plugin {r.id} named in DLCORE_PLUGINS could not be loaded: {r.error}\n{r.traceback}")
    return plugins


def _register(manager: pluggy.PluginManager, record: PluginRecord, plugin: object) -> None:
    try:
        manager.register(plugin, name=record.id)
        manager.check_pending()
    except Exception as exc:  # noqa: BLE001 - any defect in a plugin must only reject that plugin
        if manager.get_plugin(record.id) is not None:
            manager.unregister(name=record.id)
        record.fail(PluginStatus.REJECTED, exc)
        _warn(record)
        return
    record.status = PluginStatus.LOADED
    record.empty = not manager.get_hookcallers(plugin)
