"""Search spaces: the tunable parameters of a kernel, declared beside the kernel.

A space is plain data: parameters with finite domains, constraints between them, and entries fixed
for every config. Strategies read it; a backend refines it for its chip (``restrict``,
``with_constraints``) and gets a new space back, so the kernel's declaration is never changed under
another device's feet. Triton's ``num_warps`` and ``num_stages`` are parameters like any other.

Example::

    SearchSpace(
        [PowerOfTwo("BLOCK_M", 16, 256), PowerOfTwo("BLOCK_K", 16, 128), num_warps(4, 8)],
        [Constraint("tile fits shared memory", lambda c: c["BLOCK_M"] * c["BLOCK_K"] <= 8192)],
    )
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from types import MappingProxyType
from typing import Any, Protocol

from dlcore.errors import SearchSpaceError

Config = dict[str, Any]

# Rejection sampling draws from the unconstrained product; this many misses in a row means the
# constraints reject most of it, and enumerating the valid configs once is cheaper than retrying.
_REJECTION_TRIES = 64


class Param(Protocol):
    """What a space needs of a parameter: its name and its finite, ordered tuple of values."""

    name: str
    values: tuple

    def describe(self) -> str: ...

    def to_dict(self) -> dict[str, Any]: ...


def _check_values(name: str, values: tuple, declared: str) -> None:
    if not values:
        raise SearchSpaceError(f"parameter {name!r}: {declared} has no values; give at least one")
    if len(set(values)) != len(values):
        raise SearchSpaceError(f"parameter {name!r}: {declared} repeats a value; list each value once")


@dataclass(frozen=True)
class Choice:
    """Explicit values, in the order given (which is the order a grid search tries them)."""

    name: str
    values: tuple

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", tuple(self.values))
        _check_values(self.name, self.values, f"choice {self.values}")

    def describe(self) -> str:
        return f"one of {self.values}"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": "choice", "values": list(self.values)}


@dataclass(frozen=True)
class PowerOfTwo:
    """Every power of two in ``[low, high]``, ascending; block sizes are usually declared this way."""

    name: str
    low: int
    high: int
    values: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.low < 1:
            raise SearchSpaceError(f"parameter {self.name!r}: PowerOfTwo low={self.low}; low must be >= 1")
        first = (self.low - 1).bit_length()  # exponent of the smallest power of two >= low
        values = tuple(1 << k for k in range(first, self.high.bit_length()))
        object.__setattr__(self, "values", values)
        _check_values(self.name, values, f"PowerOfTwo({self.low}, {self.high})")

    def describe(self) -> str:
        return f"a power of two in [{self.low}, {self.high}]"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": "power_of_two", "low": self.low, "high": self.high}


@dataclass(frozen=True)
class IntRange:
    """Integers ``low, low + step, ...`` up to and including ``high``."""

    name: str
    low: int
    high: int
    step: int = 1
    values: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.step < 1:
            raise SearchSpaceError(f"parameter {self.name!r}: IntRange step={self.step}; step must be >= 1")
        values = tuple(range(self.low, self.high + 1, self.step))
        object.__setattr__(self, "values", values)
        _check_values(self.name, values, f"IntRange({self.low}, {self.high}, {self.step})")

    def describe(self) -> str:
        return f"an integer in [{self.low}, {self.high}] in steps of {self.step}"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": "int_range", "low": self.low, "high": self.high, "step": self.step}


def num_warps(*values: int) -> Choice:
    """Triton's ``num_warps`` launch option as a parameter."""
    return Choice("num_warps", values)


def num_stages(*values: int) -> Choice:
    """Triton's ``num_stages`` (software pipelining depth) as a parameter."""
    return Choice("num_stages", values)


@dataclass(frozen=True)
class Constraint:
    """A relation between parameters that every valid config satisfies.

    ``predicate`` receives the whole config (fixed entries included); ``description`` is what
    :meth:`SearchSpace.is_valid` reports when it is violated, so phrase it as the requirement.
    """

    description: str
    predicate: Callable[[Config], bool]

    def holds(self, config: Config) -> bool:
        return bool(self.predicate(config))


def same_value(a: Any, b: Any) -> bool:
    """``a == b`` of one type: 16.0 == 16 and True == 1 in Python, but a kernel takes neither for 16
    or 1 (a config read from a tampered cache may hold them)."""
    return a == b and type(a) is type(b)


@dataclass(frozen=True)
class SearchSpace:
    """The configs a kernel may be tuned over: a cartesian product of params, filtered by constraints.

    :param params: the tunable parameters; their declaration order is the enumeration order.
    :param constraints: relations every valid config satisfies.
    :param fixed: entries merged into every config without being searched (e.g. a backend's option).
    """

    params: tuple[Param, ...]
    constraints: tuple[Constraint, ...] = ()
    fixed: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", tuple(self.params))
        object.__setattr__(self, "constraints", tuple(self.constraints))
        object.__setattr__(self, "fixed", MappingProxyType(dict(self.fixed)))
        names = [p.name for p in self.params]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise SearchSpaceError(f"search space declares {repeated} more than once; name each parameter once")
        both = sorted(set(names) & self.fixed.keys())
        if both:
            raise SearchSpaceError(f"{both} are both searched and fixed; drop them from params or from fixed")

    @property
    def names(self) -> tuple[str, ...]:
        """The searched parameters' names, in declaration order."""
        return tuple(p.name for p in self.params)

    def configs(self) -> Iterator[Config]:
        """Every valid config, in a stable order: the product in declaration order, last param fastest."""
        for config in self._valid:
            yield dict(config)

    def size(self) -> int:
        """The number of valid configs."""
        return len(self._valid)

    def is_valid(self, config: Config) -> str | None:
        """``None`` if ``config`` belongs to the space, otherwise why not (for messages and tests).

        Fixed entries may be left out of ``config``; given, they must match.
        """
        for param in self.params:
            if param.name not in config:
                return f"missing parameter {param.name!r}"
            value = config[param.name]
            if not any(same_value(value, v) for v in param.values):
                return f"{param.name}={value!r} is not {param.describe()}"
        for name, value in self.fixed.items():
            if name in config and config[name] != value:
                return f"{name}={config[name]!r}, but the space fixes {name}={value!r}"
        unknown = sorted(config.keys() - set(self.names) - self.fixed.keys())
        if unknown:
            return f"unknown parameters {unknown}; the space has {list(self.names) + list(self.fixed)}"
        return self._violated({**config, **self.fixed})

    def sample(self, rng: random.Random) -> Config:
        """One valid config drawn uniformly, reproducibly from ``rng``.

        Draws from the unconstrained product and rejects invalid configs, so a huge space is not
        enumerated; when the constraints reject almost everything, falls back to the enumeration.
        """
        for _ in range(_REJECTION_TRIES):
            config = self._merge([rng.choice(p.values) for p in self.params])
            if self._violated(config) is None:
                return config
        if not self._valid:
            raise SearchSpaceError(f"search space has no valid config: {self.to_dict()}")
        return dict(rng.choice(self._valid))

    def restrict(self, **subsets: Iterable[Any]) -> SearchSpace:
        """A new space where each named parameter keeps only the given values (in its own order).

        A backend uses this to narrow a kernel's space to what its chip supports, e.g.
        ``space.restrict(num_warps=(4, 8))``. A value outside the parameter's domain is an error,
        since it is most likely a typo that would otherwise silently shrink the space.
        """
        unknown = sorted(subsets.keys() - set(self.names))
        if unknown:
            raise SearchSpaceError(f"cannot restrict {unknown}: the space's parameters are {list(self.names)}")
        params = []
        for param in self.params:
            if param.name not in subsets:
                params.append(param)
                continue
            allowed = tuple(subsets[param.name])
            outside = [v for v in allowed if v not in param.values]
            if outside:
                raise SearchSpaceError(f"cannot restrict {param.name!r} to {outside}: it is {param.describe()}")
            params.append(Choice(param.name, tuple(v for v in param.values if v in allowed)))
        return replace(self, params=tuple(params))

    def with_constraints(self, *more: Constraint) -> SearchSpace:
        """A new space with ``more`` constraints added to this one's."""
        return replace(self, constraints=self.constraints + more)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description, for ``dlcore tune`` tables and logs."""
        return {
            "params": [p.to_dict() for p in self.params],
            "constraints": [c.description for c in self.constraints],
            "fixed": dict(self.fixed),
            "size": self.size(),
        }

    @cached_property
    def _valid(self) -> tuple[Config, ...]:
        # Enumerated once: the space is immutable and strategies ask for size() and configs() often.
        product = itertools.product(*(p.values for p in self.params))
        configs = (self._merge(values) for values in product)
        return tuple(c for c in configs if self._violated(c) is None)

    def _merge(self, values: Iterable[Any]) -> Config:
        return {**dict(zip(self.names, values, strict=True)), **self.fixed}

    def _violated(self, config: Config) -> str | None:
        for constraint in self.constraints:
            if not constraint.holds(config):
                return constraint.description
        return None
