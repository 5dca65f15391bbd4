"""What a search measures: one implementation's time for a config, on cloned inputs.

The backend's timer gives the time (``do_bench`` on CUDA; synchronize + perf_counter elsewhere),
warm-up excluded; for a training call, of the forward and the backward together. The result is
checked against the op's float64 reference on the first evaluation of each implementation, and
the winner of a search is checked before it is accepted, so a wrong-but-fast config can never
win. ``check="all"`` checks every config; so does a training call (unless ``check="none"``), whose
gradients are checked too (:class:`~dlcore.tuning.verify.Reference`): a config's backward launches
kernels of their own sizes, which the forward's check says nothing of. Each config is checked at
most once.
"""

from __future__ import annotations

import torch

from dlcore.declarations.backend import Backend
from dlcore.declarations.device import DeviceProfile
from dlcore.declarations.implementation import Config, Implementation, PlanTransform
from dlcore.declarations.op import Op
from dlcore.errors import InvalidOptionError, WrongResultError
from dlcore.runtime.runner import runner
from dlcore.tuning.policy import CHECKS
from dlcore.tuning.selection import clone_args, step, wrong_result
from dlcore.tuning.verify import Reference


class Objective:
    """``objective(config) -> milliseconds`` for one implementation on one set of inputs."""

    def __init__(self, op: Op, impl: Implementation, bound: tuple, backend: Backend, device: torch.device,
                 check: str = "first", transform: PlanTransform | None = None, training: bool = False,
                 profile: DeviceProfile | None = None):
        if check not in CHECKS:
            raise InvalidOptionError(f"check={check!r}; use one of {', '.join(CHECKS)}")
        self.op = op
        self.impl = impl
        self.backend = backend
        self.device = device
        self.check = check
        self.transform = transform
        self.training = training
        #: the device's profile the plans are called with (None: looked up by the inputs' device)
        self.profile = profile
        self._inputs = clone_args(bound)
        self._pristine = clone_args(bound)
        self._reference: Reference | None = None
        self._checked: set[tuple] = set()
        self._evaluations = 0

    def verify(self, config: Config) -> None:
        """Raise :class:`WrongResultError` unless ``config`` reproduces the reference: its outputs,
        and for a training call the gradients of the inputs that require grad."""
        key = tuple(sorted(config.items()))
        if key in self._checked:
            return
        if self._reference is None:
            self._reference = Reference(self.op, self._pristine, training=self.training)
        run = runner(self.impl, config, self.transform, profile=self.profile)
        problem = wrong_result(run, self._pristine, self._reference)
        if problem is not None:
            raise WrongResultError(f"wrong result: {problem}")
        self._checked.add(key)

    def __call__(self, config: Config) -> float:
        if self.check == "all" or (self.check == "first" and self._evaluations == 0) or (
                self.training and self.check != "none"):
            self.verify(config)
        self._evaluations += 1
        run = step(runner(self.impl, config, self.transform, profile=self.profile), self._inputs, self.training)
        return self.backend.timer(run, self.device)
