"""Tuning the candidates of one call: search each one's space, keep the fastest correct config."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from dlcore.backend import Backend
from dlcore.device import DeviceProfile
from dlcore.errors import NoKernelError
from dlcore.implementation import Implementation, PlanTransform
from dlcore.op import Op
from dlcore.selection import Selection, now
from dlcore.signature import Signature
from dlcore.tuning.objective import Objective, WrongResultError
from dlcore.tuning.policy import TunePolicy
from dlcore.tuning.space import SearchSpace
from dlcore.tuning.strategy import Evaluation, SearchResult, Strategy


def tune(
    op: Op,
    candidates: list[Implementation],
    bound: tuple,
    signature: Signature,
    backend: Backend,
    profile: DeviceProfile,
    device: torch.device,
    policy: TunePolicy,
    strategy: Strategy,
    refine: Callable[[SearchSpace, Signature, DeviceProfile], SearchSpace],
    declined: dict[str, str],
    progress: Callable[[Evaluation], None] | None = None,
    transform: PlanTransform | None = None,
) -> tuple[Selection, dict[str, SearchResult]]:
    """Search every candidate's space with ``strategy``; the fastest verified config wins."""
    results: dict[str, SearchResult] = {}
    best: dict[str, tuple[float, dict]] = {}
    failed: dict[str, str] = {}
    evaluations = 0
    for impl in candidates:
        objective = Objective(op, impl, bound, backend, device, check=policy.check, transform=transform)
        space = impl.space()
        if space is None:
            space = SearchSpace(params=(), fixed=impl.default_config(signature, profile))
        else:
            space = refine(space, signature, profile)
        result = strategy.search(space, objective, policy.budget(space), seed=0, progress=progress)
        results[impl.name] = result
        evaluations += len(result.evaluations)
        winner = _verified_winner(result, objective)
        if winner is None:
            reasons = {e.reason for e in result.evaluations if e.reason}
            failed[impl.name] = "; ".join(sorted(reasons)[:3]) or "no config could be measured"
        else:
            best[impl.name] = winner
    if not best:
        raise NoKernelError(signature.op, signature.describe(), {**declined, **failed})
    name = min(best, key=lambda n: best[n][0])
    time_ms, config = best[name]
    return Selection(
        impl=name, config=config, how=f"tuned ({policy.level}, {strategy.name})", time_ms=time_ms,
        measured={n: t for n, (t, _) in best.items()}, failed=failed, declined=dict(declined),
        strategy=strategy.name, evaluations=evaluations, when=now(),
    ), results


def _verified_winner(result: SearchResult, objective: Objective) -> tuple[float, dict] | None:
    """The fastest config of ``result`` that passes the correctness check."""
    for evaluation in sorted(result.evaluations, key=lambda e: e.time):
        if not math.isfinite(evaluation.time):
            return None
        try:
            objective.verify(evaluation.config)
        except WrongResultError:
            continue
        return evaluation.time, dict(evaluation.config)
    return None
