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
  takes it from the shelf (:mod:`dlcore.runtime.shelf`) or goes through Triton and keeps the
  compiled kernel it hands back; later launches call ``compiled.run(...)`` as ``JITFunction.run``
  does, Triton's launch hooks (profilers) included (:func:`run_compiled`).

Kernels that run in the interpreter, and kernels with pre-run hooks, always go through Triton, as
every kernel does when Triton lacks an internal this path relies on (:mod:`dlcore.runtime.internals`).
A kernel that asks Triton's allocator for global scratch is launched after
:func:`dlcore.runtime.allocator.ensure_allocator` in the launching thread, whichever thread
compiled it. A bound op's launches, recorded once and replayed, are :mod:`dlcore.runtime.replay`'s.
"""

from __future__ import annotations

import inspect
import threading
import warnings
from typing import Any

import torch

from dlcore.declarations.implementation import KernelCall, LaunchPlan
from dlcore.runtime import internals
from dlcore.runtime.allocator import ensure_allocator, needs_allocator
from dlcore.runtime.shelf import Shelf, shelf_name

_MISSING = object()


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
    runtime = internals.found.runtime
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
        found = internals.found
        driver = found.driver
        values = self.values(call.args, call.kwargs)
        device = driver.get_current_device()
        key = spec_key(values, self.constexpr, self.parameters, call.kwargs, device,
                       found.runtime.add_stages_inspection_hook)
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
        run_compiled(compiled, grid3(call.grid), driver.get_current_stream(device), values)
        return compiled, values

    def _first(self, call: KernelCall, key: tuple) -> tuple[Any, bool]:
        """The compiled kernel of a new specialization, from the shelf (not launched yet) or through
        Triton (launched); None when Triton hands back none that can be called directly."""
        name = shelf_name(self.kernel, key, call.kwargs)
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
    if type(kernel).__name__ == "JITFunction" and internals.checked().usable:
        missing = internals.kernel_missing(kernel)
        if missing:
            internals.found.missing.extend(missing)
            warnings.warn(f"dlcore launches every Triton kernel through kernel[grid](...): {kernel} lacks "
                          f"{', '.join(missing)}", stacklevel=2)
            _entries.clear()
        elif not kernel.pre_run_hooks:
            found = KernelEntry(kernel)
    _entries[kernel] = found
    return found


def clear() -> None:
    """Forget every kernel's entry (``dlcore.reset()``): the next launch of each finds its compiled
    specializations again, on the shelf or through Triton."""
    _entries.clear()


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
