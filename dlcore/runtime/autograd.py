"""A kernel's autograd: its backward custom op (:class:`BackwardOp`, ``<ns>::<op>_backward``,
with its own autograd for the gradients of the gradients), the formula its forward custom op
registers (:class:`Autograd`), the same formula as an eager ``torch.autograd.Function``
(:class:`EagerForward`), and the stand-in that captures a backward call to plan it
(:class:`Capture`), all made from the kernel's :class:`~dlcore.runtime.backward.Backward`."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from dlcore.declarations.device import DeviceProfile
from dlcore.declarations.implementation import Config
from dlcore.declarations.op import REQUIRED, Op
from dlcore.declarations.signature import Signature
from dlcore.errors import DeclarationError, NoDoubleBackwardError
from dlcore.runtime.backward import Backward
from dlcore.runtime.profile import OnDevice
from dlcore.runtime.schema import BodyConfig
from dlcore.runtime.torch_ops import Launches, run_backward, warn_no_gradient


class SecondOrderOnly(torch.autograd.Function):
    """The identity on a second-order gradient, whose backward (a third order) raises."""

    @staticmethod
    def forward(ctx: Any, gradient: torch.Tensor, users: str) -> torch.Tensor:
        ctx.users = users
        return gradient.view_as(gradient)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple:
        raise NoDoubleBackwardError(
            f"{ctx.users}: a third-order gradient (a backward through second-order gradients) is not supported: "
            f"{ctx.users} gives first- and second-order gradients. Where higher orders are needed, compute "
            f"{ctx.users} in torch (its op's reference)")


#: every backward op defined in this process, for the ops :class:`NoDoubleBackwardError` lists. Not
#: cleared by ``dlcore.reset()``: it mirrors the custom ops registered with torch, which last as long
#: as the process
_BACKWARDS: list[BackwardOp] = []


class BackwardOp:
    """A backward custom op: its body, how an autograd formula runs it, and its own autograd (the
    gradients of the gradients: through its reference with ``Backward.second_order``, else an
    error naming the ops whose backward is first-order only)."""

    def __init__(self, kernel: str, namespace: str, keys: tuple[str, ...], op: Op, backward: Backward,
                 default_config: Callable[[Signature, DeviceProfile], Config]):
        reference, results, plan = backward.reference, backward.results, backward.plan
        if reference is None or results is None or plan is None:
            raise DeclarationError(
                f"{kernel}: a Backward declares plan, reference and results, or names another kernel (of=)")
        self.name = f"{kernel}_backward"
        self.keys = keys
        self.plan = plan
        self.results = results
        self.namespace = getattr(torch.ops, namespace)
        parameters = inspect.signature(reference).parameters
        names = tuple(parameters)
        schema = torch.library.infer_schema(reference, mutates_args=())
        arguments, returns = schema.split(") -> ", 1)
        ints = ", ".join(f"int {k.lower()}" for k in keys)
        schema = f"{arguments}{', ' if names and ints else ''}{ints}) -> {returns}"
        missing = [a.name for a in op.args if backward.renames.get(a.name, a.name) not in names
                   and a.default is REQUIRED]
        if missing:
            raise DeclarationError(
                f"{kernel}: the backward's arguments {names} lack {missing}, which the default config "
                f"reads; name the backward argument that holds each in renames")
        #: per forward argument, the position of the backward argument holding it (None: its default)
        self.sources = tuple(names.index(backward.renames.get(a.name, a.name))
                             if backward.renames.get(a.name, a.name) in names else None for a in op.args)
        self.defaults = tuple(a.default for a in op.args)
        self.launches = Launches(OnDevice(plan, 0), BodyConfig(keys, op, default_config, self.forward_args))
        self.first = next(i for i, p in enumerate(parameters.values()) if "Tensor" in str(p.annotation))
        self.op = torch.library.custom_op(f"{namespace}::{self.name}", self.body, mutates_args=(), schema=schema)
        self.op.register_fake(self.fake)
        #: the ops whose autograd runs this backward (``Backward.of`` adds to its kernel's)
        self.users = [op.name]
        self.reference = reference
        self.count = len(names)
        self.second_order = backward.second_order
        if self.second_order:
            self.op.register_autograd(self._second_order, setup_context=self._save_inputs)
        else:
            self.op.register_autograd(self._first_order_only, setup_context=self._save_nothing)
        _BACKWARDS.append(self)

    def forward_args(self, args: tuple) -> tuple:
        """The forward's arguments the default config reads, from the backward's ``args``."""
        return tuple(self.defaults[i] if s is None else args[s] for i, s in enumerate(self.sources))

    def body(self, *values: Any) -> Any:
        """The backward custom op's body: its launches, or its reference on float64 inputs."""
        args = values[:self.count]
        if args[self.first].dtype == torch.float64:
            return self.reference(*args)
        return self.launches.run(args, values[self.count:])

    def fake(self, *values: Any) -> Any:
        return self.results(*values[:self.count])

    def _save_inputs(self, ctx: Any, inputs: tuple, output: Any) -> None:
        values = inputs[:self.count]
        ctx.positions = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
        ctx.save_for_backward(*(values[i] for i in ctx.positions))
        ctx.values = [None if isinstance(v, torch.Tensor) else v for v in values]
        ctx.config_count = len(inputs) - self.count

    def _second_order(self, ctx: Any, *grads: Any) -> tuple:
        """The gradients of the backward's inputs: autograd through its reference, recomputed on
        detached copies of the saved inputs (the engine takes each gradient on to the input's own
        node). Under ``create_graph=True`` they are marked so that a third order raises: their
        graph would end at the copies, not reach the op's inputs."""
        result = [None] * (self.count + ctx.config_count)
        wanted = [i for i in ctx.positions if ctx.needs_input_grad[i]]
        if not wanted:
            return tuple(result)
        create = torch.is_grad_enabled()
        args = list(ctx.values)
        for i, t in zip(ctx.positions, ctx.saved_tensors):
            args[i] = t.detach().requires_grad_(i in wanted)
        with torch.enable_grad():
            outputs = self.reference(*args)
        outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        if pairs:
            got = torch.autograd.grad([o for o, _ in pairs], [args[i] for i in wanted], [g for _, g in pairs],
                                      allow_unused=True, create_graph=create)
            for i, g in zip(wanted, got):
                result[i] = SecondOrderOnly.apply(g, ", ".join(self.users)) if create and g is not None else g
        return tuple(result)

    @staticmethod
    def _save_nothing(ctx: Any, inputs: tuple, output: Any) -> None:
        pass

    def _first_order_only(self, ctx: Any, *grads: Any) -> tuple:
        users = ", ".join(self.users)
        first = sorted({u for b in _BACKWARDS if not b.second_order for u in b.users})
        second = sorted({u for b in _BACKWARDS if b.second_order for u in b.users})
        raise NoDoubleBackwardError(
            f"{users}: a gradient of its gradients (create_graph=True, then a backward through the gradients "
            f"it gave) is not supported: its backward kernels give first-order gradients only. First order "
            f"only: {', '.join(first)}; second order too: {', '.join(second) or 'none'}. Where second-order "
            f"gradients are needed, compute {users} in torch (its op's reference)")

    def run(self, ints: tuple, *args: Any) -> Any:
        """The backward on ``args`` with the forward's config ``ints``: its body at once in plain
        eager autograd, else through the custom op (looked up each time: tests may wrap it)."""
        return run_backward(getattr(self.namespace, self.name), self.body, *args, *ints)


class Autograd:
    """A kernel custom op's autograd formula: :meth:`save` keeps what the :class:`Backward` names,
    :meth:`formula` runs its ``gradients``. An argument that requires grad and gets no gradient
    from ``gradients`` (a table the op declares not differentiable) is named once by a
    :class:`~dlcore.runtime.torch_ops.NoGradientWarning`, never left without one silently."""

    def __init__(self, name: str, backward: Backward, backward_op: BackwardOp, names: tuple[str, ...],
                 outputs: tuple[str, ...], config_count: int):
        index = {n: i for i, n in enumerate(names)}
        unknown = [n for n in (*backward.saved, *backward.saved_for,
                               *(x for v in backward.saved_for.values() for x in v))
                   if n not in index and n not in outputs]
        if unknown:
            raise DeclarationError(f"{name}: Backward names {unknown}, neither arguments {names} nor outputs {outputs}")
        self.name = name
        self.backward = backward
        self.backward_op = backward_op
        self.names = names
        self.outputs = outputs
        self.single = len(outputs) == 1
        self.saved_for = tuple((index[n], extra) for n, extra in backward.saved_for.items())
        self.none = (None,) * config_count
        self.residuals = backward.residuals

    def setup_context(self, ctx: Any, inputs: tuple, output: Any) -> None:
        """The custom op's ``setup_context``."""
        self.save(ctx, inputs, output, ctx.needs_input_grad)

    def save(self, ctx: Any, inputs: tuple, output: Any, needs: tuple[bool, ...]) -> None:
        """Keep on ``ctx`` what the formula reads: the named arguments and outputs, those of
        ``saved_for`` whose argument ``needs`` a gradient, and the config ints."""
        named = dict(zip(self.names, inputs))
        residuals = self.residuals
        if residuals is not None and not (residuals.shown_by is not None and named.get(residuals.shown_by)):
            # The residuals the caller never sees get no gradient: None reaches the formula where
            # autograd would otherwise allocate and zero-fill one the size of each (an MLP's [M, N]
            # pre-activations: two fills and their memory every backward).
            ctx.set_materialize_grads(False)
        named.update(zip(self.outputs, (output,) if self.single else output))
        keep = list(self.backward.saved)
        for i, extra in self.saved_for:
            if needs[i]:
                keep.extend(n for n in extra if n not in keep)
        tensors = [n for n in keep if isinstance(named[n], torch.Tensor)]
        ctx.save_for_backward(*(named[n] for n in tensors))
        ctx.tensor_names = tensors
        ctx.values = {n: named[n] for n in keep if n not in tensors}
        ctx.config = inputs[len(self.names):]
        ctx.needs = needs

    def formula(self, ctx: Any, *grads: Any) -> tuple:
        """The gradients of the custom op's inputs (None for the config ints)."""
        names = self.names
        if all(g is None for g in grads):  # no gradient reached any output (gradcheck asks): none out
            return (None,) * (len(names) + len(self.none))
        saved = SimpleNamespace(**ctx.values, **dict(zip(ctx.tensor_names, ctx.saved_tensors)))
        needs = ctx.needs
        got = self.backward.gradients(functools.partial(self.backward_op.run, ctx.config), saved, grads,
                                      dict(zip(names, needs)))
        result = tuple(got.get(n) for n in names)
        for n, need, grad in zip(names, needs, result):
            if need and grad is None:
                warn_no_gradient(self.name, n)
        return (*result, *self.none)


class EagerForward(torch.autograd.Function):
    """A kernel custom op's body and autograd formula as a ``torch.autograd.Function``, the kernel
    its first argument: what an eager training call runs
    (:func:`~dlcore.runtime.torch_ops.plain_eager_forward`), sparing the custom-op dispatcher's tens
    of microseconds a call; the same :class:`Autograd`, so the gradients are the custom op's. Each
    kernel runs a subclass named ``<op>_eager`` (its nodes read ``<op>_eagerBackward``)."""

    @staticmethod
    def forward(ctx: Any, kernel: Any, *values: Any) -> Any:
        # forward(ctx, ...) rather than a separate setup_context: Function.apply then binds no
        # signature (inspect.signature) on every call
        output = kernel.forward(*values)
        ctx.autograd = kernel.autograd
        kernel.autograd.save(ctx, values, output, ctx.needs_input_grad[1:])
        return output

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple:
        return (None, *ctx.autograd.formula(ctx, *grads))


class Capture:
    """Stands for a backward op inside an autograd formula: keeps the arguments it is called with
    and returns its outputs, allocated (the formula's result is not used)."""

    def __init__(self, backward_op: BackwardOp):
        self.backward_op = backward_op
        self.calls: list[tuple] = []

    def __call__(self, *args: Any) -> Any:
        self.calls.append(args)
        return self.backward_op.results(*args)
