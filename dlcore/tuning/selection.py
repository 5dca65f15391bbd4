"""Choosing among the candidate implementations of one call, and the record of that choice."""

from __future__ import annotations

import datetime
import enum
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from dlcore.declarations.call import Call
from dlcore.declarations.implementation import Implementation
from dlcore.errors import NoBackwardError, NoKernelError
from dlcore.runtime.runner import runner
from dlcore.tuning.verify import NO_GRADIENT, Reference, warn_unchecked


class How(str, enum.Enum):
    """How a selection was made."""

    def __str__(self) -> str:
        return self.value

    ONLY_CANDIDATE = "only candidate"
    REQUESTED = "requested"
    MEASURED = "measured"
    TUNED = "tuned"


class Level(enum.IntEnum):
    """How much a selection is worth: one serves every request at or below its level."""

    HEURISTIC = 0  # a default config, nothing measured
    MEASURED = 1  # each candidate's default timed once
    QUICK = 2  # searched with a small budget
    FULL = 3  # searched with the whole budget


@dataclass
class Selection:
    """What was chosen for a signature, and why. Serialisable to JSON (the cache stores it)."""

    impl: str
    config: dict[str, Any]
    how: How
    level: Level = Level.HEURISTIC
    time_ms: float | None = None
    measured: dict[str, float] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    declined: dict[str, str] = field(default_factory=dict)
    strategy: str | None = None
    evaluations: int = 0
    when: str = ""

    def __post_init__(self) -> None:
        # typed whatever it was made from: an enum, its value, or (for the level) its name
        self.how = How(self.how)
        self.level = Level[self.level.upper()] if isinstance(self.level, str) else Level(self.level)

    def describe(self) -> str:
        """``how`` in words: ``measured``, ``tuned (quick, tpe)``, ..."""
        if self.how is How.TUNED:
            return f"tuned ({self.level.name.lower()}, {self.strategy})"
        return self.how.value

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["how"], data["level"] = self.how.value, self.level.name.lower()
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Selection:
        """The selection ``to_json`` wrote; ValueError, KeyError or TypeError if ``data`` is not one
        (each field of its type: a stored or imported entry is checked as it is read)."""
        selection = cls(**data)
        number = (int, float)
        fields = (("impl", selection.impl, str), ("config", selection.config, dict),
                  ("time_ms", selection.time_ms, (*number, type(None))), ("measured", selection.measured, dict),
                  ("failed", selection.failed, dict), ("declined", selection.declined, dict),
                  ("strategy", selection.strategy, (str, type(None))), ("evaluations", selection.evaluations, int),
                  ("when", selection.when, str))
        for name, value, kind in fields:
            if not isinstance(value, kind) or isinstance(value, bool):
                raise TypeError(f"selection field {name} is {type(value).__name__}")
        if selection.time_ms is not None and not selection.time_ms >= 0:
            raise ValueError(f"selection time_ms is {selection.time_ms}: a time is not negative")
        if not all(isinstance(t, number) and not isinstance(t, bool) for t in selection.measured.values()):
            raise TypeError("selection field measured holds a time that is not a number")
        if not all(isinstance(k, str) for k in selection.config):
            raise TypeError("selection field config has a key that is not a string")
        return selection


#: rounds :func:`select` times the candidates in
ROUNDS = 2
#: a near tie: the two fastest within this fraction of the faster after :data:`ROUNDS` rounds ...
TIE_MARGIN = 0.05
#: ... takes this many more rounds of those two alone (single rounds of short GEMMs differ by a few
#: percent, enough to pick the slower of two candidates)
TIE_ROUNDS = 4


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def clone_args(bound: tuple) -> tuple:
    """Copies of the tensor arguments with the same shapes, strides and values; leaves that require
    grad where the originals do."""
    return tuple(_clone(a) if isinstance(a, torch.Tensor) else a for a in bound)


def _clone(t: torch.Tensor) -> torch.Tensor:
    copy = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)
    with torch.no_grad():
        copy.copy_(t)
    return copy.requires_grad_(t.requires_grad)


def step(run: Callable[[tuple], Any], inputs: tuple, training: bool) -> Callable[[], object]:
    """What a candidate is timed by: ``run(inputs)``; for a training call (:attr:`Signature.training`)
    also the backward, ``torch.autograd.grad`` of every output for a fixed gradient of ones with
    respect to the inputs that require grad, so that the choice is the fastest training step and
    not the fastest forward. An implementation whose outputs carry no gradient raises
    :class:`NoBackwardError` (it would train nothing)."""
    if not training:
        return lambda: run(inputs)
    wanted = [a for a in inputs if isinstance(a, torch.Tensor) and a.requires_grad]

    def forward_and_backward() -> object:
        result = run(inputs)
        outputs = [t for t in (result if isinstance(result, (tuple, list)) else (result,))
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if not outputs:
            raise NoBackwardError(NO_GRADIENT)
        return torch.autograd.grad(outputs, wanted, [torch.ones_like(t) for t in outputs], allow_unused=True)

    return forward_and_backward


def wrong_result(run: Callable[[tuple], Any], args: tuple, reference: Reference) -> str | None:
    """What ``run`` computes wrong on copies of ``args`` against ``reference``: its outputs, and for a
    training call (some of ``args`` require grad) its gradients; ``None`` when all are right."""
    inputs = clone_args(args)
    return reference.compare(run(inputs), inputs).problem


def without_measuring(call: Call, impl: Implementation, how: How) -> Selection:
    """``impl`` with its heuristic config, nothing measured."""
    return Selection(impl=impl.name, config=impl.default_config(call.signature, call.profile), how=how,
                     declined=dict(call.declined), when=now())


def _time_rounds(call: Call, runs: dict[str, Callable[[], object]], names: list[str], rounds: int,
                 times: dict[str, list[float]], failed: dict[str, str]) -> None:
    """``rounds`` more rounds of ``names``, in alternating order, appended to ``times``; a candidate
    that raises or times a non-finite value goes to ``failed`` with its reason."""
    for round_ in range(rounds):
        order = names if round_ % 2 == 0 else list(reversed(names))
        for name in order:
            if name in failed:
                continue
            try:
                elapsed = call.backend.timer(runs[name], call.device)
            except Exception as exc:  # noqa: BLE001 - any failure disqualifies only this candidate
                failed[name] = f"{type(exc).__name__}: {exc}".splitlines()[0]
                continue
            if math.isfinite(elapsed):
                times[name].append(elapsed)
            else:
                failed[name] = f"timer returned {elapsed}"


def _best_rounds(times: dict[str, list[float]], failed: dict[str, str]) -> dict[str, float]:
    return {name: min(t) for name, t in times.items() if t and name not in failed}


def select(call: Call) -> Selection:
    """Time each candidate of ``call`` with its default config on cloned inputs (forward and backward
    for a training call: :func:`step`), in :data:`ROUNDS` rounds that alternate the order; a
    candidate's time is its best round (a round slowed by the device's clocks or a neighbour counts
    less), and the fastest wins. When the two fastest lie within :data:`TIE_MARGIN` of each other,
    they alone take :data:`TIE_ROUNDS` more rounds before the choice: the time goes where the
    choice is uncertain.

    For a training call each candidate is first checked once, outputs and gradients, against the
    float64 reference (:func:`wrong_result`): the step timed is the one a model trains by,
    so a wrong backward is as disqualifying as a wrong forward.

    A candidate that raises or computes a wrong result is skipped, its reason kept. If all fail,
    :class:`NoKernelError`.
    """
    failed: dict[str, str] = {}
    configs = {}
    runs = {}
    training = checking = call.signature.training
    reference = None
    for impl in call.candidates:
        config = configs[impl.name] = impl.default_config(call.signature, call.profile)
        try:
            run = runner(impl, config, call.transform, profile=call.profile)
            problem = None
            if checking:
                try:
                    reference = reference or Reference(call.op, call.args, training=True)
                    problem = wrong_result(run, call.args, reference)
                except torch.OutOfMemoryError:
                    checking, reference = False, None
                    warn_unchecked(call.op.name, call.signature.describe())
            if problem is not None:
                failed[impl.name] = f"wrong result: {problem}"
                continue
            runs[impl.name] = step(run, clone_args(call.args), training)
        except Exception as exc:  # noqa: BLE001 - any failure disqualifies only this candidate
            failed[impl.name] = f"{type(exc).__name__}: {exc}".splitlines()[0]
    times: dict[str, list[float]] = {name: [] for name in runs}
    _time_rounds(call, runs, list(runs), ROUNDS, times, failed)
    measured = _best_rounds(times, failed)
    close = sorted(measured, key=measured.__getitem__)[:2]
    if len(close) == 2 and measured[close[1]] <= measured[close[0]] * (1 + TIE_MARGIN):
        _time_rounds(call, runs, close, TIE_ROUNDS, times, failed)
        measured = _best_rounds(times, failed)
    if not measured:
        raise NoKernelError(call.signature.op, call.signature.describe(), {**call.declined, **failed})
    best = min(measured, key=measured.__getitem__)
    return Selection(impl=best, config=configs[best], how=How.MEASURED, level=Level.MEASURED, time_ms=measured[best],
                     measured=measured, failed=failed, declined=dict(call.declined), when=now())
