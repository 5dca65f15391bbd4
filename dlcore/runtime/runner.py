"""How an implementation runs: the :class:`Runner` every route calls with the op's bound arguments
(``get_op``'s bound op, a kernel's public function, a selection and a search).

A runner holds one implementation, one config (or None: the implementation's heuristic default for
each exact input), and one table of the exact inputs it has seen (:func:`dlcore.runtime.replay.replay_key`).
Per call it decides the route:

- a custom-op implementation when autograd or ``torch.compile`` must see the call
  (:func:`dlcore.runtime.torch_ops.through_custom_op`, the decision every route asks): its custom op;
- else its launches: recorded once per exact input and replayed after where the implementation is
  replayable and compiled (:class:`dlcore.runtime.replay.Replay`), else planned on every call,
  rewritten by the launch passes, through the warm launcher (:func:`dlcore.runtime.launch.run_plan`);
- a Triton implementation built without the template (no custom op, no backward): its launches,
  with one :class:`~dlcore.runtime.torch_ops.ForwardOnlyWarning` the first time it runs on inputs
  that require grad;
- anything else: ``impl.run(args, config)``.

A runner may hold a guard (a bound op's check of inputs it was not made for, a public function's
validation): it runs once per exact input metadata, on whichever route sees it first, and is
remembered in the same table as the recordings; calls with metadata seen before skip it, and
``torch.compile`` tracing leaves it to the custom op's fake.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from dlcore.declarations.device import DeviceProfile
from dlcore.declarations.implementation import Config, Implementation, LaunchPlan, PlanTransform, TritonImplementation
from dlcore.runtime.launch import run_plan
from dlcore.runtime.profile import for_profile
from dlcore.runtime.replay import CHECKED, Replay, check_once, remember, replay_key
from dlcore.runtime.torch_ops import CustomOpTritonImplementation, through_custom_op, warn_forward_only

#: ``guard(args)`` raises for arguments a runner must not run (see the module doc)
Guard = Callable[[tuple], None]
#: ``heuristic(args)``: the config of an implementation's default for these arguments
Heuristic = Callable[[tuple], Config]


class Planned:
    """``run(args, config)`` planned on every call, for implementations whose launches are not
    replayed: ``guard`` sees each exact input metadata once, and the config of each (``config``,
    or ``heuristic(args)`` where it is None) is worked out then and kept with it (at most
    :data:`~dlcore.runtime.replay.LIMIT`, the oldest forgotten first); a call whose arguments
    cannot be a key is checked and worked out each time."""

    __slots__ = ("run", "config", "heuristic", "guard", "configs")

    def __init__(self, run: Callable[[tuple, Config], Any], config: Config | None, heuristic: Heuristic | None,
                 guard: Guard | None):
        self.run = run
        self.config = config
        self.heuristic = heuristic
        self.guard = guard
        #: the config of each exact input seen (:data:`~dlcore.runtime.replay.CHECKED` where only its guard ran)
        self.configs: dict[tuple, Any] = {}

    def __call__(self, args: tuple) -> Any:
        if torch.compiler.is_compiling():  # fake tensors have no address to key; the custom op's fake validates
            return self.run(args, self._config(args))
        try:
            key = replay_key(args)
            config = self.configs.get(key)
        except TypeError:  # an argument that cannot be a key (a list, say): checked on every call
            if self.guard is not None:
                self.guard(args)
            return self.run(args, self._config(args))
        if config is None or config is CHECKED:
            if config is None and self.guard is not None:
                self.guard(args)
            config = self._config(args)
            remember(self.configs, key, config)
        return self.run(args, config)

    def check(self, args: tuple) -> None:
        """The guard of a call that runs elsewhere, once per exact input (:func:`check_once`)."""
        check_once(self.configs, self.guard, args)

    def clear(self) -> None:
        self.configs.clear()

    def _config(self, args: tuple) -> Config:
        return self.heuristic(args) if self.config is None else self.config


class Runner:
    """``impl`` with ``config`` bound (None: its heuristic default per exact input, from
    ``heuristic``), called with the op's bound arguments; see the module doc for the routes.

    :param transform: rewrites each launch plan (the ``ast`` and ``launch`` compiler passes).
    :param guard: checks each exact input metadata once, before it runs.
    :param profile: the device's the plans are called with (``plan(args, config, profile)``: the
        call's, ``Call.profile``; None: the profile of the inputs' device, looked up on each plan).
    :param heuristic: the config where ``config`` is None (a public function's default).
    """

    __slots__ = ("impl", "config", "launches", "call")

    def __init__(self, impl: Implementation, config: Config | None, transform: PlanTransform | None = None,
                 guard: Guard | None = None, profile: DeviceProfile | None = None,
                 heuristic: Heuristic | None = None):
        if config is None and heuristic is None:
            raise ValueError("a runner without a config needs the heuristic that gives one")
        self.impl = impl
        self.config = config
        if isinstance(impl, TritonImplementation):
            self.launches = launches(impl, config, transform, guard, profile, heuristic)
        else:
            self.launches = Planned(impl.run, config, heuristic, guard)
        #: ``call(args)``: the route decided and run (a closure over the parts: the warm path's cost)
        self.call = self._routes()

    def _routes(self) -> Callable[[tuple], Any]:
        impl, config, launched = self.impl, self.config, self.launches
        if isinstance(impl, CustomOpTritonImplementation):
            custom_op, check = impl.custom_op, launched.check

            def call(args: tuple) -> Any:
                if through_custom_op(impl, args):
                    check(args)
                    return custom_op(args, config)
                return launched(args)

            return call
        if isinstance(impl, TritonImplementation):
            # Built without the template: no custom op and no backward, so forward only by construction.
            def plain(args: tuple) -> Any:
                warn_forward_only(impl, args)
                return launched(args)

            return plain
        return launched

    def __call__(self, args: tuple) -> Any:
        return self.call(args)

    @property
    def seen(self) -> dict[tuple, Any]:
        """The exact inputs this runner has seen (a recording or a config for each)."""
        launched = self.launches
        return launched.recordings if isinstance(launched, Replay) else launched.configs

    def clear(self) -> None:
        """Forget every exact input: each is checked, planned and recorded again on its next call."""
        self.launches.clear()


def runner(impl: Implementation, config: Config, transform: PlanTransform | None = None,
           guard: Guard | None = None, profile: DeviceProfile | None = None) -> Runner:
    """A :class:`Runner` of ``impl`` with ``config``."""
    return Runner(impl, config, transform, guard, profile)


class _WithConfig:
    """``plan(args, config)`` where a None config means ``heuristic(args)``'s (a replay's plan:
    called only to record). It keeps the plan's name and module (what a NotReplayedWarning names)."""

    def __init__(self, plan: Callable[[tuple, Config], LaunchPlan], heuristic: Heuristic):
        functools.update_wrapper(self, plan)
        self.plan = plan
        self.heuristic = heuristic

    def __call__(self, args: tuple, config: Config | None) -> LaunchPlan:
        return self.plan(args, self.heuristic(args) if config is None else config)


def launches(impl: TritonImplementation, config: Config | None, transform: PlanTransform | None,
             guard: Guard | None = None, profile: DeviceProfile | None = None,
             heuristic: Heuristic | None = None) -> Replay | Planned:
    """``impl``'s launches with ``config`` (None: ``heuristic(args)``'s), autograd aside: recorded
    once per exact input and replayed where the implementation is replayable and compiled, else
    planned on every call; ``guard`` checks each exact input metadata once, before its plan;
    ``profile`` as :class:`Runner` takes it."""
    plan = for_profile(impl.plan, profile)
    if impl.replayable and not impl.interpreted:
        return Replay(plan if config is not None else _WithConfig(plan, heuristic), config, transform, guard)
    if transform is None:
        return Planned(lambda args, chosen: run_plan(plan(args, chosen)), config, heuristic, guard)
    return Planned(lambda args, chosen: run_plan(transform(plan(args, chosen))), config, heuristic, guard)
