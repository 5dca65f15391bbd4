"""What a kernel module declares of its backward: :class:`Backward` (the autograd formula and the
backward kernel it runs) and :class:`Residuals` (what a forward computes for its backward alone), and
the callables they take (:data:`Plan`, :data:`Gradients`). :mod:`dlcore.runtime.autograd` makes
the backward custom op and the formula from them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Protocol

from dlcore.declarations.device import DeviceProfile
from dlcore.declarations.implementation import Config, LaunchPlan
from dlcore.declarations.op import Op

#: ``plan(args, config, profile) -> LaunchPlan``
Plan = Callable[[tuple, Config, DeviceProfile], LaunchPlan]
#: ``gradients(backward, saved, grads, needs) -> {argument name: gradient}``: see :class:`Backward`
Gradients = Callable[[Callable[..., Any], SimpleNamespace, tuple, Mapping[str, bool]], Mapping[str, Any]]


class DeclaredKernel(Protocol):
    """What ``Backward.of`` reads of another kernel (a :class:`~dlcore.runtime.template.Kernel`):
    its op, and the backward op it declares (None: it declares none)."""

    op: Op
    backward: Any


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
    of: DeclaredKernel | None = None
    residuals: Residuals | None = None
    second_order: bool = False
