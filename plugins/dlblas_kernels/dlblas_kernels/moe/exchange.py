"""How tokens reach the ranks holding their experts and how the results come back: the exchange interface,
and its implementation on ``torch.distributed.all_to_all_single`` (NCCL on GPUs, gloo on CPUs).

An exchange's :meth:`~Exchange.dispatch` takes a rank's tokens with the physical slot of each choice
and returns what this rank must compute (:class:`Received`): rows of hidden states, each with the
slot ids, local to this rank, of the choices it serves here (``-1`` for the others) and their weights
(0 for the others). The layer runs the expert computation on them, which weighs and sums each row's
local choices; :meth:`~Exchange.combine` sends the rows back and sums each token's rows. The DeepEP
exchanges (:mod:`dlblas_kernels.moe.deepep`) keep the same contract.

The all-to-all exchange sends one row per (token, destination rank), not per choice: a token whose
choices fall on one rank crosses once. Counts go first (one ``all_to_all_single`` of ``W`` integers,
then a copy to the host for the split sizes), then the hidden rows, their weights and their ids, and
the results on the way back. The exchange is differentiable (for the hidden states and the weights):
its backward is the same all-to-all the other way.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dlcore.api import DlcoreError


class ExchangeKind(enum.Enum):
    """Which exchange a layer uses."""

    #: DeepEP's normal kernels for bfloat16 tokens when ``deep_ep`` imports and the group runs on NCCL, else
    #: all-to-all
    AUTO = "auto"
    #: ``torch.distributed.all_to_all_single``: any backend that implements it (NCCL, gloo)
    ALL_TO_ALL = "all_to_all"
    #: DeepEP's normal (high-throughput) dispatch and combine
    DEEPEP = "deepep"
    #: DeepEP's low-latency dispatch and combine (decoding: few tokens per rank, bounded in advance)
    DEEPEP_LOW_LATENCY = "deepep_low_latency"


class ExchangeUnavailableError(DlcoreError, ImportError):
    """The exchange asked for cannot run here (DeepEP is not installed); the message says what to do."""


@dataclass
class Received:
    """What one rank computes: ``hidden [N, H]``, ``topk_ids [N, k]`` (slot ids local to the rank,
    ``-1`` for a choice served elsewhere), ``topk_weights [N, k]`` float32 (0 where the id is ``-1``),
    and what :meth:`Exchange.combine` needs to send the results back."""

    hidden: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    handle: Any


class Exchange(ABC):
    """Sends tokens to the ranks that hold their experts' slots and the results back."""

    kind: ExchangeKind

    def __init__(self, group: dist.ProcessGroup | None = None):
        """``group``: the ranks that hold the experts (the default group when None; without
        torch.distributed initialised, this process alone)."""
        self.group = group
        self.rank, self.world_size = rank_and_size(group)

    @abstractmethod
    def dispatch(self, hidden: torch.Tensor, topk_weights: torch.Tensor, slot_ids: torch.Tensor,
                 slots_per_rank: int) -> Received:
        """``hidden [T, H]``, ``topk_weights [T, k]`` float32, ``slot_ids [T, k]`` int64 physical slots
        (``-1`` dropped) of this rank's tokens; slot ``s`` lives on rank ``s // slots_per_rank``. A
        collective: every rank of the group calls it, with its own ``T`` (0 allowed)."""

    @abstractmethod
    def combine(self, out: torch.Tensor, received: Received) -> torch.Tensor:
        """``out [N, H]``, the computed rows of ``received``, back to their tokens: ``[T, H]``, each
        token the sum of its rows (0 for a token every choice of which was dropped). A collective."""


def rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size; ``(0, 1)`` without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class AllToAllExchange(Exchange):
    """The exchange on ``torch.distributed.all_to_all_single``; without a process group (one rank) no
    communication at all."""

    kind = ExchangeKind.ALL_TO_ALL

    def dispatch(self, hidden: torch.Tensor, topk_weights: torch.Tensor, slot_ids: torch.Tensor,
                 slots_per_rank: int) -> Received:
        tokens = slot_ids.shape[0]
        world = self.world_size
        # destination rank of every choice; dropped choices go to an extra column, cut off below
        dest = torch.where(slot_ids >= 0, slot_ids // slots_per_rank, world)
        hit = torch.zeros(tokens, world + 1, dtype=torch.bool, device=slot_ids.device)
        hit.scatter_(1, dest, True)
        hit = hit[:, :world]
        # one row per (destination rank, token), ordered by rank then token: the send layout
        rank_of_row, token_of_row = hit.t().nonzero(as_tuple=True)
        send_counts = hit.sum(0)
        here = dest[token_of_row] == rank_of_row.unsqueeze(1)
        ids = torch.where(here, slot_ids[token_of_row] - rank_of_row.unsqueeze(1) * slots_per_rank, -1)
        weights = torch.where(here, topk_weights[token_of_row].float(), 0.0)
        rows = hidden[token_of_row]
        if world == 1:
            send = recv = [rows.shape[0]]
        else:
            recv_counts = torch.empty_like(send_counts)
            dist.all_to_all_single(recv_counts, send_counts, group=self.group)
            send, recv = send_counts.tolist(), recv_counts.tolist()
            rows, weights = AllToAll.apply(recv, send, self.group, rows, weights)
            ids = all_to_all(ids, recv, send, self.group)
        return Received(hidden=rows, topk_weights=weights, topk_ids=ids, handle=(token_of_row, tokens, send, recv))

    def combine(self, out: torch.Tensor, received: Received) -> torch.Tensor:
        token_of_row, tokens, send, recv = received.handle
        back = out if self.world_size == 1 else AllToAll.apply(send, recv, self.group, out)[0]
        # each token's rows summed at float32 at least: a token served by two ranks adds two partial sums
        wide = torch.promote_types(out.dtype, torch.float32)
        result = torch.zeros(tokens, out.shape[1], dtype=wide, device=out.device)
        result.index_add_(0, token_of_row, back.to(wide))
        return result.to(out.dtype)


def all_to_all(rows: torch.Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    """Rows ``send[r]`` at a time to each rank ``r`` of ``group``; ``recv[r]`` rows from each."""
    out = rows.new_empty((sum(recv), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """:func:`all_to_all` of several tensors, differentiable: the backward sends their gradients back
    the other way, all of them, in the same order on every rank (a gradient autograd does not need
    goes as zeros), so that every rank's backward runs the same collectives."""

    @staticmethod
    def forward(ctx, recv: list[int], send: list[int], group: dist.ProcessGroup | None,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.splits = (recv, send, group)
        return tuple(all_to_all(t, recv, send, group) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        recv, send, group = ctx.splits
        return (None, None, None, *(all_to_all(g, send, recv, group) for g in grads))
