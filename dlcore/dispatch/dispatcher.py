"""The dispatcher: ``(op name, inputs)`` -> key -> memo -> disk store -> selection -> bound op.

One :class:`Dispatcher` owns everything remembered about choices: the bound ops of exact inputs
seen before (its memo), the selections made in this process, and the disk store they are kept in
between processes. ``dlcore.get_op`` is :func:`default`'s ``get_op``; tests and services may make
their own, on another registry or cache directory.
"""

from __future__ import annotations

import functools
import inspect
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dlcore.compiler import folding, passes, rewrite, toolchain
from dlcore.compiler.passes import default_pipeline
from dlcore.compiler.rewrite import launch_transform
from dlcore.declarations.backend import Backend
from dlcore.declarations.call import Call
from dlcore.declarations.device import DeviceProfile
from dlcore.declarations.implementation import Implementation, PlanTransform
from dlcore.declarations.op import Op
from dlcore.declarations.signature import Signature, make_signature
from dlcore.declarations.space import same_value
from dlcore.dispatch.bound import BoundOp
from dlcore.dispatch.key import DISABLE_IMPLS, Key, environment, exact_key
from dlcore.dispatch.store import CacheWarning, DiskCache, make_record
from dlcore.errors import InvalidCallError, InvalidOptionError, NoKernelError, UnknownImplementationError
from dlcore.plugins.registry import Registry, registry
from dlcore.plugins.registry import reset as reset_registry
from dlcore.runtime import launch, replay, shelf, template, torch_ops
from dlcore.tuning.policy import Tune, TunePolicy, resolve, satisfies
from dlcore.tuning.selection import How, Selection, select, without_measuring
from dlcore.tuning.strategy import Evaluation, SearchResult
from dlcore.tuning.tune import tune

#: exact inputs remembered per dispatcher for the hit path; the oldest are forgotten first
EXACT_LIMIT = 4096


class Dispatcher:
    """Chooses, remembers and binds implementations.

    :param registry: where ops, implementations, backends and strategies come from (default: the
        process's plugins, :func:`dlcore.plugins.registry.registry`).
    :param directory: the disk store's directory (default: ``DLCORE_CACHE_DIR``, read when the
        store is first opened).
    """

    def __init__(self, registry: Callable[[], Registry] = registry, directory: Path | str | None = None):
        self._registry = registry
        self._directory = directory
        self._store: DiskCache | None = None
        #: the memo, by exact inputs (:func:`exact_key`), and by signature, options and environment:
        #: inputs of one shape bucket share one bound op
        self._exact: dict[tuple, BoundOp] = {}
        self._bound: dict[tuple, BoundOp] = {}
        #: key digest -> the selection made or read in this process
        self._selections: dict[str, Selection] = {}
        #: key digest -> the selection tune_op made in this process: times measured here, comparable
        self._tuned: dict[str, Selection] = {}

    @property
    def store(self) -> DiskCache:
        """The disk store, opened on first use."""
        if self._store is None:
            self._store = DiskCache(self._directory)
        return self._store

    def clear(self) -> None:
        """Forget every choice made in this process (the disk store stays) and close the store."""
        self._exact.clear()
        self._bound.clear()
        self._selections.clear()
        self._tuned.clear()
        if self._store is not None:
            self._store.close()
            self._store = None

    def get_op(
        self,
        name: str,
        args: tuple | list,
        kwargs: dict[str, Any] | None = None,
        *,
        impl: str | None = None,
        tune: str | None = None,
        strategy: str | None = None,
        budget: int | None = None,
        progress: Callable[[Evaluation], None] | None = None,
        **unknown: Any,
    ) -> BoundOp:
        """The best implementation of op ``name`` for ``args`` on their device, bound and ready to call.

        :param name: a registered op (``dlcore ops`` lists them).
        :param args: the arguments the op will be called with (tensors and scalars, in its order).
        :param kwargs: arguments by name, if any.
        :param impl: use this implementation (by name) instead of selecting one, even one that
            ``DLCORE_DISABLE_IMPLS`` excludes.
        :param tune: ``off`` | ``quick`` | ``full``; default ``DLCORE_TUNE`` or ``off`` (see
            :mod:`dlcore.tuning.policy`).
        :param strategy: the search strategy when tuning (default ``DLCORE_TUNE_STRATEGY`` or ``tpe``).
        :param budget: the number of evaluations per implementation when tuning.
        :param progress: called after each evaluation while tuning.
        :raises UnknownOpError: no op of that name.
        :raises InvalidCallError: ``name``, ``args`` or ``kwargs`` is of the wrong kind, or a keyword
            is none of the options above (an op's arguments go in ``args`` or ``kwargs``).
        :raises InvalidInputError: an argument is wrong (dtype, rank, shape, device, strides).
        :raises InvalidOptionError: ``tune``, ``strategy``, ``budget``, a tuning variable or
            ``DLCORE_DISABLE_IMPLS`` has a bad value.
        :raises BackendUnavailableError: no usable backend for the inputs' device.
        :raises NoKernelError: every implementation declined or failed.
        """
        if unknown:
            raise not_an_option(name, args, unknown)
        check_request(name, args, kwargs)
        options = (impl, tune, strategy, budget)
        exact = exact_key(name, args, kwargs, options)
        try:
            hit = self._exact.get(exact) if exact is not None else None
        except TypeError:  # an option that cannot be a key (a list, say): resolve() below names it
            exact = hit = None
        if hit is not None:
            return hit
        call = self.prepare(name, args, kwargs, impl)
        policy = resolve(tune, strategy, budget)
        memo_key = (call.signature, call.device, options, environment())
        bound_op = self._bound.get(memo_key)
        if bound_op is None:
            key = self.key_of(call)
            selection = self._cached(call, key, policy)
            if selection is None:
                selection = self.remember(key, self._select(call, policy, impl, progress))
            bound_op = self._bound[memo_key] = self._bind(call, key, selection)
        if exact is not None:
            if len(self._exact) >= EXACT_LIMIT:
                del self._exact[next(iter(self._exact))]
            self._exact[exact] = bound_op
        return bound_op

    def tune_op(self, name: str, args: tuple | list, *, strategy: str, budget: int | None = None, tune: str = "full",
                progress: Callable[[Evaluation], None] | None = None) -> tuple[BoundOp, dict[str, SearchResult]]:
        """Tune now, whatever is cached, and remember the result: what ``dlcore tune`` runs.

        The result replaces what the cache holds for the key, unless that is better: a faster
        selection tuned in this process (another strategy's search on these inputs, timed by this
        process), or one of a higher level (a full search, against this quick one). A time read from
        the disk or an import is never compared with this one: it was measured on other inputs of
        the key, perhaps on another machine. Inputs without elements are refused: there is
        nothing to time."""
        check_request(name, args, None)
        call = self.prepare(name, args)
        empty = [spec.name for spec, value in zip(call.op.args, call.args)
                 if callable(getattr(value, "numel", None)) and value.numel() == 0]
        if empty:
            raise InvalidOptionError(f"{name}: nothing to tune: {', '.join(empty)} has no elements (give sizes "
                                     "above 0; a tuned config of empty inputs would serve their whole shape bucket)")
        key = self.key_of(call)
        policy = resolve(tune, strategy, budget)
        selection, results = self._search(call, policy, progress)
        here, known = self._tuned.get(key.digest), self._remembered(key)
        if here is not None and here.time_ms is not None and here.time_ms < selection.time_ms \
                and satisfies(here, policy):
            selection = here
        elif known is not None and known.level > selection.level:
            selection = known
        self._tuned[key.digest] = selection
        return self._bind(call, key, self.remember(key, selection)), results

    def prepare(self, name: str, args: tuple | list, kwargs: dict[str, Any] | None = None,
                impl: str | None = None) -> Call:
        """Validate the arguments and find the candidates of a call."""
        reg = self._registry()
        op = reg.op(name)
        bound = op.bind(args, kwargs)
        device = op.validate(bound)
        backend = reg.backend_for(device)
        profile = reg.profile(backend, device)
        signature = make_signature(op, bound, device)
        candidates, declined = find_candidates(reg, op, signature, backend, profile, impl)
        return Call(op, bound, device, backend, profile, signature, candidates, declined, plan_transform(profile))

    def key_of(self, call: Call) -> Key:
        return Key.of(call, default_pipeline(call.profile.backend).names)

    def remember(self, key: Key, selection: Selection) -> Selection:
        """Keep ``selection`` for ``key`` in memory, and on disk unless it was made without measuring;
        the bound ops of ``key`` bound before are forgotten."""
        self._selections[key.digest] = selection
        if selection.how not in (How.ONLY_CANDIDATE, How.REQUESTED):
            self.store.put(key.digest, make_record(key.op, key.as_dict(), selection))
        for memo in (self._exact, self._bound):
            for memo_key in [k for k, v in memo.items() if v.cache_key == key.digest]:
                del memo[memo_key]
        return selection

    def _bind(self, call: Call, key: Key, selection: Selection) -> BoundOp:
        chosen = call.candidate(selection.impl)
        kinds = {c.name: c.describe() for c in call.candidates}
        return BoundOp(call.op, chosen, selection, call.signature, call.profile, key.digest, call.transform, kinds)

    def _remembered(self, key: Key) -> Selection | None:
        found = self._selections.get(key.digest)
        if found is None:
            found = self.store.get(key.digest)
            if found is not None:
                self._selections[key.digest] = found
        return found

    def _cached(self, call: Call, key: Key, policy: TunePolicy) -> Selection | None:
        """A remembered selection good enough for ``policy`` whose implementation is still a
        candidate and whose config that implementation could have chosen (a shared cache may have
        been edited: a config outside the space is ignored, with a warning, and chosen again)."""
        selection = self._remembered(key)
        if selection is None or not satisfies(selection, policy):
            return None
        impl = call.candidate(selection.impl)
        if impl is None:
            return None
        problem = config_problem(impl, selection.config, call)
        if problem:
            warnings.warn(f"dlcore: ignoring the cached selection of {call.op.name} ({impl.name}, "
                          f"{selection.config}): {problem}", CacheWarning, stacklevel=4)
            self._selections.pop(key.digest, None)
            return None
        return selection

    def _search(self, call: Call, policy: TunePolicy,
                progress: Callable[[Evaluation], None] | None) -> tuple[Selection, dict[str, SearchResult]]:
        reg = self._registry()
        return tune(call, policy, reg.strategy(policy.strategy), reg.refine_space, progress)

    def _select(self, call: Call, policy: TunePolicy, requested: str | None,
                progress: Callable[[Evaluation], None] | None) -> Selection:
        if policy.level is not Tune.OFF:
            return self._search(call, policy, progress)[0]
        if requested is not None:
            return without_measuring(call, call.candidates[0], How.REQUESTED)
        if len(call.candidates) == 1:
            return without_measuring(call, call.candidates[0], How.ONLY_CANDIDATE)
        return select(call)


def config_problem(impl: Implementation, config: Any, call: Call) -> str:
    """Why ``impl`` could not have chosen ``config`` for ``call`` ('' if it could): it is its
    heuristic default, or a member of its declared search space."""
    if not isinstance(config, dict):
        return f"the config is a {type(config).__name__}, not a mapping"
    default = impl.default_config(call.signature, call.profile)
    if config.keys() == default.keys() and all(same_value(config[k], default[k]) for k in default):
        return ""
    space = impl.space(call.profile)
    if space is None:
        return "the implementation has no search space, and the config is not its default"
    return space.is_valid(config) or ""


def plan_transform(profile: DeviceProfile) -> PlanTransform | None:
    """The ``ast`` and ``launch`` compiler passes for ``profile``'s backend, as a plan rewrite
    (None when no pass rewrites plans there)."""
    return launch_transform(profile, default_pipeline(profile.backend))


@functools.lru_cache(maxsize=8)
def disabled_implementations(value: str) -> frozenset[tuple[str, str]]:
    """The ``(op, implementation)`` pairs named by a :data:`DISABLE_IMPLS` value, ``op:impl,op:impl``.

    :raises InvalidOptionError: an entry is not ``op:impl`` (both names given, one colon).
    """
    pairs = set()
    for entry in (e.strip() for e in value.split(",")):
        if not entry:
            continue
        op, colon, impl = (part.strip() for part in entry.partition(":"))
        if not (op and colon and impl) or ":" in impl:
            raise InvalidOptionError(
                f"{DISABLE_IMPLS}={value!r}: {entry!r} is not OP:IMPLEMENTATION; give a comma-separated "
                f"list such as matmul:torch,ffn:triton (`dlcore ops` lists the names)")
        pairs.add((op, impl))
    return frozenset(pairs)


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
    (or when asked for by name). Implementations named in ``DLCORE_DISABLE_IMPLS`` decline, unless
    asked for by name: the argument wins over the environment, as ``tune=`` does over ``DLCORE_TUNE``.

    :raises InvalidOptionError: ``DLCORE_DISABLE_IMPLS`` is malformed, or names an implementation
        of this op that it does not have.
    """
    implementations = reg.implementations_of(op.name)
    disabled = {impl for name, impl in disabled_implementations(os.environ.get(DISABLE_IMPLS, "")) if name == op.name}
    unknown = sorted(disabled - {i.name for i in implementations})
    if unknown:
        raise InvalidOptionError(
            f"{DISABLE_IMPLS} names {', '.join(f'{op.name}:{n}' for n in unknown)}, but {op.name} has no such "
            f"implementation; it has: {', '.join(i.name for i in implementations)}")
    if requested is not None:
        implementations = [i for i in implementations if i.name == requested]
        if not implementations:
            names = ", ".join(i.name for i in reg.implementations_of(op.name))
            raise UnknownImplementationError(f"{op.name} has no implementation {requested!r}; it has: {names}")
        disabled = set()
    candidates: list[Implementation] = []
    declined: dict[str, str] = {}
    for candidate in implementations:
        reason = (f"disabled by {DISABLE_IMPLS}" if candidate.name in disabled else None) \
            or backend.accepts(candidate, signature) or candidate.supports(signature, profile)
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
        elif candidates and declined:
            _warn_fallback(op, profile, declined)
    if not candidates:
        raise NoKernelError(op.name, f"{signature.describe()} on {profile.describe()}", declined)
    return candidates, declined


class FallbackWarning(UserWarning):
    """Every dedicated implementation declined the inputs: the op's torch reference runs instead."""


#: (op, backend) pairs already warned about in this process
_warned_fallback: set[tuple[str, str]] = set()


def _warn_fallback(op: Op, profile: DeviceProfile, declined: dict[str, str]) -> None:
    """Say once per op and backend that the reference serves, and why: ``.explain()`` alone hides it."""
    if (op.name, profile.backend) in _warned_fallback:
        return
    _warned_fallback.add((op.name, profile.backend))
    why = "; ".join(f"{name}: {reason}" for name, reason in declined.items())
    warnings.warn(f"dlcore: {op.name} on {profile.describe()} runs its torch reference, since every implementation "
                  f"declined ({why})", FallbackWarning, stacklevel=6)  # the caller of dlcore.get_op


_default: Dispatcher | None = None


def default() -> Dispatcher:
    """The process's dispatcher, behind ``dlcore.get_op``."""
    global _default
    if _default is None:
        _default = Dispatcher()
    return _default


def check_request(name: Any, args: Any, kwargs: Any) -> None:
    """:class:`InvalidCallError` unless ``name`` is a str, ``args`` a tuple or list and ``kwargs`` a
    dict or None (a few hundred nanoseconds: it runs before every memo lookup)."""
    if type(name) is not str:
        raise InvalidCallError(f"get_op: name is {name!r} ({type(name).__name__}); expected an op's name as a str, "
                               "e.g. 'rms_norm' (`dlcore ops` lists them)")
    if not isinstance(args, (tuple, list)):
        raise InvalidCallError(f"get_op({name!r}, args): args is a {type(args).__name__}; expected a tuple or list "
                               "of the op's arguments in its order, e.g. (x, weight)")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise InvalidCallError(f"get_op({name!r}, args, kwargs): kwargs is a {type(kwargs).__name__}; expected a dict "
                               "of arguments by name, or None")


#: the options ``get_op`` takes by keyword, besides the op's arguments
OPTIONS = tuple(p.name for p in inspect.signature(Dispatcher.get_op).parameters.values()
                if p.kind is inspect.Parameter.KEYWORD_ONLY)


def not_an_option(name: Any, args: Any, unknown: dict[str, Any]) -> InvalidCallError:
    """The error of ``get_op`` given keywords that are none of its options: most likely the op's
    own arguments, which go in the kwargs dict."""
    given = ", ".join(f"{k}={v!r}" for k, v in unknown.items())
    words = "is no option" if len(unknown) == 1 else "are no options"
    example = ""
    if type(name) is str and isinstance(args, (tuple, list)):
        placeholders = ", ".join(["..."] * len(args)) + ("," if len(args) == 1 else "")
        example = f": get_op({name!r}, ({placeholders}), {dict(unknown)!r})"
    return InvalidCallError(f"get_op({name!r}, ...): {given} {words} of get_op (its options: {', '.join(OPTIONS)}); "
                            f"an op's arguments go in args, in its order, or by name in the kwargs dict{example}")


def get_op(name: str, args: tuple | list, kwargs: dict[str, Any] | None = None, **options: Any) -> BoundOp:
    """:meth:`Dispatcher.get_op` of the :func:`default` dispatcher."""
    return default().get_op(name, args, kwargs, **options)


def reset() -> None:
    """Forget the plugins, every choice of the default dispatcher and everything the process
    remembered besides: the next ``get_op`` rediscovers everything and reads the disk store (of
    ``DLCORE_CACHE_DIR`` then) anew, every warning given once warns again, and what was derived
    once (kernels' configs and recorded launches, compiled-kernel entries, the Triton installation's
    stamp, rewritten and folded kernels, toolchain probes, pass pipelines) is derived again. The
    custom ops stay registered with torch, and the compiler-stages hook installed, as long as the
    process."""
    global _default
    if _default is not None:
        _default.clear()
    _default = None
    _warned_fallback.clear()
    for module in (template, torch_ops, replay, launch, shelf, rewrite, folding, toolchain, passes):
        module.clear()
    reset_registry()
