"""Operator declarations: argument schema, validation, torch reference, key policy.

An :class:`Op` is what ``get_op`` looks up by name. Its implementations are declared separately
(see :mod:`dlcore.declarations.implementation`), possibly by other plugins.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dlcore.declarations.layout import ACCEPTED_LAYOUT_TEXT, layout_of
from dlcore.declarations.overlap import Overlap, overlap, overlaps_itself
from dlcore.errors import DeclarationError, InvalidInputError

REQUIRED = object()


def _article(noun: str) -> str:
    """``noun`` after "a" or "an" (by its first letter)."""
    return ("an " if noun[:1].lower() in "aeiou" else "a ") + noun


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class TensorArg:
    """A tensor argument.

    ``layouts``: the stride classes accepted (see :mod:`dlcore.declarations.layout`). ``same_dtype_as``: the
    name of an earlier tensor argument whose dtype this one must share. ``bucket``: the key policy
    for this argument's shape in cache keys (``"rows"``: leading dimensions flattened and rounded up
    to a power of two, last dimension exact; ``"tokens"``: for ``[..., S, H, D]``, the dimensions
    before the heads flattened into the token count and rounded up to a power of two, heads and
    ``D`` exact; ``"sequence"``: for attention's ``[B, S, H, D]``, the batch and the sequence length
    each rounded up to a power of two, heads and ``D`` exact; ``None``: exact shape). ``differentiable``: whether a
    model takes gradients with respect to this argument: False for tables and constants (rotary
    cos and sin), which backwards need not differentiate and ``dlcore bench`` never asks gradients of
    (one that requires grad and gets no gradient from a kernel's backward is named by a warning).
    ``optional``: the argument may be ``None`` (its default, so it may be left out: a bias); the
    signature then records it as absent, and it has no gradient.
    """

    name: str
    dtypes: tuple[torch.dtype, ...]
    min_rank: int = 1
    max_rank: int | None = None
    layouts: tuple[str, ...] = ("contiguous", "rows")
    same_dtype_as: str | None = None
    bucket: str | None = None
    differentiable: bool = True
    optional: bool = False

    @property
    def default(self) -> Any:
        """``None`` for an optional tensor (it may be left out), else :data:`REQUIRED`."""
        return None if self.optional else REQUIRED


@dataclass(frozen=True)
class ScalarArg:
    """A Python scalar argument. ``keyed``: its value (not only its type) selects the kernel.
    ``choices``: the values accepted, if only some are (an activation's name); ``types`` may then
    include ``str`` and ``type(None)``. ``finite``: NaN and infinities refused; ``minimum``: the
    smallest number accepted (NaN refused too). Both are checked on the host, before any launch."""

    name: str
    types: tuple[type, ...] = (float, int)
    default: Any = REQUIRED
    keyed: bool = False
    choices: tuple[Any, ...] | None = None
    finite: bool = False
    minimum: float | None = None
    #: a ``bool`` argument that, when true, makes the op write its results into these tensor
    #: arguments (``inplace``): each is then checked to overlap neither itself nor another argument
    writes: tuple[str, ...] = ()


Arg = TensorArg | ScalarArg


@dataclass(frozen=True)
class Op:
    """An operator: what it computes (``reference``) and what it accepts (``args``, ``check``).

    ``reference`` takes the arguments in declared order and computes the result with torch; it is
    the ground truth for tests and correctness checks, and it runs when no dedicated kernel accepts
    the inputs, unless ``fallback`` is False.
    ``example(sizes, dtype, device, generator)`` builds random arguments from named sizes (e.g.
    ``tokens``, ``hidden``), defaults in ``example_sizes``: what ``dlcore check``, ``bench`` and
    ``tune`` run on. ``example_paths``: name -> sizes over ``example_sizes`` whose inputs take
    another of the op's paths (weight streaming at one token, split-K, fp8 weights): ``dlcore
    lower`` plans each, so that every kernel an implementation launches is lowered.
    ``cost(args) -> (bytes, flops)``: the fewest bytes the op must move through memory (each input
    read once, each output written once) and its floating-point operations, for bound ``args``;
    ``bench`` turns times into GB/s and TFLOP/s with it. ``cost`` may take ``mode="fwd"|"bwd"``;
    ``bench`` asks for ``bwd`` to rate a backward.
    ``baselines``: name -> factory returning a callable with the op's arguments (e.g. the eager torch
    code a model would run, ``"torch"``; a peer library's kernel, ``"liger"``), or ``None`` when
    that baseline is not installed. Factories import lazily.
    ``check(op, args)`` raises :class:`InvalidInputError` for relations between arguments (shapes
    that must agree); per-argument dtype, rank, layout and device checks are done from ``args``.
    """

    name: str
    args: tuple[Arg, ...]
    reference: Callable[..., Any]
    doc: str = ""
    check: Callable[[Op, dict[str, Any]], None] | None = None
    fallback: bool = True
    example: Callable[..., tuple] | None = None
    example_sizes: dict[str, int] = field(default_factory=dict)
    example_paths: dict[str, dict[str, int]] = field(default_factory=dict)
    cost: Callable[[tuple], tuple[int, int]] | None = None
    baselines: dict[str, Callable[[], Callable[..., Any] | None]] = field(default_factory=dict)
    _index: dict[str, int] = field(default=None, init=False, repr=False, compare=False)  # type: ignore[assignment]
    #: the positions of the flags that make the op write into tensor arguments (``ScalarArg.writes``)
    _writers: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {a.name: i for i, a in enumerate(self.args)})
        tensors = {a.name for a in self.args if isinstance(a, TensorArg)}
        for a in self.args:
            if isinstance(a, ScalarArg) and set(a.writes) - tensors:
                raise DeclarationError(f"{self.name}: {a.name} writes {a.writes}, but its tensor arguments are "
                                       f"{sorted(tensors)}")
        object.__setattr__(self, "_writers",
                           tuple(i for i, a in enumerate(self.args) if isinstance(a, ScalarArg) and a.writes))

    # -- binding --------------------------------------------------------------------------------

    def usage(self) -> str:
        parts = []
        for a in self.args:
            if a.default is not REQUIRED:
                parts.append(f"{a.name}={a.default!r}")
            else:
                parts.append(a.name)
        return f"{self.name}({', '.join(parts)})"

    def bind(self, args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> tuple:
        """Arguments in declared order, defaults filled in."""
        if kwargs is None and len(args) == len(self.args):
            return tuple(args)
        if len(args) > len(self.args):
            raise InvalidInputError(
                self.name, "call", f"got {len(args)} positional arguments", self.usage()
            )
        values = list(args) + [REQUIRED] * (len(self.args) - len(args))
        for key, value in (kwargs or {}).items():
            if key not in self._index:
                raise InvalidInputError(self.name, "call", f"got an unexpected argument {key!r}", self.usage())
            i = self._index[key]
            if i < len(args):
                raise InvalidInputError(self.name, "call", f"got {key!r} twice", self.usage())
            values[i] = value
        for i, a in enumerate(self.args):
            if values[i] is REQUIRED:
                default = a.default
                if default is REQUIRED:
                    raise InvalidInputError(self.name, a.name, "is missing", self.usage())
                values[i] = default
        return tuple(values)

    # -- validation -----------------------------------------------------------------------------

    def validate(self, bound: tuple) -> torch.device:
        """Check every argument; return the device the inputs live on."""
        device = None
        first_tensor = None
        for spec, value in zip(self.args, bound):
            if isinstance(spec, ScalarArg):
                self._check_scalar(spec, value)
                continue
            if value is None and spec.optional:
                continue
            self._check_tensor(spec, value, bound)
            if device is None:
                device, first_tensor = value.device, spec.name
            elif value.device != device:
                raise InvalidInputError(
                    self.name, spec.name, f"is on {value.device} while {first_tensor} is on {device}",
                    "tensors on one device", "Move all inputs to the same device.",
                )
        for i in self._writers:
            if bound[i]:
                self._check_writes(self.args[i], bound)
        self.check_values(bound)
        return device if device is not None else torch.device("cpu")

    def check_values(self, bound: tuple) -> None:
        """The op's own ``check`` alone, without the declared dtypes and layouts: what the float64
        reference path (``torch.autograd.gradcheck``'s inputs) runs, whose dtype the declarations refuse."""
        if self.check is not None:
            self.check(self, dict(zip(self._index, bound)))

    def _check_writes(self, spec: ScalarArg, bound: tuple) -> None:
        """The tensors ``spec`` makes the op write into overlap neither themselves nor another
        tensor argument (:mod:`dlcore.declarations.overlap`)."""
        tensors = {a.name: v for a, v in zip(self.args, bound) if isinstance(v, torch.Tensor)}
        for name in spec.writes:
            written = tensors[name]
            if overlaps_itself(written):
                raise InvalidInputError(
                    self.name, name, f"has elements that share memory (shape {tuple(written.shape)}, strides "
                    f"{tuple(written.stride())})", f"with {spec.name}=True, a {name} whose elements are distinct",
                    f"Pass {name}.clone(), or {spec.name}=False.")
            for other, value in tensors.items():
                if other == name or (other in spec.writes and spec.writes.index(other) < spec.writes.index(name)):
                    continue
                shared = overlap(written, value)
                if shared is not Overlap.NONE:
                    raise InvalidInputError(
                        self.name, name, f"and {other} are {shared.value}",
                        f"with {spec.name}=True, a {name} that shares no memory with {other}",
                        f"Pass distinct tensors, or {spec.name}=False.")

    def _check_scalar(self, spec: ScalarArg, value: Any) -> None:
        if isinstance(value, torch.Tensor) or not isinstance(value, spec.types) or (
            isinstance(value, bool) and bool not in spec.types
        ):
            names = " or ".join("None" if t is type(None) else t.__name__ for t in spec.types)
            raise InvalidInputError(self.name, spec.name, f"is {_article(type(value).__name__)}",
                                    f"{_article(names)} for {spec.name}")
        if float in spec.types and isinstance(value, int) and not isinstance(value, bool):
            try:
                float(value)
            except OverflowError:
                got = f"is an integer of {value.bit_length()} bits, beyond a float's range"
                raise InvalidInputError(self.name, spec.name, got, f"{spec.name} as a float (at most about 1.8e308)"
                                        ) from None
        if spec.choices is not None and value not in spec.choices:
            raise InvalidInputError(self.name, spec.name, f"is {value!r}",
                                    f"one of {', '.join(repr(c) for c in spec.choices)}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if spec.finite and not math.isfinite(value):
                raise InvalidInputError(self.name, spec.name, f"is {value!r}", f"a finite number for {spec.name}")
            if spec.minimum is not None and not value >= spec.minimum:
                raise InvalidInputError(self.name, spec.name, f"is {value!r}", f"{spec.name} >= {spec.minimum!r}")

    def _check_tensor(self, spec: TensorArg, value: Any, bound: tuple) -> None:
        if not isinstance(value, torch.Tensor):
            raise InvalidInputError(
                self.name, spec.name, f"is a {type(value).__name__}", f"a torch.Tensor for {spec.name}"
            )
        if value.dtype not in spec.dtypes:
            accepted = ", ".join(_dtype_name(d) for d in spec.dtypes)
            raise InvalidInputError(
                self.name, spec.name, f"has dtype {value.dtype}", accepted, f"Convert with {spec.name}.to(...)."
            )
        if spec.same_dtype_as is not None:
            other = bound[self._index[spec.same_dtype_as]]
            if isinstance(other, torch.Tensor) and other.dtype != value.dtype:
                raise InvalidInputError(
                    self.name, spec.name, f"has dtype {value.dtype} but {spec.same_dtype_as} has {other.dtype}",
                    f"{spec.name} with the dtype of {spec.same_dtype_as}",
                )
        rank = value.dim()
        if rank < spec.min_rank or (spec.max_rank is not None and rank > spec.max_rank):
            if spec.max_rank == spec.min_rank:
                want = f"{spec.min_rank}"
            elif spec.max_rank is None:
                want = f"at least {spec.min_rank}"
            else:
                want = f"{spec.min_rank} to {spec.max_rank}"
            raise InvalidInputError(
                self.name, spec.name, f"has {rank} dimensions (shape {tuple(value.shape)})",
                f"{spec.name} with {want} dimensions",
            )
        layout = layout_of(value)
        if layout not in spec.layouts:
            accepted = " or ".join(ACCEPTED_LAYOUT_TEXT[k] for k in spec.layouts)
            raise InvalidInputError(
                self.name, spec.name, f"has strides {tuple(value.stride())} for shape {tuple(value.shape)}",
                accepted, f"Call {spec.name}.contiguous() first.",
            )

    def expect_shape(self, name: str, value: torch.Tensor, shape: tuple[int, ...], why: str) -> None:
        """For ``check`` functions: raise unless ``value.shape == shape``."""
        if tuple(value.shape) != tuple(shape):
            raise InvalidInputError(
                self.name, name, f"has shape {tuple(value.shape)}", f"{name} of shape {tuple(shape)} ({why})"
            )

    def example_inputs(self, sizes: dict[str, int], dtype: torch.dtype, device: torch.device | str,
                       seed: int = 0) -> tuple:
        """Random arguments from ``example``: ``sizes`` over ``example_sizes``, drawn from ``seed``."""
        if self.example is None:
            raise DeclarationError(
                f"op {self.name!r} declares no example inputs, which `dlcore check`, `tune`, `bench` and `lower` "
                f"need: its plugin should give Op(..., example=fn(sizes, dtype, device, generator), "
                f"example_sizes={{...}}) (docs/plugins.md); get_op itself works on real tensors")
        return self.example({**self.example_sizes, **sizes}, dtype, torch.device(device),
                            torch.Generator().manual_seed(seed))

    def tensor_args(self) -> list[TensorArg]:
        return [a for a in self.args if isinstance(a, TensorArg)]

    def differentiable(self) -> tuple[int, ...]:
        """The positions of the tensor arguments declared differentiable, in declared order."""
        return tuple(i for i, a in enumerate(self.args) if isinstance(a, TensorArg) and a.differentiable)

    def dtypes(self) -> tuple[torch.dtype, ...]:
        """The dtypes of the first tensor argument: what ``dlcore ops`` lists."""
        tensors = self.tensor_args()
        return tensors[0].dtypes if tensors else ()
