"""What each kernel plugin provides, remembered between processes.

Importing a kernel plugin is the dearest part of a first ``get_op`` (its ``@triton.jit`` kernels and
PyTorch custom ops are built at import), and every new kernel would add to it. So the first process
that loads a kernel plugin writes down the ops it declares or implements; later processes load a
kernel plugin only when one of those ops is asked for (see :class:`dlcore.plugins.registry.Registry`).

What is written down is trusted only while it still describes the installed code:

- the index is kept per environment (interpreter prefix and import path);
- each plugin's entry is bound to its entry point's value and to a stamp of its files (path,
  size and modification time of every ``.py`` file of its top-level package): an edited, upgraded
  or reinstalled plugin is loaded eagerly again and learnt anew;
- a plugin that implements any hook besides declaring ops and implementations, or that failed to
  load, is never deferred (its hooks, or its warning, matter to every process);
- a plugin the index does not know is loaded eagerly, as before there was an index.

The file holds JSON only and is replaced atomically; one that fails to parse is ignored. At worst
a tampered index makes a process load an installed plugin early or late; it cannot add code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlcore.cachedir import environment_key, write_json
from dlcore.plugins.stamps import Stamps, plugin_root

SCHEMA = 1
#: the hooks a deferred kernel plugin may implement: what it provides is then known from the index
DEFERRABLE_HOOKS = frozenset({"dlcore_ops", "dlcore_implementations"})


@dataclass
class Entry:
    """One kernel plugin as last loaded: its entry point's value, what it provides, whether to defer it."""

    value: str
    ops: list[str]
    eager: bool
    root: str
    stamp: str

    def to_json(self) -> dict[str, Any]:
        return {"value": self.value, "ops": self.ops, "eager": self.eager, "root": self.root, "stamp": self.stamp}

    @classmethod
    def from_json(cls, data: Any) -> Entry | None:
        # Every field its own JSON type: a string where the list of ops belongs would otherwise be
        # read character by character, and the plugin never loaded for its real ops.
        if not isinstance(data, dict):
            return None
        value, ops, eager, root, stamp = (data.get(k) for k in ("value", "ops", "eager", "root", "stamp"))
        if not (isinstance(ops, list) and all(isinstance(o, str) for o in ops) and isinstance(eager, bool)
                and all(isinstance(f, str) for f in (value, root, stamp))):
            return None
        return cls(value, list(ops), eager, root, stamp)


@dataclass
class PluginIndex:
    """The index of one environment: plugin id -> :class:`Entry`."""

    path: Path
    entries: dict[str, Entry] = field(default_factory=dict)
    _stamps: Stamps = field(default_factory=Stamps)

    @classmethod
    def open(cls, directory: Path) -> PluginIndex:
        """This environment's index under ``directory`` (empty if there is none, or none readable)."""
        index = cls(directory / "plugins" / f"kernels-{environment_key()}.json")
        try:
            data = json.loads(index.path.read_text())
        except (OSError, ValueError):
            return index
        if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("plugins"), dict):
            return index
        for plugin_id, raw in data["plugins"].items():
            entry = Entry.from_json(raw)
            if entry is not None:
                index.entries[str(plugin_id)] = entry
        return index

    def known(self, plugin_id: str, value: str) -> Entry | None:
        """The entry for this plugin if it still describes the installed code."""
        entry = self.entries.get(plugin_id)
        if entry is None or entry.value != value or self._stamps(entry.root) != entry.stamp:
            return None
        return entry

    def deferrable(self, plugin_id: str, value: str) -> bool:
        entry = self.known(plugin_id, value)
        return entry is not None and not entry.eager

    def providers(self, op: str) -> set[str]:
        """The known, deferrable plugins that declare or implement ``op``."""
        return {pid for pid, e in self.entries.items() if not e.eager and op in e.ops}

    def learn(self, plugin_id: str, value: str, ops: set[str], eager: bool) -> None:
        """Remember what a plugin loaded in this process provides (after its import)."""
        root = plugin_root(value.split(":")[0])
        if root is None:
            return
        # One stamp per root (several plugins share a package); if it was taken before the import,
        # an edit since then makes the next process see a mismatch and learn again.
        self.entries[plugin_id] = Entry(value, sorted(ops), eager, root, self._stamps(root))

    def save(self) -> None:
        """Write the index atomically; a failure to write only costs later processes some time."""
        plugins = {pid: e.to_json() for pid, e in sorted(self.entries.items())}
        write_json(self.path, {"schema": SCHEMA, "plugins": plugins})
