"""Launch templates: a bound op's launches, recorded once per exact input and replayed after.

A bound op's plan depends only on its inputs' shapes, strides, dtypes, device and pointer
alignment (the contract of a *replayable* implementation, see
:class:`dlcore.declarations.implementation.TritonImplementation`). So the first call with given exact input
metadata runs the plan (and the launch passes) as usual, launching through Triton, and records
what it did: for each launch its compiled kernel, grid and arguments, each tensor argument traced
back to an input or a result; for each result its shape, strides and dtype. Later calls with the
same metadata allocate the results and call the compiled kernels directly with those arguments:
no plan, no pass, no specialization key (the approach of FlagGems' LibEntry, taken one step
further).

Scratch tensors the plan declares (:class:`~dlcore.declarations.implementation.LaunchPlan`'s ``scratch``) are
allocated afresh for each replay, like the results. A call is not recorded (and keeps taking the
plan's path) when a launch argument is a tensor that is neither an input, a result nor a declared
scratch tensor at offset zero (an undeclared buffer, a copy, a view at an offset),
when two inputs start at one address, when two results share memory, when a result that is not
empty is handed to no launch (the plan filled it on the host), or when Triton does not hand back a
compiled kernel. Templates
are recorded for at most :data:`LIMIT` exact inputs per bound op, the oldest dropped first. A
template is dropped when the installed compiler-stage hook changes (the compiled kernels would).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dlcore.declarations.implementation import Config, LaunchPlan, PlanTransform
from dlcore.runtime.launcher import KernelLayout, TritonRuntime, grid3, run_compiled, run_plan

#: exact inputs remembered per bound op
LIMIT = 64

_MISSING = object()


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
    ``slots`` says which arguments are taken from the call's inputs or results."""

    __slots__ = ("compiled", "grid", "values", "slots")

    def __init__(self, compiled: Any, grid: tuple[int, int, int], values: list[Any], slots: list[tuple[int, int]]):
        self.compiled = compiled
        self.grid = grid
        self.values = values
        self.slots = slots


class Template:
    """The launches of one exact input, ready to replay."""

    __slots__ = ("launches", "results", "scratch", "single", "from_input", "device", "hook")

    def __init__(self, launches: list[_Launch], results: list[tuple], scratch: list[tuple], single: bool,
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

    def run(self, args: tuple) -> Any:
        outs: list[Any] = []
        for i, spec in enumerate(self.results):
            if spec is None:
                outs.append(args[self.from_input[i]])
            else:
                shape, strides, dtype, device = spec
                outs.append(torch.empty_strided(shape, strides, dtype=dtype, device=device))
        scratch = [torch.empty_strided(shape, strides, dtype=dtype, device=device)
                   for shape, strides, dtype, device in self.scratch]
        stream = TritonRuntime.driver.get_current_stream(self.device)
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


def record(args: tuple, plan: LaunchPlan) -> tuple[Any, Template | None]:
    """Run ``plan`` through Triton, and record it when it can be replayed; returns the plan's
    result (computed either way) and the template or None."""
    if not plan.calls or any(type(call.kernel).__name__ == "InterpretedFunction" for call in plan.calls):
        # Nothing launched (empty inputs), or TRITON_INTERPRET=1: nothing compiled to replay, and
        # perhaps no GPU driver to ask.
        return run_plan(plan), None
    TritonRuntime.load()
    try:
        results, single = _flat_results(plan.result)
        inputs = [a for a in args if isinstance(a, torch.Tensor)]
        input_index = {id(a): i for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
        specs: list[tuple | None] = []
        from_input: dict[int, int] = {}
        pointers: dict[int, tuple[int, int]] = {}
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                if a.data_ptr() in pointers:
                    # Two inputs at one address (sin passed as cos, say): a launch argument could not
                    # tell which one it is, and a later call may pass two different tensors.
                    raise NotReplayable("two inputs share an address")
                pointers[a.data_ptr()] = (0, i)
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
        for i, t in enumerate(plan.scratch):
            if t.storage_offset() != 0 or t.data_ptr() in pointers:
                raise NotReplayable("a scratch tensor shares memory with an input, a result or another")
            pointers[t.data_ptr()] = (2, i)
            scratch_specs.append((tuple(t.shape), t.stride(), t.dtype, t.device))
    except NotReplayable:
        return run_plan(plan), None
    launches: list[_Launch] = []
    replayable = True
    hook = TritonRuntime.runtime.add_stages_inspection_hook
    for call in plan.calls:
        compiled = call.kernel[call.grid](*call.args, **call.kwargs)
        if not replayable:
            continue
        if compiled is None or not hasattr(compiled, "packed_metadata"):
            replayable = False
            continue
        values = KernelLayout(call.kernel).values(call.args, call.kwargs)
        slots = []
        for position, v in enumerate(values):
            if isinstance(v, torch.Tensor):
                source = pointers.get(v.data_ptr())
                if source is None:
                    replayable = False
                    break
                slots.append((position, source))
                values[position] = None
        launches.append(_Launch(compiled, grid3(call.grid), values, slots))
    if not replayable:
        return plan.result, None
    # A result no launch is handed was filled on the host (zeros for an empty sum, say): a replay
    # would hand back uninitialised memory.
    handed = {index for launch in launches for _, (kind, index) in launch.slots if kind == 1}
    if any(spec is not None and i not in handed and results[i].numel() for i, spec in enumerate(specs)):
        return plan.result, None
    device = TritonRuntime.driver.get_current_device()
    return plan.result, Template(launches, specs, scratch_specs, single, from_input, device, hook)


class Replay:
    """The run function of a bound op whose implementation is replayable (see the module doc), and
    of a custom op's body (:class:`dlcore.runtime.torch_ops.Launches`): ``plan(args, config)`` is called
    only to record, ``config`` being whatever ``plan`` takes (a config, or a body's config ints)."""

    __slots__ = ("plan", "config", "transform", "templates")

    def __init__(self, plan: Callable[[tuple, Any], LaunchPlan], config: Config | tuple,
                 transform: PlanTransform | None):
        self.plan = plan
        self.config = config
        self.transform = transform
        self.templates: dict[tuple, Template | None] = {}

    def __call__(self, args: tuple) -> Any:
        key = exact_key(args)
        try:
            template = self.templates.get(key, _MISSING)
        except TypeError:  # an argument that cannot be a key (a list, say): nothing to look up
            return run_plan(self._planned(args))
        if template is None:
            return run_plan(self._planned(args))
        if template is not _MISSING and template.hook is TritonRuntime.runtime.add_stages_inspection_hook:
            return template.run(args)
        result, template = record(args, self._planned(args))
        templates = self.templates
        templates.pop(key, None)
        if len(templates) >= LIMIT:
            del templates[next(iter(templates))]
        templates[key] = template
        return result

    def _planned(self, args: tuple) -> LaunchPlan:
        plan = self.plan(args, self.config)
        return plan if self.transform is None else self.transform(plan)
