"""``get_op``: signature -> candidates -> cache -> selection -> bound op."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dlcore.backend import Backend
from dlcore.bound import BoundOp
from dlcore.cache import DiskCache, MemoryCache, cache_key, key_parts, make_record
from dlcore.device import DeviceProfile
from dlcore.errors import NoKernelError, UnknownImplementationError
from dlcore.implementation import Implementation
from dlcore.op import Op
from dlcore.registry import Registry, registry
from dlcore.registry import reset as reset_registry
from dlcore.selection import Selection, by_measurement, without_measuring
from dlcore.signature import Signature, make_signature
from dlcore.tuning.policy import TunePolicy, resolve, satisfies
from dlcore.tuning.strategy import Evaluation

_memory = MemoryCache()
_disk: DiskCache | None = None
_bound: dict[tuple, BoundOp] = {}


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
    reg = registry()
    op = reg.op(name)
    bound = op.bind(args, kwargs)
    device = op.validate(bound)
    backend = reg.backend_for(device)
    profile = reg.profile(backend, device)
    signature = make_signature(op, bound, device)
    policy = resolve(tune, strategy, budget)

    memo_key = (signature, device, impl, policy)
    hit = _bound.get(memo_key)
    if hit is not None:
        return hit

    candidates, declined = find_candidates(reg, op, signature, backend, profile, impl)
    parts = key_parts(signature, profile, backend.version, candidates)
    key = cache_key(parts, op.name)
    selection = _cached(key, candidates, policy)
    if selection is None:
        selection = _select(reg, op, candidates, bound, signature, backend, profile, device, policy, impl,
                            declined, progress)
        record = make_record(op.name, parts, selection)
        _memory.put(key, record)
        if selection.how not in ("only candidate", "requested"):
            disk_cache().put(key, record)
    chosen = next(c for c in candidates if c.name == selection.impl)
    bound_op = _bound[memo_key] = BoundOp(op, chosen, selection, signature, profile, key)
    return bound_op


def _cached(key: str, candidates: list[Implementation], policy: TunePolicy) -> Selection | None:
    """A remembered selection good enough for ``policy`` whose implementation is still a candidate."""
    selection = _memory.get(key) or disk_cache().get(key)
    if selection is None or not satisfies(selection.how, policy):
        return None
    if not any(c.name == selection.impl for c in candidates):
        return None
    return selection


def _select(
    reg: Registry, op: Op, candidates: list[Implementation], bound: tuple, signature: Signature,
    backend: Backend, profile: DeviceProfile, device: Any, policy: TunePolicy, requested: str | None,
    declined: dict[str, str], progress: Callable[[Evaluation], None] | None,
) -> Selection:
    if policy.level != "off":
        from dlcore.tuning.tune import tune

        selection, _ = tune(op, candidates, bound, signature, backend, profile, device, policy,
                            reg.strategy(policy.strategy), reg.refine_space, declined, progress)
        return selection
    if requested is not None:
        return without_measuring(candidates[0], signature, profile, "requested", declined)
    if len(candidates) == 1:
        return without_measuring(candidates[0], signature, profile, "only candidate", declined)
    return by_measurement(candidates, bound, signature, backend, profile, device, declined)


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
