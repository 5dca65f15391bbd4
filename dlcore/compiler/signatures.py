"""A launch's Triton signature, and its compile for a target that need not be present.

From a :class:`~dlcore.declarations.implementation.KernelCall` (on ``meta`` tensors or real ones),
each kernel's Triton signature and constexprs are derived: by default specialized on the argument
values as a real launch would specialize them (:func:`launch_signature`: pointers and integers
known divisible by 16 carry ``tt.divisibility = 16``, integers equal to 1 become constants), else
on the types and constexprs alone (:func:`kernel_signature`). :func:`compile_call` runs
``triton.compile`` for a ``GPUTarget`` (no device needed) with the launch's options and FP fusion as
a launch on this Triton has it (:func:`fp_fusion`). :mod:`dlcore.compiler.lowering` builds on it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch

from dlcore.declarations.implementation import KernelCall

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
    #: keyed by parameter name or by Triton's argument path (``(index,)``)
    constexprs: dict[Any, Any]
    options: dict[str, Any]
    #: Triton's attributes by argument path, e.g. ``{(0,): [["tt.divisibility", 16]]}``
    attrs: dict[tuple[int, ...], list] = field(default_factory=dict)


def kernel_signature(call: KernelCall) -> KernelSignature:
    """The Triton signature of one launch, unspecialized: each parameter's type, the constexpr
    values, the options; no divisibility attributes, integers equal to 1 stay arguments."""
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


class _MetaPointer:
    """A ``meta`` tensor as Triton's specialization sees a tensor argument: a dtype and an address.

    A meta tensor has no storage, so the address is assumed: its storage starts 16-byte aligned,
    as every block of the CUDA caching allocator does, and the tensor starts ``storage_offset``
    elements into it.
    """

    def __init__(self, tensor: torch.Tensor):
        self.dtype = tensor.dtype
        self._address = tensor.storage_offset() * tensor.element_size()

    def data_ptr(self) -> int:
        return self._address


def _as_launched(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.device.type == "meta":
        return _MetaPointer(value)
    return value


def launch_signature(call: KernelCall, target: Any) -> KernelSignature:
    """The Triton signature a real launch of ``call`` compiles with on ``target`` (a ``GPUTarget``).

    Triton's own specialization runs on the argument values, as ``JITFunction.run`` does at a
    launch, honouring the kernel's ``do_not_specialize`` and ``do_not_specialize_on_alignment``:
    a tensor whose address is a multiple of 16, and an integer divisible by 16, carry
    ``tt.divisibility = 16``; an integer equal to 1 becomes a constexpr. A ``meta`` tensor has no
    address: it is taken to be 16-byte aligned when ``storage_offset * element_size`` is a
    multiple of 16 (its storage assumed to start where the CUDA caching allocator's blocks do, on
    a 16-byte boundary or better), unaligned otherwise.
    """
    from triton.compiler import make_backend

    backend = make_backend(target)
    args = [_as_launched(a) for a in call.args]
    kwargs = {k: _as_launched(v) for k, v in call.kwargs.items()}
    try:
        from triton.runtime.jit import create_function_from_signature

        pack_args = call.kernel._pack_args
    except (ImportError, AttributeError):
        types, constexprs, attrs = _specialize_by_rule(call.kernel, args, kwargs, backend)
    else:
        binder = create_function_from_signature(call.kernel.signature, call.kernel.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        _, types, constexprs, attrs = pack_args(backend, {**fp_fusion(), **kwargs}, bound, specialization, options)
    options = {k: v for k, v in call.kwargs.items() if k in LAUNCH_OPTIONS}
    return KernelSignature(call.kernel.__name__, types, constexprs, options, attrs)


def _specialize_by_rule(fn: Any, args: list, kwargs: dict, backend: Any) -> tuple[dict, dict, dict]:
    """What ``launch_signature`` computes, for a Triton whose binder it cannot call: the rules of
    ``specialize_impl`` in Triton 3.6 and 3.9, for tensors and scalars (not tuples or descriptors)."""
    params = inspect.signature(fn.fn).parameters
    values = {**{k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty},
              **dict(zip(fn.arg_names, args)), **kwargs}
    types: dict[str, str] = {}
    constexprs: dict[tuple[int, ...], Any] = {}
    attrs: dict[tuple[int, ...], list] = {}
    for i, (p, name) in enumerate(zip(fn.params, fn.arg_names)):
        value = values[name]
        annotated = p.annotation_type if isinstance(p.annotation_type, str) else ""
        specialize = not p.do_not_specialize and not (annotated == "u1" or annotated[:2] in ("fp", "bf"))
        aligned = specialize and not p.do_not_specialize_on_alignment
        if p.is_constexpr or value is None or (specialize and not annotated and type(value) is int and value == 1):
            types[name], constexprs[(i,)] = "constexpr", value
            continue
        if hasattr(value, "data_ptr"):
            types[name] = ("*k" if p.is_const else "*") + TRITON_TYPES[value.dtype]
            divisible = aligned and value.data_ptr() % 16 == 0
        else:
            types[name] = "u1" if isinstance(value, bool) else _scalar_type(value)
            divisible = aligned and type(value) is int and value % 16 == 0
        types[name] = annotated or types[name]
        if divisible:
            attrs[(i,)] = backend.parse_attr("D")
    return types, constexprs, attrs


def ast_source(call: KernelCall, target: Any, specialize: bool) -> tuple[Any, KernelSignature]:
    """The source ``triton.compile`` takes for ``call``: a Gluon kernel's own (it starts at ttgir, its
    layouts written by hand), any other's Triton source."""
    sig = launch_signature(call, target) if specialize else kernel_signature(call)
    if getattr(call.kernel, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as Source
    else:
        from triton.compiler import ASTSource as Source
    return Source(call.kernel, sig.types, constexprs=sig.constexprs, attrs=sig.attrs), sig


def compile_call(call: KernelCall, target: Any, specialize: bool = True) -> Any:
    """``triton.compile`` one launch for ``target`` (a ``GPUTarget``); returns the compiled kernel.

    :param specialize: specialize on the argument values as a launch does (see
        :func:`launch_signature`); ``False``: only on the types and constexprs.
    """
    import triton

    source, sig = ast_source(call, target, specialize)
    return triton.compile(source, target=target, options=compile_options(sig))


def compile_options(sig: KernelSignature) -> dict[str, Any]:
    """``sig``'s launch options for ``triton.compile``, FP fusion among them (:func:`fp_fusion`)."""
    return {**fp_fusion(), **sig.options}


def fp_fusion() -> dict[str, bool]:
    """``enable_fp_fusion`` as a launch on this Triton has it: the user's ``TRITON_DEFAULT_FP_FUSION``
    where set, else Triton's default; nothing on a Triton without the knob. Passed explicitly, since
    Triton 3.9 warns on every compile that leaves the choice to an unset variable (its default is to
    change in 3.10), a warning a ``dlcore lower`` user did nothing to cause."""
    import triton

    language = getattr(getattr(triton, "knobs", None), "language", None)
    fusion = getattr(language, "default_fp_fusion", None)
    return {} if fusion is None else {"enable_fp_fusion": bool(fusion)}

