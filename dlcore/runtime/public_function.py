"""A kernel's public function (:class:`PublicFunction`): the op's signature, validation and the
heuristic config, no dispatcher; under ``torch.compile`` tracing the custom op alone."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from dlcore.declarations.implementation import Config, TritonImplementation
from dlcore.declarations.op import REQUIRED, Op
from dlcore.declarations.signature import make_signature
from dlcore.errors import DeclarationError, InvalidInputError
from dlcore.runtime.profile import device_profile
from dlcore.runtime.runner import Runner


def _on_the_cpu(op: Op, bound: tuple) -> InvalidInputError:
    """The error of a public function called on CPU tensors whose kernels are compiled for a device."""
    name = next(a.name for a, value in zip(op.args, bound) if isinstance(value, torch.Tensor))
    return InvalidInputError(op.name, name, "is on the CPU, where compiled Triton kernels cannot read it",
                             "tensors on the device its kernels are compiled for (e.g. cuda)",
                             "TRITON_INTERPRET=1, set before triton is first imported, runs them on the CPU")


#: a parameter not yet given a value, while a call is bound
_UNSET = object()


def _all_float64(bound: tuple) -> bool:
    """Every floating tensor argument is float64, and there is one."""
    floats = [t.dtype for t in bound if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return bool(floats) and all(d == torch.float64 for d in floats)


class PublicFunction:
    """A kernel's public function: called with the op's parameters and defaults (its
    ``__signature__``, which ``help()`` and ``inspect.signature`` show), validated, the heuristic
    config, no dispatcher; under ``torch.compile`` tracing the custom op alone. A positional call
    (every argument, or those before the trailing defaults) binds nothing; any other is bound by
    the op's argument names, a wrong arity raising ``TypeError`` as Python does for a function.

    It runs through a :class:`~dlcore.runtime.runner.Runner` without a config, as a bound op
    runs through one with its selected config: the inputs of each exact input metadata
    (:func:`~dlcore.runtime.replay.replay_key`) validated and the heuristic config worked out
    once, when the launches are recorded, replayed after; a call with new metadata pays the
    validation, the signature, the heuristic and the plan. A condition on the data (fused_moe's
    expert ids) is checked at the first call of each metadata, as a bound op checks it."""

    def __init__(self, op: Op, implementation: TritonImplementation,
                 custom_op: Callable[[tuple, Config | None], Any], *, first: int, differentiable: bool, module: str):
        """:param custom_op: ``custom_op(args, config | None)``, the bound ``args`` through the kernel's
            custom op (:meth:`Kernel.call_custom_op <dlcore.runtime.template.Kernel.call_custom_op>`).
        :param first: the position of the argument that gives the device.
        :param differentiable: the custom op has an autograd formula."""
        if not all(n.isidentifier() for n in (op.name, *(a.name for a in op.args))):
            raise DeclarationError(f"{op.usage()}: the op and its arguments need Python identifiers as names")
        self.op = op
        self.custom_op = custom_op
        self.first = first
        self.differentiable = differentiable
        self.validate, self.default_config = op.validate, implementation.default_config
        # Compiled kernels cannot read host memory; the interpreter (TRITON_INTERPRET=1 when triton was
        # first imported) runs them on the CPU. Fixed for the process when the kernels are made.
        self.on_cpu = implementation.interpreted
        #: the implementation with its heuristic config, validated and replayed per exact input metadata
        self.runner = Runner(implementation, None, guard=self.check, heuristic=self.heuristic)
        self._run = self.runner.call
        # Python's rule: a parameter keeps its default only if every later one has one too (ffn's optional
        # w1 and w3 come before the required rms_w: they are passed, as None where w13 replaces them).
        trailing = len(op.args)
        while trailing and op.args[trailing - 1].default is not REQUIRED:
            trailing -= 1
        self.arity = len(op.args)
        self.required = trailing
        self.defaults = tuple(a.default for a in op.args[trailing:])
        self.position = {a.name: i for i, a in enumerate(op.args)}
        self.__signature__ = inspect.Signature([
            inspect.Parameter(a.name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                              default=a.default if i >= trailing else inspect.Parameter.empty)
            for i, a in enumerate(op.args)])
        self.__name__ = self.__qualname__ = op.name
        self.__module__ = module
        wrt = ", ".join(op.args[i].name for i in op.differentiable())
        self.__doc__ = (
            f"{op.doc}.\n\nThe Triton kernel with its heuristic config (``dlcore.get_op`` selects and tunes); "
            + (f"differentiable in {wrt}" if differentiable else "forward only")
            + ", and one node under ``torch.compile``."
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        given = len(args)
        if kwargs or given < self.required or given > self.arity:
            args = self.bind(args, kwargs)
        elif given < self.arity:
            args = (*args, *self.defaults[given - self.required:])
        return self.call(args)

    def bind(self, args: tuple, kwargs: Mapping[str, Any]) -> tuple:
        """The op's arguments in order from a call's, the defaults filled in; a ``TypeError`` worded as
        Python's for a function called with arguments it does not take."""
        name, arity, required = self.__name__, self.arity, self.required
        if len(args) > arity:
            raise TypeError(f"{name}() takes {arity} positional arguments but {len(args)} were given")
        values = [*args, *((_UNSET,) * (arity - len(args)))]
        for key, value in kwargs.items():
            at = self.position.get(key)
            if at is None:
                raise TypeError(f"{name}() got an unexpected keyword argument {key!r}")
            if values[at] is not _UNSET:
                raise TypeError(f"{name}() got multiple values for argument {key!r}")
            values[at] = value
        missing = [a.name for a, value in zip(self.op.args[:required], values) if value is _UNSET]
        if missing:
            raise TypeError(f"{name}() missing {len(missing)} required argument(s): {', '.join(map(repr, missing))}")
        for at in range(required, arity):
            if values[at] is _UNSET:
                values[at] = self.defaults[at - required]
        return tuple(values)

    def call(self, bound: tuple) -> Any:
        """The op on its ``bound`` arguments."""
        if torch.compiler.is_compiling():
            return self.custom_op(bound, None)
        first = bound[self.first]
        if (isinstance(first, torch.Tensor) and first.dtype == torch.float64 and self.differentiable
                and _all_float64(bound)):  # one dtype read on the hot path; the scan only for float64
            # the references, forward and backward (torch.autograd.gradcheck's inputs): the custom op's
            # body takes them for float64, so gradcheck checks the backward formula against them; a
            # float64 tensor beside other floats is refused by the validation below, as before; the op's
            # own check (a label's range, say) runs all the same
            self.op.check_values(bound)
            return self.custom_op(bound, None)
        if isinstance(first, torch.Tensor) and first.device.type == "meta":
            # no data to run a kernel on: the custom op's fake gives the outputs' shapes, as torch's ops do
            return self.custom_op(bound, None)
        return self._run(bound)

    def check(self, bound: tuple) -> None:
        """The op's validation of ``bound``, and that a compiled kernel is not handed CPU tensors."""
        device = self.validate(bound)
        if device.type == "cpu" and not self.on_cpu:
            raise _on_the_cpu(self.op, bound)

    def heuristic(self, bound: tuple) -> Config:
        """The heuristic config for ``bound``, on its device's profile."""
        device = bound[self.first].device
        return self.default_config(make_signature(self.op, bound, device), device_profile(device))

    def __get__(self, instance: Any, owner: type | None = None) -> PublicFunction:
        # A non-data descriptor, as a function is: help() and inspect read it as a routine (its
        # signature, its doc); as a class attribute it stays unbound.
        return self

    def __repr__(self) -> str:
        return f"<kernel function {self.__module__}.{self.__name__}{self.__signature__}>"
