"""The warm launch path: compiled Triton kernels called directly, without Triton's per-call dispatch.

``kernel[grid](*args)`` binds the arguments, computes a specialization key, looks up the compiled
kernel, then launches it: tens of microseconds of Python per call. This module (the approach of
FlagGems' LibEntry) owns what dlcore does instead, and nothing else:

- **the specialization key** (:func:`spec_key`), at least as fine as Triton's own: for each pointer
  its dtype and 16-byte alignment, for each integer its range class (i32, i64, u64), whether it
  equals 1 and whether it divides by 16, the constexpr values, every keyword that is no parameter
  (the launch options: num_warps, num_stages, ...), the device and the installed stages hook
  (compiler passes);
- **the compiled kernels per kernel** (:class:`KernelEntry`): the first launch of a specialization
  goes through Triton and keeps the compiled kernel it hands back; later launches call
  ``compiled.run(...)`` as ``JITFunction.run`` does, Triton's launch hooks (profilers) included;
- **the shelf** (:class:`Shelf`): where, in Triton's own cache, the compiled kernel of each
  specialization lies, kept under dlcore's cache directory. A new process's first launch of a
  shelved specialization loads that compiled kernel itself and launches it, skipping Triton's
  first-call path: the binder's creation, the hash of every file of Triton's installation
  (``triton_key``, about 350 ms on the GPU host) and the compile-cache lookup. The shelf's folder is
  named by a stamp of the Triton installation (version, files' sizes and times, ``TRITON_*``
  variables, cache directory), each entry by the kernel's own ``cache_key`` (its source and
  dependencies, as Triton hashes them), the target and the specialization; a missing cache file
  sends the launch back through Triton;
- **launch templates** (:class:`Replay`): a bound op's launches recorded once per exact input and
  replayed after, with no plan, no pass and no specialization key (see :class:`Replay`).

Kernels that run in the interpreter, and kernels with pre-run hooks, always go through Triton.
A kernel that asks Triton's allocator for global scratch is launched after
:func:`dlcore.runtime.allocator.ensure_allocator` in the launching thread, whichever thread
compiled it or recorded its template.

**Triton internals relied on**, checked once at the first launch of a compiled kernel
(:func:`internals`): ``triton.knobs.runtime`` (launch hooks, stages hook, JIT cache hooks),
``triton.knobs.compilation`` and ``triton.knobs.cache``; ``triton.runtime.driver.active``
(current device, stream, target; ``launcher_cls.__call__`` taking grid, stream and function first);
``JITFunction.run`` launching as ``kernel.run(grid_0, grid_1, grid_2, stream, kernel.function,
kernel.packed_metadata, launch_metadata, launch_enter_hook, launch_exit_hook, *args)``; a
JITFunction's ``params`` (``is_constexpr``), ``arg_names``, ``fn``, ``pre_run_hooks``, ``debug`` and
``cache_key``; ``CompiledKernel(src, metadata_group, hash)`` with ``run``, ``function``,
``packed_metadata``, ``launch_metadata``, ``src``, ``hash`` and ``name``; ``ASTSource(fn, signature,
constexprs, attrs)``; ``triton.runtime.cache.get_cache_manager`` and
``get_cache_invalidating_env_vars``. When any is missing or different (another Triton), one
warning names what, and every launch goes through ``kernel[grid](...)``: slower, never wrong.

What the shelf saves a new process's first call is measured in docs/performance.md ("First call").

Read against Triton 3.6.0 (the GPU host's) and 3.9.0 (the newest, read from its wheel): all of the
above exist in both, with the same signatures. One difference: in 3.9 the launch hooks are
``HookChain`` objects, never None; a chain with no calls counts here as no hook (Triton 3.9 then
builds launch metadata nobody reads; this path passes None).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dlcore.cachedir import default_directory, write_json
from dlcore.declarations.implementation import Config, KernelCall, LaunchPlan, PlanTransform
from dlcore.runtime.allocator import ensure_allocator, needs_allocator

#: exact inputs remembered per bound op
LIMIT = 64
#: specializations shelved per kernel; the least recently shelved are forgotten first
SHELF_LIMIT = 256

#: how JITFunction.run launches what it compiled (whitespace removed): the call this module repeats
_TRITON_LAUNCH = ("kernel.run(grid_0,grid_1,grid_2,stream,kernel.function,kernel.packed_metadata,launch_metadata,"
                  "knobs.runtime.launch_enter_hook,knobs.runtime.launch_exit_hook,*bound_args.values())")

_MISSING = object()


# --- Triton's internals, checked once ------------------------------------------------------------

@dataclass
class Internals:
    """What this module takes from Triton; ``missing`` names what was not found (then nothing else
    here is used, and every launch goes through ``kernel[grid](...)``)."""

    missing: list[str] = field(default_factory=list)
    runtime: Any = None
    compilation: Any = None
    cache: Any = None
    driver: Any = None
    compiled_kernel: Any = None
    ast_source: Any = None
    cache_manager: Any = None
    env_vars: Any = None

    @property
    def usable(self) -> bool:
        return not self.missing


_internals: Internals | None = None


def _has(obj: Any, names: tuple[str, ...], label: str, missing: list[str]) -> None:
    missing.extend(f"{label}.{n}" for n in names if not hasattr(obj, n))


def _parameters(fn: Any) -> list[str]:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def check() -> Internals:
    """Look for every Triton internal this module relies on (see the module doc)."""
    found = Internals()
    missing = found.missing
    try:
        from triton import knobs

        found.runtime, found.compilation, found.cache = knobs.runtime, knobs.compilation, knobs.cache
        _has(found.runtime, ("launch_enter_hook", "launch_exit_hook", "add_stages_inspection_hook", "jit_cache_hook",
                             "debug"), "triton.knobs.runtime", missing)
        _has(found.compilation, ("always_compile", "override", "dump_ir", "instrumentation_mode"),
             "triton.knobs.compilation", missing)
        _has(found.cache, ("dir",), "triton.knobs.cache", missing)
    except (ImportError, AttributeError):
        missing.append("triton.knobs")
    try:
        from triton.runtime import driver

        found.driver = driver.active
        _has(found.driver, ("get_current_device", "get_current_stream", "get_current_target", "launcher_cls"),
             "triton.runtime.driver.active", missing)
        launcher = getattr(found.driver, "launcher_cls", None)
        if launcher is not None and _parameters(launcher.__call__)[1:6] != ["gridX", "gridY", "gridZ", "stream",
                                                                             "function"]:
            missing.append("launcher_cls.__call__(self, gridX, gridY, gridZ, stream, function, ...)")
    except (ImportError, AttributeError, RuntimeError):
        missing.append("triton.runtime.driver.active")
    try:
        from triton.runtime.jit import JITFunction

        source = re.sub(r"\s+", "", inspect.getsource(JITFunction.run))
        if _TRITON_LAUNCH not in source:
            missing.append("JITFunction.run launching through kernel.run(grid..., packed_metadata, hooks, *args)")
    except (ImportError, AttributeError, OSError, TypeError):
        missing.append("triton.runtime.jit.JITFunction.run")
    try:
        from triton.compiler.compiler import ASTSource, CompiledKernel

        found.compiled_kernel, found.ast_source = CompiledKernel, ASTSource
        _has(CompiledKernel, ("run", "launch_metadata"), "CompiledKernel", missing)
        if _parameters(CompiledKernel.__init__) != ["self", "src", "metadata_group", "hash"]:
            missing.append("CompiledKernel(src, metadata_group, hash)")
        if _parameters(ASTSource.__init__)[:5] != ["self", "fn", "signature", "constexprs", "attrs"]:
            missing.append("ASTSource(fn, signature, constexprs, attrs)")
    except ImportError:
        missing.append("triton.compiler.compiler.CompiledKernel")
    try:
        from triton._C.libtriton import get_cache_invalidating_env_vars
        from triton.runtime.cache import get_cache_manager

        found.cache_manager, found.env_vars = get_cache_manager, get_cache_invalidating_env_vars
    except ImportError:
        missing.append("triton.runtime.cache.get_cache_manager")
    return found


def internals() -> Internals:
    """The checked internals (checked at the first call); warns once when any is missing."""
    global _internals
    if _internals is None:
        _internals = check()
        if _internals.missing:
            import triton

            warnings.warn(f"dlcore launches every Triton kernel through kernel[grid](...): Triton {triton.__version__} "
                          f"lacks what its warm path relies on: {', '.join(_internals.missing)}", stacklevel=3)
    return _internals


def _kernel_missing(kernel: Any) -> list[str]:
    names = ("params", "arg_names", "fn", "pre_run_hooks", "debug", "cache_key")
    missing = [f"JITFunction.{n}" for n in names if not hasattr(kernel, n)]
    if not missing and not all(hasattr(p, "is_constexpr") for p in kernel.params):
        missing.append("JITFunction.params[i].is_constexpr")
    return missing


# --- the specialization key and the direct launch ------------------------------------------------

def _int_class(v: int) -> int:
    if v == 1:
        return 1
    size = 2 if -(2**31) <= v < 2**31 else 8 if v >= 2**63 else 3
    return size + (4 if v % 16 == 0 else 0)


def spec_key(values: list[Any], constexpr: list[bool], names: frozenset[str], kwargs: dict[str, Any], device: int,
             hook: Any) -> tuple:
    """What Triton's specialization of ``values`` depends on (see the module doc), or finer."""
    key: list[Any] = [device, id(hook)]
    append = key.append
    for value, is_constexpr in zip(values, constexpr):
        kind = type(value)
        if is_constexpr:
            append(value)
        elif kind is int:
            append(_int_class(value))
        elif isinstance(value, torch.Tensor):
            append((value.dtype, value.data_ptr() % 16 == 0))
        elif kind is bool:
            append(("b", value))
        else:
            append(kind)
    for option, value in kwargs.items():
        if option not in names:
            append((option, value))
    return tuple(key)


def grid3(grid: tuple[int, ...]) -> tuple[int, int, int]:
    """A launch grid of one to three dimensions as the three ``compiled.run`` takes."""
    return (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)


def _active(hook: Any) -> bool:
    # Triton 3.9's hooks are chains, never None: an empty chain calls nothing.
    return hook is not None and bool(getattr(hook, "calls", True))


def run_compiled(compiled: Any, grid: tuple[int, int, int], stream: Any, values: list[Any]) -> None:
    """What ``JITFunction.run`` does once it holds the compiled kernel: the launch, with Triton's
    launch hooks (profilers) called as they would be."""
    runtime = _internals.runtime
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    if _active(enter) or _active(leave):
        metadata = compiled.launch_metadata(grid, stream, *values)
    else:
        metadata = enter = leave = None
    compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, metadata, enter,
                 leave, *values)


class KernelEntry:
    """A kernel's parameters, in order, with their defaults and constexpr flags (computed once), and
    its compiled kernels per specialization key."""

    __slots__ = ("kernel", "names", "parameters", "constexpr", "defaults", "compiled", "shelf")

    def __init__(self, kernel: Any):
        self.kernel = kernel
        self.names = list(kernel.arg_names)
        self.parameters = frozenset(self.names)
        self.constexpr = [p.is_constexpr for p in kernel.params]
        signature = inspect.signature(kernel.fn).parameters
        self.defaults = {n: p.default for n, p in signature.items() if p.default is not inspect.Parameter.empty}
        self.compiled: dict[tuple, Any] = {}
        self.shelf: Shelf | None = None

    def values(self, args: tuple, kwargs: dict[str, Any]) -> list[Any]:
        values = list(args)
        for name in self.names[len(args):]:
            values.append(kwargs[name] if name in kwargs else self.defaults[name])
        return values

    def launch(self, call: KernelCall) -> tuple[Any, list[Any]]:
        """Launch ``call``; returns the compiled kernel that ran (None when Triton handed none back)
        and the kernel's argument values."""
        triton = _internals
        active = triton.driver
        values = self.values(call.args, call.kwargs)
        device = active.get_current_device()
        key = spec_key(values, self.constexpr, self.parameters, call.kwargs, device,
                       triton.runtime.add_stages_inspection_hook)
        compiled = self.compiled.get(key)
        if compiled is None:
            with _FIRST_LAUNCH:
                compiled = self.compiled.get(key)  # another thread's first launch may have got it
                if compiled is None:
                    compiled, launched = self._first(call, key)
                    if compiled is not None:
                        self.compiled[key] = compiled
                    if launched:
                        return compiled, values
        if needs_allocator(compiled):
            ensure_allocator()
        run_compiled(compiled, grid3(call.grid), active.get_current_stream(device), values)
        return compiled, values

    def _first(self, call: KernelCall, key: tuple) -> tuple[Any, bool]:
        """The compiled kernel of a new specialization, from the shelf (not launched yet) or through
        Triton (launched); None when Triton hands back none that can be called directly."""
        name = _shelf_name(self.kernel, key, call.kwargs)
        if name is not None and self.shelf is None:
            self.shelf = Shelf.of(self.kernel)
        if name is not None:
            compiled = self.shelf.load(name, self.kernel)
            if compiled is not None:
                return compiled, False
        compiled = call.kernel[call.grid](*call.args, **call.kwargs)
        if compiled is None or not hasattr(compiled, "packed_metadata"):
            return None, True
        if name is not None:
            self.shelf.store(name, compiled)
        return compiled, True


_entries: dict[Any, KernelEntry | None] = {}
#: one first launch (Triton's compile or a shelf load) at a time in the process: Triton's compile is
#: not thread-safe, and two threads would each compile and shelve the same specialization
_FIRST_LAUNCH = threading.RLock()


def entry(kernel: Any) -> KernelEntry | None:
    """The kernel's entry, or None when it goes through ``kernel[grid](...)``: not a compiled
    JITFunction (an interpreted one, say), pre-run hooks, or Triton's internals missing."""
    found = _entries.get(kernel, _MISSING)
    if found is not _MISSING:
        return found
    found = None
    if type(kernel).__name__ == "JITFunction" and internals().usable:
        missing = _kernel_missing(kernel)
        if missing:
            _internals.missing.extend(missing)
            warnings.warn(f"dlcore launches every Triton kernel through kernel[grid](...): {kernel} lacks "
                          f"{', '.join(missing)}", stacklevel=2)
            _entries.clear()
        elif not kernel.pre_run_hooks:
            found = KernelEntry(kernel)
    _entries[kernel] = found
    return found


def launch(call: KernelCall) -> None:
    """Launch ``call``: directly through its compiled kernel when this specialization ran before."""
    found = entry(call.kernel)
    if found is None:
        call.kernel[call.grid](*call.args, **call.kwargs)
    else:
        found.launch(call)


def run_plan(plan: LaunchPlan) -> Any:
    """Run ``plan``, each launch through :func:`launch`."""
    for call in plan.calls:
        launch(call)
    return plan.result


# --- the shelf: compiled kernels found again in a new process -------------------------------------

_PLAIN = (int, float, bool, str, type(None))
_stamp: str | None = None


def stamp() -> str:
    """Names the Triton installation and settings that Triton's compile-cache key depends on,
    cheaply: its version and the sizes and times of its files (not their hash), the ``TRITON_*``
    variables, the cache directory and the variables Triton says invalidate its cache."""
    global _stamp
    if _stamp is None:
        import triton

        root = Path(triton.__file__).parent
        files = []
        for folder in ("_C", "compiler", "backends", "language", "runtime"):
            for path, _, names in os.walk(root / folder):
                for name in names:
                    if name.endswith((".py", ".so")):
                        st = os.stat(os.path.join(path, name))
                        files.append((os.path.join(path, name), st.st_size, st.st_mtime_ns))
        settings = sorted((k, v) for k, v in os.environ.items() if k.startswith("TRITON_"))
        text = json.dumps([triton.__version__, sorted(files), settings, str(_internals.cache.dir),
                           sorted(_internals.env_vars().items())])
        _stamp = hashlib.sha256(text.encode()).hexdigest()[:20]
    return _stamp


def _shelf_name(kernel: Any, key: tuple, kwargs: dict[str, Any]) -> str | None:
    """The shelf's name for a specialization, or None when it is not shelved: a stages hook or a
    JIT cache hook installed, compilation forced or dumped, or a constexpr of no plain type."""
    triton = _internals
    compilation = triton.compilation
    if (key[1] != id(None) or triton.runtime.jit_cache_hook is not None or compilation.always_compile
            or compilation.override or compilation.dump_ir):
        return None
    items = []
    for item in key[2:]:
        if isinstance(item, tuple) and item and isinstance(item[0], torch.dtype):
            items.append([str(item[0]), item[1]])
        elif isinstance(item, type):
            items.append(item.__name__)
        elif isinstance(item, _PLAIN):
            items.append(item)
        elif isinstance(item, tuple) and all(isinstance(i, _PLAIN) for i in item):
            items.append(list(item))
        else:
            return None
    target = triton.driver.get_current_target()
    debug = bool(kwargs.get("debug", kernel.debug) or triton.runtime.debug)
    text = json.dumps([kernel.cache_key, str(target), debug, str(compilation.instrumentation_mode), items])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _encode(value: Any) -> Any:
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (*_PLAIN, list, tuple)) for v in value):
        return [_encode(v) for v in value]
    raise TypeError(type(value).__name__)


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


class Shelf:
    """Where Triton keeps the compiled kernels of one JIT kernel, per specialization (a JSON file
    under ``<dlcore cache>/launch/<stamp>/``)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            entries = json.loads(path.read_text())
        except (OSError, ValueError):
            entries = {}
        # a shelf of another shape (damaged, or not dlcore's) is an empty one
        self.entries: dict[str, Any] = entries if isinstance(entries, dict) else {}

    @classmethod
    def of(cls, kernel: Any) -> Shelf:
        return cls(default_directory() / "launch" / stamp() / f"{kernel.fn.__module__}.{kernel.fn.__qualname__}.json")

    def load(self, name: str, kernel: Any) -> Any:
        """The compiled kernel shelved as ``name``, loaded from Triton's cache; None when the shelf
        or Triton's cache does not hold it."""
        found = self.entries.get(name)
        if found is None:
            return None
        triton = _internals
        try:
            group = triton.cache_manager(found["hash"]).get_group(f"{found['name'][:150]}.json")
            if not group:
                return None
            signature = {k: _tuples(v) for k, v in found["signature"].items()}
            constexprs = {_tuples(k): _tuples(v) for k, v in found["constants"]}
            attrs = {_tuples(k): v for k, v in found["attrs"]}
            src = triton.ast_source(kernel, signature, constexprs, attrs)
            return triton.compiled_kernel(src, group, found["hash"])
        except (OSError, ValueError, KeyError, TypeError, StopIteration):
            return None  # a file of Triton's cache gone or changed: Triton compiles or finds it again

    def store(self, name: str, compiled: Any) -> None:
        src = getattr(compiled, "src", None)
        try:
            found = {"hash": compiled.hash, "name": compiled.name, "signature": dict(src.signature),
                     "constants": [[list(k), _encode(v)] for k, v in src.constants.items()],
                     "attrs": [[list(k), _encode(v)] for k, v in src.attrs.items()]}
        except (AttributeError, TypeError):
            return  # not an AST-compiled kernel, or a constant JSON cannot hold
        if self.entries.get(name) != found:
            self.entries.pop(name, None)
            self.entries[name] = found
            while len(self.entries) > SHELF_LIMIT:  # the least recently shelved go first
                del self.entries[next(iter(self.entries))]
            write_json(self.path, self.entries)


# --- launch templates: a bound op's launches, recorded once per exact input -------------------------

def exact_key(args: tuple) -> tuple:
    """Everything a replayable plan may depend on, exactly: per tensor its dtype, shape, strides,
    device and 16-byte alignment; other arguments by type and value."""
    key: list[Any] = []
    append = key.append
    for a in args:
        if isinstance(a, torch.Tensor):
            append((a.dtype, a.shape, a.stride(), a.device, a.data_ptr() & 15))
        else:
            append((type(a), a))
    return tuple(key)


class _Launch:
    """One recorded launch: ``compiled.run`` with the grid and arguments of the first call;
    ``slots`` says which arguments are taken from the call's inputs, results or scratch."""

    __slots__ = ("compiled", "grid", "values", "slots")

    def __init__(self, compiled: Any, grid: tuple[int, int, int], values: list[Any], slots: list[tuple[int, tuple]]):
        self.compiled = compiled
        self.grid = grid
        self.values = values
        self.slots = slots


class Template:
    """The launches of one exact input, ready to replay."""

    __slots__ = ("launches", "results", "scratch", "single", "from_input", "device", "hook", "allocates")

    def __init__(self, launches: list[_Launch], results: list[tuple | None], scratch: list[tuple], single: bool,
                 from_input: dict[int, int], device: int, hook: Any):
        self.launches = launches
        #: per result: (shape, strides, dtype, device) to allocate, or None when it is an input
        self.results = results
        #: per scratch tensor: (shape, strides, dtype, device) to allocate
        self.scratch = scratch
        self.single = single
        self.from_input = from_input
        self.device = device
        self.hook = hook
        #: a launch asks Triton's allocator for scratch: the replaying thread needs one
        #: (:mod:`dlcore.runtime.allocator`), whichever thread recorded the template
        self.allocates = any(needs_allocator(launch.compiled) for launch in launches)

    def run(self, args: tuple) -> Any:
        if self.allocates:
            ensure_allocator()
        outs: list[Any] = []
        for i, spec in enumerate(self.results):
            if spec is None:
                outs.append(args[self.from_input[i]])
            else:
                shape, strides, dtype, device = spec
                outs.append(torch.empty_strided(shape, strides, dtype=dtype, device=device))
        scratch = [torch.empty_strided(shape, strides, dtype=dtype, device=device)
                   for shape, strides, dtype, device in self.scratch]
        stream = _internals.driver.get_current_stream(self.device)
        sources = (args, outs, scratch)
        for launch in self.launches:
            values = launch.values
            if launch.slots:
                values = list(values)
                for position, (kind, index) in launch.slots:
                    values[position] = sources[kind][index]
            run_compiled(launch.compiled, launch.grid, stream, values)
        return outs[0] if self.single else tuple(outs)


class NotReplayable(Exception):
    """Why a call's launches cannot be recorded (internal: the call keeps the plan's path)."""


def _flat_results(result: Any) -> tuple[list[torch.Tensor], bool]:
    if isinstance(result, torch.Tensor):
        return [result], True
    if isinstance(result, tuple) and all(isinstance(r, torch.Tensor) for r in result):
        return list(result), False
    raise NotReplayable(f"result of type {type(result).__name__}")


@dataclass
class _Sources:
    """Where each tensor of a call lives: per data pointer (0: input, 1: result, 2: scratch; index)."""

    pointers: dict[int, tuple[int, int]]
    results: list[tuple | None]
    scratch: list[tuple]
    from_input: dict[int, int]


def _sources(args: tuple, results: list[torch.Tensor], scratch: tuple) -> _Sources:
    inputs = [a for a in args if isinstance(a, torch.Tensor)]
    input_index = {id(a): i for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
    pointers: dict[int, tuple[int, int]] = {}
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            if a.data_ptr() in pointers:
                # Two inputs at one address (sin passed as cos, say): a launch argument could not
                # tell which one it is, and a later call may pass two different tensors.
                raise NotReplayable("two inputs share an address")
            pointers[a.data_ptr()] = (0, i)
    specs: list[tuple | None] = []
    from_input: dict[int, int] = {}
    for i, r in enumerate(results):
        if id(r) in input_index:
            specs.append(None)
            from_input[i] = input_index[id(r)]
            continue
        if r.storage_offset() != 0 or r.data_ptr() in pointers or any(
                r.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for x in inputs):
            raise NotReplayable("a result shares memory with an input or another result")
        pointers[r.data_ptr()] = (1, i)
        specs.append((tuple(r.shape), r.stride(), r.dtype, r.device))
    scratch_specs = []
    for i, t in enumerate(scratch):
        if t.storage_offset() != 0 or t.data_ptr() in pointers:
            raise NotReplayable("a scratch tensor shares memory with an input, a result or another")
        pointers[t.data_ptr()] = (2, i)
        scratch_specs.append((tuple(t.shape), t.stride(), t.dtype, t.device))
    return _Sources(pointers, specs, scratch_specs, from_input)


def _traced(compiled: Any, values: list[Any], pointers: dict[int, tuple[int, int]]) -> list[tuple[int, tuple]] | None:
    """Each tensor argument's source, its value cleared in ``values``; None if one has none."""
    slots = []
    for position, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            source = pointers.get(v.data_ptr())
            if source is None:
                return None
            slots.append((position, source))
            values[position] = None
    return slots


def _unsourced(args: tuple, plan: LaunchPlan) -> str | tuple[int, Any, int, torch.Tensor] | None:
    """What keeps ``plan`` from being recorded for ``args``: a reason (results or inputs sharing
    memory), the first launch tensor argument with no source as (launch, call, position, tensor),
    or None."""
    try:
        results, _ = _flat_results(plan.result)
        sources = _sources(args, results, plan.scratch)
    except NotReplayable as exc:
        return str(exc)
    for n, call in enumerate(plan.calls):
        for position, value in enumerate((*call.args, *call.kwargs.values())):
            tensor = getattr(value, "base", None) if not isinstance(value, torch.Tensor) else value
            if isinstance(tensor, torch.Tensor) and tensor.data_ptr() not in sources.pointers:
                return n, call, position, tensor
    return None


def _described(found: str | tuple[int, Any, int, torch.Tensor] | None) -> str | None:
    """:func:`_unsourced`'s finding in words."""
    if found is None or isinstance(found, str):
        return found
    n, call, position, tensor = found
    name = getattr(call.kernel, "__name__", str(call.kernel))
    return (f"launch {n} ({name}), argument {position}: a tensor {tuple(tensor.shape)} that is "
            f"neither an input, a result nor a declared scratch tensor at offset zero")


def why_not_replayable(args: tuple, plan: LaunchPlan) -> str | None:
    """Why :class:`Replay` would not record ``plan`` for ``args`` (so that every call of a bound op
    would run the plan again, on the host), as far as is known without compiling: its result's
    form, inputs or results sharing memory, or a launch's tensor argument (a tensor descriptor's
    base included) that is neither an input, a result nor a declared scratch tensor at offset zero.
    None: nothing found. For tests and ``dlcore`` checks; needs no GPU."""
    return _described(_unsourced(args, plan))


def _a_layout_copy(args: tuple, tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is an input made contiguous by the plan (an expanded gradient, say,
    perhaps flattened to rows): an input's dtype, element count and values, in other strides.
    Such a plan is right not to be recorded for these inputs; nothing its author could declare."""
    return any(isinstance(a, torch.Tensor) and a.dtype == tensor.dtype and a.device == tensor.device
               and a.numel() == tensor.numel() and (a.shape, a.stride()) != (tensor.shape, tensor.stride())
               and torch.equal(a.reshape(tensor.shape), tensor) for a in args)


def record(args: tuple, plan: LaunchPlan) -> tuple[Any, Template | None]:
    """Run ``plan`` (each launch through its kernel's entry, so that the first call of a new process
    takes the shelf), and record it when it can be replayed; returns the plan's result (computed
    either way) and the template or None."""
    if not plan.calls or any(type(call.kernel).__name__ == "InterpretedFunction" for call in plan.calls):
        # Nothing launched (empty inputs), or TRITON_INTERPRET=1: nothing compiled to replay, and
        # perhaps no GPU driver to ask.
        return run_plan(plan), None
    if not internals().usable:
        return run_plan(plan), None
    try:
        results, single = _flat_results(plan.result)
        sources = _sources(args, results, plan.scratch)
    except NotReplayable:
        return run_plan(plan), None
    launches: list[_Launch] | None = []
    hook = _internals.runtime.add_stages_inspection_hook
    for call in plan.calls:
        found = entry(call.kernel)
        if found is None:
            call.kernel[call.grid](*call.args, **call.kwargs)
            launches = None
            continue
        compiled, values = found.launch(call)
        if launches is None:
            continue
        slots = _traced(compiled, values, sources.pointers) if compiled is not None else None
        if slots is None:
            launches = None
            continue
        launches.append(_Launch(compiled, grid3(call.grid), values, slots))
    if launches is None:
        return plan.result, None
    # A result no launch is handed was filled on the host (zeros for an empty sum, say): a replay
    # would hand back uninitialised memory.
    handed = {index for launch in launches for _, (kind, index) in launch.slots if kind == 1}
    if any(spec is not None and i not in handed and results[i].numel() for i, spec in enumerate(sources.results)):
        return plan.result, None
    device = _internals.driver.get_current_device()
    return plan.result, Template(launches, sources.results, sources.scratch, single, sources.from_input, device,
                                 hook)


class NotReplayedWarning(UserWarning):
    """A replayable implementation's plan whose launches cannot be recorded (a launch argument that is
    neither an input, a result nor declared scratch, say): every call of its bound op plans again on
    the host. Once per plan; a fault of the plan's declaration, for its author."""


_not_replayed: set[str] = set()


def _warn_not_replayed(plan_fn: Callable[..., Any], args: tuple, plan: LaunchPlan) -> None:
    if any(type(call.kernel).__name__ == "InterpretedFunction" for call in plan.calls):
        return
    name = f"{getattr(plan_fn, '__module__', '?')}.{getattr(plan_fn, '__qualname__', plan_fn)}"
    if name in _not_replayed:
        return
    found = _unsourced(args, plan)
    if found is None:  # no compiled kernel or warm path (warned where found), or results filled on the host
        return
    if not isinstance(found, str) and _a_layout_copy(args, found[3]):
        return
    _not_replayed.add(name)
    why = _described(found)
    hint = " (a tensor the plan allocates belongs in LaunchPlan.scratch)" if "declared scratch" in why else ""
    warnings.warn(f"dlcore: {name}'s launches are not replayed, so each call plans again: {why}{hint}",
                  NotReplayedWarning, stacklevel=3)


class Replay:
    """The run function of a bound op whose implementation is replayable, and of a custom op's body
    (:class:`dlcore.runtime.torch_ops.Launches`): ``plan(args, config)`` is called only to record,
    ``config`` being whatever ``plan`` takes (a config, or a body's config ints).

    A bound op's plan depends only on its inputs' shapes, strides, dtypes, device and pointer
    alignment (the contract of a *replayable* implementation, see
    :class:`dlcore.declarations.implementation.TritonImplementation`). So the first call with given
    exact input metadata runs the plan (and the launch passes) as usual and records what it did: for
    each launch its compiled kernel, grid and arguments, each tensor argument traced back to an
    input, a result or a declared scratch tensor; for each result its shape, strides and dtype.
    Later calls with the same metadata allocate the results and scratch and call the compiled
    kernels directly. ``guard(args)``, when given, runs before the plan on each exact input metadata
    not seen before (and on each call whose arguments cannot be a key), and raises for arguments
    the plan must not see: a bound op's check of its inputs (:mod:`dlcore.dispatch.bound`), which
    replays never pay for.

    A call is not recorded (and keeps taking the plan's path) when a launch argument is a tensor
    that is neither an input, a result nor a declared scratch tensor at offset zero, when two inputs
    start at one address, when two results share memory, when a result that is not empty is handed
    to no launch (the plan filled it on the host), or when Triton does not hand back a compiled
    kernel. Templates are kept for at most :data:`LIMIT` exact inputs, the oldest dropped first, and
    recorded again when the installed compiler-stage hook changes (the compiled kernels would).
    """

    __slots__ = ("plan", "config", "transform", "guard", "templates")

    def __init__(self, plan: Callable[[tuple, Any], LaunchPlan], config: Config | tuple,
                 transform: PlanTransform | None, guard: Callable[[tuple], None] | None = None):
        self.plan = plan
        self.config = config
        self.transform = transform
        self.guard = guard
        self.templates: dict[tuple, Template | None] = {}

    def __call__(self, args: tuple) -> Any:
        key = exact_key(args)
        try:
            template = self.templates.get(key, _MISSING)
        except TypeError:  # an argument that cannot be a key (a list, say): nothing to look up
            if self.guard is not None:
                self.guard(args)
            return run_plan(self._planned(args))
        if template is None:
            return run_plan(self._planned(args))
        if template is not _MISSING:
            if template.hook is _internals.runtime.add_stages_inspection_hook:
                return template.run(args)
        elif self.guard is not None:
            self.guard(args)
        plan = self._planned(args)
        result, template = record(args, plan)
        if template is None and plan.calls:
            _warn_not_replayed(self.plan, args, plan)
        templates = self.templates
        templates.pop(key, None)
        if len(templates) >= LIMIT:
            del templates[next(iter(templates))]
        templates[key] = template
        return result

    def _planned(self, args: tuple) -> LaunchPlan:
        plan = self.plan(args, self.config)
        return plan if self.transform is None else self.transform(plan)
