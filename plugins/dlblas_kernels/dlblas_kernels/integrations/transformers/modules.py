"""A model's RMSNorm, rotary and SwiGLU MLP modules switched to dlcore's ops, in place.

Each switch sets the module's ``forward`` to a small object holding what it needs: parameters,
buffers and their names stay as they are (the state dict does not change), and gradients reach
the same parameters through the ops' backward. A call a kernel cannot take (mixed dtypes under
autocast, a layout transformers does not use) runs the module's own forward, which is exact.

- RMSNorm (``x * rsqrt(mean(x^2) + eps) * weight``): ``rms_norm``.
- A SwiGLU MLP (``down(silu(gate x) * up x)``) right after an RMSNorm in the decoder layer: the
  norm's forward passes its input on, and the MLP runs ``ffn`` (the norm, both projections and
  SwiGLU in one op, the norm's weight a differentiable argument), then ``down``.
- Rotary embedding: the attention's forward keeps its code, with the names of its modeling file's
  rotary functions (``apply_rotary_pos_emb``; DeepSeek's ``apply_rotary_pos_emb_interleave``)
  bound to :class:`RotateHalf` and :class:`Deinterleaved`, which run ``apply_rotary_pos_emb``.
  Other models of the family, and other instances, keep the modeling file's functions.
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Callable

import torch
from torch import nn

from dlblas_kernels.integrations.transformers.ops import call
from dlblas_kernels.kernels.apply_rotary_pos_emb import apply_rotary_pos_emb
from dlblas_kernels.kernels.ffn import ffn
from dlblas_kernels.kernels.rms_norm import rms_norm

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _eligible(*tensors: torch.Tensor) -> bool:
    """One dtype the kernels take, and no autocast (whose casts the module's own code would make)."""
    dtype = tensors[0].dtype
    return (dtype in DTYPES and all(t.dtype == dtype for t in tensors)
            and not torch.is_autocast_enabled(tensors[0].device.type))


def _original_forward(module: nn.Module) -> Callable:
    """The class's forward bound to ``module``: what the module ran before it was switched."""
    return types.MethodType(type(module).forward, module)


# --- RMSNorm -------------------------------------------------------------------------------------

class RMSNormForward:
    """``rms_norm(x, weight, eps)`` for an RMSNorm module (its ``weight`` and ``variance_epsilon``)."""

    def __init__(self, norm: nn.Module) -> None:
        self.norm = norm

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        norm = self.norm
        if not _eligible(hidden_states, norm.weight):
            return _original_forward(norm)(hidden_states)
        return call("rms_norm", rms_norm, hidden_states, norm.weight, norm.variance_epsilon)


def switch_norm(norm: nn.Module) -> None:
    norm.forward = RMSNormForward(norm)


# --- SwiGLU MLP with the norm before it -----------------------------------------------------------

class NormInMLP:
    """The forward of an RMSNorm whose MLP applies it (:class:`NormedMLPForward`): its input, as is.
    Called on another input than the MLP's (which transformers' decoder layers never do), the
    result would be wrong: only :func:`switch_norm_and_mlp` sets it, for the pairs of
    :mod:`.families`."""

    def __init__(self, norm: nn.Module) -> None:
        self.norm = norm

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states


class NormedMLPForward:
    """``down(ffn(x, gate.weight, up.weight, norm.weight, eps))``: the decoder layer's
    ``mlp(norm(x))`` with the norm inside ``ffn``."""

    def __init__(self, norm: nn.Module, mlp: nn.Module) -> None:
        self.norm, self.mlp = norm, mlp

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        norm, mlp = self.norm, self.mlp
        w1, w3 = mlp.gate_proj.weight, mlp.up_proj.weight
        if not _eligible(hidden_states, w1, w3, norm.weight):
            return _original_forward(mlp)(_original_forward(norm)(hidden_states))
        shape = hidden_states.shape
        h = call("ffn", ffn, hidden_states.reshape(-1, shape[-1]), w1, w3, norm.weight, norm.variance_epsilon)
        return mlp.down_proj(h.view(*shape[:-1], h.shape[-1]))


def is_swiglu_mlp(mlp: nn.Module) -> bool:
    """``gate_proj``, ``up_proj`` and ``down_proj`` linears without bias, and SiLU."""
    linears = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    return (all(isinstance(m, nn.Linear) and m.bias is None for m in linears)
            and is_silu(getattr(mlp, "act_fn", None)))


def is_silu(activation: object) -> bool:
    """torch's ``nn.SiLU`` or transformers' ``SiLUActivation`` (``ACT2FN["silu"]``), not a subclass
    that may compute something else."""
    return type(activation) is nn.SiLU or (type(activation).__name__ == "SiLUActivation"
                                            and type(activation).__module__ == "transformers.activations")


def switch_norm_and_mlp(norm: nn.Module, mlp: nn.Module) -> None:
    norm.forward = NormInMLP(norm)
    mlp.forward = NormedMLPForward(norm, mlp)


# --- rotary --------------------------------------------------------------------------------------

class RotateHalf:
    """transformers' ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` (rotate-half, q and k
    ``[B, H, S, D]``, cos and sin ``[B, S, D]``) by dlcore's ``apply_rotary_pos_emb``; the modeling
    file's own function for any other form."""

    def __init__(self, original: Callable) -> None:
        self.original = original

    def __call__(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        if (unsqueeze_dim != 1 or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or q.shape[-1] % 2
                or not _eligible(q, k, cos, sin)):
            return self.original(q, k, cos, sin, unsqueeze_dim)
        return rotate(q, k, cos, sin)


class Deinterleaved:
    """DeepSeek's ``apply_rotary_pos_emb_interleave``: pairs ``(2i, 2i + 1)`` in, rotated halves out,
    which is the rotate-half rotation of ``cat(x[..., 0::2], x[..., 1::2])``."""

    def __init__(self, original: Callable) -> None:
        self.original = original

    def __call__(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 position_ids: torch.Tensor | None = None, unsqueeze_dim: int = 1
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        if (unsqueeze_dim != 1 or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or q.shape[-1] % 2
                or not _eligible(q, k, cos, sin)):
            return self.original(q, k, cos, sin, position_ids, unsqueeze_dim)
        return rotate(*(torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1) for t in (q, k)), cos, sin)


def rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary of ``[B, H, S, D]`` q and k: the op's ``[B, S, H, D]`` views (no copy for
    the projections transformers transposes), the results viewed back."""
    q_out, k_out = call("apply_rotary_pos_emb", apply_rotary_pos_emb, q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return q_out.transpose(1, 2), k_out.transpose(1, 2)


#: the rotary functions of modeling files, by name, and what replaces each
ROTARY_FUNCTIONS: dict[str, type] = {"apply_rotary_pos_emb": RotateHalf,
                                     "apply_rotary_pos_emb_interleave": Deinterleaved}


def switch_rotary(attention: nn.Module) -> bool:
    """Bind the rotary functions the attention's forward calls to dlcore's, for this module alone:
    its forward is the class's code with those global names rebound. False where it calls none."""
    forward = type(attention).forward
    code_names = set(inspect.unwrap(forward).__code__.co_names)
    module_globals = inspect.unwrap(forward).__globals__
    names = {name: replacement(module_globals[name]) for name, replacement in ROTARY_FUNCTIONS.items()
             if name in code_names and name in module_globals}
    function = rebound(forward, names) if names else None
    if function is None:
        return False
    attention.forward = types.MethodType(function, attention)
    return True


def rebound(function: Callable, names: dict[str, Callable]) -> Callable | None:
    """``function`` with the global ``names`` rebound, through its decorators: each wrapper
    (``functools.wraps``: ``__wrapped__``) rebuilt around the rebuilt function it closes over; None
    where a wrapper holds what it wraps otherwise than in its closure."""
    wrapped = getattr(function, "__wrapped__", None)
    if wrapped is None:
        copy = types.FunctionType(function.__code__, scope(function.__globals__, names).__dict__,
                                  function.__name__, function.__defaults__, function.__closure__)
        copy.__kwdefaults__, copy.__qualname__ = function.__kwdefaults__, function.__qualname__
        return copy
    inner = rebound(wrapped, names)
    if inner is None:
        return None
    cells = tuple(types.CellType(inner) if _holds(cell, wrapped) else cell for cell in function.__closure__ or ())
    if not any(_holds(cell, inner) for cell in cells):
        return None
    copy = types.FunctionType(function.__code__, function.__globals__, function.__name__, function.__defaults__,
                              cells)
    copy.__kwdefaults__, copy.__qualname__ = function.__kwdefaults__, function.__qualname__
    copy.__dict__.update(function.__dict__, __wrapped__=inner)
    return copy


def scope(module_globals: dict, names: dict[str, Callable]) -> types.ModuleType:
    """A module holding a modeling file's globals with ``names`` rebound, importable under a name of
    its own (``torch.compile`` finds a function's globals by their module's name, and must not find
    the modeling file's), made once per modeling file."""
    name = f"{__name__}.rebound.{module_globals['__name__']}"
    module = sys.modules.get(name)
    if module is None:
        module = types.ModuleType(name)
        module.__dict__.update({k: v for k, v in module_globals.items() if k not in ("__name__", "__spec__")})
        module.__dict__.update(names)
        sys.modules[name] = module
    return module


def _holds(cell: types.CellType, value: object) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False
