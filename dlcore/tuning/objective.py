"""What a search measures: one implementation's time for a config, on cloned inputs.

The backend's timer gives the time (``do_bench`` on CUDA; synchronize + perf_counter elsewhere),
warm-up excluded; for a training call, of the forward and the backward together. The result is
checked against the op's float64 reference on the first evaluation of each implementation, and
the winner of a search is checked again before it is accepted, so a wrong-but-fast config can
never win. ``check="all"`` checks every config.
"""

from __future__ import annotations

import torch

from dlcore.declarations.backend import Backend
from dlcore.declarations.implementation import Config, Implementation, PlanTransform
from dlcore.declarations.op import Op
from dlcore.errors import InvalidOptionError, WrongResultError
from dlcore.runtime.runner import runner
from dlcore.tuning.policy import CHECKS
from dlcore.tuning.selection import clone_args, step
from dlcore.tuning.verify import mismatch, reduce_dim_of, reference_result


class Objective:
    """``objective(config) -> milliseconds`` for one implementation on one set of inputs."""

    def __init__(self, op: Op, impl: Implementation, bound: tuple, backend: Backend, device: torch.device,
                 check: str = "first", transform: PlanTransform | None = None, training: bool = False):
        if check not in CHECKS:
            raise InvalidOptionError(f"check={check!r}; use one of {', '.join(CHECKS)}")
        self.op = op
        self.impl = impl
        self.backend = backend
        self.device = device
        self.check = check
        self.transform = transform
        self.training = training
        self._inputs = clone_args(bound)
        self._pristine = clone_args(bound)
        self._expected: tuple | None = None
        self._evaluations = 0

    def verify(self, config: Config) -> None:
        """Raise :class:`WrongResultError` unless ``config`` reproduces the reference."""
        if self._expected is None:
            self._expected = reference_result(self.op, self._pristine)
        actual = runner(self.impl, config, self.transform)(clone_args(self._pristine))
        problem = mismatch(actual, self._expected, reduce_dim_of(self._pristine))
        if problem is not None:
            raise WrongResultError(f"wrong result: {problem}")

    def __call__(self, config: Config) -> float:
        if self.check == "all" or (self.check == "first" and self._evaluations == 0):
            self.verify(config)
        self._evaluations += 1
        run = step(runner(self.impl, config, self.transform), self._inputs, self.training)
        return self.backend.timer(run, self.device)
