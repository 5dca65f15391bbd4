"""``get_op``: signature -> candidates -> cache -> selection -> bound op."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dlcore import bindings
from dlcore.backend import Backend
from dlcore.bindings import exact_key
from dlcore.bound import BoundOp
from dlcore.cache import DiskCache, MemoryCache, cache_key, key_parts, make_record
from dlcore.cachedir import generation
from dlcore.device import DeviceProfile
from dlcore.errors import NoKernelError, UnknownImplementationError
from dlcore.implementation import Implementation, PlanTransform
from dlcore.op import Op
from dlcore.registry import Registry, registry
from dlcore.registry import reset as reset_registry
from dlcore.selection import Selection, by_measurement, without_measuring
from dlcore.signature import Signature, make_signature
from dlcore.tuning.policy import TunePolicy, resolve, satisfies
from dlcore.tuning.strategy import Evaluation, SearchResult

_memory = MemoryCache()
_disk: DiskCache | None = None
_bound: dict[tuple, BoundOp] = {}
_exact: dict[tuple, BoundOp] = {}
#: per cache key: the generation of the disk's selections when the disk was last read for it (what
#: a binding of its choice is valid under, see dlcore.bindings)
_consulted: dict[str, str] = {}
#: exact inputs remembered for the in-process hit path; the oldest are forgotten first
EXACT_LIMIT = 4096


def disk_cache() -> DiskCache:
    """The on-disk cache of this process (``DLCORE_CACHE_DIR``), opened on first use."""
    global _disk
    if _disk is None:
        _disk = DiskCache()
    return _disk


def clear_caches() -> None:
    """Forget every selection made in this process (the disk cache stays)."""
    global _disk
    _memory.clear()
    _bound.clear()
    _consulted.clear()
    _exact.clear()
    bindings.forget()
    if _disk is not None:
        _disk.close()
        _disk = None


def reset() -> None:
    """Forget the plugins and every selection: the next ``get_op`` rediscovers everything."""
    clear_caches()
    reset_registry()


def get_op(
    name: str,
    args: tuple | list,
    kwargs: dict[str, Any] | None = None,
    *,
    impl: str | None = None,
    tune: str | None = None,
    strategy: str | None = None,
    budget: int | None = None,
    progress: Callable[[Evaluation], None] | None = None,
) -> BoundOp:
    """The best implementation of op ``name`` for ``args`` on their device, bound and ready to call.

    :param name: a registered op (``dlcore ops`` lists them).
    :param args: the arguments the op will be called with (tensors and scalars, in its order).
    :param kwargs: arguments by name, if any.
    :param impl: use this implementation (by name) instead of selecting one.
    :param tune: ``off`` | ``quick`` | ``full``; default ``DLCORE_TUNE`` or ``off`` (see
        :mod:`dlcore.tuning.policy`).
    :param strategy: the search strategy when tuning (default ``DLCORE_TUNE_STRATEGY`` or ``tpe``).
    :param budget: the number of evaluations per implementation when tuning.
    :param progress: called after each evaluation while tuning.
    :raises UnknownOpError: no op of that name.
    :raises InvalidInputError: an argument is wrong (dtype, rank, shape, device, strides).
    :raises BackendUnavailableError: no usable backend for the inputs' device.
    :raises NoKernelError: every implementation declined or failed.
    """
    exact = exact_key(name, args, kwargs, impl, tune, strategy, budget)
    hit = _exact.get(exact) if exact is not None else None
    if hit is not None:
        return hit
    call = prepare(name, args, kwargs, impl)
    policy = resolve(tune, strategy, budget)
    memo_key = (call.signature, call.device, impl, policy)
    bound_op = _bound.get(memo_key)
    if bound_op is None:
        if _memory.get(call.key) is None:  # the disk is read now (and a choice made if it misses)
            _consulted[call.key] = generation(disk_cache().directory)  # read first: see dlcore.bindings
        selection = _cached(call, policy)
        if selection is None:
            selection = remember(call, _select(call, policy, impl, progress))
        bound_op = _bound[memo_key] = call.bind(selection)
    if exact is not None:
        if len(_exact) >= EXACT_LIMIT:
            del _exact[next(iter(_exact))]
        _exact[exact] = bound_op
        bindings.note(exact, call, bound_op.selection, _consulted.get(call.key, ""))
    return bound_op


@dataclass
class Call:
    """Everything known about one call before anything is chosen."""

    op: Op
    bound: tuple
    device: torch.device
    backend: Backend
    profile: DeviceProfile
    signature: Signature
    candidates: list[Implementation]
    declined: dict[str, str]
    parts: dict[str, str]
    key: str

    transform: PlanTransform | None = None

    def bind(self, selection: Selection) -> BoundOp:
        chosen = next(c for c in self.candidates if c.name == selection.impl)
        return BoundOp(self.op, chosen, selection, self.signature, self.profile, self.key, self.transform)


def prepare(name: str, args: tuple | list, kwargs: dict[str, Any] | None = None, impl: str | None = None) -> Call:
    """Validate the arguments and find the candidates and the cache key of a call."""
    reg = registry()
    op = reg.op(name)
    bound = op.bind(args, kwargs)
    device = op.validate(bound)
    backend = reg.backend_for(device)
    profile = reg.profile(backend, device)
    signature = make_signature(op, bound, device)
    candidates, declined = find_candidates(reg, op, signature, backend, profile, impl)
    parts = key_parts(signature, profile, backend.version, candidates)
    return Call(op, bound, device, backend, profile, signature, candidates, declined, parts,
                cache_key(parts, op.name), plan_transform(profile))


def plan_transform(profile: DeviceProfile) -> PlanTransform | None:
    """The ``ast`` and ``launch`` compiler passes for ``profile``'s backend, as a plan rewrite
    (None when no pass rewrites plans there)."""
    from dlcore.compiler.passes import default_pipeline, launch_transform

    return launch_transform(profile, default_pipeline(profile.backend))


def remember(call: Call, selection: Selection) -> Selection:
    """Keep ``selection`` for ``call`` in memory, and on disk unless it was made without measuring."""
    record = make_record(call.op.name, call.parts, selection)
    _memory.put(call.key, record)
    if selection.how not in ("only candidate", "requested"):
        disk_cache().put(call.key, record)
    for memo in (_bound, _exact):
        for memo_key in [k for k, v in memo.items() if v.cache_key == call.key]:
            del memo[memo_key]
    return selection


def tune_op(name: str, args: tuple | list, *, strategy: str, budget: int | None = None, tune: str = "full",
            progress: Callable[[Evaluation], None] | None = None) -> tuple[BoundOp, dict[str, SearchResult]]:
    """Tune now, whatever is cached, and remember the result: what ``dlcore tune`` runs."""
    call = prepare(name, args)
    policy = resolve(tune, strategy, budget)
    selection, results = _search(call, policy, progress)
    known = _remembered(call.key)
    if known is not None and known.time_ms is not None and known.time_ms < selection.time_ms \
            and satisfies(known.how, policy):
        selection = known
    return call.bind(remember(call, selection)), results


def _search(call: Call, policy: TunePolicy,
            progress: Callable[[Evaluation], None] | None) -> tuple[Selection, dict[str, SearchResult]]:
    """Tune every candidate of ``call`` with ``policy``'s strategy and budget."""
    from dlcore.tuning.tune import tune

    reg = registry()
    return tune(call.op, call.candidates, call.bound, call.signature, call.backend, call.profile, call.device,
                policy, reg.strategy(policy.strategy), reg.refine_space, call.declined, progress, call.transform)


def _remembered(key: str) -> Selection | None:
    return _memory.get(key) or disk_cache().get(key)


def _cached(call: Call, policy: TunePolicy) -> Selection | None:
    """A remembered selection good enough for ``policy`` whose implementation is still a candidate."""
    selection = _remembered(call.key)
    if selection is None or not satisfies(selection.how, policy):
        return None
    if not any(c.name == selection.impl for c in call.candidates):
        return None
    return selection


def _select(call: Call, policy: TunePolicy, requested: str | None,
            progress: Callable[[Evaluation], None] | None) -> Selection:
    if policy.level != "off":
        return _search(call, policy, progress)[0]
    if requested is not None:
        return without_measuring(call.candidates[0], call.signature, call.profile, "requested", call.declined)
    if len(call.candidates) == 1:
        return without_measuring(call.candidates[0], call.signature, call.profile, "only candidate", call.declined)
    return by_measurement(call.candidates, call.bound, call.signature, call.backend, call.profile, call.device,
                          call.declined, call.transform)


def find_candidates(
    reg: Registry,
    op: Op,
    signature: Signature,
    backend: Backend,
    profile: DeviceProfile,
    requested: str | None = None,
) -> tuple[list[Implementation], dict[str, str]]:
    """The implementations that accept ``signature`` on ``backend``, and why each other one declined.

    The torch reference is a fallback: it is a candidate only when no dedicated implementation is
    (or when asked for by name).
    """
    implementations = reg.implementations_of(op.name)
    if requested is not None:
        implementations = [i for i in implementations if i.name == requested]
        if not implementations:
            names = ", ".join(i.name for i in reg.implementations_of(op.name))
            raise UnknownImplementationError(f"{op.name} has no implementation {requested!r}; it has: {names}")
    candidates: list[Implementation] = []
    declined: dict[str, str] = {}
    for candidate in implementations:
        reason = backend.accepts(candidate, signature) or candidate.supports(signature, profile)
        if reason is None:
            candidates.append(candidate)
        else:
            declined[candidate.name] = reason
    dedicated = [c for c in candidates if not getattr(c, "fallback_only", False)]
    if requested is None:
        if dedicated:
            for c in candidates:
                if c not in dedicated:
                    declined[c.name] = "fallback only; a dedicated implementation accepts these inputs"
            candidates = dedicated
        elif not op.fallback:
            for c in candidates:
                declined[c.name] = f"{op.name} declares no fallback to its reference"
            candidates = []
    if not candidates:
        raise NoKernelError(op.name, f"{signature.describe()} on {profile.describe()}", declined)
    return candidates, declined
