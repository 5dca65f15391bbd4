"""What ``get_op`` bound, remembered between processes, so that a new process skips discovery.

On a disk hit, the full ``get_op`` of a new process imports pluggy, stevedore and diskcache,
discovers every backend, pass and strategy plugin, imports the op's kernel modules and reads the
cache: tens of milliseconds. For inputs exactly like ones bound before (the in-process hit path's
key: dtype, shape, strides, device and alignment of each tensor, the scalars, the options), this
file holds what was bound: the plugins that provided the op, its implementation and the launch
passes, the device profile, the signature and the selection. ``get_op`` then returns a
:class:`RecalledOp` at once, which imports the kernel's module at its first call and calls those
plugins' hooks directly, without discovery. If they no longer provide what was recorded, that
first call takes the full path instead.

A binding is trusted only while everything it was made from is unchanged:

- the environment: interpreter and import path (the file is per environment), the modification
  time of each import-path entry (installing, upgrading or removing a distribution changes its
  site directory), and the variables in :data:`ENVIRONMENT`;
- the files of dlcore and of every plugin involved (the op's, each of its implementations', the
  backend's and the passes'), stamped as the plugin index stamps them;
- the selections on disk: their generation (:mod:`dlcore.cachedir`) must be the one read before
  the binding was made, so a ``dlcore tune``, ``cache clear`` or ``cache import`` retires it;
- the device, by the name and capability torch reports for it;
- no plugin had failed to load (every process must see its warning).

Each binding is a small JSON file, named by a hash of its key, under
``<cache dir>/bindings/<environment>/``: a new process reads the one file of its inputs, however
many there are. They are written when the process exits, at most :data:`LIMIT` per environment,
newest kept. The files hold JSON only. A tampered file can at worst make a process import an
installed module named in it and call its hook functions; what they return must be an op,
implementation or pass of the recorded name, or the full path runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dlcore.bound import BoundOp
from dlcore.cachedir import default_directory, environment_key, generation, write_json
from dlcore.stamps import Stamps, import_path_stamp, plugin_root

if TYPE_CHECKING:
    from dlcore.dispatch import Call
    from dlcore.selection import Selection

SCHEMA = 1
#: bindings kept per environment; the oldest are forgotten first
LIMIT = 1024
#: the environment variables a selection depends on, besides the inputs and the cache directory
ENVIRONMENT = ("DLCORE_TUNE", "DLCORE_TUNE_STRATEGY", "DLCORE_TUNE_CHECK", "DLCORE_PLUGINS", "DLCORE_DISABLE_PLUGINS",
               "DLCORE_ENABLE_PASSES", "DLCORE_DISABLE_PASSES", "DLC_DUMP_IR", "TRITON_INTERPRET")
#: the options of ``get_op`` that are part of the key, in order
OPTIONS = ("impl", "tune", "strategy", "budget")

_environ = os.environ


def exact_key(name: str, args: tuple | list, kwargs: dict[str, Any] | None, *options: Any) -> tuple | None:
    """A key for a hit without validation, cheap to compute: everything validation and the
    signature depend on (dtype, shape, strides, device, alignment of each tensor; scalar values),
    exactly. Inputs seen before with the same key were validated then."""
    if kwargs:
        return None
    key: list[Any] = [name, options, _environ.get("DLCORE_TUNE"), _environ.get("DLCORE_TUNE_STRATEGY")]
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.dtype, a.shape, a.stride(), a.device, a.data_ptr() % 16 == 0))
        elif isinstance(a, (int, float, bool, str)) or a is None:
            key.append((type(a), a))
        else:
            return None
    return tuple(key)


def _identity_of(key: tuple) -> str | None:
    """The identity of the device of the tensors in ``key`` (None without tensors)."""
    for part in key[4:]:
        if isinstance(part[0], torch.dtype):
            return device_identity(part[3])
    return None


_identities: dict[torch.device, str | None] = {}


def device_identity(device: torch.device) -> str | None:
    """The model of ``device`` as torch names it (None if torch cannot say)."""
    if device not in _identities:
        if device.type == "cpu":
            identity = "cpu"
        else:
            module = getattr(torch, device.type, None)
            try:
                identity = f"{module.get_device_name(device)} {tuple(module.get_device_capability(device))}"
            except Exception:  # noqa: BLE001 - a device module without these: not identifiable
                identity = None
        _identities[device] = identity
    return _identities[device]


def _environment() -> dict[str, str]:
    return {v: _environ[v] for v in ENVIRONMENT if v in _environ}


class _Store:
    """This process's view of the bindings: one small file per exact input, so that a new process
    reads one file whatever the number of bindings; what this process adds is written at exit."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.folder = directory / "bindings" / environment_key()
        self.added: dict[str, dict[str, Any]] = {}
        self.dropped: set[str] = set()
        self._generation: str | None = None
        self._paths: str | None = None
        self.stamp = Stamps()

    def file(self, text: str) -> Path:
        return self.folder / f"{hashlib.sha256(text.encode()).hexdigest()[:32]}.json"

    def read(self, text: str) -> dict[str, Any] | None:
        """The binding stored for ``text``, if its file holds one for exactly that key."""
        try:
            data = json.loads(self.file(text).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("schema") != SCHEMA or data.get("key") != text:
            return None
        record = data.get("binding")
        return record if isinstance(record, dict) else None

    def generation(self) -> str:
        if self._generation is None:
            self._generation = generation(self.directory)
        return self._generation

    def paths(self) -> str:
        if self._paths is None:
            self._paths = import_path_stamp()
        return self._paths

    def trusted(self, record: dict[str, Any], identity: str | None) -> bool:
        try:
            return (identity is not None and record["device"] == identity
                    and record["generation"] == self.generation() and record["paths"] == self.paths()
                    and record["environ"] == _environment()
                    and all(self.stamp(root) == s for root, s in record["roots"].items()))
        except (KeyError, TypeError, AttributeError):
            return False

    def find(self, text: str, identity: str | None) -> dict[str, Any] | None:
        if text in self.dropped:
            return None
        record = self.added.get(text) or self.read(text)
        return record if record is not None and self.trusted(record, identity) else None

    def add(self, text: str, record: dict[str, Any]) -> None:
        _at_exit()
        self.dropped.discard(text)
        self.added[text] = record

    def drop(self, text: str) -> None:
        _at_exit()
        self.added.pop(text, None)
        self.dropped.add(text)

    def flush(self) -> None:
        """Write what this process added (unless the selections changed since), remove what it
        dropped, and keep the newest :data:`LIMIT` files."""
        if not self.added and not self.dropped:
            return
        current = generation(self.directory)
        for text in self.dropped:
            self.file(text).unlink(missing_ok=True)
        for text, record in self.added.items():
            if record["generation"] == current:
                write_json(self.file(text), {"schema": SCHEMA, "key": text, "binding": record})
        self.added.clear()
        self.dropped.clear()
        try:
            files = sorted(os.scandir(self.folder), key=lambda e: e.stat().st_mtime_ns)
        except OSError:
            return
        for old in files[:-LIMIT] if len(files) > LIMIT else ():
            Path(old.path).unlink(missing_ok=True)


_lock = threading.Lock()
_store: _Store | None = None
_recalled: dict[tuple, RecalledOp] = {}
_registered_exit = False


def store() -> _Store:
    global _store
    if _store is None:
        with _lock:
            if _store is None:
                _store = _Store(default_directory())
    return _store


def _at_exit() -> None:
    global _registered_exit
    if not _registered_exit:
        import atexit

        atexit.register(flush)
        _registered_exit = True


def flush() -> None:
    """Write this process's new bindings (at exit, and before the store is forgotten)."""
    if _store is not None:
        _store.flush()


def forget() -> None:
    """Forget this process's view: the next recall reads the file (and ``DLCORE_CACHE_DIR``) again."""
    global _store
    flush()
    _recalled.clear()
    _store = None


def recall(name: str, args: tuple | list, kwargs: dict[str, Any] | None, options: dict[str, Any]) -> BoundOp | None:
    """The bound op remembered for exactly these inputs, if one is and it is still trusted."""
    if not options.keys() <= {*OPTIONS, "progress"}:
        return None
    key = exact_key(name, args, kwargs, *(options.get(o) for o in OPTIONS))
    if key is None:
        return None
    hit = _recalled.get(key)
    if hit is not None:
        return hit
    text = repr(key)
    record = store().find(text, _identity_of(key))
    if record is None:
        return None
    hit = _recalled[key] = RecalledOp(text, record, name, options)
    return hit


def note(key: tuple | None, call: Call, selection: Selection, seen_generation: str) -> None:
    """Remember what the full path bound for inputs of ``key``, if it can be restored later."""
    if key is None:
        return
    identity = _identity_of(key)
    record = _record(call, selection, seen_generation, identity) if identity is not None else None
    if record is not None:
        store().add(repr(key), record)


def _record(call: Call, selection: Selection, seen_generation: str, identity: str) -> dict[str, Any] | None:
    from dlcore.compiler.passes import default_pipeline
    from dlcore.registry import registry
    from dlcore.signature import Signature

    reg = registry()
    if any(r.status in ("failed", "rejected") for r in reg.plugins.records):
        return None
    passes = default_pipeline(call.profile.backend)
    if passes.has_ir_passes:
        return None
    signature = json.loads(json.dumps(call.signature.to_json()))
    if Signature.from_json(signature) != call.signature:
        return None  # a scalar JSON does not keep as it is
    name = call.op.name
    impl = next(c for c in call.candidates if c.name == selection.impl)
    try:  # what was put into the registry by hand (tests do) has no plugin to restore it from
        involved = {reg.op_plugin[name], reg.backend_plugin[call.backend.name], impl.plugin,
                    *(i.plugin for i in reg.implementations_of(name)),
                    *(reg.pass_plugin[p.name] for p in passes.passes)}
        values = {pid: reg.plugins.record(pid).value for pid in involved}
    except KeyError:
        return None
    roots = {plugin_root("dlcore")} | {plugin_root(v.split(":")[0]) for v in values.values()}
    if None in roots:
        return None
    store_ = store()

    def source(plugin_id: str) -> dict[str, str]:
        return {"plugin": plugin_id, "value": values[plugin_id]}

    reference = impl.name == "reference" and impl.plugin == reg.op_plugin[name]  # the registry's own
    return {
        "device": identity,
        "generation": seen_generation,
        "paths": store_.paths(),
        "environ": _environment(),
        "roots": {root: store_.stamp(root) for root in sorted(roots)},
        "op": name,
        "impl": impl.name,
        "plugins": {"op": source(reg.op_plugin[name]), "impl": None if reference else source(impl.plugin),
                    "passes": [[source(reg.pass_plugin[p.name]), p.name] for p in passes.passes]},
        "nargs": len(call.op.args),
        "cache_key": call.key,
        "profile": call.profile.as_dict(),
        "signature": signature,
        "selection": json.loads(json.dumps(selection.to_json())),
    }


def _provided(source: dict[str, str], hook: str, kind: type, name: str, match: Any = None) -> Any:
    """The one item named ``name`` that ``source``'s plugin returns from its ``hook``."""
    from importlib.metadata import EntryPoint

    plugin = EntryPoint(name="", value=source["value"], group="").load()
    found = [item for item in getattr(plugin, hook)() or ()
             if isinstance(item, kind) and item.name == name and (match is None or match(item))]
    if len(found) != 1:
        raise LookupError(f"{source['plugin']} provides {len(found)} {kind.__name__} named {name!r} from {hook}")
    return found[0]


def restore(record: dict[str, Any]) -> tuple:
    """What a :class:`BoundOp` is made of, from a binding: (op, impl, selection, signature,
    profile, transform). Raises if a plugin no longer provides what was recorded."""
    from dlcore.compiler.passes import Pass, Pipeline, launch_transform
    from dlcore.device import DeviceProfile
    from dlcore.implementation import Implementation, ReferenceImplementation
    from dlcore.op import Op
    from dlcore.selection import Selection
    from dlcore.signature import Signature

    plugins, name = record["plugins"], record["op"]
    op = _provided(plugins["op"], "dlcore_ops", Op, name)
    if plugins["impl"] is None:
        impl = ReferenceImplementation(op)
        impl.plugin = plugins["op"]["plugin"]
    else:
        impl = _provided(plugins["impl"], "dlcore_implementations", Implementation, record["impl"],
                         lambda i: i.op == name)
        impl.plugin = plugins["impl"]["plugin"]
    profile = DeviceProfile(**record["profile"])
    passes = tuple(_provided(source, "dlcore_passes", Pass, pass_name) for source, pass_name in plugins["passes"])
    transform = launch_transform(profile, Pipeline(profile.backend, passes))
    return (op, impl, Selection.from_json(record["selection"]), Signature.from_json(record["signature"]), profile,
            transform)


class RecalledOp(BoundOp):
    """A bound op recalled from the bindings file: its kernel module is imported, and the op made
    whole, at its first call (or when an attribute that needs it is read)."""

    __slots__ = ("_text", "_record", "_request", "_pending")

    def __init__(self, text: str, record: dict[str, Any], name: str, options: dict[str, Any]):
        self._text = text
        self._record = record
        self._request = (name, options)
        self._pending = True
        self.config = record["selection"]["config"]
        self.cache_key = record["cache_key"]
        self._nargs = record["nargs"]
        self._run = self._first_run

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not kwargs and len(args) == self._nargs:
            return self._run(args)
        if self._pending:
            self._complete(args, kwargs)
        return self._run(self.op.bind(args, kwargs or None))

    def _first_run(self, args: tuple) -> Any:
        self._complete(args, None)
        return self._run(args)

    def _complete(self, args: tuple | None, kwargs: dict[str, Any] | None) -> None:
        """Restore the parts from the plugins; if they no longer restore, bind through the full path
        (with the arguments of this first call)."""
        try:
            op, impl, selection, signature, profile, transform = restore(self._record)
            BoundOp.__init__(self, op, impl, selection, signature, profile, self.cache_key, transform)
        except Exception as exc:  # noqa: BLE001 - whatever no longer restores, the full path decides
            store().drop(self._text)
            if args is None:
                from dlcore.errors import DlcoreError

                raise DlcoreError(f"the binding of {self._request[0]} recalled from {store().file(self._text)} "
                                  f"no longer restores ({type(exc).__name__}: {exc}); call get_op again") from exc
            from dlcore.dispatch import get_op

            name, options = self._request
            full = get_op(name, args, kwargs, **options)
            for slot in BoundOp.__slots__:
                setattr(self, slot, getattr(full, slot))
        self._pending = False

    def __getattr__(self, name: str) -> Any:
        if name in BoundOp.__slots__:  # a part not restored yet
            if name == "selection":
                from dlcore.selection import Selection

                self.selection = Selection.from_json(self._record["selection"])
            else:
                self._complete(None, None)
            return getattr(self, name)
        raise AttributeError(name)

    def __repr__(self) -> str:
        return f"<BoundOp {self._request[0]} -> {self._record['impl']} {self.config} (recalled)>"
