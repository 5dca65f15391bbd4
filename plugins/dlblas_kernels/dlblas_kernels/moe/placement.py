"""Where the experts live: physical slots, split contiguously over the ranks, each holding one logical expert.

With ``S`` slots over ``W`` ranks, rank ``r`` holds slots ``[r*S/W, (r+1)*S/W)``. The plain placement
has one slot per expert in order (rank ``r`` holds experts ``[r*E/W, (r+1)*E/W)``); a balanced one
(:func:`dlblas_kernels.moe.eplb.balance`) gives hot experts several slots (replicas) and orders the
slots so that every rank carries about the same load. Replicas hold the same weights, so which one
serves a token changes nothing in the result; :meth:`Placement.physical_ids` spreads each expert's
tokens over its replicas by token index.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from dlcore.api import InvalidInputError


@dataclass(frozen=True)
class Placement:
    """Which logical expert each physical slot holds (``slot_experts[s]``), over ``num_ranks`` ranks."""

    slot_experts: tuple[int, ...]
    num_experts: int
    num_ranks: int

    def __post_init__(self) -> None:
        slots = len(self.slot_experts)
        if self.num_ranks < 1 or slots % self.num_ranks:
            raise InvalidInputError("Placement", "slot_experts", f"has {slots} slots over {self.num_ranks} ranks",
                                    "a slot count divisible by the number of ranks")
        outside = sorted({e for e in self.slot_experts if not 0 <= e < self.num_experts})
        if outside:
            raise InvalidInputError("Placement", "slot_experts", f"names experts {outside}",
                                    f"expert ids in [0, {self.num_experts})")
        missing = sorted(set(range(self.num_experts)) - set(self.slot_experts))
        if missing:
            raise InvalidInputError("Placement", "slot_experts", f"leaves experts {missing} without a slot",
                                    "every expert in at least one slot")

    @classmethod
    def contiguous(cls, num_experts: int, num_ranks: int) -> Placement:
        """One slot per expert in order: rank ``r`` holds experts ``[r*E/W, (r+1)*E/W)``."""
        if num_ranks < 1 or num_experts % num_ranks:
            raise InvalidInputError("Placement", "num_experts", f"{num_experts} over {num_ranks} ranks",
                                    "a number of experts divisible by the number of ranks")
        return cls(tuple(range(num_experts)), num_experts, num_ranks)

    @property
    def num_slots(self) -> int:
        return len(self.slot_experts)

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.num_ranks

    def rank_slots(self, rank: int) -> range:
        """The physical slots rank ``rank`` holds."""
        return range(rank * self.slots_per_rank, (rank + 1) * self.slots_per_rank)

    def rank_experts(self, rank: int) -> tuple[int, ...]:
        """The logical expert of each slot of rank ``rank``, in slot order."""
        return tuple(self.slot_experts[s] for s in self.rank_slots(rank))

    @cached_property
    def replicas(self) -> tuple[tuple[int, ...], ...]:
        """For each logical expert, its slots in increasing order."""
        table: list[list[int]] = [[] for _ in range(self.num_experts)]
        for slot, expert in enumerate(self.slot_experts):
            table[expert].append(slot)
        return tuple(tuple(slots) for slots in table)

    def replica_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slots [E, R], counts [E])`` int64: expert ``e``'s replicas are ``slots[e, :counts[e]]``
        (``R`` the most replicas of any expert; the rest of a row repeats its first slot)."""
        width = max(len(r) for r in self.replicas)
        slots = torch.tensor([list(r) + [r[0]] * (width - len(r)) for r in self.replicas], dtype=torch.int64)
        counts = torch.tensor([len(r) for r in self.replicas], dtype=torch.int64)
        return slots, counts

    def physical_ids(self, topk_ids: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> torch.Tensor:
        """Logical expert ids ``[T, k]`` to slot ids (int64): token ``t``'s choice of expert ``e`` goes to
        replica ``t mod count[e]``; ``-1`` (a dropped choice) stays ``-1``. ``table`` is
        :meth:`replica_table` already on the ids' device, to spare building it on every call."""
        slots, counts = table if table is not None else (t.to(topk_ids.device) for t in self.replica_table())
        ids = topk_ids.long()
        dropped = ids < 0
        experts = ids.clamp(min=0)
        token = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1)
        physical = slots[experts, token % counts[experts]]
        return physical.masked_fill(dropped, -1)
