"""A kernel custom op's schema and the config its body reads: the schema type of each scalar
argument (:func:`scalar_type`), the returns (:func:`returns`), the tensor that gives the device
(:func:`first_tensor`), and the config from the trailing ints (:class:`BodyConfig`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dlcore.declarations.device import DeviceProfile
from dlcore.declarations.implementation import Config
from dlcore.declarations.op import Op, ScalarArg, TensorArg
from dlcore.declarations.signature import Signature, make_signature
from dlcore.errors import DeclarationError
from dlcore.runtime.profile import device_profile


def scalar_type(arg: ScalarArg) -> tuple[str, Callable[[Any], Any]]:
    """The schema type of a scalar argument and the conversion its value takes (``None`` passes
    through where the types admit it: the schema type is then optional, ``str?``)."""
    types = tuple(t for t in arg.types if t is not type(None))
    if types == (torch.dtype,):  # an output dtype (fp8_gemm's out_dtype)
        kind, convert = "ScalarType", lambda value: value
    elif types == (bool,):
        kind, convert = "bool", bool
    elif types == (str,):
        kind, convert = "str", str
    elif float in types:
        kind, convert = "float", float
    elif int in types:
        kind, convert = "int", int
    else:
        raise DeclarationError(
            f"scalar argument {arg.name!r} of types {arg.types} has no custom-op type (bool, int, float, str, "
            f"any of them or None; or torch.dtype)")
    if len(types) == len(arg.types):
        return kind, convert
    return f"{kind}?", lambda value: None if value is None else convert(value)


def returns(count: int) -> str:
    return "Tensor" if count == 1 else f"({', '.join(['Tensor'] * count)})"


def first_tensor(op: Op) -> int:
    first = next((i for i, a in enumerate(op.args) if isinstance(a, TensorArg)), None)
    if first is None or op.args[first].optional:
        raise DeclarationError(f"{op.usage()}: a kernel's op needs a tensor argument first among its tensors "
                               f"that is not optional (it gives the device)")
    return first




def same(args: tuple) -> tuple:
    """The forward's arguments of a forward body: its own."""
    return args


class BodyConfig:
    """A body's config from its trailing ints: the named values, or (all zero) the heuristic default
    for the forward arguments ``forward(args)`` computes from the body's."""

    __slots__ = ("keys", "op", "default_config", "forward", "first")

    def __init__(self, keys: tuple[str, ...], op: Op, default_config: Callable[[Signature, DeviceProfile], Config],
                 forward: Callable[[tuple], tuple]):
        self.keys, self.op, self.default_config, self.forward = keys, op, default_config, forward
        self.first = first_tensor(op)

    def __call__(self, args: tuple, ints: tuple) -> Config:
        if any(ints):
            return dict(zip(self.keys, ints))
        forward = self.forward(args)
        device = forward[self.first].device
        return self.default_config(make_signature(self.op, forward, device), device_profile(device))
