"""Everything the plugins declared: ops, implementations, backends, passes and strategies.

Built once per process from the :class:`~dlcore.plugins.discovery.PluginSet`, by calling each collecting
hook plugin by plugin, so that a plugin whose hook raises is reported and dropped alone. Kernel
plugins known to the :mod:`~dlcore.plugins.index` join when one of their ops is first asked for.
"""

from __future__ import annotations

import difflib
import threading
from collections.abc import Callable
from typing import Any

import torch

from dlcore.declarations.backend import Backend
from dlcore.declarations.device import UNKNOWN_DEVICE, DeviceProfile
from dlcore.declarations.implementation import Implementation, ReferenceImplementation
from dlcore.declarations.op import Op
from dlcore.errors import BackendUnavailableError, PluginConflictError, UnknownOpError, UnknownStrategyError
from dlcore.plugins.discovery import DEFERRABLE_GROUP, PluginSet, PluginStatus, discover
from dlcore.plugins.index import DEFERRABLE_HOOKS, PluginIndex


class Registry:
    """What the loaded plugins declared. Kernel plugins that the :class:`PluginIndex` knows are
    loaded on first use: asking for an op loads the plugins that declare or implement it."""

    def __init__(self, plugins: PluginSet, index: PluginIndex | None = None):
        self.plugins = plugins
        self.index = index
        self._ops: dict[str, Op] = {}
        self.op_plugin: dict[str, str] = {}
        self.implementations: dict[str, list[Implementation]] = {}
        self.backends: dict[str, Backend] = {}
        self.backend_plugin: dict[str, str] = {}
        self._by_device_type: dict[str, Backend] = {}
        self.strategies: dict[str, Any] = {}
        self.passes: list[Any] = []
        self.pass_plugin: dict[str, str] = {}
        self._profiles: dict[torch.device, DeviceProfile] = {}
        self._availability: dict[str, Any] = {}
        self._complete: set[str] = set()  # ops whose every provider is loaded
        self._ignored: dict[str, set[str]] = {}  # plugin -> ops of its implementations left out
        self._loading = threading.RLock()
        self._collect()
        if index is not None:
            self._learn(index)

    # -- building -------------------------------------------------------------------------------

    def _each(self, hook_name: str, accept: Callable[[str, Any], None], only: set[str] | None = None) -> None:
        """Call ``hook_name`` on each plugin (of ``only``, if given); hand each returned item to
        ``accept(plugin, item)``."""
        hook = getattr(self.plugins.manager.hook, hook_name)
        for impl in list(hook.get_hookimpls()):
            if only is not None and impl.plugin_name not in only:
                continue
            try:
                for item in impl.function() or ():
                    accept(impl.plugin_name, item)
            except Exception as exc:  # noqa: BLE001 - a broken plugin must not break the others
                self.plugins.fail(impl.plugin_name, exc)

    def _collect(self) -> None:
        self._each("dlcore_backends", self._add_backend)
        self._each("dlcore_ops", self._add_op)
        self._each("dlcore_implementations", self._add_implementation)
        self._each("dlcore_strategies", self._add_strategy)
        self._each("dlcore_passes", self._add_pass)

    def _load(self, plugin_ids: set[str]) -> None:
        """Load deferred kernel plugins and take in their ops, then their implementations."""
        loaded = set(self.plugins.load(plugin_ids))
        self._each("dlcore_ops", self._add_op, loaded)
        self._each("dlcore_implementations", self._add_implementation, loaded)

    def _require(self, op: str) -> None:
        """Load every deferred plugin that provides ``op``, and those that provide what they provide
        (an implementation's op is then always declared before it arrives)."""
        if op in self._complete:
            return
        with self._loading:
            deferred = {r.id for r in self.plugins.deferred()}
            wanted, chosen = {op}, set()
            while more := {p for p in deferred - chosen if wanted.intersection(self.index.entries[p].ops)}:
                chosen |= more
                for p in more:
                    wanted.update(self.index.entries[p].ops)
            if chosen:
                self._load(chosen)
            self._complete |= wanted

    def load_all(self) -> None:
        """Load every deferred plugin (for listings: ``dlcore ops``, ``dlcore plugins``, ``--all``)."""
        with self._loading:
            deferred = {r.id for r in self.plugins.deferred()}
            if deferred:
                self._load(deferred)
            self._complete |= set(self._ops)

    def _learn(self, index: PluginIndex) -> None:
        """Write down what each kernel plugin loaded now, and unknown to ``index``, provides."""
        provides: dict[str, set[str]] = {}
        for name, plugin in self.op_plugin.items():
            provides.setdefault(plugin, set()).add(name)
        for name, impls in self.implementations.items():
            for impl in impls:
                provides.setdefault(impl.plugin, set()).add(name)
        for plugin, ops in self._ignored.items():  # provided all the same, once their op is declared
            provides.setdefault(plugin, set()).update(ops)
        learnt = False
        for record in self.plugins.records:
            if record.group != DEFERRABLE_GROUP or record.status in (PluginStatus.DISABLED, PluginStatus.DEFERRED):
                continue
            if index.known(record.id, record.value) is not None:
                continue
            plugin = self.plugins.manager.get_plugin(record.id)
            hooks = {c.name for c in self.plugins.manager.get_hookcallers(plugin) or ()} if plugin else set()
            eager = record.status is not PluginStatus.LOADED or not hooks <= DEFERRABLE_HOOKS
            index.learn(record.id, record.value, provides.get(record.id, set()), eager)
            learnt = True
        if learnt:
            index.save()

    def _add_backend(self, plugin: str, backend: Backend) -> None:
        taken = [t for t in backend.device_types if t in self._by_device_type]
        if taken or backend.name in self.backends:
            owner = self.backend_plugin.get(backend.name) or self._by_device_type[taken[0]].name
            raise PluginConflictError(
                f"backend {backend.name!r} claims {taken or backend.name}, already owned by {owner}")
        self.backends[backend.name] = backend
        self.backend_plugin[backend.name] = plugin
        for device_type in backend.device_types:
            self._by_device_type[device_type] = backend

    def _add_op(self, plugin: str, op: Op) -> None:
        if op.name in self._ops:
            raise PluginConflictError(f"op {op.name!r} is already declared by {self.op_plugin[op.name]}")
        self._ops[op.name] = op
        self.op_plugin[op.name] = plugin
        reference = ReferenceImplementation(op)
        reference.plugin = plugin
        self.implementations[op.name] = [reference]

    def _add_implementation(self, plugin: str, impl: Implementation) -> None:
        if impl.op not in self._ops:
            self._require(impl.op)  # declared by a plugin not loaded yet?
        if impl.op not in self._ops:
            # Left out alone and noted on its plugin's record (``dlcore plugins``), not failed: an
            # implementation of another plugin's op goes quietly when that plugin is disabled.
            self._ignored.setdefault(plugin, set()).add(impl.op)
            self.plugins.record(plugin).ignored.append(
                f"{impl.qualname}: op {impl.op!r} is declared by no loaded plugin")
            return
        existing = self.implementations[impl.op]
        if any(i.name == impl.name for i in existing):
            raise PluginConflictError(f"{impl.op} already has an implementation named {impl.name!r}")
        impl.plugin = plugin
        existing.append(impl)

    def _add_pass(self, plugin: str, p: Any) -> None:
        self.passes.append(p)
        self.pass_plugin.setdefault(getattr(p, "name", ""), plugin)

    def _add_strategy(self, plugin: str, strategy: Any) -> None:
        if strategy.name in self.strategies:
            raise PluginConflictError(f"strategy {strategy.name!r} is already provided")
        self.strategies[strategy.name] = strategy

    # -- lookups --------------------------------------------------------------------------------

    @property
    def ops(self) -> dict[str, Op]:
        """Every op, every deferred plugin loaded first."""
        self.load_all()
        return self._ops

    def op(self, name: str) -> Op:
        self._require(name)
        if name not in self._ops and self.plugins.deferred():
            # the plugin index may be stale or edited (an op it does not list): every plugin
            # loaded before the op is called unknown, on this error path only
            self.load_all()
        try:
            return self._ops[name]
        except KeyError:
            known = sorted(set(self._ops).union(*(self.index.entries[r.id].ops for r in self.plugins.deferred())))
            raise UnknownOpError(name, known, difflib.get_close_matches(name, known, n=3, cutoff=0.5),
                                 self._disabled_provider(name)) from None

    def _disabled_provider(self, op: str) -> str:
        """Which installed but disabled (or broken) kernel plugin provides ``op``, and why it is off
        ('' if none): known from the plugin index, or from the convention that a kernel entry point
        is named after its op."""
        off = (PluginStatus.DISABLED, PluginStatus.FAILED, PluginStatus.REJECTED)
        for r in self.plugins.records:
            if r.group == DEFERRABLE_GROUP and r.empty and r.name == op:
                return (f"plugin {r.id} ({r.distribution} {r.version}), loaded but it provides nothing: {r.value} "
                        "defines no dlcore_* hook function (dlcore_ops, dlcore_implementations)")
            if r.group != DEFERRABLE_GROUP or r.status not in off:
                continue
            entry = self.index.entries.get(r.id) if self.index is not None else None
            if r.name == op or (entry is not None and op in entry.ops):
                if r.status is PluginStatus.DISABLED:
                    return f"plugin {r.id} ({r.distribution}), installed but {r.error}"
                what = "failed to load" if r.status is PluginStatus.FAILED else "was rejected"
                return (f"plugin {r.id} ({r.distribution} {r.version}), installed but it {what}: {r.error} "
                        "(`dlcore plugins` shows the traceback)")
        return ""

    def implementations_of(self, op: str) -> list[Implementation]:
        self._require(op)
        return self.implementations.get(op, [])

    def backend_for(self, device: torch.device) -> Backend:
        backend = self._by_device_type.get(device.type)
        if backend is None:
            loaded = ", ".join(f"{b.name} ({'/'.join(b.device_types)})" for b in self.backends.values()) or "none"
            raise BackendUnavailableError(
                f"no backend runs on device type {device.type!r}; loaded backends: {loaded}. "
                f"Install the backend's distribution (dlc-cuda, dlc-ascend, dlc-mlu) or see `dlcore plugins`."
            )
        availability = self._availability.get(backend.name)
        if availability is None:
            availability = self._availability[backend.name] = backend.available()
        if not availability:
            raise BackendUnavailableError(f"backend {backend.name!r} is not available: {availability.reason}")
        return backend

    def profile(self, backend: Backend, device: torch.device) -> DeviceProfile:
        profile = self._profiles.get(device)
        if profile is None:
            profile = self._profiles[device] = backend.profile(device)
        return profile

    def device_profile(self, device: torch.device) -> DeviceProfile:
        """The profile of ``device`` as the backend that owns it describes it, or
        :data:`~dlcore.declarations.device.UNKNOWN_DEVICE` where no available backend does; what a
        kernel's plans size themselves by, remembered with the registry (:func:`reset` forgets it)."""
        profile = self._profiles.get(device)
        if profile is None:
            try:
                profile = self.profile(self.backend_for(device), device)
            except BackendUnavailableError:
                profile = self._profiles[device] = UNKNOWN_DEVICE
        return profile

    def refine_space(self, space: Any, signature: Any, profile: DeviceProfile) -> Any:
        """``space`` as each plugin's ``dlcore_refine_space`` hook adapts it, in registration order."""
        for impl in self.plugins.manager.hook.dlcore_refine_space.get_hookimpls():
            refined = impl.function(space=space, signature=signature, profile=profile)
            if refined is not None:
                space = refined
        return space

    def strategy(self, name: str) -> Any:
        try:
            return self.strategies[name]
        except KeyError:
            raise UnknownStrategyError(
                f"no search strategy {name!r}; registered: {', '.join(sorted(self.strategies)) or 'none'}"
            ) from None


_lock = threading.Lock()
_registry: Registry | None = None


def registry() -> Registry:
    """The process's registry, built on first use (nothing is discovered at import time)."""
    global _registry
    if _registry is None:
        with _lock:
            if _registry is None:
                from dlcore.cachedir import default_directory

                index = PluginIndex.open(default_directory())
                _registry = Registry(discover(defer=lambda r: index.deferrable(r.id, r.value)), index)
    return _registry


def reset() -> None:
    """Forget the registry (and everything cached with it): the next use rediscovers plugins."""
    global _registry
    with _lock:
        _registry = None
