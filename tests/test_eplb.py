"""Expert load balancing: the load recorder, replication of the hottest experts, the packing onto ranks,
and the imbalance on skewed (Zipf) routing before and after."""

from __future__ import annotations

import pytest
import torch
from dlblas_kernels.moe import ExpertLoadRecorder, Placement, balance, imbalance, rank_loads, routed_rank_loads
from dlblas_kernels.moe.eplb import pack, pack_groups, replicate

from dlcore import InvalidInputError


def zipf_routing(experts: int, tokens: int, k: int, exponent: float, seed: int) -> torch.Tensor:
    """``[tokens, k]`` distinct experts per token, expert popularity Zipf(``exponent``) over a random order."""
    gen = torch.Generator().manual_seed(seed)
    popularity = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** exponent
    popularity = popularity[torch.randperm(experts, generator=gen)]
    return torch.multinomial(popularity.expand(tokens, experts), k, generator=gen)


def test_replicate_gives_spare_slots_to_the_highest_load_per_replica():
    # 10 -> 5 -> 3.33 (after two spares) while 4 and 3 stay below
    assert replicate(torch.tensor([10, 4, 3, 1]), 6) == [3, 1, 1, 1]
    assert replicate(torch.tensor([10, 9, 3, 1]), 6) == [2, 2, 1, 1]
    assert replicate(torch.tensor([5, 5]), 2) == [1, 1]
    with pytest.raises(InvalidInputError, match="num_slots"):
        replicate(torch.tensor([1, 2, 3]), 2)


def test_pack_fills_every_rank_evenly_and_keeps_replicas_apart():
    loads = [8.0, 4.0, 4.0, 3.0, 3.0, 2.0, 1.0, 1.0]
    experts = [0, 0, 1, 2, 3, 4, 5, 6]
    ranks = pack(loads, experts, 4)
    assert sorted(s for r in ranks for s in r) == list(range(8))
    assert all(len(r) == 2 for r in ranks)
    assert all(len({experts[s] for s in r}) == len(r) for r in ranks)  # no rank holds expert 0 twice
    assert max(sum(loads[s] for s in r) for r in ranks) == 9.0  # the 8 alone with the smallest


@pytest.mark.parametrize("experts, ranks, spare, exponent", [
    (64, 8, 8, 1.0),     # the example: 9 slots per rank
    (64, 8, 8, 1.2),
    (256, 8, 32, 1.0),   # DeepSeek-V3's routed experts with 32 redundant slots
    (16, 4, 4, 1.5),
])
def test_zipf_routing_is_balanced_to_within_ten_percent(experts, ranks, spare, exponent):
    ids = zipf_routing(experts, tokens=4096, k=8 if experts > 16 else 2, exponent=exponent, seed=experts + ranks)
    recorder = ExpertLoadRecorder(experts)
    for step in ids.chunk(4):
        recorder.record(step)
    load = recorder.counts()
    assert recorder.steps == 4 and int(load.sum()) == ids.numel()
    plain = Placement.contiguous(experts, ranks)
    placement = balance(load, ranks, experts + spare)
    # every expert placed, every rank the same number of slots
    assert sorted(set(placement.slot_experts)) == list(range(experts))
    assert placement.num_slots == experts + spare and placement.slots_per_rank == (experts + spare) // ranks
    # the replicas are of the hottest experts only
    replicated = {e for e, slots in enumerate(placement.replicas) if len(slots) > 1}
    hottest = set(torch.argsort(load, descending=True, stable=True)[:spare].tolist())
    assert replicated and replicated <= hottest
    before = imbalance(rank_loads(plain, load))
    after = imbalance(rank_loads(placement, load))
    routed = imbalance(routed_rank_loads(placement, ids).double())
    assert before > 1.2, before
    assert after <= 1.1 and routed <= 1.1, (before, after, routed)
    assert after < before


def test_the_example_placement_numbers():
    """64 experts, 8 ranks, 8 redundant slots, Zipf 1.0, top-8 of 16384 tokens, seed 0: imbalance 1.32
    with one slot per expert in order; 1.001 balanced (1.004 routed replica by token index)."""
    ids = zipf_routing(64, tokens=16384, k=8, exponent=1.0, seed=0)
    load = torch.bincount(ids.reshape(-1), minlength=64)
    placement = balance(load, 8, 72)
    assert imbalance(rank_loads(Placement.contiguous(64, 8), load)) == pytest.approx(1.322, abs=1e-3)
    assert imbalance(rank_loads(placement, load)) == pytest.approx(1.001, abs=1e-3)
    assert imbalance(routed_rank_loads(placement, ids).double()) == pytest.approx(1.004, abs=1e-3)


def test_even_load_stays_even_and_no_load_is_balanced():
    placement = balance(torch.full((8,), 100), 4, 8)
    assert sorted(placement.slot_experts) == list(range(8))
    assert imbalance(rank_loads(placement, torch.full((8,), 100))) == 1.0
    assert imbalance(torch.zeros(4)) == 1.0
    assert len(set(balance(torch.zeros(8), 2, 10).slot_experts)) == 8


def test_recorder_counts_and_resets():
    recorder = ExpertLoadRecorder(4)
    recorder.record(torch.tensor([[0, 1], [1, -1], [3, 1]]))
    recorder.record(torch.tensor([[2, 2]], dtype=torch.int32))
    assert recorder.counts().tolist() == [1, 3, 2, 1] and recorder.steps == 2
    recorder.reset()
    assert recorder.counts().tolist() == [0, 0, 0, 0] and recorder.steps == 0
    with pytest.raises(InvalidInputError, match="topk_ids"):
        recorder.record(torch.tensor([[4]]))
    with pytest.raises(InvalidInputError, match="num_experts"):
        ExpertLoadRecorder(0)


@pytest.mark.parametrize("load, ranks, slots, arg", [
    (torch.ones(8), 3, 8, "num_slots"),
    (torch.ones(8), 2, 6, "num_slots"),
    (torch.ones(2, 4), 2, 8, "load"),
])
def test_bad_balance_arguments_are_named(load, ranks, slots, arg):
    with pytest.raises(InvalidInputError, match=arg):
        balance(load, ranks, slots)


def test_hierarchical_keeps_each_group_on_one_node_and_balances():
    """DeepSeek-V3-like: 256 experts in 8 groups on 2 nodes of 4 ranks, 32 spare slots, Zipf routing:
    every group's experts (and their replicas) on one node, four groups a node, every expert placed,
    the imbalance within 10%; one node is the flat placement."""
    ids = zipf_routing(256, 8192, 8, 1.0, seed=3)
    load = torch.bincount(ids.reshape(-1), minlength=256)
    placement = balance(load, 8, 288, num_nodes=2, num_groups=8)
    assert sorted(set(placement.slot_experts)) == list(range(256))
    node_of = {}
    for rank in range(8):
        for e in placement.rank_experts(rank):
            assert node_of.setdefault(e // 32, rank // 4) == rank // 4  # group e // 32 on one node
    assert sorted(node_of.values()) == [0] * 4 + [1] * 4
    before = imbalance(rank_loads(Placement.contiguous(256, 8), load))
    after = imbalance(rank_loads(placement, load))
    assert after <= 1.1 < before
    assert balance(load, 8, 288, num_nodes=1) == balance(load, 8, 288)


def test_pack_groups_heaviest_first_to_the_lightest_node():
    assert pack_groups([10.0, 1.0, 7.0, 4.0], 2) == [[0, 1], [2, 3]]
    assert pack_groups([1.0, 1.0, 1.0, 1.0], 4) == [[0], [1], [2], [3]]


@pytest.mark.parametrize("nodes, groups, slots, arg", [
    (3, None, 16, "num_nodes"),  # 8 ranks on 3 nodes
    (2, 3, 16, "num_groups"),  # 3 groups on 2 nodes
    (2, 6, 16, "num_groups"),  # 16 experts in 6 groups
    (2, 4, 8, "num_slots"),  # 4 slots a node for 8 experts a node
])
def test_bad_hierarchical_arguments_are_named(nodes, groups, slots, arg):
    with pytest.raises(InvalidInputError, match=arg):
        balance(torch.arange(16), 8 if arg != "num_slots" else 4, slots, num_nodes=nodes, num_groups=groups)
