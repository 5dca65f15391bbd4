"""Gradient checks shared by the kernel tests: a kernel's backward against torch autograd of its op's
float64 reference, on the same inputs and the same random output gradients."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from dlcore.testing import assert_close, randn


def as_tuple(x: Any) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def leaves(args: Sequence[Any], wrt: Sequence[int]) -> tuple:
    """``args`` with the tensors at positions ``wrt`` made leaves that require grad (same storage and
    strides: a non-contiguous input stays non-contiguous)."""
    return tuple(a.detach().requires_grad_() if i in wrt else a for i, a in enumerate(args))


def check_backward(fn: Callable[..., Any], reference: Callable[..., Any], args: Sequence[Any], wrt: Sequence[int],
                   gen: torch.Generator, reduce_dim: int = 1) -> tuple:
    """Run ``fn(*args)`` and backward from random output gradients; compare its outputs and the
    gradients of ``args[i]`` for ``i`` in ``wrt`` with those of ``reference`` on float64 copies.
    Returns ``fn``'s gradients."""
    inputs = leaves(args, wrt)
    outputs = as_tuple(fn(*inputs))
    grads_out = tuple(randn(*o.shape, dtype=o.dtype, device=o.device, generator=gen) for o in outputs)
    grads = torch.autograd.grad(outputs, [inputs[i] for i in wrt], grads_out)

    inputs64 = leaves([a.double() if isinstance(a, torch.Tensor) else a for a in args], wrt)
    expected = as_tuple(reference(*inputs64))
    expected_grads = torch.autograd.grad(expected, [inputs64[i] for i in wrt], [g.double() for g in grads_out])

    for out, ref in zip(outputs, expected):
        assert_close(out, ref, args[0].dtype, reduce_dim)
    for i, grad, ref in zip(wrt, grads, expected_grads):
        assert grad.shape == args[i].shape, f"gradient of argument {i}: shape {tuple(grad.shape)}"
        assert_close(grad, ref, args[i].dtype, reduce_dim)
    return grads
