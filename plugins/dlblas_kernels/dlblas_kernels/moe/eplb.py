"""Expert load balancing: count each expert's tokens over steps, then place the experts so the ranks carry even loads.

The design is DeepSeek's published EPLB (expert-parallel load balancer), in two steps:

1. **replicate**: every expert gets one slot; each spare slot goes, one at a time, to the expert whose
   load per replica is the highest at that moment (its tokens are spread evenly over its replicas);
2. **pack**: the slots, each carrying its expert's load divided by the expert's replica count, go to
   the ranks heaviest first, each to the least loaded rank that still has a free slot (and, where one
   of those is as light, to a rank without a replica of the same expert), so every rank ends with
   the same number of slots.

The imbalance of a placement is the heaviest rank's load over the mean rank load (1 is perfect).

Over several nodes (:func:`balance` with ``num_nodes`` and ``num_groups``), DeepSeek's hierarchical
variant: the experts come in ``num_groups`` groups of consecutive ids (DeepSeek-V3's routing picks a
few groups per token, then experts within them), and the groups are packed onto the nodes first,
the same number on each, heaviest first to the lightest node, so that a token's experts sit on few
nodes and the traffic between nodes stays low; then each node replicates its own experts onto its
slots and packs them onto its ranks as above. Node ``n`` holds ranks ``[n*W/N, (n+1)*W/N)``.
"""

from __future__ import annotations

import heapq

import torch
import torch.distributed as dist

from dlblas_kernels.moe.placement import Placement
from dlcore.api import InvalidInputError


class ExpertLoadRecorder:
    """Per-expert token counts summed over steps; :meth:`counts` sums them over the process group too."""

    def __init__(self, num_experts: int, group: dist.ProcessGroup | None = None):
        if num_experts < 1:
            raise InvalidInputError("ExpertLoadRecorder", "num_experts", f"is {num_experts}", "a positive count")
        self.num_experts = num_experts
        self.group = group
        self.steps = 0
        self._counts = torch.zeros(num_experts, dtype=torch.int64)

    def record(self, topk_ids: torch.Tensor) -> None:
        """Add one step's routing: ``topk_ids [T, k]`` logical expert ids, ``-1`` for dropped choices."""
        ids = topk_ids.reshape(-1).long()
        ids = ids[ids >= 0]
        if ids.numel() and int(ids.max()) >= self.num_experts:
            raise InvalidInputError("ExpertLoadRecorder", "topk_ids", f"holds expert {int(ids.max())}",
                                    f"ids in [-1, {self.num_experts})")
        if self._counts.device != ids.device:
            self._counts = self._counts.to(ids.device)
        self._counts += torch.bincount(ids, minlength=self.num_experts)
        self.steps += 1

    def counts(self) -> torch.Tensor:
        """The tokens each expert received since the last :meth:`reset`, over every rank of the group
        when torch.distributed is initialised (a collective: every rank calls it)."""
        total = self._counts.clone()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(total, group=self.group)
        return total

    def reset(self) -> None:
        self._counts.zero_()
        self.steps = 0


def replicate(load: torch.Tensor, num_slots: int) -> list[int]:
    """How many replicas each expert gets: one each, then every spare slot to the expert with the
    highest load per replica (ties to the lower expert id)."""
    loads = [float(x) for x in load.tolist()]
    if num_slots < len(loads):
        raise InvalidInputError("eplb", "num_slots", f"is {num_slots}", f"at least the {len(loads)} experts")
    counts = [1] * len(loads)
    heap = [(-x, e) for e, x in enumerate(loads)]
    heapq.heapify(heap)
    for _ in range(num_slots - len(loads)):
        _, e = heapq.heappop(heap)
        counts[e] += 1
        heapq.heappush(heap, (-loads[e] / counts[e], e))
    return counts


def pack(slot_loads: list[float], slot_experts: list[int], num_ranks: int) -> list[list[int]]:
    """The slots of each rank (indices into ``slot_loads``), every rank ``len(slot_loads) / num_ranks``
    of them: heaviest slot first, to the least loaded rank with room, preferring among equally light
    ranks one that holds no replica of the same expert."""
    per_rank = len(slot_loads) // num_ranks
    ranks: list[list[int]] = [[] for _ in range(num_ranks)]
    rank_load = [0.0] * num_ranks
    held: list[set[int]] = [set() for _ in range(num_ranks)]
    for slot in sorted(range(len(slot_loads)), key=lambda s: (-slot_loads[s], s)):
        expert = slot_experts[slot]
        open_ranks = [r for r in range(num_ranks) if len(ranks[r]) < per_rank]
        lightest = min(rank_load[r] for r in open_ranks)
        candidates = [r for r in open_ranks if rank_load[r] == lightest]
        fresh = [r for r in candidates if expert not in held[r]]
        rank = (fresh or candidates)[0]
        ranks[rank].append(slot)
        rank_load[rank] += slot_loads[slot]
        held[rank].add(expert)
    return ranks


def _flat(loads: list[float], experts: list[int], num_ranks: int, num_slots: int) -> list[int]:
    """The logical expert of each slot, rank after rank, for ``experts`` (their ``loads``) replicated
    onto ``num_slots`` slots and packed onto ``num_ranks`` ranks."""
    counts = replicate(torch.tensor(loads, dtype=torch.float64), num_slots)
    slot_experts = [e for e, c in zip(experts, counts) for _ in range(c)]
    per_expert = dict(zip(experts, counts))
    slot_loads = [loads[experts.index(e)] / per_expert[e] for e in slot_experts]
    ranks = pack(slot_loads, slot_experts, num_ranks)
    # within a rank, slots in expert order: a rank's local expert ids then follow the logical ones
    return [e for slots in ranks for e in sorted(slot_experts[s] for s in slots)]


def pack_groups(group_loads: list[float], num_nodes: int) -> list[list[int]]:
    """The groups of each node, ``len(group_loads) / num_nodes`` each: heaviest first, to the
    lightest node with room (ties to the lower node); each node's groups in increasing order."""
    per_node = len(group_loads) // num_nodes
    nodes: list[list[int]] = [[] for _ in range(num_nodes)]
    node_load = [0.0] * num_nodes
    for group in sorted(range(len(group_loads)), key=lambda g: (-group_loads[g], g)):
        node = min((n for n in range(num_nodes) if len(nodes[n]) < per_node), key=lambda n: (node_load[n], n))
        nodes[node].append(group)
        node_load[node] += group_loads[group]
    return [sorted(groups) for groups in nodes]


def balance(load: torch.Tensor, num_ranks: int, num_slots: int, *, num_nodes: int = 1,
            num_groups: int | None = None) -> Placement:
    """A placement of ``load.numel()`` experts onto ``num_slots`` slots over ``num_ranks`` ranks, the
    hottest experts replicated and the ranks' loads evened (``load``: tokens per logical expert).

    With ``num_nodes > 1`` (the ranks ``num_ranks / num_nodes`` to a node), hierarchically: the
    ``num_groups`` expert groups (consecutive ids; default one group per node) packed onto the nodes
    first, then each node's experts replicated onto its slots and packed onto its ranks."""
    if load.dim() != 1:
        raise InvalidInputError("eplb", "load", f"has shape {tuple(load.shape)}", "a vector [num_experts]")
    if num_ranks < 1 or num_slots % num_ranks:
        raise InvalidInputError("eplb", "num_slots", f"is {num_slots} over {num_ranks} ranks",
                                "a slot count divisible by the number of ranks")
    experts = load.numel()
    groups = num_nodes if num_groups is None else num_groups
    if num_nodes < 1 or num_ranks % num_nodes:
        raise InvalidInputError("eplb", "num_nodes", f"is {num_nodes} for {num_ranks} ranks",
                                "a node count dividing the number of ranks")
    if groups < 1 or groups % num_nodes or experts % groups:
        raise InvalidInputError("eplb", "num_groups", f"is {groups} for {experts} experts on {num_nodes} nodes",
                                "a group count dividing the experts and divisible by the number of nodes")
    loads = [float(x) for x in load.tolist()]
    if num_nodes == 1:
        return Placement(tuple(_flat(loads, list(range(experts)), num_ranks, num_slots)), experts, num_ranks)
    size = experts // groups
    slots_per_node = num_slots // num_nodes
    if slots_per_node < experts // num_nodes:
        raise InvalidInputError("eplb", "num_slots", f"is {num_slots} for {experts} experts on {num_nodes} nodes",
                                f"at least {experts // num_nodes} slots a node (its experts)")
    group_loads = [sum(loads[g * size:(g + 1) * size]) for g in range(groups)]
    ordered: list[int] = []
    for node_groups in pack_groups(group_loads, num_nodes):
        node_experts = [e for g in node_groups for e in range(g * size, (g + 1) * size)]
        ordered += _flat([loads[e] for e in node_experts], node_experts, num_ranks // num_nodes, slots_per_node)
    return Placement(tuple(ordered), experts, num_ranks)


def rank_loads(placement: Placement, load: torch.Tensor) -> torch.Tensor:
    """The load each rank carries under ``placement`` (float64 ``[W]``) when every expert's tokens are
    split evenly over its replicas."""
    load = load.double().cpu()
    counts = torch.tensor([len(r) for r in placement.replicas], dtype=torch.float64)
    per_slot = (load / counts)[list(placement.slot_experts)]
    return per_slot.view(placement.num_ranks, placement.slots_per_rank).sum(1)


def imbalance(loads: torch.Tensor) -> float:
    """The heaviest rank's load over the mean rank load (1.0 when even; 1.0 for no load at all)."""
    loads = loads.double()
    mean = float(loads.mean())
    return float(loads.max()) / mean if mean > 0 else 1.0


def routed_rank_loads(placement: Placement, topk_ids: torch.Tensor) -> torch.Tensor:
    """The tokens each rank receives (int64 ``[W]``) when ``topk_ids`` (logical ids, ``-1`` dropped) is
    routed through ``placement``: what the layer's exchange sends, replica by replica."""
    slots = placement.physical_ids(topk_ids).reshape(-1)
    slots = slots[slots >= 0]
    per_slot = torch.bincount(slots.cpu(), minlength=placement.num_slots)
    return per_slot.view(placement.num_ranks, placement.slots_per_rank).sum(1)
