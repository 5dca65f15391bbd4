"""The kernel template: everything a Triton kernel module would otherwise repeat, made from its
op's declaration by one :func:`define_kernel` call, which returns a :class:`Kernel`.

A kernel module holds its ``@triton.jit`` code, its plans, its search space and heuristic default,
its reference, and::

    KERNEL = define_kernel(OP, plan, kernels=(rms_norm_kernel,), results=outputs,
                           default_config=default_config, space=space, backward=Backward(...))
    rms_norm = KERNEL.function
    dlcore_ops, dlcore_implementations = KERNEL.dlcore_ops, KERNEL.dlcore_implementations

What the :class:`Kernel` holds, each a method or a small object a debugger shows by name, ``<ns>``
being ``namespace`` (``dlblas`` for dlblas-kernels; a third party names its own):

- **the custom op** ``<ns>::<op>`` (its body :meth:`Kernel.forward`): its schema is the op's
  declared arguments (a ``TensorArg`` is a ``Tensor``, an optional one a ``Tensor?``; a
  ``ScalarArg`` a ``bool``, ``int``, ``float`` or ``str`` by its types, ``str?`` and so on when
  ``None`` is among them), less the ``inplace`` argument if one is named, then the launch config as
  trailing ``int`` arguments named after the space's parameters, lowercased (``block_m``,
  ``num_warps``). All zero means the heuristic default, computed in the body from the actual shapes.
  The body launches the plan, its launches recorded per exact input and replayed after
  (:class:`~dlcore.runtime.torch_ops.Launches`); float64 inputs take the reference (the path
  ``torch.autograd.gradcheck`` runs);
- **its fake** (:meth:`Kernel.fake`): ``op.validate`` (so bad inputs raise while ``torch.compile``
  traces), then ``results(*args)``, the outputs allocated as the plan allocates them;
- **its autograd** (with a :class:`Backward`; :class:`Autograd`): the named arguments and outputs
  saved, the backward custom op ``<ns>::<op>_backward`` (schema: the backward reference's annotated
  signature, then the same config ints), launched directly in plain eager autograd and through the
  op where a tracer watches (:func:`~dlcore.runtime.torch_ops.run_backward`); with
  :class:`Residuals`, the custom op also returns what the forward computes for the backward alone
  (saved, never shown to callers). An argument that requires grad and gets no gradient (a table
  declared not differentiable) is named by a :class:`~dlcore.runtime.torch_ops.NoGradientWarning`; a
  gradient of the gradients (``create_graph=True``) runs autograd through the backward's reference
  where ``Backward.second_order`` says it may, and raises
  :class:`~dlcore.errors.NoDoubleBackwardError` elsewhere;
- **the implementation** (a :class:`~dlcore.runtime.torch_ops.CustomOpTritonImplementation`): the
  inference path launches the plan directly, the training path calls the custom op with the selected
  config; its ``backward_plan`` (what ``dlcore lower`` compiles) comes from the backward's own
  formula run on made-up output gradients;
- **the public function** ``KERNEL.function`` (a :class:`PublicFunction`): the op's signature;
  validation, the heuristic config and the implementation's ``run``, with no dispatcher; under
  ``torch.compile`` tracing the custom op alone (one node, no graph break);
- **the plugin hooks** ``dlcore_ops`` and ``dlcore_implementations``.

Hardware comes from the device profile, never from constants in kernels. A plan is called as
``plan(args, config, profile)`` and a space as ``space(profile)``, ``profile`` being the
:class:`~dlcore.declarations.device.DeviceProfile` of the device the inputs live on, as the backend
that owns it describes it (:meth:`Registry.profile <dlcore.plugins.registry.Registry.profile>`, the
object the dispatcher's ``Call`` carries): tuning passes ``Call.profile`` to the space; plans look
it up by their inputs' device, once per device. Where no available backend owns the device (meta
tensors while lowering, a space asked for without a device) it is :data:`UNKNOWN_DEVICE`: no cores
known and every limit 0, and a limit of 0 bounds nothing.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from dlcore.declarations.device import UNKNOWN_DEVICE, DeviceProfile, planning_target
from dlcore.declarations.implementation import Config, LaunchPlan, LoweringLimit
from dlcore.declarations.op import REQUIRED, Op, ScalarArg, TensorArg
from dlcore.declarations.signature import Signature, make_signature
from dlcore.declarations.space import SearchSpace
from dlcore.errors import DeclarationError, InvalidInputError, NoDoubleBackwardError
from dlcore.plugins.hookspecs import hookimpl
from dlcore.plugins.registry import registry
from dlcore.runtime.replay import LIMIT, replay_key
from dlcore.runtime.torch_ops import (
    CustomOpTritonImplementation,
    Launches,
    plain_eager_forward,
    run_backward,
    warn_no_gradient,
)

#: ``plan(args, config, profile) -> LaunchPlan``
Plan = Callable[[tuple, Config, DeviceProfile], LaunchPlan]
#: ``gradients(backward, saved, grads, needs) -> {argument name: gradient}``: see :class:`Backward`
Gradients = Callable[[Callable[..., Any], SimpleNamespace, tuple, Mapping[str, bool]], Mapping[str, Any]]


def device_profile(device: torch.device) -> DeviceProfile:
    """The profile of ``device`` as its backend describes it, or :data:`UNKNOWN_DEVICE`
    (:meth:`Registry.device_profile <dlcore.plugins.registry.Registry.device_profile>`, remembered
    with the registry, which ``dlcore.reset()`` forgets); for ``meta`` tensors, the target being
    lowered for (:func:`~dlcore.declarations.device.planning_for`), if any."""
    if device.type == "meta":
        target = planning_target()
        if target is not None:
            return target
    return registry().device_profile(device)


@dataclass(frozen=True)
class Residuals:
    """Tensors a forward computes for its backward alone (an MLP's pre-activations, which the
    backward would otherwise recompute at the cost of a GEMM). The custom op returns them after the
    outputs and its autograd saves them under their names; the public function, bound ops and the
    inference path never compute them, and callers of the custom op (``torch.compile`` included)
    see only the outputs.

    :param names: the residuals' names (what ``Backward.saved`` may name), in order.
    :param plan: ``plan(args, config, profile)``: the forward's launches whose result is
        ``(*outputs, *residuals)`` (the custom op's body runs it instead of the kernel's plan).
    :param results: ``results(*args)``: ``(*outputs, *residuals)``, allocated (the fake).
    :param reference: ``reference(*args)``: ``(*outputs, *residuals)`` in torch, for float64 inputs.
    :param shown_by: the name of a ``bool`` argument that, when true, hands the residuals to the
        caller after the outputs (flash attention's ``return_lse``: the log-sum-exp its backward
        needs, which some callers want too). The kernel's own plan and reference then return them
        too, for that argument true.
    """

    names: tuple[str, ...]
    plan: Plan
    results: Callable[..., Any]
    reference: Callable[..., Any]
    shown_by: str | None = None


@dataclass(frozen=True)
class Backward:
    """A kernel's autograd formula, and the backward kernel it runs.

    :param gradients: ``gradients(backward, saved, grads, needs)`` returns the gradient of each
        differentiable argument by name (missing names: no gradient). ``backward(*args)`` runs the
        backward custom op on the backward's arguments (the config ints are appended);
        ``saved.<name>`` holds each saved argument or output; ``grads`` are the output gradients in
        order (zeros for an output the loss does not reach; but where the call keeps residuals
        from its caller, None for those and for any other output without a gradient);
        ``needs[name]`` says whether the gradient of that argument is wanted.
    :param saved: the names of the forward arguments and outputs the formula reads.
    :param saved_for: more names saved only when the gradient of a given argument is wanted
        (``{"cos": ("q", "k")}``: q and k, for cos's gradient, which models rarely ask for).
    :param plan: ``plan(args, config, profile)``, the backward's launches; its config is the forward's.
    :param reference: the backward in torch, for float64 inputs. Its annotated signature is the
        backward custom op's schema (before the config ints).
    :param results: ``results(*args)``: the backward's outputs, allocated (the fake implementation).
    :param renames: the forward arguments the default config reads, by the backward argument that
        holds them when their names differ (``{"q": "dq_out"}``: dq_out has q's shape); forward
        arguments the backward lacks take their declared defaults.
    :param of: run another kernel's backward op instead of declaring one (``add_rms_norm`` runs
        ``rms_norm``'s); then ``plan``, ``reference``, ``results`` and ``renames`` stay unset, and
        both kernels must have the same config keys.
    :param residuals: what the forward computes for this backward alone (see :class:`Residuals`).
    :param second_order: ``reference`` is a differentiable torch function of its tensor arguments
        (saved outputs included, whose gradients reach the forward's inputs through this same
        formula), so gradients of the gradients (``create_graph=True``, then a backward through
        them) are autograd's through it, on the backward's inputs. Without it such a backward
        raises :class:`~dlcore.errors.NoDoubleBackwardError`: the backward kernels give
        first-order gradients only. Declare it only where the reference differentiates to the
        op's true second derivatives (not where a residual the caller never sees, such as
        attention's lse, carries part of them).
    """

    gradients: Gradients
    saved: tuple[str, ...]
    saved_for: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    plan: Plan | None = None
    reference: Callable[..., Any] | None = None
    results: Callable[..., Any] | None = None
    renames: Mapping[str, str] = field(default_factory=dict)
    of: Kernel | None = None
    residuals: Residuals | None = None
    second_order: bool = False


def _scalar_type(arg: ScalarArg) -> tuple[str, Callable[[Any], Any]]:
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


def _returns(count: int) -> str:
    return "Tensor" if count == 1 else f"({', '.join(['Tensor'] * count)})"


def _first_tensor(op: Op) -> int:
    first = next((i for i, a in enumerate(op.args) if isinstance(a, TensorArg)), None)
    if first is None or op.args[first].optional:
        raise DeclarationError(f"{op.usage()}: a kernel's op needs a tensor argument first among its tensors "
                               f"that is not optional (it gives the device)")
    return first



def _same(args: tuple) -> tuple:
    """The forward's arguments of a forward body: its own."""
    return args


class _Configs:
    """A body's config from its trailing ints: the named values, or (all zero) the heuristic default
    for the forward arguments ``forward(args)`` computes from the body's."""

    __slots__ = ("keys", "op", "default_config", "forward", "first")

    def __init__(self, keys: tuple[str, ...], op: Op, default_config: Callable[[Signature, DeviceProfile], Config],
                 forward: Callable[[tuple], tuple]):
        self.keys, self.op, self.default_config, self.forward = keys, op, default_config, forward
        self.first = _first_tensor(op)

    def __call__(self, args: tuple, ints: tuple) -> Config:
        if any(ints):
            return dict(zip(self.keys, ints))
        forward = self.forward(args)
        device = forward[self.first].device
        return self.default_config(make_signature(self.op, forward, device), device_profile(device))


class _OnDevice:
    """``plan`` given the profile of its inputs' device: ``planned(args, config)``. It keeps the
    plan's name and module (the source hash in cache keys covers the kernel module, not this one)."""

    def __init__(self, plan: Plan, first: int):
        functools.update_wrapper(self, plan)
        self.plan = plan
        self.first = first

    def __call__(self, args: tuple, config: Config) -> LaunchPlan:
        return self.plan(args, config, device_profile(args[self.first].device))

    def __repr__(self) -> str:
        return f"<{self.plan.__module__}.{self.plan.__qualname__} on its inputs' device>"


class _SecondOrderOnly(torch.autograd.Function):
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


#: every backward op defined in this process, for the ops :class:`NoDoubleBackwardError` lists
_BACKWARDS: list[_BackwardOp] = []


class _BackwardOp:
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
        self.launches = Launches(_OnDevice(plan, 0), _Configs(keys, op, default_config, self.forward_args))
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
                result[i] = _SecondOrderOnly.apply(g, ", ".join(self.users)) if create and g is not None else g
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


class _Implementation(CustomOpTritonImplementation):
    """A template kernel's implementation: its space takes the device profile."""

    def __init__(self, *args: Any, space_of: Callable[[DeviceProfile], SearchSpace] | None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._space_of = space_of

    def space(self, profile: DeviceProfile | None = None) -> SearchSpace | None:
        return None if self._space_of is None else self._space_of(profile or UNKNOWN_DEVICE)


class Autograd:
    """A kernel custom op's autograd formula: :meth:`save` keeps what the :class:`Backward` names,
    :meth:`formula` runs its ``gradients``. An argument that requires grad and gets no gradient
    from ``gradients`` (a table the op declares not differentiable) is named once by a
    :class:`~dlcore.runtime.torch_ops.NoGradientWarning`, never left without one silently."""

    def __init__(self, name: str, backward: Backward, backward_op: _BackwardOp, names: tuple[str, ...],
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
    def forward(ctx: Any, kernel: Kernel, *values: Any) -> Any:
        # forward(ctx, ...) rather than a separate setup_context: Function.apply then binds no
        # signature (inspect.signature) on every call
        output = kernel.forward(*values)
        ctx.autograd = kernel.autograd
        kernel.autograd.save(ctx, values, output, ctx.needs_input_grad[1:])
        return output

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple:
        return (None, *ctx.autograd.formula(ctx, *grads))


class _Capture:
    """Stands for a backward op inside an autograd formula: keeps the arguments it is called with
    and returns its outputs, allocated (the formula's result is not used)."""

    def __init__(self, backward_op: _BackwardOp):
        self.backward_op = backward_op
        self.calls: list[tuple] = []

    def __call__(self, *args: Any) -> Any:
        self.calls.append(args)
        return self.backward_op.results(*args)


class Kernel:
    """A Triton kernel as :func:`define_kernel` makes it from its op's declaration (see the module
    docstring): ``op``, ``implementation``, the public ``function``, the custom op ``custom_op``
    (body :meth:`forward`, fake :meth:`fake`, autograd ``autograd``), the backward op
    (``backward``, ``backward_op``), and the plugin hooks."""

    def __init__(self, op: Op, plan: Plan, *, kernels: tuple, results: Callable[..., Any],
                 default_config: Callable[[Signature, DeviceProfile], Config],
                 space: Callable[[DeviceProfile], SearchSpace] | None, backward: Backward | None,
                 outputs: tuple[str, ...], inplace: str | None, namespace: str, name: str, replayable: bool,
                 doc: str, limits: tuple[LoweringLimit, ...]):
        space_params = space(UNKNOWN_DEVICE) if space is not None else None
        keys = () if space_params is None else (*space_params.names, *space_params.fixed)
        names = tuple(a.name for a in op.args if a.name != inplace)
        taken = {k.lower() for k in keys} & set(names)
        if taken or len({k.lower() for k in keys}) != len(keys):
            raise DeclarationError(
                f"{op.name}: config keys {keys} collide, lowercased, with each other or the arguments {names}")
        self.op = op
        self.keys = keys
        self.names = names
        self.count = len(names)
        self.outputs = outputs
        self.residuals = backward.residuals if backward is not None else None
        self.returned = outputs if self.residuals is None else (*outputs, *self.residuals.names)
        position = {a.name: i for i, a in enumerate(op.args)}
        self.inplace_at = position.get(inplace) if inplace is not None else None
        self.shown_at = self._shown_at(position)
        self.first = _first_tensor(op)
        self.converters = tuple(None if isinstance(a, TensorArg) else _scalar_type(a)[1]
                                for a in op.args if a.name != inplace)
        self.zeros = (0,) * len(keys)
        planned = _OnDevice(plan, self.first)
        # The custom op's body: the kernel's plan, or the one that also computes the residuals.
        self.reference = op.reference if self.residuals is None else self.residuals.reference
        self.results = results if self.residuals is None else self.residuals.results
        body_plan = planned if self.residuals is None else _OnDevice(self.residuals.plan, self.first)
        self.launches = Launches(body_plan, _Configs(keys, op, default_config, _same), op.validate)
        self.custom_op = torch.library.custom_op(f"{namespace}::{op.name}", self.forward, mutates_args=(),
                                                 schema=self._schema(inplace))
        self.custom_op.register_fake(self.fake)
        self.ops = getattr(torch.ops, namespace)
        self.backward: _BackwardOp | None = None  # the backward op this kernel declares
        self.backward_op = None
        self.declared_backward: Backward | None = None
        self.shared_backward: _BackwardOp | None = None  # the one its autograd runs, its own or another's
        self.autograd: Autograd | None = None
        self.eager: type[EagerForward] | None = None
        self.differentiable = tuple(a.name for a in op.args if isinstance(a, TensorArg) and a.differentiable)
        if backward is not None:
            self._declare_backward(backward, namespace, default_config)
        self.implementation = _Implementation(
            op.name, name, plan=planned, kernels=kernels, default_config=default_config, space_of=space,
            replayable=replayable, backward_plan=None if backward is None else self.backward_plan,
            custom_op=self.call_custom_op, dtypes=op.dtypes(), doc=doc, limits=limits,
        )
        self.function = PublicFunction(self, plan.__module__)

    def _shown_at(self, position: Mapping[str, int]) -> int | None:
        """The position of ``Residuals.shown_by`` among the op's arguments, if it names one."""
        if self.residuals is None or self.residuals.shown_by is None:
            return None
        at = position.get(self.residuals.shown_by)
        if at is None or not isinstance(self.op.args[at], ScalarArg):
            raise DeclarationError(f"{self.op.name}: Residuals.shown_by names {self.residuals.shown_by!r}, which "
                                   f"is not one of its scalar arguments")
        return at

    def _schema(self, inplace: str | None) -> str:
        """The custom op's schema: the op's arguments less ``inplace``, then the config ints."""
        arguments = [f"Tensor{'?' if a.optional else ''} {a.name}" if isinstance(a, TensorArg)
                     else f"{_scalar_type(a)[0]} {a.name}" for a in self.op.args if a.name != inplace]
        arguments += [f"int {k.lower()}" for k in self.keys]
        return f"({', '.join(arguments)}) -> {_returns(len(self.returned))}"

    def _declare_backward(self, backward: Backward, namespace: str,
                          default_config: Callable[[Signature, DeviceProfile], Config]) -> None:
        """The backward op (this kernel's own, or ``backward.of``'s) and the custom op's autograd."""
        if backward.of is None:
            backward_op = self.backward = _BackwardOp(self.op.name, namespace, self.keys, self.op, backward,
                                                      default_config)
            self.backward_op = backward_op.op
        else:
            backward_op = backward.of.backward
            if backward_op is None or backward_op.keys != self.keys:
                raise DeclarationError(
                    f"{self.op.name}: backward of {backward.of.op.name} needs its backward op and the same "
                    f"config keys ({self.keys})")
            backward_op.users.append(self.op.name)
        self.declared_backward = backward
        self.shared_backward = backward_op
        self.autograd = Autograd(self.op.name, backward, backward_op, self.names, self.returned, len(self.keys))
        self.custom_op.register_autograd(self.autograd.formula, setup_context=self.autograd.setup_context)
        self.eager = type(f"{self.op.name}_eager", (EagerForward,), {"__module__": __name__})

    def full(self, values: Sequence[Any]) -> tuple:
        """The op's arguments from the custom op's: the ``inplace`` one put back, false."""
        at = self.inplace_at
        return tuple(values) if at is None else (*values[:at], False, *values[at:])

    def forward(self, *values: Any) -> Any:
        """The custom op's body: the plan's launches, replayed per exact input; float64 inputs take
        the reference."""
        args = self.full(values[:self.count])
        if args[self.first].dtype == torch.float64:
            return self.reference(*args)
        return self.launches.run(args, values[self.count:])

    def fake(self, *values: Any) -> Any:
        """The custom op's fake: the inputs validated, the outputs allocated."""
        args = self.full(values[:self.count])
        if args[self.first].dtype != torch.float64:
            self.op.validate(args)
        return self.results(*args)

    def call_custom_op(self, args: tuple, config: Config | None) -> Any:
        """The op's bound ``args`` through the custom op with ``config`` (None: its heuristic
        default), as an eager ``autograd.Function`` where nothing traces; the residuals dropped
        unless shown, the results copied into the inputs for ``inplace``."""
        ints = self.zeros if config is None else tuple(int(config[k]) for k in self.keys)
        at = self.inplace_at
        values = [a if c is None else c(a)
                  for c, a in zip(self.converters, (a for i, a in enumerate(args) if i != at))]
        if self.eager is not None and plain_eager_forward(values):
            result = self.eager.apply(self, *values, *ints)
        else:
            result = getattr(self.ops, self.op.name)(*values, *ints)
        if self.residuals is not None and not (self.shown_at is not None and args[self.shown_at]):
            result = result[0] if len(self.outputs) == 1 else result[:len(self.outputs)]
        if at is not None and args[at]:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            return tuple(t.copy_(r) for t, r in zip(tensors, result))
        return result

    def backward_plan(self, args: tuple, config: Config) -> LaunchPlan:
        """The backward's launches for the forward's bound ``args`` (``dlcore lower``): the formula
        run on made-up output gradients, every declared-differentiable argument wanted, its backward
        call captured and planned instead of run."""
        backward, backward_op = self.declared_backward, self.shared_backward
        single = len(self.returned) == 1
        made = self.results(*args)
        made = (made,) if single else tuple(made)
        grads = self.results(*args)
        grads = (grads,) if single else tuple(grads)
        named = {**{a.name: v for a, v in zip(self.op.args, args)}, **dict(zip(self.returned, made))}
        needs = {a.name: a.name in self.differentiable for a in self.op.args}
        capture = _Capture(backward_op)
        backward.gradients(capture, SimpleNamespace(**{n: named[n] for n in backward.saved}), grads, needs)
        return backward_op.plan(capture.calls[0], config, device_profile(args[self.first].device))

    @hookimpl
    def dlcore_ops(self) -> list[Op]:
        return [self.op]

    @hookimpl
    def dlcore_implementations(self) -> list[CustomOpTritonImplementation]:
        return [self.implementation]

    def __repr__(self) -> str:
        return f"<Kernel {self.op.name}: {self.custom_op}>"


def define_kernel(
    op: Op,
    plan: Plan,
    *,
    kernels: tuple,
    results: Callable[..., Any],
    default_config: Callable[[Signature, DeviceProfile], Config],
    space: Callable[[DeviceProfile], SearchSpace] | None = None,
    backward: Backward | None = None,
    outputs: tuple[str, ...] = ("out",),
    inplace: str | None = None,
    namespace: str = "dlblas",
    name: str = "triton",
    replayable: bool = True,
    doc: str = "",
    limits: tuple[LoweringLimit, ...] = (),
) -> Kernel:
    """``op``'s :class:`Kernel`: its custom op, fake, autograd, implementation, public function and
    hooks (see the module docstring).

    Its callables take the device profile: ``plan(args, config, profile)`` and ``space(profile)``.
    A hand-made :class:`~dlcore.declarations.implementation.TritonImplementation` (a second
    implementation of an existing op) takes ``plan(args, config)`` and ``space()`` instead.

    :param plan: ``plan(args, config, profile)``: the launches for the op's bound ``args``.
    :param kernels: the ``@triton.jit`` functions the plans launch (lowering, source hash).
    :param results: ``results(*args)``: the outputs, allocated as the plan allocates them (the fake).
    :param default_config: ``(signature, profile) -> config``, the heuristic default.
    :param space: ``space(profile)``: the search space; its parameters name the config ints. None:
        nothing to tune, the custom op takes no config ints.
    :param backward: the autograd formula; None: forward only (on inputs that require grad it warns
        once, ``ForwardOnlyWarning``, and its outputs carry no gradient).
    :param outputs: the outputs' names, in order (what ``Backward.saved`` may name).
    :param inplace: the name of a ``bool`` argument that, when true, writes the results into the
        leading tensor arguments: the custom op stays functional (the argument is not in its schema)
        and the call copies the results (autograd records the copies; ``torch.compile`` sees input
        mutations).
    :param namespace: the custom ops' namespace: ``dlblas`` is dlblas-kernels'; a third party names its own.
    :param replayable: the plan depends only on the exact input (see ``TritonImplementation``).
    :param doc: the implementation's one-line description (``dlcore ops``).
    :param limits: the kernels a backend's compiler cannot lower, and why (``dlcore ops``).
    """
    return Kernel(op, plan, kernels=kernels, results=results, default_config=default_config, space=space,
                  backward=backward, outputs=outputs, inplace=inplace, namespace=namespace, name=name,
                  replayable=replayable, doc=doc, limits=limits)


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

    The heuristic config is worked out once per exact input metadata
    (:func:`~dlcore.runtime.replay.replay_key`, the key the launches replay by), at most
    :data:`~dlcore.runtime.replay.LIMIT` of them, the oldest dropped first; a call with another key
    pays the signature and the heuristic, several times the key's cost."""

    def __init__(self, kernel: Kernel, module: str):
        op = kernel.op
        if not all(n.isidentifier() for n in (op.name, *(a.name for a in op.args))):
            raise DeclarationError(f"{op.usage()}: the op and its arguments need Python identifiers as names")
        self.kernel = kernel
        self.op = op
        implementation = kernel.implementation
        self.validate, self.default_config, self.run = op.validate, implementation.default_config, implementation.run
        # Compiled kernels cannot read host memory; the interpreter (TRITON_INTERPRET=1 when triton was
        # first imported) runs them on the CPU. Fixed for the process when the kernels are made.
        self.on_cpu = implementation.interpreted
        self.configs: dict[tuple, Config] = {}
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
            + (f"differentiable in {wrt}" if kernel.autograd is not None else "forward only")
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
            return self.kernel.call_custom_op(bound, None)
        first = bound[self.kernel.first]
        if (isinstance(first, torch.Tensor) and first.dtype == torch.float64 and self.kernel.autograd is not None
                and _all_float64(bound)):  # one dtype read on the hot path; the scan only for float64
            # the references, forward and backward (torch.autograd.gradcheck's inputs): the custom op's
            # body takes them for float64, so gradcheck checks the backward formula against them; a
            # float64 tensor beside other floats is refused by the validation below, as before
            return self.kernel.call_custom_op(bound, None)
        device = self.validate(bound)
        if device.type == "meta":
            # no data to run a kernel on: the custom op's fake gives the outputs' shapes, as torch's ops do
            return self.kernel.call_custom_op(bound, None)
        if device.type == "cpu" and not self.on_cpu:
            raise _on_the_cpu(self.op, bound)
        configs = self.configs
        key: tuple | None = replay_key(bound)
        try:
            config = configs.get(key)
        except TypeError:  # an argument that cannot be a key (a list, say): worked out each call
            key = config = None
        if config is None:
            config = self.default_config(make_signature(self.op, bound, device), device_profile(device))
            if key is not None:
                if len(configs) >= LIMIT:
                    del configs[next(iter(configs))]
                configs[key] = config
        return self.run(bound, config)

    def __get__(self, instance: Any, owner: type | None = None) -> PublicFunction:
        # A non-data descriptor, as a function is: help() and inspect read it as a routine (its
        # signature, its doc); as a class attribute it stays unbound.
        return self

    def __repr__(self) -> str:
        return f"<kernel function {self.__module__}.{self.__name__}{self.__signature__}>"
