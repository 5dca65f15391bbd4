"""PyTorch integration of Triton implementations: custom ops, autograd and ``torch.compile``.

A kernel module registers its op as a PyTorch custom op (``torch.library.custom_op``, with a fake
implementation and an autograd formula) whose trailing ``int`` arguments are the launch config
(all zero: the heuristic default). Three paths reach the kernels:

- inference (no input requires grad, or grad mode off): the launch plan runs directly, with no
  dispatcher in between; this is what ``get_op``'s bound op and the public functions do then;
- training: the same call goes through the custom op, with the config ``get_op`` selected passed
  as those trailing integers, so autograd records it and its backward kernels run later;
- ``torch.compile`` tracing: the public functions call only the custom op, which dynamo records as
  one node; its fake implementation validates the inputs, so bad inputs raise while tracing.

:class:`CustomOpTritonImplementation` makes that choice in ``run``; :func:`call` is what a public
function does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from dlcore.declarations.implementation import Config, LaunchPlan, TritonImplementation, call_directly
from dlcore.declarations.op import Op
from dlcore.runtime.launch import Replay, run_plan


def needs_autograd(args: Sequence[Any]) -> bool:
    """True when a call must go through its custom op: while ``torch.compile`` traces, or when grad
    mode is on and a tensor argument requires grad."""
    if torch.compiler.is_compiling():
        return True
    if not torch.is_grad_enabled():
        return False
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def plain_eager(tensors: Sequence[torch.Tensor | None]) -> bool:
    """True when eager autograd runs a backward formula on plain tensors with nothing watching: no
    graph being built (``create_graph``), no tracing (``torch.compile``, ``make_fx``), no tensor
    subclass (fake, functional, ...), no dispatch mode or functorch transform, no float64 (the
    reference path). A formula may then launch its backward plan directly, sparing the dispatcher's
    tens of microseconds per call that small shapes wait for; anywhere else it calls its backward
    custom op, which tracers see as one node."""
    return (not torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and all(type(t) in _PLAIN_TENSORS and t.dtype != torch.float64 for t in tensors if t is not None)
            and torch._C._len_torch_dispatch_stack() == 0 and not torch._C._are_functorch_transforms_active())


def run_backward(op: Callable[..., Any], body: Callable[..., Any], *args: Any) -> Any:
    """The backward kernels of an autograd formula: ``body(*args)``, the implementation of the
    backward custom op ``op``, called at once in plain eager autograd (:func:`plain_eager`), else
    ``op(*args)`` through the dispatcher, which tracers see as one node."""
    if plain_eager([a for a in args if isinstance(a, torch.Tensor)]):
        return body(*args)
    return op(*args)


class Launches:
    """What a custom op's body does with its plan, ``plan(args, config(args, ints)).run()``, with
    the launches recorded per exact input and replayed after (:mod:`dlcore.runtime.replay`), as a bound op
    does: a backward at a few tokens then costs a direct launch, not a plan and Triton's launcher.

    ``ints`` are the body's trailing config integers (all zero: the default, which ``config`` then
    computes from ``args``); the plan must be replayable (depend on nothing but the exact input).
    """

    __slots__ = ("plan", "config", "replays")

    def __init__(self, plan: Callable[[tuple, Config], LaunchPlan], config: Callable[[tuple, tuple], Config]):
        self.plan = plan
        self.config = config
        self.replays: dict[tuple, Replay] = {}

    def run(self, args: tuple, ints: tuple) -> Any:
        replay = self.replays.get(ints)
        if replay is None:
            replay = self.replays[ints] = Replay(self._plan, ints, None)
        return replay(args)

    def _plan(self, args: tuple, ints: tuple) -> LaunchPlan:
        """The plan for ``args`` with the config of ``ints`` (a replay's config: run when recording only)."""
        return self.plan(args, self.config(args, ints))


def config_ints(config: Config | None, keys: Sequence[str]) -> list[int]:
    """``config``'s values for ``keys``, as the custom op's trailing arguments; ``None``: all zero
    (the custom op then computes its heuristic default from the actual shapes)."""
    if config is None:
        return [0] * len(keys)
    return [int(config[k]) for k in keys]


def config_from_ints(keys: Sequence[str], values: Sequence[int], default: Callable[[], Config]) -> Config:
    """The inverse of :func:`config_ints`: all zero means ``default()``."""
    if not any(values):
        return default()
    return dict(zip(keys, values))


class CustomOpTritonImplementation(TritonImplementation):
    """A Triton implementation whose op is also a PyTorch custom op.

    :param custom_op: ``custom_op(args, config | None)`` computes bound ``args`` through the custom
        op with ``config`` (``None``: the custom op's own default), so that autograd and
        ``torch.compile`` see it; the other parameters are :class:`TritonImplementation`'s.

    ``run`` launches the plan directly unless :func:`needs_autograd` says otherwise: the inference
    path costs no more than a plain Triton implementation's.
    """

    def __init__(self, op: str, name: str, *, custom_op: Callable[[tuple, Config | None], Any], **kwargs: Any):
        super().__init__(op, name, **kwargs)
        self.custom_op = custom_op

    def run(self, args: tuple, config: Config) -> Any:
        if needs_autograd(args):
            return self.custom_op(args, config)
        return run_plan(self.plan(args, config))


def call(op: Op, impl: CustomOpTritonImplementation, args: tuple) -> Any:
    """What a kernel module's public function does with its (positional, complete) ``args``.

    Under ``torch.compile`` tracing: the custom op alone, so dynamo records one node and no graph
    break (its fake implementation validates). Otherwise: validation, the default config and
    ``impl.run`` (:func:`dlcore.declarations.implementation.call_directly`).
    """
    if torch.compiler.is_compiling():
        return impl.custom_op(args, None)
    return call_directly(op, impl, args, {})
