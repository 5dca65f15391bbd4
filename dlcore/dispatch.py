"""``get_op``: signature -> candidates -> cache -> selection -> bound op."""

from __future__ import annotations

from typing import Any

from dlcore.backend import Backend
from dlcore.bound import BoundOp
from dlcore.cache import MemoryCache, cache_key
from dlcore.device import DeviceProfile
from dlcore.errors import NoKernelError, UnknownImplementationError
from dlcore.implementation import Implementation
from dlcore.op import Op
from dlcore.registry import Registry, registry
from dlcore.registry import reset as reset_registry
from dlcore.selection import by_measurement, without_measuring
from dlcore.signature import Signature, make_signature

_selections = MemoryCache()
_bound: dict[tuple, BoundOp] = {}


def clear_caches() -> None:
    """Forget every selection made in this process."""
    _selections.clear()
    _bound.clear()


def reset() -> None:
    """Forget the plugins and every selection: the next ``get_op`` rediscovers everything."""
    clear_caches()
    reset_registry()


def get_op(name: str, args: tuple | list, kwargs: dict[str, Any] | None = None, *, impl: str | None = None) -> BoundOp:
    """The best implementation of op ``name`` for ``args`` on their device, bound and ready to call.

    :param name: a registered op (``dlcore ops`` lists them).
    :param args: the arguments the op will be called with (tensors and scalars, in its order).
    :param kwargs: arguments by name, if any.
    :param impl: use this implementation (by name) instead of selecting one.
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

    memo_key = (signature, str(device), impl)
    hit = _bound.get(memo_key)
    if hit is not None:
        return hit

    candidates, declined = find_candidates(reg, op, signature, backend, profile, impl)
    key = cache_key(signature, profile, candidates)
    selection = _selections.get(key)
    if selection is None:
        if impl is not None:
            selection = without_measuring(candidates[0], signature, profile, "requested", declined)
        elif len(candidates) == 1:
            selection = without_measuring(candidates[0], signature, profile, "only candidate", declined)
        else:
            selection = by_measurement(candidates, bound, signature, backend, profile, device, declined)
        _selections.put(key, selection)
    chosen = next(c for c in candidates if c.name == selection.impl)
    bound_op = _bound[memo_key] = BoundOp(op, chosen, selection, signature, profile, key)
    return bound_op


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
