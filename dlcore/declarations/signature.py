"""The signature of a call: what selects a kernel and keys the cache.

For each tensor: dtype, shape (bucketed by the argument's key policy), stride class and 16-byte
alignment; for each scalar: its value (keyed scalars) or its type. An optional tensor left out
(``None``) is not among the tensors: it is recorded as absent, and the key says ``name=None``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from dlcore.declarations.layout import layout_of
from dlcore.declarations.op import Op, ScalarArg, TensorArg
from dlcore.errors import DeclarationError


@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]
    layout: str
    aligned: bool

    def describe(self) -> str:
        flags = self.layout + ("" if self.aligned else ", unaligned")
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)} ({flags})"


@dataclass(frozen=True)
class Signature:
    op: str
    device_type: str
    tensors: tuple[tuple[str, TensorSpec], ...]
    scalars: tuple[tuple[str, Any], ...]
    #: the optional tensor arguments left out (None)
    absent: tuple[str, ...] = ()
    #: a training call: grad mode on and a differentiable argument that requires grad (its choice is
    #: timed forward and backward: :func:`dlcore.tuning.selection.step`)
    training: bool = False

    def tensor(self, name: str) -> TensorSpec:
        for n, spec in self.tensors:
            if n == name:
                return spec
        raise KeyError(name)

    def optional(self, name: str) -> TensorSpec | None:
        """The spec of optional tensor ``name``, or None when it was left out."""
        return None if name in self.absent else self.tensor(name)

    def scalar(self, name: str) -> Any:
        for n, value in self.scalars:
            if n == name:
                return value
        raise KeyError(name)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the first tensor argument."""
        return self.tensors[0][1].dtype

    def key(self) -> str:
        """A stable text form: equal for calls that may share a tuned config."""
        parts = [f"{n}={s.describe()}" for n, s in self.tensors]
        parts += [f"{n}=None" for n in self.absent]
        parts += [f"{n}={v!r}" for n, v in self.scalars]
        training = " training" if self.training else ""
        return f"{self.op}[{self.device_type}]({'; '.join(parts)}){training}"

    def describe(self) -> str:
        return self.key()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ints. Not ``triton.cdiv`` on the host: that is a JIT function
    whose call costs microseconds, which a launch plan pays per call."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def prev_power_of_2(n: int) -> int:
    """The power of two at or below ``n`` (1 for ``n`` of 1 or less)."""
    return 1 if n <= 1 else 1 << (n.bit_length() - 1)


def bucket_shape(shape: tuple[int, ...], policy: str | None) -> tuple[int, ...]:
    if policy is None or not shape:
        return tuple(shape)
    if policy == "rows":
        return (next_power_of_2(math.prod(shape[:-1])), shape[-1])
    if policy == "tokens":
        if len(shape) < 3:
            return bucket_shape(shape, "rows")
        return (next_power_of_2(math.prod(shape[:-2])), *shape[-2:])
    if policy == "sequence":
        if len(shape) != 4:
            return bucket_shape(shape, "rows")
        return (next_power_of_2(shape[0]), next_power_of_2(shape[1]), *shape[2:])
    raise DeclarationError(f"unknown bucket policy {policy!r}; known: 'rows', 'tokens', 'sequence' or None")


def _aligned(t: torch.Tensor) -> bool:
    """16-byte alignment of the data; tensors without storage (fake, meta) count as aligned."""
    try:
        return t.data_ptr() % 16 == 0
    except (RuntimeError, NotImplementedError):
        return True


def _scalar_key(spec: ScalarArg, value: Any) -> Any:
    return value if spec.keyed else type(value).__name__


def make_signature(op: Op, bound: tuple, device: torch.device) -> Signature:
    tensors = []
    scalars = []
    absent = []
    grad = torch.is_grad_enabled()
    training = False
    for spec, value in zip(op.args, bound):
        if isinstance(spec, TensorArg) and value is None:
            absent.append(spec.name)
        elif isinstance(spec, TensorArg):
            tensors.append((spec.name, TensorSpec(
                dtype=value.dtype,
                shape=bucket_shape(tuple(value.shape), spec.bucket),
                layout=layout_of(value),
                aligned=_aligned(value),
            )))
            training = training or (grad and spec.differentiable and value.requires_grad)
        else:
            scalars.append((spec.name, _scalar_key(spec, value)))
    return Signature(op.name, device.type, tuple(tensors), tuple(scalars), tuple(absent), training)
