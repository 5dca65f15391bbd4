"""Launching Triton kernels on the warm path, without Triton's per-call dispatch.

``kernel[grid](*args)`` binds the arguments, computes a specialization key, looks up the compiled
kernel, then launches it: tens of microseconds of Python per call. Here the first launch of each
specialization goes through Triton (compiling if needed) and keeps the compiled kernel it returns;
later launches with the same specialization call that compiled kernel directly (the approach of
FlagGems' LibEntry).

The key is at least as fine as Triton's own: for each pointer its dtype and 16-byte alignment, for
each integer its range class, whether it equals 1 and whether it divides by 16, the constexpr
values, the launch options, the device, and the installed stages hook (compiler passes). Kernels
that run in the interpreter always go through Triton.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from dlcore.declarations.implementation import KernelCall, LaunchPlan

LAUNCH_OPTIONS_ORDER = ("num_warps", "num_stages", "num_ctas", "maxnreg")


class KernelLayout:
    """A kernel's parameters, in order, with their defaults and constexpr flags (computed once)."""

    __slots__ = ("names", "constexpr", "defaults", "compiled")

    def __init__(self, kernel: Any):
        self.names = list(kernel.arg_names)
        self.constexpr = [p.is_constexpr for p in kernel.params]
        signature = inspect.signature(kernel.fn).parameters
        self.defaults = {n: p.default for n, p in signature.items() if p.default is not inspect.Parameter.empty}
        self.compiled: dict[tuple, Any] = {}

    def values(self, args: tuple, kwargs: dict[str, Any]) -> list[Any]:
        values = list(args)
        for name in self.names[len(args):]:
            values.append(kwargs[name] if name in kwargs else self.defaults[name])
        return values


_layouts: dict[Any, KernelLayout] = {}


def _int_class(v: int) -> int:
    if v == 1:
        return 1
    in_i32 = -(2**31) <= v < 2**31
    return (2 if in_i32 else 3) + (4 if v % 16 == 0 else 0)


def _spec_key(values: list[Any], layout: KernelLayout, call: KernelCall, device: int, hook: Any) -> tuple:
    key: list[Any] = [device, id(hook)]
    append = key.append
    for value, is_constexpr in zip(values, layout.constexpr):
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
    kwargs = call.kwargs
    for option in LAUNCH_OPTIONS_ORDER:
        if option in kwargs:
            append((option, kwargs[option]))
    return tuple(key)


class TritonRuntime:
    """Triton's runtime knobs and active driver, looked up once (imports cost per call)."""

    runtime: Any = None
    driver: Any = None

    @classmethod
    def load(cls) -> None:
        if cls.runtime is None:
            from triton import knobs
            from triton.runtime import driver

            cls.runtime, cls.driver = knobs.runtime, driver.active


def launch(call: KernelCall) -> None:
    """Launch ``call``: directly through its compiled kernel when this specialization ran before."""
    kernel = call.kernel
    layout = _layouts.get(kernel)
    if layout is None:
        if type(kernel).__name__ != "JITFunction":
            kernel[call.grid](*call.args, **call.kwargs)
            return
        layout = _layouts[kernel] = KernelLayout(kernel)
        TritonRuntime.load()
    runtime, active = TritonRuntime.runtime, TritonRuntime.driver
    values = layout.values(call.args, call.kwargs)
    device = active.get_current_device()
    key = _spec_key(values, layout, call, device, runtime.add_stages_inspection_hook)
    compiled = layout.compiled.get(key)
    if compiled is None:
        compiled = kernel[call.grid](*call.args, **call.kwargs)
        if compiled is not None:
            layout.compiled[key] = compiled
        return
    run_compiled(compiled, grid3(call.grid), active.get_current_stream(device), values)


def run_plan(plan: LaunchPlan) -> Any:
    """Run ``plan``, each launch through :func:`launch`."""
    for call in plan.calls:
        launch(call)
    return plan.result


def grid3(grid: tuple[int, ...]) -> tuple[int, int, int]:
    """A launch grid of one to three dimensions as the three ``compiled.run`` takes."""
    return (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)


def run_compiled(compiled: Any, grid: tuple[int, int, int], stream: Any, values: list[Any]) -> None:
    """What ``JITFunction.run`` does once it holds the compiled kernel: the launch, with Triton's
    launch hooks (profilers) called as they would be."""
    runtime = TritonRuntime.runtime
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    metadata = compiled.launch_metadata(grid, stream, *values) if enter is not None else None
    compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, metadata, enter,
                 leave, *values)
