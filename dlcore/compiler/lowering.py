"""Compiling the kernels of a launch plan for a target that need not be present.

A :class:`~dlcore.implementation.LaunchPlan` built on ``meta`` tensors names every kernel with its
real arguments; from those, each kernel's Triton signature and constexprs are derived and
``triton.compile`` runs for a ``GPUTarget`` (no device needed), giving every IR stage.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from dlcore.implementation import KernelCall

TRITON_TYPES = {
    torch.float64: "fp64",
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "i1",
}
for _name, _code in (("float8_e4m3fn", "fp8e4nv"), ("float8_e5m2", "fp8e5")):
    if hasattr(torch, _name):
        TRITON_TYPES[getattr(torch, _name)] = _code

#: launch options that are not kernel parameters
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


def _scalar_type(value: Any) -> str:
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"cannot type kernel argument {value!r} ({type(value).__name__})")


@dataclass
class KernelSignature:
    name: str
    types: dict[str, str]
    constexprs: dict[str, Any]
    options: dict[str, Any]


def kernel_signature(call: KernelCall) -> KernelSignature:
    """The Triton signature of one launch: each parameter's type, the constexpr values, the options."""
    fn = call.kernel
    names = list(fn.arg_names)
    params = inspect.signature(fn.fn).parameters
    values = dict(zip(names, call.args))
    options = {k: v for k, v in call.kwargs.items() if k in LAUNCH_OPTIONS}
    values.update({k: v for k, v in call.kwargs.items() if k not in LAUNCH_OPTIONS})
    types: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    for p, name in zip(fn.params, names):
        if name not in values:
            default = params[name].default
            if default is inspect.Parameter.empty:
                raise TypeError(f"{fn.__name__}: no value for parameter {name!r}")
            values[name] = default
        value = values[name]
        if p.is_constexpr or value is None:
            types[name] = "constexpr"
            constexprs[name] = value
        elif isinstance(value, torch.Tensor):
            types[name] = "*" + TRITON_TYPES[value.dtype]
        else:
            types[name] = _scalar_type(value)
    return KernelSignature(fn.__name__, types, constexprs, options)


def compile_call(call: KernelCall, target: Any) -> Any:
    """``triton.compile`` one launch for ``target`` (a ``GPUTarget``); returns the compiled kernel."""
    import triton
    from triton.compiler import ASTSource

    sig = kernel_signature(call)
    source = ASTSource(call.kernel, sig.types, constexprs=sig.constexprs)
    return triton.compile(source, target=target, options=sig.options)
