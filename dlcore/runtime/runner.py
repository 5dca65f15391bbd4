"""How a bound op runs its implementation: the function a selection, a search and ``get_op``'s
bound op call with the inputs.

- a replayable Triton implementation on a device: its launches recorded once per exact input and
  replayed after (:class:`dlcore.runtime.replay.Replay`);
- any other Triton implementation: its plan, rewritten by the launch passes, through the warm
  launcher (:func:`dlcore.runtime.launch.run_plan`);
- a custom-op implementation: the same, unless autograd or ``torch.compile`` must see the call
  (:func:`dlcore.runtime.torch_ops.through_custom_op`, the decision every route asks), then its
  custom op;
- a custom-op implementation without a backward (``define_kernel`` without ``Backward``), or a
  Triton implementation built without the template: its launches, with one
  :class:`~dlcore.runtime.torch_ops.ForwardOnlyWarning` the first time it runs on
  inputs that require grad;
- anything else: ``impl.run(args, config)``.

A bound op hands its runner a guard (its check of inputs it was not made for): each path calls it
once per exact input metadata (:func:`dlcore.runtime.replay.replay_key`) before running, a replay
in its recording's place, the others through :class:`Guarded`; calls with metadata seen before
skip it, and ``torch.compile`` tracing leaves it to the custom op's fake.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dlcore.declarations.device import DeviceProfile
from dlcore.declarations.implementation import Config, Implementation, PlanTransform, TritonImplementation
from dlcore.runtime.launch import run_plan
from dlcore.runtime.profile import for_profile
from dlcore.runtime.replay import LIMIT, Replay, replay_key
from dlcore.runtime.torch_ops import CustomOpTritonImplementation, through_custom_op, warn_forward_only

Runner = Callable[[tuple], Any]
#: ``guard(args)`` raises for arguments a runner must not run (see the module doc)
Guard = Callable[[tuple], None]


class Guarded:
    """``run`` behind ``guard``, which sees each exact input metadata once (at most :data:`LIMIT`
    remembered, the oldest forgotten first) and each call whose arguments cannot be a key."""

    __slots__ = ("run", "guard", "seen")

    def __init__(self, run: Runner, guard: Guard):
        self.run = run
        self.guard = guard
        self.seen: dict[tuple, None] = {}

    def __call__(self, args: tuple) -> Any:
        if torch.compiler.is_compiling():  # fake tensors have no address to key; the custom op's fake validates
            return self.run(args)
        key = replay_key(args)
        try:
            if key in self.seen:
                return self.run(args)
        except TypeError:  # an argument that cannot be a key (a list, say): checked on every call
            self.guard(args)
            return self.run(args)
        self.guard(args)
        seen = self.seen
        if len(seen) >= LIMIT:
            del seen[next(iter(seen))]
        seen[key] = None
        return self.run(args)


def guarded(run: Runner, guard: Guard | None) -> Runner:
    """``run``, behind ``guard`` when there is one."""
    return run if guard is None else Guarded(run, guard)


def runner(impl: Implementation, config: Config, transform: PlanTransform | None = None,
           guard: Guard | None = None, profile: DeviceProfile | None = None) -> Runner:
    """``impl`` with ``config`` bound, taking the bound arguments; ``transform`` rewrites each
    launch plan (the ``ast`` and ``launch`` compiler passes); ``guard`` checks each exact input
    metadata once, before it runs; ``profile`` is the device's the plans are called with
    (``plan(args, config, profile)``: the call's, ``Call.profile``; None: the profile of the
    inputs' device, looked up on each plan)."""
    if not isinstance(impl, TritonImplementation):
        return guarded(lambda args: impl.run(args, config), guard)
    launch = launches(impl, config, transform, guard, profile)
    if not isinstance(impl, CustomOpTritonImplementation):
        # Built without the template: no custom op and no backward, so forward only by construction.
        def plain(args: tuple) -> Any:
            warn_forward_only(impl, args)
            return launch(args)

        return plain
    train = guarded(lambda args: impl.custom_op(args, config), guard)

    def run(args: tuple) -> Any:
        return train(args) if through_custom_op(impl, args) else launch(args)

    return run


def launches(impl: TritonImplementation, config: Config, transform: PlanTransform | None,
             guard: Guard | None = None, profile: DeviceProfile | None = None) -> Runner:
    """``impl``'s launches with ``config``, autograd aside: recorded once per exact input and
    replayed where the implementation is replayable and compiled, else planned on every call;
    ``guard`` checks each exact input metadata once, before its plan; ``profile`` as
    :func:`runner` takes it."""
    plan = for_profile(impl.plan, profile)
    if impl.replayable and not impl.interpreted:
        return Replay(plan, config, transform, guard)
    if transform is None:
        return guarded(lambda args: run_plan(plan(args, config)), guard)
    return guarded(lambda args: run_plan(transform(plan(args, config))), guard)
