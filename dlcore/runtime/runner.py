"""How a bound op runs its implementation: the function a selection, a search and ``get_op``'s
bound op call with the inputs.

- a replayable Triton implementation on a device: its launches recorded once per exact input and
  replayed after (:class:`dlcore.runtime.launch.Replay`);
- any other Triton implementation: its plan, rewritten by the launch passes, through the warm
  launcher (:func:`dlcore.runtime.launch.run_plan`);
- a custom-op implementation: the same, unless autograd or ``torch.compile`` must see the call
  (:func:`dlcore.runtime.torch_ops.needs_autograd`), then its custom op;
- a custom-op implementation without a backward (``define_kernel`` without ``Backward``), or a
  Triton implementation built without the template: its launches, with one
  :class:`~dlcore.runtime.torch_ops.ForwardOnlyWarning` the first time it runs on
  inputs that require grad;
- anything else: ``impl.run(args, config)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dlcore.declarations.implementation import Config, Implementation, PlanTransform, TritonImplementation
from dlcore.runtime.launch import Replay, run_plan
from dlcore.runtime.torch_ops import CustomOpTritonImplementation, needs_autograd, warn_forward_only

Runner = Callable[[tuple], Any]


def runner(impl: Implementation, config: Config, transform: PlanTransform | None = None) -> Runner:
    """``impl`` with ``config`` bound, taking the bound arguments; ``transform`` rewrites each
    launch plan (the ``ast`` and ``launch`` compiler passes)."""
    if not isinstance(impl, TritonImplementation):
        return lambda args: impl.run(args, config)
    launch = launches(impl, config, transform)
    if not isinstance(impl, CustomOpTritonImplementation):
        # Built without the template: no custom op and no backward, so forward only by construction.
        def plain(args: tuple) -> Any:
            warn_forward_only(impl, args)
            return launch(args)

        return plain
    if impl.differentiable:
        def run(args: tuple) -> Any:
            if needs_autograd(args):
                return impl.custom_op(args, config)
            return launch(args)

        return run

    def forward_only(args: tuple) -> Any:
        if torch.compiler.is_compiling():
            return impl.custom_op(args, config)
        warn_forward_only(impl, args)
        return launch(args)

    return forward_only


def launches(impl: TritonImplementation, config: Config, transform: PlanTransform | None) -> Runner:
    """``impl``'s launches with ``config``, autograd aside: recorded once per exact input and
    replayed where the implementation is replayable and compiled, else planned on every call."""
    if impl.replayable and not impl.interpreted:
        return Replay(impl.plan, config, transform)
    plan = impl.plan
    if transform is None:
        return lambda args: run_plan(plan(args, config))
    return lambda args: run_plan(transform(plan(args, config)))
