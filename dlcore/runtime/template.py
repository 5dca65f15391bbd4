"""The kernel template: everything a Triton kernel module would otherwise repeat, generated from its
op's declaration by one :func:`define_kernel` call.

A kernel module holds its ``@triton.jit`` code, its plans, its search space and heuristic default,
its reference, and::

    KERNEL = define_kernel(OP, plan, kernels=(rms_norm_kernel,), results=outputs,
                           default_config=default_config, space=space, backward=Backward(...))
    rms_norm = KERNEL.function
    dlcore_ops, dlcore_implementations = KERNEL.dlcore_ops, KERNEL.dlcore_implementations

What it generates, ``<ns>`` being ``namespace`` (``dlblas`` for dlblas-kernels; a third party names
its own):

- **the custom op** ``<ns>::<op>``: its schema is the op's declared arguments (a ``TensorArg`` is a
  ``Tensor``, an optional one a ``Tensor?``; a ``ScalarArg`` a ``bool``, ``int``, ``float`` or
  ``str`` by its types, ``str?`` and so on when ``None`` is among them), less the ``inplace``
  argument if one is named, then the launch config as trailing ``int`` arguments named after the
  space's parameters, lowercased (``block_m``, ``num_warps``). All zero means the heuristic
  default, computed in the body from the actual shapes. The body launches the plan, its launches
  recorded per exact input and replayed after (:class:`~dlcore.runtime.torch_ops.Launches`);
  float64 inputs take the reference (the path ``torch.autograd.gradcheck`` runs);
- **its fake**: ``op.validate`` (so bad inputs raise while ``torch.compile`` traces), then
  ``results(*args)``, the outputs allocated as the plan allocates them;
- **its autograd** (with a :class:`Backward`): the named arguments and outputs saved, the backward
  custom op ``<ns>::<op>_backward`` (schema: the backward reference's annotated signature, then the
  same config ints), launched directly in plain eager autograd and through the op where a tracer
  watches (:func:`~dlcore.runtime.torch_ops.run_backward`); with :class:`Residuals`, the custom op
  also returns what the forward computes for the backward alone (saved, never shown to callers).
  An argument that requires grad and gets no gradient (a table declared not differentiable) is
  named by a :class:`~dlcore.runtime.torch_ops.NoGradientWarning`; a gradient of the gradients
  (``create_graph=True``) runs autograd through the backward's reference where
  ``Backward.second_order`` says it may, and raises
  :class:`~dlcore.errors.NoDoubleBackwardError` elsewhere;
- **the implementation** (a :class:`~dlcore.runtime.torch_ops.CustomOpTritonImplementation`): the
  inference path launches the plan directly, the training path calls the custom op with the
  selected config; its ``backward_plan`` (what ``dlcore lower`` compiles) comes from the backward's
  own formula run on made-up output gradients;
- **the public function** ``KERNEL.function``: the op's signature; validation, the heuristic config
  and the implementation's ``run``, with no dispatcher; under ``torch.compile`` tracing the custom
  op alone (one node, no graph break);
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

from dlcore.declarations.device import DeviceProfile, planning_target
from dlcore.declarations.implementation import Config, LaunchPlan, LoweringLimit
from dlcore.declarations.op import REQUIRED, Op, ScalarArg, TensorArg
from dlcore.declarations.signature import Signature, make_signature
from dlcore.declarations.space import SearchSpace
from dlcore.errors import BackendUnavailableError, DeclarationError, InvalidInputError, NoDoubleBackwardError
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

#: the profile of a device no available backend owns: no cores known, no limit
UNKNOWN_DEVICE = DeviceProfile(backend="", vendor="", name="unknown device", arch="", cores=0)

_profiles: dict[torch.device, DeviceProfile] = {}


def device_profile(device: torch.device) -> DeviceProfile:
    """The profile of ``device`` as its backend describes it, or :data:`UNKNOWN_DEVICE`; for ``meta``
    tensors, the target being lowered for (:func:`~dlcore.declarations.device.planning_for`), if any."""
    if device.type == "meta":
        target = planning_target()
        if target is not None:
            return target
    profile = _profiles.get(device)
    if profile is None:
        reg = registry()
        try:
            profile = reg.profile(reg.backend_for(device), device)
        except BackendUnavailableError:
            profile = UNKNOWN_DEVICE
        _profiles[device] = profile
    return profile


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


def _on_device(plan: Plan, first: int) -> Callable[[tuple, Config], LaunchPlan]:
    """``plan`` given the profile of its inputs' device; it keeps the plan's name and module (the
    source hash in cache keys covers the kernel module, not this one)."""

    @functools.wraps(plan)
    def planned(args: tuple, config: Config) -> LaunchPlan:
        return plan(args, config, device_profile(args[first].device))

    return planned


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
        count = len(names)
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
        sources = [names.index(backward.renames.get(a.name, a.name)) if backward.renames.get(a.name, a.name) in names
                   else None for a in op.args]
        defaults = [a.default for a in op.args]

        def forward(args: tuple) -> tuple:
            return tuple(defaults[i] if s is None else args[s] for i, s in enumerate(sources))

        self.launches = Launches(_on_device(plan, 0), _Configs(keys, op, default_config, forward))
        first = next(i for i, p in enumerate(parameters.values()) if "Tensor" in str(p.annotation))
        launches = self.launches

        def body(*values: Any) -> Any:
            args = values[:count]
            if args[first].dtype == torch.float64:
                return reference(*args)
            return launches.run(args, values[count:])

        self.body = body
        self.op = torch.library.custom_op(f"{namespace}::{self.name}", body, mutates_args=(), schema=schema)
        self.op.register_fake(lambda *values: results(*values[:count]))
        #: the ops whose autograd runs this backward (``Backward.of`` adds to its kernel's)
        self.users = [op.name]
        self.reference = reference
        self.count = count
        self.second_order = backward.second_order
        if self.second_order:
            self.op.register_autograd(self._second_order, setup_context=self._save_inputs)
        else:
            self.op.register_autograd(self._first_order_only, setup_context=self._save_nothing)
        _BACKWARDS.append(self)

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


class Kernel:
    """What :func:`define_kernel` made: ``op``, ``implementation``, the public ``function``, the
    custom op ``custom_op`` (and ``backward_op``), and the plugin hooks."""

    def __init__(self, op: Op, implementation: CustomOpTritonImplementation, function: Callable[..., Any],
                 custom_op: Any, backward: _BackwardOp | None):
        self.op = op
        self.implementation = implementation
        self.function = function
        self.custom_op = custom_op
        self.backward = backward
        self.backward_op = backward.op if backward is not None else None

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
    """Generate ``op``'s custom op, fake, autograd, implementation, public function and hooks (see
    the module docstring).

    :param plan: ``plan(args, config, profile)``: the launches for the op's bound ``args``.
    :param kernels: the ``@triton.jit`` functions the plans launch (lowering, source hash).
    :param results: ``results(*args)``: the outputs, allocated as the plan allocates them (the fake).
    :param default_config: ``(signature, profile) -> config``, the heuristic default.
    :param space: ``space(profile)``: the search space; its parameters name the config ints. None:
        nothing to tune, the custom op takes no config ints.
    :param backward: the autograd formula; None: forward only (a backward through the op raises).
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
    space_params = space(UNKNOWN_DEVICE) if space is not None else None
    keys = () if space_params is None else (*space_params.names, *space_params.fixed)
    names = tuple(a.name for a in op.args if a.name != inplace)
    taken = {k.lower() for k in keys} & set(names)
    if taken or len({k.lower() for k in keys}) != len(keys):
        raise DeclarationError(
            f"{op.name}: config keys {keys} collide, lowercased, with each other or the arguments {names}")
    converters = []
    schema_args = []
    for a in op.args:
        if a.name == inplace:
            continue
        if isinstance(a, TensorArg):
            schema_args.append(f"Tensor{'?' if a.optional else ''} {a.name}")
            converters.append(None)
        else:
            kind, convert = _scalar_type(a)
            schema_args.append(f"{kind} {a.name}")
            converters.append(convert)
    residuals = backward.residuals if backward is not None else None
    returned = (*outputs, *residuals.names) if residuals is not None else outputs
    schema = f"({', '.join([*schema_args, *(f'int {k.lower()}' for k in keys)])}) -> {_returns(len(returned))}"
    position = {a.name: i for i, a in enumerate(op.args)}
    at = position.get(inplace) if inplace is not None else None
    shown_at = None
    if residuals is not None and residuals.shown_by is not None:
        shown_at = position.get(residuals.shown_by)
        if shown_at is None or not isinstance(op.args[shown_at], ScalarArg):
            raise DeclarationError(f"{op.name}: Residuals.shown_by names {residuals.shown_by!r}, which is not "
                                   f"one of its scalar arguments")
    count = len(names)
    first = _first_tensor(op)
    planned = _on_device(plan, first)
    # The custom op's body: the kernel's plan, or the one that also computes the residuals.
    reference = op.reference if residuals is None else residuals.reference
    body_results = results if residuals is None else residuals.results

    def full(values: Sequence[Any]) -> tuple:
        """The op's arguments from the custom op's: the ``inplace`` one put back, false."""
        return tuple(values) if at is None else (*values[:at], False, *values[at:])

    body_plan = planned if residuals is None else _on_device(residuals.plan, first)
    launches = Launches(body_plan, _Configs(keys, op, default_config, lambda args: args), op.validate)

    def forward(*values: Any) -> Any:
        args = full(values[:count])
        if args[first].dtype == torch.float64:
            return reference(*args)
        return launches.run(args, values[count:])

    def fake(*values: Any) -> Any:
        args = full(values[:count])
        if args[first].dtype != torch.float64:
            op.validate(args)
        return body_results(*args)

    custom_op = torch.library.custom_op(f"{namespace}::{op.name}", forward, mutates_args=(), schema=schema)
    custom_op.register_fake(fake)
    ops = getattr(torch.ops, namespace)
    zeros = (0,) * len(keys)

    eager: list[type[torch.autograd.Function]] = []  # set below when the op has a backward

    def call_custom_op(args: tuple, config: Config | None) -> Any:
        ints = zeros if config is None else tuple(int(config[k]) for k in keys)
        values = [a if c is None else c(a) for c, a in zip(converters, (a for i, a in enumerate(args) if i != at))]
        if eager and plain_eager_forward(values):
            result = eager[0].apply(*values, *ints)
        else:
            result = getattr(ops, op.name)(*values, *ints)
        if residuals is not None and not (shown_at is not None and args[shown_at]):
            result = result[0] if len(outputs) == 1 else result[:len(outputs)]
        if at is not None and args[at]:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            return tuple(t.copy_(r) for t, r in zip(tensors, result))
        return result

    backward_op = None
    backward_plan = None
    if backward is not None:
        if backward.of is None:
            backward_op = _BackwardOp(op.name, namespace, keys, op, backward, default_config)
        else:
            backward_op = backward.of.backward
            if backward_op is None or backward_op.keys != keys:
                raise DeclarationError(
                    f"{op.name}: backward of {backward.of.op.name} needs its backward op and the same "
                    f"config keys ({keys})")
            backward_op.users.append(op.name)
        setup_context, formula = _register_autograd(op.name, custom_op, backward, backward_op, names, returned,
                                                    len(keys))
        eager.append(_eager_function(op.name, forward, setup_context, formula))
        backward_plan = _backward_plan(op, backward, backward_op, body_results, returned, first)

    implementation = _Implementation(
        op.name, name, plan=planned, kernels=kernels, default_config=default_config, space_of=space,
        replayable=replayable, backward_plan=backward_plan, custom_op=call_custom_op, dtypes=op.dtypes(), doc=doc,
        limits=limits,
    )
    function = _public_function(op, implementation, call_custom_op, plan.__module__, backward is not None)
    return Kernel(op, implementation, function, custom_op, backward_op if backward and backward.of is None else None)


def _register_autograd(name: str, custom_op: Any, backward: Backward, backward_op: _BackwardOp,
                       names: tuple[str, ...], outputs: tuple[str, ...],
                       config_count: int) -> tuple[Callable[..., None], Callable[..., tuple]]:
    """``custom_op``'s autograd formula: save what ``backward`` names, run its ``gradients``;
    returns ``(setup_context, formula)``. An argument that requires grad and gets no gradient from
    ``gradients`` (a table the op declares not differentiable) is named once by a
    :class:`~dlcore.runtime.torch_ops.NoGradientWarning`, never left without one silently."""
    count = len(names)
    index = {n: i for i, n in enumerate(names)}
    unknown = [n for n in (*backward.saved, *backward.saved_for, *(x for v in backward.saved_for.values() for x in v))
               if n not in index and n not in outputs]
    if unknown:
        raise DeclarationError(
            f"{custom_op}: Backward names {unknown}, neither arguments {names} nor outputs {outputs}")
    saved_for = [(index[n], extra) for n, extra in backward.saved_for.items()]
    gradients = backward.gradients
    none = (None,) * config_count
    single = len(outputs) == 1

    residuals = backward.residuals

    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        named = dict(zip(names, inputs))
        if residuals is not None and not (residuals.shown_by is not None and named.get(residuals.shown_by)):
            # The residuals the caller never sees get no gradient: None reaches the formula where
            # autograd would otherwise allocate and zero-fill one the size of each (an MLP's [M, N]
            # pre-activations: two fills and their memory every backward).
            ctx.set_materialize_grads(False)
        named.update(zip(outputs, (output,) if single else output))
        keep = list(backward.saved)
        needs = ctx.needs_input_grad
        for i, extra in saved_for:
            if needs[i]:
                keep.extend(n for n in extra if n not in keep)
        tensors = [n for n in keep if isinstance(named[n], torch.Tensor)]
        ctx.save_for_backward(*(named[n] for n in tensors))
        ctx.tensor_names = tensors
        ctx.values = {n: named[n] for n in keep if n not in tensors}
        ctx.config = inputs[count:]

    def formula(ctx: Any, *grads: Any) -> tuple:
        if all(g is None for g in grads):  # no gradient reached any output (gradcheck asks): none out
            return (None,) * (count + config_count)
        saved = SimpleNamespace(**ctx.values, **dict(zip(ctx.tensor_names, ctx.saved_tensors)))
        needs = ctx.needs_input_grad
        got = gradients(functools.partial(backward_op.run, ctx.config), saved, grads, dict(zip(names, needs)))
        result = tuple(got.get(n) for n in names)
        for n, need, grad in zip(names, needs, result):
            if need and grad is None:
                warn_no_gradient(name, n)
        return (*result, *none)

    custom_op.register_autograd(formula, setup_context=setup_context)
    return setup_context, formula


def _eager_function(name: str, body: Callable[..., Any], setup_context: Callable[..., None],
                    formula: Callable[..., tuple]) -> type[torch.autograd.Function]:
    """The custom op's body and autograd formula as a ``torch.autograd.Function``: what an eager
    training call runs (:func:`~dlcore.runtime.torch_ops.plain_eager_forward`), sparing the
    custom-op dispatcher's tens of microseconds a call; the same setup and formula, so the
    gradients are the custom op's."""
    def forward(ctx: Any, *values: Any) -> Any:
        # forward(ctx, ...) rather than a separate setup_context: Function.apply then binds no
        # signature (inspect.signature) on every call
        output = body(*values)
        setup_context(ctx, values, output)
        return output

    return type(f"{name}_eager", (torch.autograd.Function,), {
        "forward": staticmethod(forward),
        "backward": staticmethod(formula),
    })


def _backward_plan(op: Op, backward: Backward, backward_op: _BackwardOp, results: Callable[..., Any],
                   outputs: tuple[str, ...], first: int) -> Callable[[tuple, Config], LaunchPlan]:
    """The backward's launches for the forward's bound ``args`` (``dlcore lower``): the formula run
    on made-up output gradients, every declared-differentiable argument wanted, its backward call
    captured and planned instead of run."""
    names = tuple(a.name for a in op.args)
    needs = {a.name: isinstance(a, TensorArg) and a.differentiable for a in op.args}

    def backward_plan(args: tuple, config: Config) -> LaunchPlan:
        made = results(*args)
        made = (made,) if len(outputs) == 1 else tuple(made)
        grads = results(*args)
        grads = (grads,) if len(outputs) == 1 else tuple(grads)
        named = {**dict(zip(names, args)), **dict(zip(outputs, made))}
        captured: list[tuple] = []

        def capture(*backward_args: Any) -> Any:
            captured.append(backward_args)
            return backward_op.results(*backward_args)

        backward.gradients(capture, SimpleNamespace(**{n: named[n] for n in backward.saved}), grads, needs)
        return backward_op.plan(captured[0], config, device_profile(args[first].device))

    return backward_plan


def _on_the_cpu(op: Op, bound: tuple) -> InvalidInputError:
    """The error of a public function called on CPU tensors whose kernels are compiled for a device."""
    name = next(a.name for a, value in zip(op.args, bound) if isinstance(value, torch.Tensor))
    return InvalidInputError(op.name, name, "is on the CPU, where compiled Triton kernels cannot read it",
                             "tensors on the device its kernels are compiled for (e.g. cuda)",
                             "TRITON_INTERPRET=1, set before triton is first imported, runs them on the CPU")


def _public_function(op: Op, implementation: CustomOpTritonImplementation,
                     call_custom_op: Callable[[tuple, Config | None], Any], module: str,
                     differentiable: bool) -> Callable[..., Any]:
    """The kernel's public function: a plain Python function with the op's parameters and defaults
    (Python checks the arity, as it does for a hand-written one), validated, the heuristic config,
    no dispatcher; under ``torch.compile`` tracing the custom op alone. The heuristic config is
    worked out once per exact input metadata (:func:`~dlcore.runtime.replay.replay_key`, the key the
    launches replay by), at most :data:`~dlcore.runtime.replay.LIMIT` of them, the oldest dropped
    first; a call with another key pays the signature and the heuristic, several times the key's cost."""
    if not all(n.isidentifier() for n in (op.name, *(a.name for a in op.args))):
        raise DeclarationError(f"{op.usage()}: the op and its arguments need Python identifiers as names")
    validate, default_config, run = op.validate, implementation.default_config, implementation.run
    # Compiled kernels cannot read host memory; the interpreter (TRITON_INTERPRET=1 when triton was
    # first imported) runs them on the CPU. Fixed for the process when the kernels are made.
    on_cpu = implementation.interpreted
    configs: dict[tuple, Config] = {}

    def call(bound: tuple) -> Any:
        if torch.compiler.is_compiling():
            return call_custom_op(bound, None)
        device = validate(bound)
        if device.type == "meta":
            # no data to run a kernel on: the custom op's fake gives the outputs' shapes, as torch's ops do
            return call_custom_op(bound, None)
        if device.type == "cpu" and not on_cpu:
            raise _on_the_cpu(op, bound)
        key: tuple | None = replay_key(bound)
        try:
            config = configs.get(key)
        except TypeError:  # an argument that cannot be a key (a list, say): worked out each call
            key = config = None
        if config is None:
            config = default_config(make_signature(op, bound, device), device_profile(device))
            if key is not None:
                if len(configs) >= LIMIT:
                    del configs[next(iter(configs))]
                configs[key] = config
        return run(bound, config)

    # Python's rule: a parameter keeps its default only if every later one has one too (ffn's optional
    # w1 and w3 come before the required rms_w: they are passed, as None where w13 replaces them).
    trailing = len(op.args)
    while trailing and op.args[trailing - 1].default is not REQUIRED:
        trailing -= 1
    defaults = {f"_default_{a.name}": a.default for a in op.args[trailing:]}
    parameters = ", ".join(f"{a.name}=_default_{a.name}" if f"_default_{a.name}" in defaults else a.name
                           for a in op.args)
    names = "".join(f"{a.name}, " for a in op.args)
    scope: dict[str, Any] = {"_call": call, **defaults}
    # The op's argument names are identifiers its declaration gave; the source holds nothing else.
    exec(f"def {op.name}({parameters}):\n    return _call(({names}))\n", scope)  # noqa: S102
    function = scope[op.name]
    function.__module__ = module
    wrt = ", ".join(op.args[i].name for i in op.differentiable())
    function.__doc__ = (
        f"{op.doc}.\n\nThe Triton kernel with its heuristic config (``dlcore.get_op`` selects and tunes); "
        + (f"differentiable in {wrt}" if differentiable else "forward only")
        + ", and one node under ``torch.compile``."
    )
    return function
