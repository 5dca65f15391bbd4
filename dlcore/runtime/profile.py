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

    def __init__(self, plan: Plan, first: int):
        functools.update_wrapper(self, plan)
        self.plan = plan
        self.first = first

    def __call__(self, args: tuple, config: Config) -> LaunchPlan:
        return self.plan(args, config, device_profile(args[self.first].device))

    def __repr__(self) -> str:
        return f"<{self.plan.__module__}.{self.plan.__qualname__} on its inputs' device>"
