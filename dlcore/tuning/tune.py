"""Tuning the candidates of one call: search each one's space, keep the fastest correct config."""

from __future__ import annotations

import math
from collections.abc import Callable

from dlcore.declarations.call import Call
from dlcore.declarations.device import DeviceProfile
from dlcore.declarations.signature import Signature
from dlcore.declarations.space import SearchSpace
from dlcore.errors import NoKernelError, WrongResultError
from dlcore.tuning.objective import Objective
from dlcore.tuning.policy import TunePolicy
from dlcore.tuning.selection import How, Selection, now
from dlcore.tuning.strategy import Evaluation, SearchResult, Strategy


def tune(
    call: Call,
    policy: TunePolicy,
    strategy: Strategy,
    refine: Callable[[SearchSpace, Signature, DeviceProfile], SearchSpace],
    progress: Callable[[Evaluation], None] | None = None,
) -> tuple[Selection, dict[str, SearchResult]]:
    """Search every candidate's space with ``strategy``; the fastest verified config wins."""
    results: dict[str, SearchResult] = {}
    best: dict[str, tuple[float, dict]] = {}
    failed: dict[str, str] = {}
    evaluations = 0
    signature, profile = call.signature, call.profile
    for impl in call.candidates:
        objective = Objective(call.op, impl, call.args, call.backend, call.device, check=policy.check,
                              transform=call.transform, training=signature.training, profile=profile)
        space = impl.space(profile)
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
        raise NoKernelError(signature.op, signature.describe(), {**call.declined, **failed})
    name = min(best, key=lambda n: best[n][0])
    time_ms, config = best[name]
    return Selection(
        impl=name, config=config, how=How.TUNED, level=policy.level.wanted, time_ms=time_ms,
        measured={n: t for n, (t, _) in best.items()}, failed=failed, declined=dict(call.declined),
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
