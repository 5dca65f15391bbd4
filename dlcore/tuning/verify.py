"""Checking an op's result against its reference: for selection, tuning and ``dlcore check``.

The reference runs in float64 on the same inputs; the tolerance comes from the output dtype
(:data:`dlcore.testing.TOLERANCES`), scaled by the size of the reduction behind each element.
Integer outputs (indices) match exactly.

A training call (:attr:`~dlcore.declarations.signature.Signature.training`) is checked backward
too: the gradient of each input that is declared differentiable and requires grad, for fixed
random output gradients, against autograd through the float64 reference on the same output
gradients. The tolerances are the forward's table, of the least precise trained input's dtype,
relative to the gradient's largest element: a gradient element sums terms that cancel (a weight's,
over the tokens), so its rounding error follows the terms rather than what is left of them, and in
16-bit dtypes even torch's own composite misses an element-by-element tolerance. The reference's
gradient is the op's whole derivative, whichever formula and backward kernels an implementation
declares, so a wrong formula shows as well as a wrong kernel.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dlcore.declarations.op import Op
from dlcore.errors import NoBackwardError
from dlcore.testing import least_precise, randn, tolerance, upcast

#: why an implementation whose outputs carry no gradient cannot serve a training call
NO_GRADIENT = "its outputs carry no gradient: a forward-only implementation, in a call whose inputs require grad"
#: the seed of the output gradients a training call's check propagates back
GRADIENT_SEED = 0


class UncheckedWarning(UserWarning):
    """A training call's candidates were timed without the check of their results: the float64
    reference did not fit in the device's memory beside the inputs."""


def warn_unchecked(op: str, signature: str) -> None:
    """Say that ``op``'s candidates for ``signature`` go unchecked, and what checks them instead."""
    warnings.warn(f"dlcore: {op} ({signature}): the float64 reference does not fit in memory beside the inputs, so "
                  f"the candidates' outputs and gradients are not checked against it; `dlcore check {op} --training` "
                  f"checks them at smaller sizes", UncheckedWarning, stacklevel=4)


def as_tuple(x: Any) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def reference_result(op: Op, args: Sequence[Any]) -> tuple:
    """The op's reference on float64 copies of ``args``."""
    return as_tuple(op.reference(*upcast(*args)))


def reduce_dim_of(args: Sequence[Any]) -> int:
    """The longest last dimension among the tensor arguments: the length of the reductions an
    output element may sum over, which scales the tolerance."""
    return max((t.shape[-1] for t in args if isinstance(t, torch.Tensor) and t.dim()), default=1)


def gradient_dim_of(args: Sequence[Any]) -> int:
    """The longest dimension among the tensor arguments: a gradient element may sum over any
    dimension the forward contracts or broadcasts (a weight's over the tokens), which scales the
    tolerance of gradients as :func:`reduce_dim_of` does the forward's."""
    return max((max(t.shape) for t in args if isinstance(t, torch.Tensor) and t.dim()), default=1)


def max_abs_error(actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> float:
    """The largest absolute difference between paired tensors, both upcast to float64 (float8
    included, which takes part in no arithmetic of its own); 0 for tensors without elements."""
    return max(((a.detach().double().cpu() - e.detach().double().cpu()).abs().max().item()
                for a, e in zip(actual, expected) if a.numel() and a.shape == e.shape), default=0.0)


def mismatch(actual: Any, expected: Sequence[torch.Tensor], reduce_dim: int = 1,
             labels: Sequence[str] | None = None, *, dtype: torch.dtype | None = None,
             by_largest: bool = False) -> str | None:
    """``None`` if ``actual`` matches the float64 ``expected`` within tolerance, else what differs.
    ``labels`` name the tensors in the message (default ``output 0``, ``output 1``, ...); ``dtype``
    gives the tolerance of that dtype instead of each tensor's own.

    The relative tolerance scales each element's own magnitude; with ``by_largest``, the largest
    magnitude of its tensor, for sums whose terms cancel (gradients), where an element's rounding
    error follows the terms it sums rather than what is left of them."""
    actual = as_tuple(actual)
    if len(actual) != len(expected):
        return f"{len(actual)} outputs, expected {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected)):
        label = labels[i] if labels is not None else f"output {i}"
        if tuple(a.shape) != tuple(e.shape):
            return f"{label} has shape {tuple(a.shape)}, expected {tuple(e.shape)}"
        if not a.is_floating_point():  # indices and counts: exactly
            differs = a.detach().cpu() != e.detach().cpu()
            if differs.any():
                return f"{label}: {int(differs.sum())} of {differs.numel()} elements differ"
            continue
        atol, rtol = tolerance(dtype or a.dtype, reduce_dim)
        a64, e64 = a.detach().double().cpu(), e.detach().double().cpu()
        if torch.isnan(a64).any() and not torch.isnan(e64).any():
            return f"{label} holds NaN"
        magnitude = e64.abs().max() if by_largest and e64.numel() else e64.abs()
        bad = (a64 - e64).abs() > atol + rtol * magnitude
        if bad.any():
            worst = (a64 - e64).abs().max().item()
            return f"{label}: {int(bad.sum())} of {bad.numel()} elements off, max abs error {worst:.3g}"
    return None


def trained_inputs(op: Op, args: Sequence[Any]) -> tuple[int, ...]:
    """The positions of the tensor arguments declared differentiable that require grad: the inputs
    whose gradients a training call's check compares (an argument declared non-differentiable, a
    rotary table, is no implementation's to differentiate)."""
    return tuple(i for i in op.differentiable()
                 if isinstance(args[i], torch.Tensor) and args[i].requires_grad)


def output_gradients(outputs: Sequence[Any], carried: Sequence[bool],
                     seed: int = GRADIENT_SEED) -> tuple[torch.Tensor | None, ...]:
    """Fixed random gradients for the floating ``outputs`` whose reference ``carried`` a gradient,
    each of its output's dtype, shape and device (``None`` for the others). Random rather than
    ones: ones would hide a wrong backward wherever the outputs' sum is constant (a softmax's rows)."""
    generator = torch.Generator().manual_seed(seed)
    return tuple(randn(*o.shape, dtype=o.dtype, device=o.device, generator=generator)
                 if c and isinstance(o, torch.Tensor) and o.is_floating_point() else None
                 for o, c in zip(outputs, carried))


def _float64_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``, in float64 if it is floating (one copy, where ``double()`` then ``clone()``
    would make two)."""
    return t.to(torch.float64, copy=True) if t.is_floating_point() else t.clone()


@dataclass
class Comparison:
    """An implementation's outputs and gradients against the float64 reference's."""

    #: what differs in the outputs, or None
    forward: str | None
    #: the largest absolute error among the outputs
    forward_error: float
    #: per input whose gradient is checked: (largest absolute error, what differs or None)
    gradients: dict[str, tuple[float, str | None]] = field(default_factory=dict)

    @property
    def problem(self) -> str | None:
        """The first difference: the outputs', else the first wrong gradient's."""
        return self.forward or next((p for _, p in self.gradients.values() if p is not None), None)


class Reference:
    """The float64 reference of one call: its outputs, and for a training call the gradients of the
    inputs :func:`trained_inputs` names, each computed once and then compared with any number of
    implementations and configs (:meth:`compare`).

    The arguments are copied in float64 when the reference is made, so that an implementation that
    writes into its inputs changes nothing here.
    """

    def __init__(self, op: Op, args: Sequence[Any], training: bool = False):
        self.op = op
        self.trained = trained_inputs(op, args) if training else ()
        self.names = tuple(op.args[i].name for i in self.trained)
        self.reduce_dim = reduce_dim_of(args)
        self.gradient_dim = gradient_dim_of(args)
        #: the tolerance every gradient is held to: the least precise trained input's dtype (a float32
        #: input's gradient computed from bfloat16 products has bfloat16's rounding)
        self.gradient_dtype = least_precise(args[i].dtype for i in self.trained) if self.trained else None
        with torch.no_grad():
            self._args = tuple(_float64_copy(a) if isinstance(a, torch.Tensor) else a for a in args)
        self._outputs: tuple | None = None
        #: per output, whether the reference's carries a gradient to a trained input
        self._carried: tuple[bool, ...] = ()
        self._gradients: dict[tuple, tuple[torch.Tensor, ...]] = {}

    def _forward(self) -> tuple[list, tuple]:
        """The reference on leaves that require grad at the trained positions: (leaves, outputs)."""
        leaves = [a.detach().requires_grad_() if i in self.trained else a for i, a in enumerate(self._args)]
        with torch.enable_grad() if self.trained else torch.no_grad():
            return leaves, as_tuple(self.op.reference(*leaves))

    @property
    def outputs(self) -> tuple:
        if self._outputs is None:
            _, outputs = self._forward()
            self._carried = tuple(isinstance(o, torch.Tensor) and o.requires_grad for o in outputs)
            self._outputs = tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outputs)
        return self._outputs

    def gradients(self, grads_out: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor, ...]:
        """The gradients of the trained inputs for output gradients ``grads_out`` (their values in
        float64; ``None`` for an output that carries none), zeros for an input no output reaches;
        computed once per set of output dtypes."""
        key = tuple(None if g is None else g.dtype for g in grads_out)
        found = self._gradients.get(key)
        if found is None:
            leaves, outputs = self._forward()
            pairs = [(o, g.double()) for o, g in zip(outputs, grads_out) if g is not None]
            wrt = [leaves[i] for i in self.trained]
            grads = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                        allow_unused=True) if pairs else (None,) * len(wrt)
            found = self._gradients[key] = tuple(torch.zeros_like(x) if g is None else g.detach()
                                                 for x, g in zip(wrt, grads))
        return found

    def compare(self, outputs: Any, inputs: Sequence[Any]) -> Comparison:
        """``outputs``, computed by an implementation from ``inputs`` (copies of the reference's
        arguments, requiring grad where they did), against the reference; for a training call the
        gradients of the trained inputs too, propagated back from :func:`output_gradients`.

        :raises NoBackwardError: a training call's ``outputs`` carry no gradient."""
        outputs = as_tuple(outputs)
        expected = self.outputs
        comparison = Comparison(mismatch(outputs, expected, self.reduce_dim), max_abs_error(outputs, expected))
        if not self.trained or len(outputs) != len(expected) or any(
                tuple(o.shape) != tuple(e.shape) for o, e in zip(outputs, expected)):
            return comparison
        grads_out = output_gradients(outputs, self._carried)
        carried = [(o, g) for o, g in zip(outputs, grads_out) if g is not None and o.requires_grad]
        if not carried:
            raise NoBackwardError(NO_GRADIENT)
        wrt = [inputs[i] for i in self.trained]
        actual = torch.autograd.grad([o for o, _ in carried], wrt, [g for _, g in carried], allow_unused=True)
        for name, grad, want in zip(self.names, actual, self.gradients(grads_out)):
            label = f"gradient of {name}"
            if grad is None:
                error = want.abs().max().item() if want.numel() else 0.0
                problem = f"{label}: none computed, where the reference's reaches {error:.3g}" if error else None
                comparison.gradients[name] = (error, problem)
            else:
                comparison.gradients[name] = (max_abs_error((grad,), (want,)),
                                              mismatch((grad,), (want,), self.gradient_dim, labels=(label,),
                                                       dtype=self.gradient_dtype, by_largest=True))
        return comparison
