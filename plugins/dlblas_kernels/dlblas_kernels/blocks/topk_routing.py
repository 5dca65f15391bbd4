"""topk_gating's kernels: the route, scan and assign launches of the forward and the backward's one
launch per token block. What each computes, and the layout of their outputs, is
:mod:`dlblas_kernels.kernels.topk_gating`'s module doc; its plans size and launch them.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _gates(logits_ptr, tokens, experts, S, E, stride_s, stride_e):
    """``(x, p)``: the block's logits in float32 (-inf past E) and their softmax along the experts.
    Tokens past S read the last token again (no all -inf row: no NaN), for the caller to mask."""
    LOG2E: tl.constexpr = 1.4426950408889634
    rows = tl.minimum(tokens, S - 1).to(tl.int64)
    x = tl.load(logits_ptr + rows[:, None] * stride_s + experts[None, :] * stride_e, mask=(experts < E)[None, :],
                other=-float("inf")).to(tl.float32)
    # A row of -inf only: exponentials 0, gates 0 / 0 = NaN as in torch.
    m = tl.max(x, axis=1)
    m = tl.where(m == -float("inf"), 0.0, m)
    e = tl.exp2((x - m[:, None]) * LOG2E)
    return x, e / tl.sum(e, axis=1)[:, None]


@triton.jit
def topk_gating_route_kernel(
    logits_ptr, experts_ptr, gates_ptr, counts_ptr, gate_sums_ptr,
    S, E, blocks, stride_s, stride_e,
    K: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr,
):
    block = tl.program_id(0)
    tokens = block * BLOCK_S + tl.arange(0, BLOCK_S)
    in_range = tokens < S
    experts = tl.arange(0, BLOCK_E)
    real = experts < E
    x, p = _gates(logits_ptr, tokens, experts, S, E, stride_s, stride_e)
    tl.store(gate_sums_ptr + block * E + experts, tl.sum(tl.where(in_range[:, None], p, 0.0), axis=0), mask=real)
    free = real[None, :] & (tokens >= 0)[:, None]
    for j in tl.static_range(K):
        # the largest logit not yet chosen, the lowest expert among equals
        left = tl.where(free, x, -float("inf"))
        best = tl.max(left, axis=1)
        choice = tl.min(tl.where(free & (left == best[:, None]), experts[None, :], BLOCK_E), axis=1)
        # a NaN logit matches nothing: stay in range (its routing is arbitrary)
        choice = tl.minimum(choice, E - 1)
        picked = experts[None, :] == choice[:, None]
        free = free & ~picked
        tl.store(experts_ptr + j * S + tokens, choice, mask=in_range)
        tl.store(gates_ptr + j * S + tokens, tl.sum(tl.where(picked, p, 0.0), axis=1), mask=in_range)
        count = tl.sum((picked & in_range[:, None]).to(tl.int32), axis=0)
        tl.store(counts_ptr + (j * blocks + block) * E + experts, count, mask=real)


@triton.jit
def topk_gating_scan_kernel(
    counts_ptr, offsets_ptr, gate_sums_ptr, totals_ptr, parts_ptr, select_ptr,
    E, C, rows, blocks, inv_tokens, inv_choices,
    BLOCK_R: tl.constexpr, BLOCK_EC: tl.constexpr, BLOCK_C: tl.constexpr,
):
    group = tl.program_id(0)
    experts = group * BLOCK_EC + tl.arange(0, BLOCK_EC)
    real = experts < E
    r = tl.arange(0, BLOCK_R)
    # rows of counts in rank order (rank j, then block): their exclusive prefix sums are first slots
    total = tl.zeros((BLOCK_EC,), tl.int32)
    for start in range(0, rows, BLOCK_R):
        mask = ((start + r) < rows)[:, None] & real[None, :]
        at = (start + r)[:, None] * E + experts[None, :]
        count = tl.load(counts_ptr + at, mask=mask, other=0)
        tl.store(offsets_ptr + at, total[None, :] + tl.cumsum(count, axis=0) - count, mask=mask)
        total += tl.sum(count, axis=0)
    tl.store(totals_ptr + experts, total, mask=real)
    sums = tl.zeros((BLOCK_EC,), tl.float32)
    for start in range(0, blocks, BLOCK_R):
        mask = ((start + r) < blocks)[:, None] & real[None, :]
        sums += tl.sum(tl.load(gate_sums_ptr + (start + r)[:, None] * E + experts[None, :], mask=mask, other=0.0),
                       axis=0)
    tl.store(parts_ptr + group, tl.sum(sums * inv_tokens * (total.to(tl.float32) * inv_choices), axis=0))
    # slots past each expert's last choice hold no token
    filled = tl.where(real, tl.minimum(total, C), C)
    slots = tl.arange(0, BLOCK_C)
    empty = tl.full((BLOCK_EC, BLOCK_C), -1, tl.int64)
    for start in range(tl.min(filled, axis=0) // BLOCK_C * BLOCK_C, C, BLOCK_C):
        slot = start + slots
        mask = (slot[None, :] >= filled[:, None]) & (slot < C)[None, :]
        tl.store(select_ptr + experts[:, None].to(tl.int64) * C + slot[None, :], empty, mask=mask)


@triton.jit
def topk_gating_assign_kernel(
    experts_ptr, gates_ptr, offsets_ptr, parts_ptr,
    l_aux_ptr, ec_ptr, weights_ptr, select_ptr,
    S, E, C, blocks, parts, l_aux_scale,
    K: tl.constexpr, K_POW2: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr,
    DUMP_DROPPED: tl.constexpr,
):
    EPSILON: tl.constexpr = 1.1920928955078125e-07
    block = tl.program_id(0)
    if block == 0:
        p = tl.arange(0, BLOCK_P)
        share = tl.load(parts_ptr + p, mask=p < parts, other=0.0)
        tl.store(l_aux_ptr, tl.sum(share, axis=0) * l_aux_scale)
    tokens = block * BLOCK_S + tl.arange(0, BLOCK_S)
    in_range = tokens < S
    # earlier[s, s']: token s' comes before token s in the block
    earlier = (tokens[None, :] < tokens[:, None]) & in_range[None, :]
    ranks = tl.arange(0, K_POW2)
    kept_gates = tl.zeros((BLOCK_S, K_POW2), tl.float32)
    for j in tl.static_range(K):
        choice = tl.load(experts_ptr + j * S + tokens, mask=in_range, other=0)
        same = earlier & (choice[None, :] == choice[:, None])
        slot = tl.load(offsets_ptr + (j * blocks + block) * E + choice, mask=in_range, other=0) \
            + tl.sum(same.to(tl.int32), axis=1)
        kept = in_range & (slot < C)
        position = choice * C + slot
        tl.store(ec_ptr + j * S + tokens, tl.where(kept, position, 0), mask=in_range)
        if DUMP_DROPPED:  # to the dump slot E * C, masked by the tokens in range only (see the module doc)
            tl.store(select_ptr + tl.where(kept, position, E * C).to(tl.int64), tokens.to(tl.int64), mask=in_range)
        else:
            tl.store(select_ptr + position.to(tl.int64), tokens.to(tl.int64), mask=kept)
        # what the backward needs of the choice: its expert, or -1 where dropped
        tl.store(experts_ptr + j * S + tokens, tl.where(kept, choice, -1), mask=in_range)
        gate = tl.load(gates_ptr + j * S + tokens, mask=in_range, other=0.0)
        kept_gates = tl.where(ranks[None, :] == j, tl.where(kept, gate, 0.0)[:, None], kept_gates)
    denominator = tl.maximum(tl.sum(kept_gates, axis=1), EPSILON)
    tl.store(weights_ptr + ranks[None, :] * S + tokens[:, None], kept_gates / denominator[:, None],
             mask=in_range[:, None] & (ranks < K)[None, :])


@triton.jit
def topk_gating_backward_kernel(
    d_l_aux_ptr, d_weights_ptr, logits_ptr, kept_ptr, totals_ptr, d_logits_ptr,
    S, E, stride_s, stride_e, stride_ds, stride_de, stride_dw, l_aux_scale,
    K: tl.constexpr, K_POW2: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr,
):
    EPSILON: tl.constexpr = 1.1920928955078125e-07
    block = tl.program_id(0)
    tokens = block * BLOCK_S + tl.arange(0, BLOCK_S)
    in_range = tokens < S
    experts = tl.arange(0, BLOCK_E)
    real = experts < E
    _, p = _gates(logits_ptr, tokens, experts, S, E, stride_s, stride_e)
    # l_aux = sum_e (sum_s p[s, e]) * count_e * E / (S * S * k): dl_aux/dp[s, e] = count_e * l_aux_scale
    count = tl.load(totals_ptr + experts, mask=real, other=0).to(tl.float32)
    d_l_aux = tl.load(d_l_aux_ptr).to(tl.float32)
    grad = tl.zeros((BLOCK_S, BLOCK_E), tl.float32) + (d_l_aux * l_aux_scale * count)[None, :]
    ranks = tl.arange(0, K_POW2)
    kept_gates = tl.zeros((BLOCK_S, K_POW2), tl.float32)
    d_weights = tl.zeros((BLOCK_S, K_POW2), tl.float32)
    for j in tl.static_range(K):
        choice = tl.load(kept_ptr + j * S + tokens, mask=in_range, other=-1)
        gate = tl.sum(tl.where(experts[None, :] == choice[:, None], p, 0.0), axis=1)
        kept_gates = tl.where(ranks[None, :] == j, gate[:, None], kept_gates)
        dw = tl.load(d_weights_ptr + (j * S + tokens).to(tl.int64) * stride_dw, mask=in_range, other=0.0)
        d_weights = tl.where(ranks[None, :] == j, dw.to(tl.float32)[:, None], d_weights)
    total = tl.sum(kept_gates, axis=1)
    denominator = tl.maximum(total, EPSILON)
    # through the denominator, where it is not clamped: sum_j d_w[j] * w[j]
    through = tl.where(total >= EPSILON, tl.sum(d_weights * kept_gates, axis=1) / denominator, 0.0)
    coefficients = (d_weights - through[:, None]) / denominator[:, None]
    for j in tl.static_range(K):
        choice = tl.load(kept_ptr + j * S + tokens, mask=in_range, other=-1)
        c = tl.sum(tl.where(ranks[None, :] == j, coefficients, 0.0), axis=1)
        grad += tl.where(experts[None, :] == choice[:, None], c[:, None], 0.0)
    d_logits = p * (grad - tl.sum(p * grad, axis=1)[:, None])
    rows = tokens.to(tl.int64)
    tl.store(d_logits_ptr + rows[:, None] * stride_ds + experts[None, :] * stride_de,
             d_logits.to(d_logits_ptr.dtype.element_ty), mask=in_range[:, None] & real[None, :])
