"""EPMoE: a mixture-of-experts layer whose experts are spread over the ranks of a process group.

Every rank builds the layer with its contiguous shard of the ``E`` experts (``E / W`` of them on each
of the ``W`` ranks) and calls it with its own tokens and their global expert ids. One call:

1. the logical expert ids become physical slots (:class:`~dlblas_kernels.moe.placement.Placement`;
   the same as the ids until a balanced placement replicates hot experts);
2. the exchange (:mod:`dlblas_kernels.moe.exchange`) sends each token to the ranks serving its
   choices;
3. each rank runs the single-device MoE computation (``dlblas_kernels.fused_moe`` unless another
   ``compute`` is given, with the same arguments) on what it received, over its local slots;
4. the exchange sends the results back, where each token's partial sums are added.

The output equals ``fused_moe(hidden, w13_all, w2_all, topk_weights, topk_ids)`` on one device with
all experts, up to the order of the floating-point additions. fp8 weights (float8_e4m3fn with
DeepSeek-V3's 128x128 block scales) come with their scales, sharded like the weights and passed on
to the computation: ``compute(..., w13_scale, w2_scale)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

import dlblas_kernels
from dlblas_kernels.moe.deepep import DeepEPExchange, DeepEPLowLatencyExchange, deepep_available
from dlblas_kernels.moe.eplb import ExpertLoadRecorder, balance
from dlblas_kernels.moe.exchange import AllToAllExchange, Exchange, ExchangeKind, Received, rank_and_size
from dlblas_kernels.moe.placement import Placement
from dlcore.api import InvalidInputError

#: ``compute(hidden [N, H], w13 [L, 2I, H], w2 [L, H, I], topk_weights [N, k], topk_ids [N, k]) -> [N, H]``,
#: and ``w13_scale [L, ceil(2I/128), ceil(H/128)], w2_scale [L, ceil(H/128), ceil(I/128)]`` after them
#: when the layer holds fp8 weights
Compute = Callable[..., torch.Tensor]


def make_exchange(kind: ExchangeKind | str, group: dist.ProcessGroup | None,
                  dtype: torch.dtype = torch.bfloat16) -> Exchange:
    """The exchange of ``kind`` over ``group`` for tokens of ``dtype``; ``auto`` is DeepEP's normal
    kernels where ``deep_ep`` imports, the group runs on NCCL and the tokens are bfloat16 (what
    DeepEP sends), else all-to-all."""
    kind = ExchangeKind(kind)
    if kind is ExchangeKind.AUTO:
        nccl = dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl"
        deepep = nccl and dtype == torch.bfloat16 and deepep_available()
        kind = ExchangeKind.DEEPEP if deepep else ExchangeKind.ALL_TO_ALL
    if kind is ExchangeKind.DEEPEP:
        return DeepEPExchange(group)
    if kind is ExchangeKind.DEEPEP_LOW_LATENCY:
        return DeepEPLowLatencyExchange(group)
    return AllToAllExchange(group)


class EPMoE(nn.Module):
    """Expert-parallel MoE layer: this rank's shard ``w13 [E/W, 2I, H]`` (gate rows then up rows of each
    expert) and ``w2 [E/W, H, I]`` of ``E`` experts over the ``W`` ranks of ``group``.

    ``exchange``: an :class:`ExchangeKind` (or its value) or an :class:`Exchange`; ``compute``: the
    single-device MoE computation (default ``dlblas_kernels.fused_moe``, looked up at each call);
    ``recorder``: an :class:`~dlblas_kernels.moe.eplb.ExpertLoadRecorder` that every call feeds with
    its routing (for :meth:`rebalance`); ``w13_scale``, ``w2_scale``: the block scales of fp8
    weights (this rank's shard, one row per local expert), moved with the weights by
    :meth:`apply_placement`. Building the layer is a collective (the ranks check that their shards
    agree).
    """

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                 exchange: ExchangeKind | str | Exchange = ExchangeKind.AUTO, compute: Compute | None = None,
                 recorder: ExpertLoadRecorder | None = None, w13_scale: torch.Tensor | None = None,
                 w2_scale: torch.Tensor | None = None):
        super().__init__()
        check_shard(w13, w2)
        check_scales(w13, w13_scale, w2_scale)
        self.group = group
        self.rank, self.world_size = rank_and_size(group)
        local, two_inter, hidden = w13.shape
        shapes = self._gather_shapes(torch.tensor([local, two_inter, hidden], device=w13.device))
        if len(set(shapes)) > 1:
            raise InvalidInputError(
                "EPMoE", "w13", f"has shape {list(w13.shape)} on rank {self.rank}; the ranks hold {shapes}",
                "the same [E/W, 2I, H] on every rank: E experts divisible by the W ranks, E/W on each",
                hint="give each rank its contiguous shard: experts [r*E/W, (r+1)*E/W) on rank r")
        self.num_experts = local * self.world_size
        self.hidden_size = hidden
        self.w13 = nn.Parameter(w13, requires_grad=w13.requires_grad)
        self.w2 = nn.Parameter(w2, requires_grad=w2.requires_grad)
        self.register_buffer("w13_scale", w13_scale)
        self.register_buffer("w2_scale", w2_scale)
        # the tokens' dtype: the weights', bfloat16 beside fp8 weights (what DeepEP sends)
        tokens = torch.bfloat16 if w13_scale is not None else w13.dtype
        self.exchange = exchange if isinstance(exchange, Exchange) else make_exchange(exchange, group, tokens)
        self.compute = compute
        self.recorder = recorder
        self._set_placement(Placement.contiguous(self.num_experts, self.world_size))

    @classmethod
    def from_experts(cls, w13: torch.Tensor, w2: torch.Tensor, group: dist.ProcessGroup | None = None,
                     w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                     **options: object) -> EPMoE:
        """The layer over all ``E`` experts' weights ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` (and the
        block scales of fp8 ones), every rank keeping its own shard of them."""
        rank, world = rank_and_size(group)
        if w13.shape[0] % world:
            raise InvalidInputError("EPMoE", "w13", f"holds {w13.shape[0]} experts for {world} ranks",
                                    "a number of experts divisible by the number of ranks")
        local = w13.shape[0] // world
        shard = slice(rank * local, (rank + 1) * local)
        scales = {name: None if scale is None else scale[shard].clone()
                  for name, scale in (("w13_scale", w13_scale), ("w2_scale", w2_scale))}
        return cls(w13[shard].clone(), w2[shard].clone(), group, **scales, **options)

    @property
    def placement(self) -> Placement:
        return self._placement

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """``hidden [T, H]``, ``topk_weights [T, k]``, ``topk_ids [T, k]`` (global logical expert ids,
        ``-1`` for a dropped choice) of this rank's tokens -> ``[T, H]``. A collective: every rank
        calls it, each with its own ``T`` (0 allowed)."""
        received = self.dispatch(hidden, topk_weights, topk_ids)
        return self.exchange.combine(self.compute_experts(received), received)

    def dispatch(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> Received:
        """Step 1 and 2 of :meth:`forward`: the tokens this rank computes (a collective)."""
        self._check_tokens(hidden, topk_weights, topk_ids)
        if self.recorder is not None:
            self.recorder.record(topk_ids)
        table = (self._replica_slots, self._replica_counts)
        slots = self._placement.physical_ids(topk_ids, table)
        received = self.exchange.dispatch(hidden, topk_weights, slots, self._placement.slots_per_rank)
        received.topk_ids = received.topk_ids.to(topk_ids.dtype)
        return received

    def compute_experts(self, received: Received) -> torch.Tensor:
        """Step 3 of :meth:`forward`: the local experts over the received rows, ``[N, H]`` (local)."""
        if received.hidden.shape[0] == 0:
            # nothing to compute; the empty result still hangs on the received rows, so that under
            # autograd this rank's backward runs the exchange's collectives as every other rank's does
            return received.hidden * 0
        compute = self.compute or dlblas_kernels.fused_moe
        args = (received.hidden, self.w13, self.w2, received.topk_weights, received.topk_ids)
        if self.w13_scale is not None:
            return compute(*args, self.w13_scale, self.w2_scale)
        return compute(*args)

    def apply_placement(self, placement: Placement) -> None:
        """Move the experts' weights to ``placement`` (a collective): each rank ends with the weights of
        its new slots, taken from a rank that held the expert (itself when it did). The output of
        every later call is unchanged; only where its work is done moves."""
        if (placement.num_experts, placement.num_ranks) != (self.num_experts, self.world_size):
            raise InvalidInputError(
                "EPMoE.apply_placement", "placement",
                f"places {placement.num_experts} experts over {placement.num_ranks} ranks",
                f"the layer's {self.num_experts} experts over its {self.world_size} ranks")
        w13, w2 = self._migrate(placement, self.w13.detach(), self.w2.detach())
        self.w13 = nn.Parameter(w13, requires_grad=self.w13.requires_grad)
        self.w2 = nn.Parameter(w2, requires_grad=self.w2.requires_grad)
        if self.w13_scale is not None:
            self.w13_scale, self.w2_scale = self._migrate(placement, self.w13_scale, self.w2_scale)
        self._set_placement(placement)

    def rebalance(self, num_slots: int | None = None) -> Placement:
        """Place the experts by the recorder's counts (over all ranks) onto ``num_slots`` slots (the
        current number when None), apply the placement, reset the recorder; a collective."""
        if self.recorder is None:
            raise InvalidInputError("EPMoE.rebalance", "recorder", "is None",
                                    "a layer built with recorder=ExpertLoadRecorder(num_experts, group)")
        placement = balance(self.recorder.counts(), self.world_size, num_slots or self._placement.num_slots)
        self.apply_placement(placement)
        self.recorder.reset()
        return placement

    def _set_placement(self, placement: Placement) -> None:
        self._placement = placement
        slots, counts = placement.replica_table()
        device = self.w13.device
        self.register_buffer("_replica_slots", slots.to(device), persistent=False)
        self.register_buffer("_replica_counts", counts.to(device), persistent=False)

    def _migrate(self, new: Placement, first: torch.Tensor, second: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``first [slots, ...]`` and ``second [slots, ...]`` (the weights w13 and w2, or
        their scales) under ``new``: the new slots of expert ``e`` copy it from this rank's old slot
        when there is one, else from one of its old replicas elsewhere (spread by slot index), all
        transfers in one ``all_to_all_single`` of rows holding both (as bytes where fp8)."""
        old = self._placement
        local = first.shape[0]
        fp8 = first.dtype.itemsize == 1 and first.is_floating_point()
        as_rows = lambda t: (t.contiguous().view(torch.uint8) if fp8 else t).reshape(local, -1)  # noqa: E731
        flat = torch.cat([as_rows(first), as_rows(second)], dim=1)
        split = first[0].numel()
        world, rank = self.world_size, self.rank
        sends: list[list[int]] = [[] for _ in range(world)]  # old local slots this rank sends to each rank
        recv_from: list[list[int]] = [[] for _ in range(world)]  # new local slots it fills from each rank
        copies: list[tuple[int, int]] = []  # (new local slot, old local slot) kept on this rank
        for slot, expert in enumerate(new.slot_experts):
            dst = slot // new.slots_per_rank
            sources = old.replicas[expert]
            on_dst = [s for s in sources if s // old.slots_per_rank == dst]
            src_slot = on_dst[0] if on_dst else sources[slot % len(sources)]
            src = src_slot // old.slots_per_rank
            if dst == rank and src == rank:
                copies.append((slot - rank * new.slots_per_rank, src_slot - rank * old.slots_per_rank))
            elif src == rank:
                sends[dst].append(src_slot - rank * old.slots_per_rank)
            elif dst == rank:
                recv_from[src].append(slot - rank * new.slots_per_rank)
        out = flat.new_empty(new.slots_per_rank, flat.shape[1])
        for new_local, old_local in copies:
            out[new_local] = flat[old_local]
        if world > 1:
            send_rows = flat[[s for dst in sends for s in dst]]
            recv_rows = flat.new_empty(sum(len(r) for r in recv_from), flat.shape[1])
            dist.all_to_all_single(recv_rows, send_rows.contiguous(),
                                   output_split_sizes=[len(r) for r in recv_from],
                                   input_split_sizes=[len(s) for s in sends], group=self.group)
            out[[s for src in recv_from for s in src]] = recv_rows
        slots = new.slots_per_rank

        def back(rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
            rows = rows.contiguous().view(like.dtype) if fp8 else rows.contiguous()
            return rows.reshape(slots, *like.shape[1:])

        return back(out[:, :split], first), back(out[:, split:], second)

    def _gather_shapes(self, shape: torch.Tensor) -> list[tuple[int, ...]]:
        if self.world_size == 1:
            return [tuple(shape.tolist())]
        gathered = [torch.empty_like(shape) for _ in range(self.world_size)]
        dist.all_gather(gathered, shape, group=self.group)
        return [tuple(g.tolist()) for g in gathered]

    def _check_tokens(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> None:
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise InvalidInputError("EPMoE", "hidden", f"has shape {list(hidden.shape)}",
                                    f"[T, {self.hidden_size}] (the experts' hidden size)")
        fp8 = self.w13_scale is not None
        if (hidden.dtype != self.w13.dtype and not (fp8 and hidden.is_floating_point())
                or hidden.device != self.w13.device):
            raise InvalidInputError("EPMoE", "hidden", f"is {hidden.dtype} on {hidden.device}",
                                    f"the experts' {'activation dtype' if fp8 else self.w13.dtype} on "
                                    f"{self.w13.device}")
        if topk_ids.device != hidden.device or topk_weights.device != hidden.device:
            raise InvalidInputError("EPMoE", "topk_ids", f"is on {topk_ids.device}, topk_weights on "
                                    f"{topk_weights.device}", f"hidden's device {hidden.device}")
        if topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0]:
            raise InvalidInputError("EPMoE", "topk_ids", f"has shape {list(topk_ids.shape)}",
                                    f"[T, k] with T = {hidden.shape[0]} (hidden's rows)")
        if topk_weights.shape != topk_ids.shape or not topk_weights.is_floating_point():
            raise InvalidInputError("EPMoE", "topk_weights",
                                    f"has shape {list(topk_weights.shape)} and dtype {topk_weights.dtype}",
                                    f"floating point of topk_ids' shape {list(topk_ids.shape)}")
        if topk_ids.dtype not in (torch.int32, torch.int64):
            raise InvalidInputError("EPMoE", "topk_ids", f"has dtype {topk_ids.dtype}", "torch.int32 or torch.int64")
        if topk_ids.numel():
            low, high = (int(v) for v in torch.aminmax(topk_ids))
            if low < -1 or high >= self.num_experts:
                raise InvalidInputError("EPMoE", "topk_ids", f"holds ids from {low} to {high}",
                                        f"global expert ids in [0, {self.num_experts}), or -1 for a dropped choice")


def check_scales(w13: torch.Tensor, w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None) -> None:
    """The block scales of fp8 weights come both or not at all, one row per local expert, on the
    weights' device (their shapes are checked by the computation)."""
    if (w13_scale is None) != (w2_scale is None):
        named = "w2_scale" if w2_scale is None else "w13_scale"
        raise InvalidInputError("EPMoE", named, "is None while the other scale is given",
                                "w13_scale and w2_scale together (fp8 weights) or neither")
    for name, scale in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        if scale is not None and (scale.dim() != 3 or scale.shape[0] != w13.shape[0] or scale.device != w13.device):
            raise InvalidInputError("EPMoE", name, f"has shape {list(scale.shape)} on {scale.device}",
                                    f"[{w13.shape[0]}, ., .] on {w13.device}: one row of block scales per local "
                                    f"expert, on the weights' device")


def check_shard(w13: torch.Tensor, w2: torch.Tensor) -> None:
    """``w13 [L, 2I, H]`` and ``w2 [L, H, I]`` agree, or an :class:`InvalidInputError` names the one at fault."""
    if w13.dim() != 3 or w13.shape[1] % 2:
        raise InvalidInputError("EPMoE", "w13", f"has shape {list(w13.shape)}",
                                "[E/W, 2I, H] (gate rows, then up rows)")
    local, two_inter, hidden = w13.shape
    expected = [local, hidden, two_inter // 2]
    if list(w2.shape) != expected:
        raise InvalidInputError("EPMoE", "w2", f"has shape {list(w2.shape)}", f"{expected} ([E/W, H, I] to match w13)")
    if w2.dtype != w13.dtype or w2.device != w13.device:
        raise InvalidInputError("EPMoE", "w2", f"is {w2.dtype} on {w2.device}", f"w13's {w13.dtype} on {w13.device}")
