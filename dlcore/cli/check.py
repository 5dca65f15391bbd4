"""`dlcore check`: run an op on random inputs, compare with its reference, explain the choice."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch

from dlcore.cli.options import DTYPES, check_sizes, parse_sizes, resolve_device
from dlcore.declarations.implementation import Implementation
from dlcore.declarations.op import Op
from dlcore.dispatch.dispatcher import get_op
from dlcore.errors import InvalidOptionError
from dlcore.plugins.registry import registry
from dlcore.tuning.verify import Reference, as_tuple


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="run get_op on random inputs, compare with the reference, explain the choice")
    p.add_argument("op")
    p.add_argument("--shape", type=parse_sizes, default={}, help="named sizes, e.g. tokens=37,hidden=256")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", default=None, help="cuda when available, else cpu")
    p.add_argument("--impl", default=None, help="run this implementation instead of selecting one")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--training", action="store_true",
                   help="the differentiable inputs require grad: the call a training step makes (its candidates "
                        "timed forward and backward); each input's gradient is compared with the reference's too")
    p.set_defaults(func=run_check)


def run_check(args: argparse.Namespace) -> int:
    op = registry().op(args.op)
    report = check_op(op, args.shape, DTYPES[args.dtype], resolve_device(args.device), impl=args.impl, seed=args.seed,
                      training=args.training)
    print(report.explanation)
    sizes = ", ".join(f"{k}={v}" for k, v in report.sizes.items())
    print(f"\ncheck {op.name} ({sizes}, {args.dtype}) against the float64 reference: "
          f"max abs error {report.max_abs_error:.3g}: {verdict(report.problem)}")
    for name, (error, problem) in report.gradients.items():
        print(f"  gradient of {name}: max abs error {error:.3g}: {verdict(problem)}")
    return 0 if report.ok else 1


def verdict(problem: str | None) -> str:
    return "OK" if problem is None else f"MISMATCH: {problem}"


@dataclass
class CheckReport:
    op: str
    sizes: dict[str, int]
    dtype: torch.dtype
    explanation: str
    max_abs_error: float
    #: what differs in the outputs, or None
    problem: str | None
    #: for a training call, per input whose gradient is checked: (max abs error, what differs or None)
    gradients: dict[str, tuple[float, str | None]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.problem is None and all(problem is None for _, problem in self.gradients.values())


def check_op(op: Op, sizes: dict[str, int], dtype: torch.dtype, device: str, impl: str | None = None,
             seed: int = 0, training: bool = False) -> CheckReport:
    """Run ``get_op`` on random inputs of ``sizes`` and compare with the float64 reference; with
    ``training`` the differentiable inputs require grad (get_op selects for a training step) and
    their gradients are compared too (:class:`~dlcore.tuning.verify.Reference`)."""
    check_sizes(op, sizes)
    full = {**op.example_sizes, **sizes}
    args = op.example_inputs(sizes, dtype, device, seed)
    if training:
        wanted = op.differentiable()
        # an optional input left out (None) and an integer one have no gradient
        args = tuple(a.requires_grad_() if i in wanted and isinstance(a, torch.Tensor) and a.is_floating_point()
                     else a for i, a in enumerate(args))
    bound = get_op(op.name, args, impl=impl)
    reference = Reference(op, args, training=training)
    outputs = as_tuple(bound(*args))
    refuse_interpreted_float8(op, bound.impl, outputs)
    comparison = reference.compare(outputs, args)
    return CheckReport(op.name, full, dtype, bound.explain(), comparison.forward_error, comparison.forward,
                       comparison.gradients)


#: the float8 dtypes Triton's interpreter converts to wrongly
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def refuse_interpreted_float8(op: Op, impl: Implementation, outputs: tuple) -> None:
    """Refuse to judge float8 outputs of kernels run by Triton's interpreter, whose float8
    conversions are wrong (a rounding carry into the exponent is lost, subnormals are truncated):
    the comparison would blame the kernel for the interpreter."""
    if not getattr(impl, "interpreted", False):
        return
    quantized = [f"output {i} ({str(o.dtype).removeprefix('torch.')})" for i, o in enumerate(outputs)
                 if isinstance(o, torch.Tensor) and o.dtype in FLOAT8]
    if quantized:
        raise InvalidOptionError(
            f"check {op.name}: {', '.join(quantized)} cannot be checked under TRITON_INTERPRET=1, whose float8 "
            f"conversions are wrong (a rounding carry is lost, subnormals are truncated); check it on a GPU, "
            f"where the kernel's float8 output is compared with the reference's")
