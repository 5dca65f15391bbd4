"""Launch replays: a bound op's launches, recorded once per exact input and replayed after.

:class:`Replay` runs a replayable plan's first call with given exact inputs (:func:`replay_key`)
through the warm launch path (:mod:`dlcore.runtime.launch`), records what it launched
(:class:`Recording`), and replays that on later calls: no plan, no pass and no specialization key.
A recording's kernel that asks Triton's allocator for global scratch is replayed after
:func:`dlcore.runtime.allocator.ensure_allocator` in the replaying thread, whichever thread recorded it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dlcore.declarations.implementation import Config, LaunchPlan, PlanTransform
from dlcore.runtime import internals
from dlcore.runtime.allocator import ensure_allocator, needs_allocator
from dlcore.runtime.launch import entry, grid3, run_compiled, run_plan

#: exact inputs remembered per bound op
LIMIT = 64

_MISSING = object()
#: an exact input checked by its guard, its launches not recorded (it ran through the custom op)
CHECKED = object()


def remember(entries: dict[tuple, Any], key: tuple, value: Any) -> None:
    """``entries[key] = value``, the entry made the newest; at most :data:`LIMIT` kept, the oldest
    dropped first."""
    entries.pop(key, None)
    if len(entries) >= LIMIT:
        del entries[next(iter(entries))]
    entries[key] = value


def check_once(entries: dict[tuple, Any], guard: Callable[[tuple], None] | None, args: tuple) -> None:
    """``guard(args)`` where ``args``' exact input metadata has no entry, the key then remembered as
    :data:`CHECKED`: a call that runs elsewhere (the custom op, under autograd) is checked once, as
    one that runs through ``entries``' owner is; checked on every call where the arguments cannot be
    a key; nothing while ``torch.compile`` traces (fake tensors have no address to key; the custom
    op's fake validates)."""
    if guard is None or torch.compiler.is_compiling():
        return
    try:
        key = replay_key(args)
        known = key in entries
    except TypeError:  # an argument that cannot be a key (a list, say)
        guard(args)
        return
    if not known:
        guard(args)
        remember(entries, key, CHECKED)


def replay_key(args: tuple) -> tuple:
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
    ``slots`` says which arguments are taken from the call's inputs, results or scratch: per
    argument its position and ``(kind, index, view)``, ``view`` None for the tensor itself, else
    ``(offset, shape, strides)``: a view of it that many elements further into its storage (a
    plan's row chunk of an input, say)."""

    __slots__ = ("compiled", "grid", "values", "slots")

    def __init__(self, compiled: Any, grid: tuple[int, int, int], values: list[Any], slots: list[tuple[int, tuple]]):
        self.compiled = compiled
        self.grid = grid
        self.values = values
        self.slots = slots


class Recording:
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
        #: (:mod:`dlcore.runtime.allocator`), whichever thread recorded it
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
        stream = internals.found.driver.get_current_stream(self.device)
        sources = (args, outs, scratch)
        for launch in self.launches:
            values = launch.values
            if launch.slots:
                values = list(values)
                for position, (kind, index, view) in launch.slots:
                    source = sources[kind][index]
                    values[position] = source if view is None else source.as_strided(
                        view[1], view[2], source.storage_offset() + view[0])
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
    """Where each tensor of a call lives: per data pointer (0: input, 1: result, 2: scratch; index),
    and per storage the one tensor of the call in it (None where several share a storage: a view
    of it could not tell which one it is of)."""

    pointers: dict[int, tuple[int, int]]
    #: the tensors of no elements (all at address 0), by identity
    empties: dict[int, tuple[int, int]]
    results: list[tuple | None]
    scratch: list[tuple]
    from_input: dict[int, int]
    storages: dict[int, tuple[int, int, torch.Tensor] | None]


def _sources(args: tuple, results: list[torch.Tensor], scratch: tuple) -> _Sources:
    # A tensor of no elements holds no memory: its address (0) tells nothing, and it shares nothing.
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.numel()]
    input_index = {id(a): i for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
    pointers: dict[int, tuple[int, int]] = {}
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.numel():
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
        if r.numel():
            if r.storage_offset() != 0 or r.data_ptr() in pointers or any(
                    r.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for x in inputs):
                raise NotReplayable("a result shares memory with an input or another result")
            pointers[r.data_ptr()] = (1, i)
        specs.append((tuple(r.shape), r.stride(), r.dtype, r.device))
    scratch_specs = []
    for i, t in enumerate(scratch):
        if t.numel():
            if t.storage_offset() != 0 or t.data_ptr() in pointers:
                raise NotReplayable("a scratch tensor shares memory with an input, a result or another")
            pointers[t.data_ptr()] = (2, i)
        scratch_specs.append((tuple(t.shape), t.stride(), t.dtype, t.device))
    storages: dict[int, tuple[int, int, torch.Tensor] | None] = {}
    empties: dict[int, tuple[int, int]] = {}
    tensors = [(0, i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    tensors += [(1, i, r) for i, r in enumerate(results) if specs[i] is not None]  # not an in-place op's input
    tensors += [(2, i, t) for i, t in enumerate(scratch)]
    for kind, index, t in tensors:
        if not t.numel():
            empties.setdefault(id(t), (kind, index))
            continue
        storage = t.untyped_storage().data_ptr()
        storages[storage] = None if storage in storages else (kind, index, t)
    return _Sources(pointers, empties, specs, scratch_specs, from_input, storages)


def _source(tensor: torch.Tensor, sources: _Sources) -> tuple[int, int, tuple | None] | None:
    """Where a launch's tensor argument comes from: an input, result or scratch tensor itself, or a
    view into the storage of exactly one of them with its dtype; None if neither."""
    if not tensor.numel():
        found = sources.empties.get(id(tensor))
        return None if found is None else (*found, None)
    found = sources.pointers.get(tensor.data_ptr())
    if found is not None:
        return (*found, None)
    base = sources.storages.get(tensor.untyped_storage().data_ptr())
    if base is None or base[2].dtype != tensor.dtype:
        return None
    kind, index, t = base
    return kind, index, (tensor.storage_offset() - t.storage_offset(), tuple(tensor.shape), tensor.stride())


def _traced(compiled: Any, values: list[Any], sources: _Sources) -> list[tuple[int, tuple]] | None:
    """Each tensor argument's source, its value cleared in ``values``; None if one has none."""
    slots = []
    for position, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            source = _source(v, sources)
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
            if isinstance(tensor, torch.Tensor) and _source(tensor, sources) is None:
                return n, call, position, tensor
    return None


def _described(found: str | tuple[int, Any, int, torch.Tensor] | None) -> str | None:
    """:func:`_unsourced`'s finding in words."""
    if found is None or isinstance(found, str):
        return found
    n, call, position, tensor = found
    name = getattr(call.kernel, "__name__", str(call.kernel))
    return (f"launch {n} ({name}), argument {position}: a tensor {tuple(tensor.shape)} that is "
            f"neither an input, a result nor a declared scratch tensor, nor a view into one of them")


def why_not_replayable(args: tuple, plan: LaunchPlan) -> str | None:
    """Why :class:`Replay` would not record ``plan`` for ``args`` (so that every call of a bound op
    would run the plan again, on the host), as far as is known without compiling: its result's
    form, inputs or results sharing memory, or a launch's tensor argument (a tensor descriptor's
    base included) that is neither an input, a result nor a declared scratch tensor, nor a view into one of them.
    None: nothing found. For tests and ``dlcore`` checks; needs no GPU."""
    return _described(_unsourced(args, plan))


def _a_layout_copy(args: tuple, tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is an input made contiguous by the plan (an expanded gradient, say,
    perhaps flattened to rows): an input's dtype, element count and values, in other strides.
    Such a plan is right not to be recorded for these inputs; nothing its author could declare."""
    return any(isinstance(a, torch.Tensor) and a.dtype == tensor.dtype and a.device == tensor.device
               and a.numel() == tensor.numel() and (a.shape, a.stride()) != (tensor.shape, tensor.stride())
               and torch.equal(a.reshape(tensor.shape), tensor) for a in args)


def record(args: tuple, plan: LaunchPlan) -> tuple[Any, Recording | None]:
    """Run ``plan`` (each launch through its kernel's entry, so that the first call of a new process
    takes the shelf), and record it when it can be replayed; returns the plan's result (computed
    either way) and the recording or None."""
    if not plan.calls or any(type(call.kernel).__name__ == "InterpretedFunction" for call in plan.calls):
        # Nothing launched (empty inputs), or TRITON_INTERPRET=1: nothing compiled to replay, and
        # perhaps no GPU driver to ask.
        return run_plan(plan), None
    if not internals.checked().usable:
        return run_plan(plan), None
    try:
        results, single = _flat_results(plan.result)
        sources = _sources(args, results, plan.scratch)
    except NotReplayable:
        return run_plan(plan), None
    launches: list[_Launch] | None = []
    hook = internals.found.runtime.add_stages_inspection_hook
    for call in plan.calls:
        found = entry(call.kernel)
        if found is None:
            call.kernel[call.grid](*call.args, **call.kwargs)
            launches = None
            continue
        compiled, values = found.launch(call)
        if launches is None:
            continue
        slots = _traced(compiled, values, sources) if compiled is not None else None
        if slots is None:
            launches = None
            continue
        launches.append(_Launch(compiled, grid3(call.grid), values, slots))
    if launches is None:
        return plan.result, None
    # A result no launch is handed was filled on the host (zeros for an empty sum, say): a replay
    # would hand back uninitialised memory.
    handed = {index for launch in launches for _, (kind, index, _view) in launch.slots if kind == 1}
    if any(spec is not None and i not in handed and results[i].numel() for i, spec in enumerate(sources.results)):
        return plan.result, None
    device = internals.found.driver.get_current_device()
    return plan.result, Recording(launches, sources.results, sources.scratch, single, sources.from_input, device,
                                  hook)


class NotReplayedWarning(UserWarning):
    """A replayable implementation's plan whose launches cannot be recorded (a launch argument that is
    neither an input, a result nor declared scratch, say): every call of its bound op plans again on
    the host. Once per plan; a fault of the plan's declaration, for its author."""


#: the plans already warned about (NotReplayedWarning), by name; :func:`clear` forgets them
_not_replayed: set[str] = set()


def clear() -> None:
    """Forget which plans were warned about, so that each warns again (``dlcore.reset()``)."""
    _not_replayed.clear()


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
    ``config`` being whatever ``plan`` takes (a config, or a body's config ints); an
    implementation's plan comes with its device profile bound (:mod:`dlcore.runtime.profile`).

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
    that is neither an input, a result nor a declared scratch tensor, nor a view into one of them
    (replayed as the same view of the call's own), when two inputs start at one address, when two
    results share memory, when a result that is not empty is handed to no launch (the plan filled
    it on the host), or when Triton does not hand back a compiled kernel. Recordings are kept for at
    most :data:`LIMIT` exact inputs, the oldest dropped first, and
    recorded again when the installed compiler-stage hook changes (the compiled kernels would).
    """

    __slots__ = ("plan", "config", "transform", "guard", "recordings")

    def __init__(self, plan: Callable[[tuple, Any], LaunchPlan], config: Config | tuple | None,
                 transform: PlanTransform | None, guard: Callable[[tuple], None] | None = None):
        self.plan = plan
        self.config = config
        self.transform = transform
        self.guard = guard
        #: per exact input: its recording, None (not replayable: planned each call) or :data:`CHECKED`
        self.recordings: dict[tuple, Recording | None | object] = {}

    def __call__(self, args: tuple) -> Any:
        key = replay_key(args)
        try:
            recording = self.recordings.get(key, _MISSING)
        except TypeError:  # an argument that cannot be a key (a list, say): nothing to look up
            if self.guard is not None:
                self.guard(args)
            return run_plan(self._planned(args))
        if recording is None:
            return run_plan(self._planned(args))
        if recording is _MISSING:
            if self.guard is not None:
                self.guard(args)
        elif recording is not CHECKED and recording.hook is internals.found.runtime.add_stages_inspection_hook:
            return recording.run(args)
        plan = self._planned(args)
        result, recording = record(args, plan)
        if recording is None and plan.calls:
            _warn_not_replayed(self.plan, args, plan)
        remember(self.recordings, key, recording)
        return result

    def check(self, args: tuple) -> None:
        """The guard of a call that runs elsewhere, once per exact input (:func:`check_once`)."""
        check_once(self.recordings, self.guard, args)

    def clear(self) -> None:
        """Forget every exact input: each is checked and recorded again on its next call."""
        self.recordings.clear()

    def _planned(self, args: tuple) -> LaunchPlan:
        plan = self.plan(args, self.config)
        return plan if self.transform is None else self.transform(plan)
