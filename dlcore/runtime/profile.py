"""A plan's device profile: the :class:`~dlcore.declarations.device.DeviceProfile` of the device
its inputs live on (:func:`device_profile`), and a plan given it (:class:`OnDevice`)."""

from __future__ import annotations

import functools

import torch

from dlcore.declarations.device import DeviceProfile, planning_target
from dlcore.declarations.implementation import Config, LaunchPlan
from dlcore.plugins.registry import registry
from dlcore.runtime.backward import Plan


def device_profile(device: torch.device) -> DeviceProfile:
    """The profile of ``device`` as its backend describes it, or :data:`UNKNOWN_DEVICE`
    (:meth:`Registry.device_profile <dlcore.plugins.registry.Registry.device_profile>`, remembered
    with the registry, which ``dlcore.reset()`` forgets); for ``meta`` tensors, the target being
    lowered for (:func:`~dlcore.declarations.device.planning_for`), if any."""
    if device.type == "meta":
        target = planning_target()
        if target is not None:
            return target
    return registry().device_profile(device)


class OnDevice:
    """``plan`` given the profile of its inputs' device: ``planned(args, config)``. It keeps the
    plan's name and module (the source hash in cache keys covers the kernel module, not this one)."""

    def __init__(self, plan: Plan, first: int | None):
        """:param first: the position of the tensor that gives the device (None: the first tensor)."""
        functools.update_wrapper(self, plan)
        self.plan = plan
        self.first = first

    def __call__(self, args: tuple, config: Config) -> LaunchPlan:
        device = first_device(args) if self.first is None else args[self.first].device
        return self.plan(args, config, device_profile(device))

    def __repr__(self) -> str:
        return f"<{self.plan.__module__}.{self.plan.__qualname__} on its inputs' device>"


class ForProfile:
    """``plan`` given one profile, the device's of the call it serves: ``planned(args, config)``.
    It keeps the plan's name and module, as :class:`OnDevice` does."""

    def __init__(self, plan: Plan, profile: DeviceProfile):
        functools.update_wrapper(self, plan)
        self.plan = plan
        self.profile = profile

    def __call__(self, args: tuple, config: Config) -> LaunchPlan:
        return self.plan(args, config, self.profile)

    def __repr__(self) -> str:
        return f"<{self.plan.__module__}.{self.plan.__qualname__} for {self.profile.describe()}>"


def first_device(args: tuple) -> torch.device:
    """The device of the first tensor among ``args`` (an op's first tensor argument is never
    optional: it gives the device)."""
    return next(a for a in args if isinstance(a, torch.Tensor)).device


def for_profile(plan: Plan, profile: DeviceProfile | None) -> ForProfile | OnDevice:
    """``plan`` given ``profile``, or (None: no call in view) the profile of its inputs' device."""
    return OnDevice(plan, None) if profile is None else ForProfile(plan, profile)
