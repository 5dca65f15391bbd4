from __future__ import annotations

import math

import dlblas_kernels
import dlblas_kernels.kernels.topk_gating as topk_gating_module
import pytest
import torch
from dlblas_kernels.kernels.topk_gating import (
    KERNEL,
    OP,
    backward_plan,
    capacity,
    topk_gating,
    topk_gating_backward_reference,
    topk_gating_reference,
    topk_gating_training_reference,
)
from gradients import leaves

from dlcore import InvalidInputError
from dlcore.declarations.device import planning_for
from dlcore.declarations.signature import make_signature
from dlcore.runtime.profile import first_device
from dlcore.runtime.template import UNKNOWN_DEVICE, device_profile
from dlcore.testing import assert_close, poison, randn
from dlcore.tuning.verify import mismatch, reference_result

TRITON = KERNEL.implementation
#: what no kernel writes into an index output: an element left unwritten shows
UNWRITTEN = 2**30


def route(logits, k, capacity_factor=1.0, min_capacity=2):
    """The reference's four outputs for float64 logits built from ``logits`` (nested lists)."""
    return topk_gating_reference(torch.tensor(logits, dtype=torch.float64), k, capacity_factor, min_capacity)


def softmax_rows(rows):
    out = []
    for row in rows:
        total = sum(math.exp(v) for v in row)
        out.append([math.exp(v) / total for v in row])
    return out


def assert_routing(outputs, l_aux, ec_idx, weights, select):
    got_l_aux, got_ec, got_weights, got_select = outputs
    assert got_ec.dtype == torch.int32 and got_select.dtype == torch.int64
    assert got_ec.tolist() == ec_idx
    assert got_select.tolist() == select
    assert got_weights.tolist() == pytest.approx(weights, abs=1e-12)
    assert got_l_aux.dim() == 0 and got_l_aux.item() == pytest.approx(l_aux, abs=1e-12)


# -- the reference against hand-computed cases -----------------------------------------------------


def test_reference_ties_go_to_the_lower_expert():
    """Equal logits: both tokens take experts 0 then 1. C = max(ceil(2 / 4 * 2), 2) = 2, nothing
    dropped; gates 1/4, weights 1/2; me = 1/4, ce = (1/2, 1/2, 0, 0): l_aux = 16 * mean = 1."""
    assert_routing(route([[0.0] * 4, [0.0] * 4], 2), 1.0, [0, 1, 2, 3], [0.5] * 4, [0, 1, 0, 1, -1, -1, -1, -1])


@pytest.mark.parametrize("min_capacity, ec_idx, weights, select", [
    (0, [2, 3, 0, 0], [1.0, 1.0, 0.0, 0.0], [-1, -1, 0, 1]),            # C = ceil(4 / 2) = 2
    (3, [3, 4, 5, 0], [1.0, 1.0, 1.0, 0.0], [-1, -1, -1, 0, 1, 2]),     # C = min_capacity = 3
])
def test_reference_drops_past_the_capacity(min_capacity, ec_idx, weights, select):
    """k = 1: all four tokens choose expert 1 and take its slots in token order until C; l_aux
    counts the dropped choices too: ce = (0, 1), me_1 = sigmoid(1), l_aux = 4 * me_1 / 2."""
    p1 = 1 / (1 + math.exp(-1))
    assert_routing(route([[0.0, 1.0]] * 4, 1, 1.0, min_capacity), 2 * p1, ec_idx, weights, select)


def test_reference_ranks_all_first_choices_before_second_choices():
    """S = E = 3, k = 2, C = 2. First choices: s0 -> e0, s1 -> e1, s2 -> e1 (expert 1 full); second
    choices: s0 -> e1 (slot 2: dropped), s1 -> e2, s2 -> e0 (slot 1). Token-major ranking would
    drop s2's first choice instead."""
    logits = [[3.0, 2.0, 0.0], [0.0, 3.0, 2.0], [2.0, 3.0, 0.0]]
    high = 1 / (1 + math.exp(-1))  # e^3 / (e^3 + e^2)
    gates = softmax_rows(logits)
    me = [sum(row[e] for row in gates) / 3 for e in range(3)]
    ce = [2 / 6, 3 / 6, 1 / 6]
    l_aux = sum(m * c for m, c in zip(me, ce)) / 3 * 9
    assert_routing(route(logits, 2), l_aux, [0, 2, 3, 0, 4, 1], [1.0, high, high, 0.0, 1 - high, 1 - high],
                   [0, 2, 1, 2, 1, -1])


def test_reference_k8_over_8_experts_slots_follow_the_rank():
    """k = E = 8: every token chooses every expert, in order of its logits. Token 0 chooses expert e
    at rank e, token 1 at rank 7 - e: the token of the lower rank takes slot 0. With k = E, ce = 1/E
    and l_aux = 1 whatever the gates."""
    logits = [[7.0 - e for e in range(8)], [float(e) for e in range(8)]]
    gates = softmax_rows(logits)
    ec_idx, weights = [], []
    for j in range(8):  # rank j: token 0 chooses expert j, token 1 expert 7 - j
        ec_idx += [2 * j + (0 if j <= 3 else 1), 2 * (7 - j) + (0 if 7 - j >= 4 else 1)]
        weights += [gates[0][j], gates[1][7 - j]]
    select = [0, 1] * 4 + [1, 0] * 4
    assert_routing(route(logits, 8), 1.0, ec_idx, weights, select)


def test_reference_64_experts_a_token_may_lose_every_choice():
    """E = 64, k = 2, C = max(ceil(4 / 64 * 2), 2) = 2: all four tokens choose experts 0 then 1;
    tokens 2 and 3 lose both choices: weights 0 (the clamped sum divides nothing)."""
    row = [-float(e) for e in range(64)]
    gates = softmax_rows([row])[0]
    l_aux = (gates[0] * 0.5 + gates[1] * 0.5) / 64 * 64 * 64
    first = 1 / (1 + math.exp(-1))  # e^0 / (e^0 + e^-1)
    weights = [first, first, 0.0, 0.0, 1 - first, 1 - first, 0.0, 0.0]
    select = [0, 1, 0, 1] + [-1] * 124
    assert_routing(route([row] * 4, 2), l_aux, [0, 1, 0, 0, 2, 3, 0, 0], weights, select)


def test_reference_256_experts():
    """E = 256, k = 1, logits equal but one tie at the top of token 2 (experts 17 and 200): tokens 0
    and 1 fill expert 0 (C = 2), token 2 takes expert 17, the lower of its two. k = 8 of equal
    logits: experts 0 to 7."""
    zeros = [0.0] * 256
    top = list(zeros)
    top[17] = top[200] = 5.0
    gates = softmax_rows([zeros, top])
    me_0 = (2 * gates[0][0] + gates[1][0]) / 3
    me_17 = (2 * gates[0][17] + gates[1][17]) / 3
    l_aux = (me_0 * 2 / 3 + me_17 * 1 / 3) / 256 * 256 * 256
    select = [-1] * 512
    select[0:2], select[34] = [0, 1], 2
    assert_routing(route([zeros, zeros, top], 1), l_aux, [0, 1, 34], [1.0, 1.0, 1.0], select)
    _, ec_idx, weights, _ = route([zeros], 8)
    assert ec_idx.tolist() == [e * 2 for e in range(8)] and weights.tolist() == pytest.approx([1 / 8] * 8)


def test_capacity():
    assert capacity(4096, 64, 8, 1.0, 2) == 512
    assert capacity(16384, 256, 2, 1.25, 4) == 160
    assert capacity(1, 64, 2, 1.0, 2) == 2 and capacity(1, 64, 2, 1.0, 0) == 1
    assert capacity(100, 16, 3, 0.5, 2) == 10  # ceil(9.375)


@pytest.mark.parametrize("k", [1, 2, 8])
def test_reference_gradcheck(k, gen):
    """l_aux and token_exp_weights against finite differences (float64), with drops (C = 1 for k
    1 and 2, 4 for k 8)."""
    logits = randn(7, 8, dtype=torch.float64, generator=gen, scale=2.0).requires_grad_()
    assert (topk_gating_reference(logits.detach(), k, 0.5, 1)[2] == 0).any()
    assert torch.autograd.gradcheck(lambda x: topk_gating_reference(x, k, 0.5, 1)[::2], (logits,))


def test_a_missing_output_gradient_keeps_float64_logits_on_the_reference():
    """An output given no gradient (gradcheck asks one output at a time) takes zeros in the logits'
    float64: the backward op takes its reference path by its first tensor's dtype, and float32 zeros
    sent float64 logits (on the CPU) to the compiled kernels on a GPU host."""
    from types import SimpleNamespace

    from dlblas_kernels.kernels.topk_gating import _gradients

    def dtypes(*args):
        return args[0].dtype, args[1].dtype

    for dtype in (torch.float64, torch.float32):
        saved = SimpleNamespace(logits=torch.zeros(6, 16, dtype=dtype), k=3, expert_counts=torch.zeros(16),
                                kept_experts=torch.zeros(6, 3, dtype=torch.int64))
        assert _gradients(dtypes, saved, (None, None, None, None), None) == {"logits": (dtype, dtype)}


def test_backward_reference_is_autograd_of_the_reference(gen):
    """The backward's closed form (what the backward custom op runs on float64) equals torch
    autograd through the reference; and the custom op's float64 path passes gradcheck."""
    logits = randn(6, 16, dtype=torch.float64, generator=gen, scale=2.0)
    d_l_aux, d_weights = randn(1, dtype=torch.float64, generator=gen)[0], randn(18, dtype=torch.float64, generator=gen)
    x = logits.clone().requires_grad_()
    l_aux, _, weights, _ = topk_gating_reference(x, 3, 0.6)
    (expected,) = torch.autograd.grad([l_aux, weights], [x], [d_l_aux, d_weights])
    *_, kept_experts, counts = topk_gating_training_reference(logits, 3, 0.6)
    assert (kept_experts == -1).any()
    got = topk_gating_backward_reference(d_l_aux, d_weights, logits, kept_experts, counts, 3)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-12)
    op = torch.ops.dlblas.topk_gating
    assert torch.autograd.gradcheck(lambda t: op(t, 3, 0.6, 2, 0, 0)[::2], (logits.clone().requires_grad_(),))


# -- the Triton kernels against the reference ------------------------------------------------------


def launch(args, config=None):
    """The Triton plan on ``args`` with its outputs poisoned first (NaN, or UNWRITTEN for indices)."""
    if config is None:
        device = args[0].device
        config = TRITON.default_config(make_signature(OP, args, device), device_profile(device))
    plan = TRITON.plan(args, config, device_profile(first_device(args)))
    for t in plan.result:
        if t.is_floating_point():
            poison(t)
        else:
            t.fill_(UNWRITTEN)
    return plan.run()


def assert_matches_reference(outputs, logits, k, capacity_factor=1.0, min_capacity=2):
    """Indices exactly, l_aux and weights within float32's tolerance of the float64 reference."""
    l_aux, ec_idx, weights, select = topk_gating_reference(logits.double(), k, capacity_factor, min_capacity)
    got_l_aux, got_ec, got_weights, got_select = outputs
    assert torch.equal(got_ec.cpu(), ec_idx.cpu()), "token_rearranged_ec_idx"
    assert torch.equal(got_select.cpu(), select.cpu()), "expert_select_token_idx"
    assert_close(got_weights, weights, torch.float32)
    assert_close(got_l_aux, l_aux, torch.float32, reduce_dim=logits.shape[0])


# (S, E, k, capacity_factor): odd token counts, experts not a power of two, drops (factor < 1),
# many empty slots (factor 8)
SHAPES = [(37, 8, 2, 1.0), (1, 8, 1, 1.0), (45, 20, 3, 0.7), (13, 40, 8, 8.0), (64, 16, 4, 1.0)]


@pytest.mark.parametrize("tokens, experts, k, capacity_factor", SHAPES)
def test_matches_reference(tokens, experts, k, capacity_factor, dtype, device, gen):
    logits = randn(tokens, experts, dtype=dtype, device=device, generator=gen, scale=2.0)
    outputs = launch((logits, k, capacity_factor, 2))
    assert_matches_reference(outputs, logits, k, capacity_factor)


@pytest.mark.parametrize("tokens, block", [(37, 4), (6, 1)])
def test_many_blocks_and_scan_tiles(tokens, block, device, gen, monkeypatch):
    """Scan tiles of 4 x 16: the counts' rows (8 ranks x the token blocks) and the empty slots (a
    capacity of 10 * tokens with factor 40) each take several tiles."""
    monkeypatch.setattr(topk_gating_module, "SCAN_TILE", 64)
    config = {"BLOCK_S": block, "num_warps": 1}
    logits = randn(tokens, 8, device=device, generator=gen, scale=2.0)
    assert_matches_reference(launch((logits, 8, 1.0, 2), config), logits, 8)
    assert_matches_reference(launch((logits, 2, 40.0, 2), config), logits, 2, 40.0)


def test_ties_in_float16(device, gen):
    """Few distinct logits: ties everywhere, broken towards the lower expert exactly as the reference."""
    logits = torch.randint(-2, 3, (29, 16), generator=gen).to(device=device, dtype=torch.float16)
    assert_matches_reference(launch((logits, 4, 1.0, 2)), logits, 4)
    logits[3] = 0.0
    assert_matches_reference(launch((logits, 16, 1.0, 2)), logits, 16)


@pytest.mark.parametrize("layout", ["transposed", "column step"])
def test_non_contiguous_logits(layout, device, gen):
    logits = randn(23, 12, device=device, generator=gen, scale=2.0)
    if layout == "transposed":
        strided = logits.T.contiguous().T
    else:
        strided = poison(torch.empty(23, 24, device=device))[:, ::2]
        strided.copy_(logits)
    assert not strided.is_contiguous()
    assert_matches_reference(launch((strided, 3, 1.0, 2)), logits, 3)


def test_public_function(device, gen):
    logits = randn(19, 8, dtype=torch.float16, device=device, generator=gen)
    assert dlblas_kernels.topk_gating is topk_gating
    outputs = topk_gating(logits, 2, capacity_factor=0.75, min_capacity=1)
    assert [t.shape for t in outputs] == [(), (38,), (38,), (8 * 4,)]
    assert_matches_reference(outputs, logits, 2, 0.75, 1)


@pytest.mark.parametrize("tokens, experts, k, capacity_factor", [(37, 8, 2, 1.0), (21, 20, 3, 0.5), (6, 8, 8, 1.0)])
def test_gradients_match_the_reference(tokens, experts, k, capacity_factor, dtype, device, gen):
    """The backward kernel against torch autograd of the float64 reference, from random gradients
    of l_aux and token_exp_weights (the index outputs carry none)."""
    logits = randn(tokens, experts, dtype=dtype, device=device, generator=gen, scale=2.0)
    (x,) = leaves((logits,), (0,))
    l_aux, ec_idx, weights, select = topk_gating(x, k, capacity_factor)
    assert not ec_idx.requires_grad and not select.requires_grad
    d_l_aux = randn(1, device=device, generator=gen)[0]
    d_weights = randn(k * tokens, device=device, generator=gen)
    (grad,) = torch.autograd.grad([l_aux, weights], [x], [d_l_aux, d_weights])
    (x64,) = leaves((logits.double(),), (0,))
    ref = topk_gating_reference(x64, k, capacity_factor)
    (expected,) = torch.autograd.grad([ref[0], ref[2]], [x64], [d_l_aux.double(), d_weights.double()])
    assert grad.dtype == dtype and grad.shape == logits.shape
    assert_close(grad, expected, dtype)


def test_gradient_of_l_aux_alone_and_of_a_strided_weight_gradient(device, gen):
    """``l_aux.backward()`` alone (the weights' gradient materialised as zeros) and
    ``weights.sum()`` (an expanded gradient of stride 0) through non-contiguous logits."""
    logits = randn(12, 32, device=device, generator=gen, scale=2.0).T.contiguous().T
    for pick in (0, 2):
        (x,) = leaves((logits,), (0,))
        (grad,) = torch.autograd.grad(topk_gating(x, 4)[pick].sum(), [x])
        (x64,) = leaves((logits.double(),), (0,))
        (expected,) = torch.autograd.grad(topk_gating_reference(x64, 4)[pick].sum(), [x64])
        assert_close(grad, expected, torch.float32)


def test_tuning_checks_the_indices_exactly(device, gen):
    """What tuning and ``dlcore check`` compare (``mismatch``): weights within tolerance, indices exactly."""
    logits = randn(9, 8, device=device, generator=gen, scale=2.0)
    outputs = launch((logits, 2, 1.0, 2))
    expected = reference_result(OP, (logits, 2, 1.0, 2))
    assert mismatch(outputs, expected) is None
    ec_idx = outputs[1].clone()
    ec_idx[3] += 1
    assert mismatch((outputs[0], ec_idx, *outputs[2:]), expected) == "output 1: 1 of 18 elements differ"


def test_opcheck(device, gen):
    """The custom ops' schemas, fakes and autograd registration (torch.library.opcheck)."""
    (logits,) = leaves((randn(3, 4, device=device, generator=gen),), (0,))
    torch.library.opcheck(torch.ops.dlblas.topk_gating.default, (logits, 2, 1.0, 2, 0, 0))
    l_aux, _, weights, _, kept_experts, counts = torch.ops.dlblas.topk_gating(logits.detach(), 2, 1.0, 2, 0, 0)
    torch.library.opcheck(torch.ops.dlblas.topk_gating_backward.default,
                          (l_aux, weights, logits.detach(), kept_experts, counts, 2, 2, 1))


def test_plan_on_meta_tensors_reads_no_data():
    logits = torch.empty(100, 64, device="meta", dtype=torch.bfloat16)
    plan = TRITON.plan((logits, 8, 1.0, 2), {"BLOCK_S": 16, "num_warps": 4}, device_profile(logits.device))
    route, scan, assign = plan.calls
    assert route.grid == (7,) and route.kwargs == {"K": 8, "BLOCK_S": 16, "BLOCK_E": 64, "num_warps": 4}
    assert scan.grid == (4,) and scan.kwargs["BLOCK_EC"] == 16
    assert assign.grid == (7,)
    l_aux, ec_idx, weights, select = plan.result
    assert (l_aux.shape, ec_idx.shape, weights.shape, select.shape) == ((), (800,), (800,), (64 * 13,))
    (call,) = backward_plan((l_aux, weights, logits, ec_idx, ec_idx[:64], 8), {"BLOCK_S": 16, "num_warps": 4},
                            UNKNOWN_DEVICE).calls
    assert call.kernel.__name__ == "topk_gating_backward_kernel" and call.grid == (7,)


def test_default_configs():
    from dlcore.compiler.lowering import target_profile

    h200 = target_profile("cuda:90")

    def config(tokens, experts):
        logits = torch.empty(tokens, experts, device="meta")
        return TRITON.default_config(make_signature(OP, (logits, 2, 1.0, 2), torch.device("meta")), h200)

    assert config(16384, 256) == {"BLOCK_S": 32, "num_warps": 16}  # the tile held at MAX_TILE
    assert config(4096, 64) == {"BLOCK_S": 16, "num_warps": 2}  # 256 blocks: two per core
    assert config(1, 64) == {"BLOCK_S": 1, "num_warps": 1}
    assert config(1 << 20, 4096) == {"BLOCK_S": 2, "num_warps": 16}


def test_scan_tile_within_the_npu_unified_buffer():
    """On npu the scan's tiles are at most 1024 elements: bishengir-compile 1.2 overflowed the Ascend
    910B's 192 KiB unified buffer at 2048; CUDA keeps SCAN_TILE. The select output has the dump slot
    of the dropped choices past its E * C elements."""
    from dlcore.compiler.lowering import target_profile

    logits = torch.empty(4096, 256, device="meta")

    def scan(target):
        profile = target_profile(target)
        config = TRITON.default_config(make_signature(OP, (logits, 8, 1.0, 2), torch.device("meta")), profile)
        with planning_for(profile):
            plan = TRITON.plan((logits, 8, 1.0, 2), config, device_profile(logits.device))
        select = plan.result[3]
        assert select.untyped_storage().nbytes() == (select.numel() + 1) * select.element_size()
        kwargs = plan.calls[1].kwargs
        return (kwargs["BLOCK_R"] * kwargs["BLOCK_EC"], kwargs["BLOCK_C"] * kwargs["BLOCK_EC"],
                plan.calls[2].kwargs["DUMP_DROPPED"])

    # 1024 rows of counts (8 ranks x 128 token blocks), 128 slots per expert
    assert scan("cuda:90") == (topk_gating_module.SCAN_TILE, 128 * 16, 0)
    assert scan("npu:Ascend910B2") == (1024, 1024, 1)


def test_token_blocks_within_the_npu_unified_buffer():
    """On npu a token block holds at most 4096 gate elements of its tile and 32 tokens (the assign
    kernel's [BLOCK_S, BLOCK_S] pairs): bishengir-compile 1.2 overflowed the Ascend 910B's unified
    buffer with 32 tokens of 256 experts in the route and backward kernels, and 64 tokens in the
    assign kernel, and ran for over ten minutes on the backward's 16 x 256. CUDA keeps the config's."""
    from dlcore.compiler.lowering import target_profile

    npu, hopper = target_profile("npu:Ascend910B2"), target_profile("cuda:90")
    assert topk_gating_module.block_tokens({"BLOCK_S": 32}, 4096, 256, npu) == 8
    assert topk_gating_module.block_tokens({"BLOCK_S": 64}, 4096, 16, npu) == 32
    assert topk_gating_module.block_tokens({"BLOCK_S": 8}, 4096, 16, npu) == 8
    assert topk_gating_module.block_tokens({"BLOCK_S": 32}, 5, 16, npu) == 8  # no larger than the tokens
    assert topk_gating_module.block_tokens({"BLOCK_S": 64}, 4096, 256, hopper) == 64
    logits = torch.empty(4096, 256, device="meta")
    config = {"BLOCK_S": 32, "num_warps": 16}
    with planning_for(npu):
        forward = TRITON.plan((logits, 8, 1.0, 2), config, device_profile(logits.device))
    assert [forward.calls[i].kwargs["BLOCK_S"] for i in (0, 2)] == [8, 8] and forward.calls[0].grid == (512,)


@pytest.mark.parametrize("tokens, experts, k, capacity_factor", [(45, 20, 3, 0.7), (37, 8, 2, 1.0)])
def test_npu_assign_writes_dropped_choices_to_the_dump_slot(tokens, experts, k, capacity_factor, device, gen):
    """The assign kernel's npu form (DUMP_DROPPED) gives the same outputs; the slot past the E * C
    holds the token of a dropped choice."""
    logits = randn(tokens, experts, device=device, generator=gen, scale=2.0)
    args = (logits, k, capacity_factor, 2)
    config = TRITON.default_config(make_signature(OP, args, logits.device), device_profile(logits.device))
    plan = TRITON.plan(args, config, device_profile(first_device(args)))
    plan.calls[2].kwargs["DUMP_DROPPED"] = 1
    select = plan.result[3]
    with_dump = select.as_strided((select.numel() + 1,), (1,))
    with_dump.fill_(UNWRITTEN)
    for t in plan.result[:3]:
        poison(t) if t.is_floating_point() else t.fill_(UNWRITTEN)
    assert_matches_reference(plan.run(), logits, k, capacity_factor)
    kept_experts = topk_gating_training_reference(logits.double(), k, capacity_factor, 2)[4].cpu()
    dropped = {s % tokens for s in (kept_experts == -1).nonzero().flatten().tolist()}
    assert dropped and int(with_dump[-1]) in dropped


@pytest.mark.parametrize("case", ["k 0", "k above E", "k a float", "1-D logits", "3-D logits",
                                  "int logits", "capacity_factor 0", "capacity_factor negative",
                                  "capacity_factor nan", "capacity_factor inf", "min_capacity negative",
                                  "no tokens", "too many slots"])
def test_bad_inputs_raise_before_launch(case, device, no_launch):
    logits, k, capacity_factor, min_capacity = torch.randn(5, 8, device=device), 2, 1.0, 2
    named = {"k 0": "k", "k above E": "k", "k a float": "k", "1-D logits": "logits", "3-D logits": "logits",
             "int logits": "logits", "no tokens": "logits",
             "min_capacity negative": "min_capacity"}.get(case, "capacity_factor")
    if case == "k 0":
        k = 0
    elif case == "k above E":
        k = 9
    elif case == "k a float":
        k = 2.0
    elif case == "1-D logits":
        logits = logits[0]
    elif case == "3-D logits":
        logits = logits[None]
    elif case == "int logits":
        logits = logits.int()
    elif case == "capacity_factor 0":
        capacity_factor = 0.0
    elif case == "capacity_factor negative":
        capacity_factor = -1
    elif case == "capacity_factor nan":
        capacity_factor = float("nan")
    elif case == "capacity_factor inf":
        capacity_factor = float("inf")
    elif case == "min_capacity negative":
        min_capacity = -1
    elif case == "no tokens":
        logits = logits[:0]
    else:
        capacity_factor = 1e9
    with pytest.raises(InvalidInputError) as raised:
        topk_gating(logits, k, capacity_factor, min_capacity)
    assert raised.value.arg == named, str(raised.value)
