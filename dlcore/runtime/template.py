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
- **its autograd** (with a :class:`~dlcore.runtime.backward.Backward`;
  :class:`~dlcore.runtime.autograd.Autograd`): the named arguments and outputs
  saved, the backward custom op ``<ns>::<op>_backward`` (schema: the backward reference's annotated
  signature, then the same config ints), launched directly in plain eager autograd and through the
  op where a tracer watches (:func:`~dlcore.runtime.torch_ops.run_backward`); with
  :class:`~dlcore.runtime.backward.Residuals`, the custom op also returns what the forward
  computes for the backward alone (saved, never shown to callers). An argument that requires grad
  and gets no gradient (a table declared not differentiable) is named by a
  :class:`~dlcore.runtime.torch_ops.NoGradientWarning`; a gradient of the gradients
  (``create_graph=True``) runs autograd through the backward's reference where
  ``Backward.second_order`` says it may, and raises :class:`~dlcore.errors.NoDoubleBackwardError`
  elsewhere;
- **the implementation** (a :class:`~dlcore.runtime.torch_ops.CustomOpTritonImplementation`): the
  inference path launches the plan directly, the training path calls the custom op with the selected
  config; its ``backward_plan`` (what ``dlcore lower`` compiles) comes from the backward's own
  formula run on made-up output gradients;
- **the public function** ``KERNEL.function`` (a
  :class:`~dlcore.runtime.public_function.PublicFunction`): the op's signature;
  validation, the heuristic config and the implementation's ``run``, with no dispatcher; under
  ``torch.compile`` tracing the custom op alone (one node, no graph break);
- **the plugin hooks** ``dlcore_ops`` and ``dlcore_implementations``.

Each part lives in the module that owns it: the declarations a kernel module writes
(:mod:`~dlcore.runtime.backward`), the backward custom op and the autograd formula
(:mod:`~dlcore.runtime.autograd`), the custom op's schema and body config
(:mod:`~dlcore.runtime.schema`), a plan's device profile (:mod:`~dlcore.runtime.profile`), the
public function (:mod:`~dlcore.runtime.public_function`); this module puts them together.

Hardware comes from the device profile, never from constants in kernels. A plan is called as
``plan(args, config, profile)`` and a space as ``space(profile)``, ``profile`` being the
:class:`~dlcore.declarations.device.DeviceProfile` of the device the inputs live on, as the backend
that owns it describes it (:meth:`Registry.profile <dlcore.plugins.registry.Registry.profile>`, the
object the dispatcher's ``Call`` carries): tuning passes ``Call.profile`` to the space, the runner
of a bound op or a selection passes it to the plans, the public function passes its inputs'
device's; the custom op's body, which has no call, looks it up by its inputs' device. Where no
available backend owns the device (meta tensors while lowering, a space asked for without a
device) it is :data:`UNKNOWN_DEVICE`: no cores known and every limit 0, and a limit of 0 bounds
nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import torch

from dlcore.declarations.device import UNKNOWN_DEVICE, DeviceProfile
from dlcore.declarations.implementation import Config, LaunchPlan, LoweringLimit
from dlcore.declarations.op import Op, ScalarArg, TensorArg
from dlcore.declarations.signature import Signature
from dlcore.declarations.space import SearchSpace
from dlcore.errors import DeclarationError
from dlcore.plugins.hookspecs import hookimpl
from dlcore.runtime.autograd import Autograd, BackwardOp, Capture, EagerForward
from dlcore.runtime.backward import Backward, Plan, Residuals
from dlcore.runtime.profile import OnDevice, device_profile
from dlcore.runtime.public_function import PublicFunction
from dlcore.runtime.schema import BodyConfig, first_tensor, returns, same, scalar_type
from dlcore.runtime.torch_ops import CustomOpTritonImplementation, Launches, plain_eager_forward

__all__ = ["UNKNOWN_DEVICE", "Backward", "Kernel", "Residuals", "define_kernel", "device_profile"]


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
        self.first = first_tensor(op)
        self.converters = tuple(None if isinstance(a, TensorArg) else scalar_type(a)[1]
                                for a in op.args if a.name != inplace)
        self.zeros = (0,) * len(keys)
        planned = OnDevice(plan, self.first)
        # The custom op's body: the kernel's plan, or the one that also computes the residuals.
        self.reference = op.reference if self.residuals is None else self.residuals.reference
        self.results = results if self.residuals is None else self.residuals.results
        body_plan = planned if self.residuals is None else OnDevice(self.residuals.plan, self.first)
        self.launches = Launches(body_plan, BodyConfig(keys, op, default_config, same), op.validate)
        self.custom_op = torch.library.custom_op(f"{namespace}::{op.name}", self.forward, mutates_args=(),
                                                 schema=self._schema(inplace))
        self.custom_op.register_fake(self.fake)
        self.ops = getattr(torch.ops, namespace)
        self.backward: BackwardOp | None = None  # the backward op this kernel declares
        self.backward_op = None
        self.declared_backward: Backward | None = None
        self.shared_backward: BackwardOp | None = None  # the one its autograd runs, its own or another's
        self.autograd: Autograd | None = None
        self.eager: type[EagerForward] | None = None
        self.differentiable = tuple(a.name for a in op.args if isinstance(a, TensorArg) and a.differentiable)
        if backward is not None:
            self._declare_backward(backward, namespace, default_config)
        self.implementation = CustomOpTritonImplementation(
            op.name, name, plan=plan, kernels=kernels, default_config=default_config, space=space,
            replayable=replayable, backward_plan=None if backward is None else self.backward_plan,
            custom_op=self.call_custom_op, dtypes=op.dtypes(), doc=doc, limits=limits,
        )
        self.function = PublicFunction(op, self.implementation, self.call_custom_op, first=self.first,
                                       differentiable=self.autograd is not None, module=plan.__module__)
        _kernels.add(self)

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
                     else f"{scalar_type(a)[0]} {a.name}" for a in self.op.args if a.name != inplace]
        arguments += [f"int {k.lower()}" for k in self.keys]
        return f"({', '.join(arguments)}) -> {returns(len(self.returned))}"

    def _declare_backward(self, backward: Backward, namespace: str,
                          default_config: Callable[[Signature, DeviceProfile], Config]) -> None:
        """The backward op (this kernel's own, or ``backward.of``'s) and the custom op's autograd."""
        if backward.of is None:
            backward_op = self.backward = BackwardOp(self.op.name, namespace, self.keys, self.op, backward,
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

    def backward_plan(self, args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
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
        capture = Capture(backward_op)
        backward.gradients(capture, SimpleNamespace(**{n: named[n] for n in backward.saved}), grads, needs)
        if not capture.calls:  # a formula that made these gradients in the forward (scaled residuals): nothing
            return LaunchPlan(calls=[], result=None)
        return backward_op.plan(capture.calls[0], config, profile)

    @hookimpl
    def dlcore_ops(self) -> list[Op]:
        return [self.op]

    @hookimpl
    def dlcore_implementations(self) -> list[CustomOpTritonImplementation]:
        return [self.implementation]

    def clear(self) -> None:
        """Forget what its calls remembered: the public function's heuristic configs and the
        recorded launches of its custom op and of the backward op it declares."""
        self.function.runner.clear()
        self.launches.clear()
        if self.backward is not None:
            self.backward.launches.clear()

    def __repr__(self) -> str:
        return f"<Kernel {self.op.name}: {self.custom_op}>"


#: every kernel made in this process (not kept alive by this set), for :func:`clear`
_kernels: weakref.WeakSet[Kernel] = weakref.WeakSet()


def clear() -> None:
    """Forget what every kernel's calls remembered (``dlcore.reset()``; :meth:`Kernel.clear`). The
    custom ops stay registered with torch, as long as the process."""
    for kernel in list(_kernels):
        kernel.clear()


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

    Its callables take the device profile: ``plan(args, config, profile)`` and ``space(profile)``,
    as a hand-made :class:`~dlcore.declarations.implementation.TritonImplementation`'s (a second
    implementation of an existing op) do.

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
