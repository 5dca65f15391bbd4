"""topk_gating: GShard-style top-k routing of ``S`` tokens over ``E`` experts with expert capacity,
the tokens rearranged by expert (InternEvo's fused top-k gating, in DLBlas's layout).

For ``logits [S, E]`` (math in float32)::

    gates = softmax(logits, dim=1)
    C     = max(ceil(S / E * capacity_factor * k), min_capacity)           the capacity of an expert

- **choices**: each token's ``k`` experts of the largest logits (the largest gates: softmax keeps
  the order; the logits are compared because they are exact, where two gates may round to one
  float), equal logits to the lower expert index. Choice ``j`` of token ``s`` has the rank
  ``j * S + s``: all first choices, then all second choices, and so on.
- **slots**: the slot of choice ``(j, s)`` of expert ``e`` is the number of choices of ``e`` of lower
  rank; a choice whose slot is ``>= C`` is dropped.
- ``l_aux = mean_e(me_e * ce_e) * E * E`` (a scalar), ``me`` the mean gate of each expert over the
  tokens, ``ce`` the number of tokens that chose it (before dropping) over ``S * k``.
- ``token_exp_weights [k * S]`` float32 (index ``j * S + s``): the gate of a kept choice over the sum
  of its token's kept gates (that sum at least float32's eps); 0 for a dropped one.
- ``token_rearranged_ec_idx [k * S]`` int32: ``e * C + slot`` of a kept choice, 0 of a dropped one.
- ``expert_select_token_idx [E * C]`` int64: the token in slot ``c`` of expert ``e`` at ``e * C + c``,
  -1 where no choice fills the slot.

``l_aux`` and ``token_exp_weights`` are differentiable in the logits (the choices and slots are
constants of the backward); the index outputs are not.

Logits must be finite or ``-inf``: a NaN logit is not checked for (that would read the logits back
to the host on every call), and its token's choices, which then take capacity from other tokens,
may differ between this kernel and the reference.

Forward, three launches, deterministic (no atomics):

1. **route**, a program per block of ``BLOCK_S`` tokens (the whole row of experts in registers):
   softmax, the ``k`` choices by ``k`` rounds of (largest logit left, lowest index among equals),
   the gate of each choice, the block's count of each expert per choice rank
   ``counts [k, blocks, E]`` and its sum of gates per expert.
2. **scan**, a program per group of experts: the exclusive prefix sum of ``counts`` in rank order
   (rank ``j``, then block), which is the first slot each (rank, block) takes of each expert; each
   expert's total (its ``ce``), its share of ``l_aux``, and -1 in the slots past its last choice.
3. **assign**, a program per token block again: a choice's slot is its (rank, block)'s first slot
   plus the choices of the same expert and rank by earlier tokens of the block; then the kept
   choices' indices and tokens, and the weights normalised over each token's kept gates. Program 0
   sums the scan's shares of ``l_aux``. On npu (``DUMP_DROPPED``) a dropped choice's token goes to a
   dump slot past the ``E * C``: triton-ascend 3.2's adapter turns a scatter masked by loaded data
   into a load, a select and a store through one gathered pointer, which its triton-to-linalg then
   rejects ("tt.addptr has multiple users"); on GPUs the masked scatter stays (no stores of all
   dropped choices to one address).

Backward, one launch per token block: the softmax recomputed from the logits, and with ``p`` the
gates, ``g`` the output gradients, ``D_s`` token ``s``'s clamped sum of kept gates::

    dL/dp[s, e]  = g_l_aux * E * ce_e / S
                 + (g_w[j, s] - [sum >= eps] * sum_j' g_w[j', s] * w[j', s]) / D_s   for kept (j, s) of e
    dlogits      = p * (dL/dp - sum_e p * dL/dp)

The forward keeps for it each choice's expert (-1 where dropped) and each expert's count.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dlblas_kernels.blocks.npu import buffer_tile, on_npu
from dlblas_kernels.blocks.topk_routing import (
    topk_gating_assign_kernel,
    topk_gating_backward_kernel,
    topk_gating_route_kernel,
    topk_gating_scan_kernel,
)
from dlcore.api import (
    Backward,
    Config,
    DeviceProfile,
    InvalidInputError,
    KernelCall,
    LaunchPlan,
    Op,
    PowerOfTwo,
    Residuals,
    ScalarArg,
    SearchSpace,
    Signature,
    TensorArg,
    cdiv,
    define_kernel,
    next_power_of_2,
    num_warps,
)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ANY_LAYOUT = ("contiguous", "rows", "strided")
#: the smallest sum of kept gates a weight is divided by
EPS = torch.finfo(torch.float32).eps

# Elements of the [BLOCK_S, BLOCK_E] tile a token-block program holds at most (the default config),
# and per thread; the fewest token blocks the default keeps per core (the scan's rows grow with them).
MAX_TILE = 8192
ELEMENTS_PER_THREAD = 16
BLOCKS_PER_CORE = 2
# The scan's tiles: experts per program and elements per tile.
SCAN_EXPERTS = 16
SCAN_TILE = 4096
# On npu the tiles live in the AI core's unified buffer: bishengir-compile 1.2 asks about 97 bytes of
# it per element of the scan's tile (1589248 bits for 2048 elements, over the 192 KiB of an Ascend
# 910B); the budget per element leaves headroom.
UB_BYTES_PER_SCAN_ELEMENT = 128
# The same for the token blocks: the route kernel asks about 26 bytes per element of its [BLOCK_S,
# BLOCK_E] tile (213376 for 32 x 256), the backward about 46 (373440), and the assign kernel about
# 130 per pair of a block's tokens, [BLOCK_S, BLOCK_S] (532864 for 64 tokens). The budgets per
# element leave headroom: with the backward's 16 x 256 tile (within the buffer by 46 bytes an
# element) bishengir-compile ran past ten minutes, where 8 x 256 took five seconds.
UB_BYTES_PER_TILE_ELEMENT = 64
UB_BYTES_PER_TOKEN_PAIR = 160


def capacity(tokens: int, experts: int, k: int, capacity_factor: float, min_capacity: int) -> int:
    """``C = max(ceil(S / E * capacity_factor * k), min_capacity)``: the slots of each expert."""
    return max(math.ceil(tokens / experts * capacity_factor * k), min_capacity)


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)


def topk_gating_training_reference(logits: torch.Tensor, k: int, capacity_factor: float = 1.0,
                                   min_capacity: int = 2) -> tuple[torch.Tensor, ...]:
    """The four outputs (see the module doc) and what the backward keeps: each choice's expert, -1
    where dropped (``[k * S]`` int32), and each expert's number of choices (``[E]`` int32). Gates
    and weights in float32 (float64 for float64 logits)."""
    compute = _compute_dtype(logits)
    x = logits.to(compute)
    tokens, num_experts = x.shape
    slots_per_expert = capacity(tokens, num_experts, k, capacity_factor, min_capacity)
    gates = torch.softmax(x, dim=1)
    # a stable descending sort keeps equal logits in expert order: the lower index first
    chosen = torch.sort(x, dim=1, descending=True, stable=True).indices[:, :k]
    experts = chosen.T.reshape(-1)  # rank j * S + s
    one_hot = torch.nn.functional.one_hot(experts, num_experts)
    slots = (one_hot.cumsum(0) - 1).gather(1, experts[:, None]).squeeze(1)
    kept = slots < slots_per_expert
    counts = one_hot.sum(0)
    me = gates.mean(0)
    ce = counts.to(compute) / (tokens * k)
    l_aux = (me * ce).mean() * num_experts * num_experts
    kept_gates = torch.where(kept, gates.gather(1, chosen).T.reshape(-1), 0.0)
    denominator = kept_gates.view(k, tokens).sum(0).clamp(min=EPS)
    weights = kept_gates / denominator.repeat(k)
    positions = experts * slots_per_expert + slots
    ec_idx = torch.where(kept, positions, 0).to(torch.int32)
    select = torch.full((num_experts * slots_per_expert,), -1, dtype=torch.int64, device=logits.device)
    select[positions[kept]] = torch.arange(tokens, device=logits.device).repeat(k)[kept]
    kept_experts = torch.where(kept, experts, -1).to(torch.int32)
    return l_aux, ec_idx, weights, select, kept_experts, counts.to(torch.int32)


def topk_gating_reference(logits: torch.Tensor, k: int, capacity_factor: float = 1.0,
                          min_capacity: int = 2) -> tuple[torch.Tensor, ...]:
    """``(l_aux, token_rearranged_ec_idx, token_exp_weights, expert_select_token_idx)`` in torch;
    differentiable in ``logits`` through torch's autograd."""
    return topk_gating_training_reference(logits, k, capacity_factor, min_capacity)[:4]


def topk_gating_backward_reference(d_l_aux: torch.Tensor, d_weights: torch.Tensor, logits: torch.Tensor,
                                   kept_experts: torch.Tensor, expert_counts: torch.Tensor, k: int) -> torch.Tensor:
    """The gradient of the logits from those of ``l_aux`` and ``token_exp_weights`` (the module doc's
    formula), in float32 (or wider), returned in the logits' dtype."""
    compute = _compute_dtype(logits)
    p = torch.softmax(logits.to(compute), dim=1)
    tokens, num_experts = p.shape
    grad = (d_l_aux.to(compute) * num_experts / (tokens * tokens * k) * expert_counts.to(compute)).expand(tokens, -1)
    experts = kept_experts.view(k, tokens).T.long()
    kept = experts >= 0
    at = experts.clamp(min=0)
    kept_gates = torch.where(kept, p.gather(1, at), 0.0)
    total = kept_gates.sum(1)
    denominator = total.clamp(min=EPS)
    dw = d_weights.to(compute).reshape(k, tokens).T
    through = torch.where(total >= EPS, (dw * kept_gates).sum(1) / denominator, 0.0)
    coefficients = torch.where(kept, (dw - through[:, None]) / denominator[:, None], 0.0)
    grad = grad.scatter_add(1, at, coefficients)
    return (p * (grad - (p * grad).sum(1, keepdim=True))).to(logits.dtype)


def _sizes(logits: torch.Tensor, k: int, capacity_factor: float, min_capacity: int) -> tuple[int, int, int]:
    tokens, experts = logits.shape
    return tokens, experts, capacity(tokens, experts, k, capacity_factor, min_capacity)


def training_outputs(logits: torch.Tensor, k: int, capacity_factor: float = 1.0,
                     min_capacity: int = 2) -> tuple[torch.Tensor, ...]:
    """The four outputs and the two residuals, allocated (float64 for float64 logits);
    ``expert_select_token_idx`` is the first ``E * C`` elements of ``E * C + 1``, the last the slot
    the assign kernel writes dropped choices to on npu (``DUMP_DROPPED``)."""
    tokens, experts, slots = _sizes(logits, k, capacity_factor, min_capacity)
    compute, device = _compute_dtype(logits), logits.device
    return (torch.empty((), dtype=compute, device=device),
            torch.empty(k * tokens, dtype=torch.int32, device=device),
            torch.empty(k * tokens, dtype=compute, device=device),
            torch.empty(experts * slots + 1, dtype=torch.int64, device=device)[:experts * slots],
            torch.empty(k * tokens, dtype=torch.int32, device=device),
            torch.empty(experts, dtype=torch.int32, device=device))


def outputs(logits: torch.Tensor, k: int, capacity_factor: float = 1.0, min_capacity: int = 2) -> tuple:
    return training_outputs(logits, k, capacity_factor, min_capacity)[:4]


def block_tokens(config: Config, tokens: int, block_e: int, profile: DeviceProfile | None = None) -> int:
    """The config's token block, no larger than the tokens need; on npu no larger than the unified
    buffer holds, with ``block_e`` experts per token (8 tokens of 256 experts, 32 of 8 on the
    Ascend 910B)."""
    block_s = min(config["BLOCK_S"], next_power_of_2(tokens))
    if on_npu(profile):
        pairs = buffer_tile(profile, UB_BYTES_PER_TOKEN_PAIR, block_s * block_s)  # a power of two
        block_s = min(block_s, buffer_tile(profile, UB_BYTES_PER_TILE_ELEMENT, block_s * block_e) // block_e,
                      1 << ((pairs.bit_length() - 1) // 2))
    return max(block_s, 1)


def scan_tile(profile: DeviceProfile | None) -> int:
    """The elements of a scan tile: :data:`SCAN_TILE`, on npu no more than its unified buffer holds."""
    return buffer_tile(profile, UB_BYTES_PER_SCAN_ELEMENT, SCAN_TILE)


def training_plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    """The three launches (see the module doc); the result is the outputs, then the residuals."""
    logits, k, capacity_factor, min_capacity = args
    tokens, experts, slots = _sizes(logits, k, capacity_factor, min_capacity)
    results = training_outputs(*args)
    l_aux, ec_idx, weights, select, kept_experts, totals = results
    block_e = max(next_power_of_2(experts), 16)
    block_s = block_tokens(config, tokens, block_e, profile)
    blocks, device = cdiv(tokens, block_s), logits.device
    rows = k * blocks
    group = min(block_e, SCAN_EXPERTS)
    groups = cdiv(experts, group)
    tile = scan_tile(profile)
    gates = torch.empty(k * tokens, dtype=torch.float32, device=device)
    counts = torch.empty(rows * experts, dtype=torch.int32, device=device)
    offsets = torch.empty(rows * experts, dtype=torch.int32, device=device)
    gate_sums = torch.empty(blocks * experts, dtype=torch.float32, device=device)
    parts = torch.empty(groups, dtype=torch.float32, device=device)
    warps = config["num_warps"]
    route = KernelCall(
        topk_gating_route_kernel, (blocks,),
        (logits, kept_experts, gates, counts, gate_sums, tokens, experts, blocks, logits.stride(0), logits.stride(1)),
        {"K": k, "BLOCK_S": block_s, "BLOCK_E": block_e, "num_warps": warps})
    scan = KernelCall(
        topk_gating_scan_kernel, (groups,),
        (counts, offsets, gate_sums, totals, parts, select, experts, slots, rows, blocks, 1.0 / tokens,
         1.0 / (tokens * k)),
        {"BLOCK_R": min(next_power_of_2(rows), tile // group), "BLOCK_EC": group,
         "BLOCK_C": min(next_power_of_2(slots), tile // group), "num_warps": 4})
    assign = KernelCall(
        topk_gating_assign_kernel, (blocks,),
        (kept_experts, gates, offsets, parts, l_aux, ec_idx, weights, select, tokens, experts, slots, blocks, groups,
         float(experts)),
        {"K": k, "K_POW2": next_power_of_2(k), "BLOCK_S": block_s, "BLOCK_P": next_power_of_2(groups),
         "DUMP_DROPPED": int(on_npu(profile)), "num_warps": warps})
    return LaunchPlan(calls=[route, scan, assign], result=results,
                      scratch=(gates, counts, offsets, gate_sums, parts))


def plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    """The four outputs; what the backward would keep is scratch."""
    trained = training_plan(args, config, profile)
    return LaunchPlan(calls=trained.calls, result=trained.result[:4], scratch=(*trained.scratch, *trained.result[4:]))


def backward_results(d_l_aux: torch.Tensor, d_weights: torch.Tensor, logits: torch.Tensor, *_: Any) -> torch.Tensor:
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


def backward_plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    """One launch per token block for ``d_logits`` from ``args = (d_l_aux, d_weights, logits,
    kept_experts, expert_counts, k)``; the token block is the forward's."""
    d_l_aux, d_weights, logits, kept_experts, totals, k = args
    tokens, experts = logits.shape
    d_logits = backward_results(*args)
    block_e = max(next_power_of_2(experts), 16)
    block_s = block_tokens(config, tokens, block_e, profile)
    call = KernelCall(
        topk_gating_backward_kernel, (cdiv(tokens, block_s),),
        (d_l_aux, d_weights, logits, kept_experts, totals, d_logits, tokens, experts, logits.stride(0),
         logits.stride(1), d_logits.stride(0), d_logits.stride(1), d_weights.stride(0),
         experts / (tokens * tokens * k)),
        {"K": k, "K_POW2": next_power_of_2(k), "BLOCK_S": block_s, "BLOCK_E": block_e,
         "num_warps": config["num_warps"]})
    return LaunchPlan(calls=[call], result=d_logits)


def heuristic_config(tokens: int, experts: int, cores: int) -> Config:
    """At least BLOCKS_PER_CORE token blocks per core where the tokens allow (fewer, larger blocks
    leave cores idle; more make the scan longer), the tile at most MAX_TILE elements, about
    ELEMENTS_PER_THREAD of them per thread."""
    block_e = max(next_power_of_2(experts), 16)
    want = next_power_of_2(cdiv(tokens, BLOCKS_PER_CORE * cores)) if cores else 16
    block_s = max(min(want, MAX_TILE // block_e, next_power_of_2(tokens)), 1)
    warps = min(max(block_s * block_e // (32 * ELEMENTS_PER_THREAD), 1), 16)
    return {"BLOCK_S": block_s, "num_warps": warps}


def default_config(sig: Signature, profile: DeviceProfile) -> Config:
    tokens, experts = sig.tensor("logits").shape  # tokens rounded up to a power of two
    return heuristic_config(tokens, experts, profile.cores if profile is not None else 0)


def space(profile: DeviceProfile) -> SearchSpace:
    """Tokens per block (the route, assign and backward kernels' tile is BLOCK_S x the experts) and
    warps."""
    return SearchSpace([PowerOfTwo("BLOCK_S", 1, 256), num_warps(1, 2, 4, 8, 16)])


def check(op: Op, args: dict[str, Any]) -> None:
    logits, k = args["logits"], args["k"]
    capacity_factor, min_capacity = args["capacity_factor"], args["min_capacity"]
    tokens, experts = logits.shape
    if tokens == 0:
        raise InvalidInputError(op.name, "logits", f"has shape {tuple(logits.shape)}, no tokens",
                                "logits [S, E] with S >= 1 (l_aux is a mean over the tokens)")
    if not 1 <= k <= experts:
        raise InvalidInputError(op.name, "k", f"is {k} for {experts} experts", f"k from 1 to E = {experts}")
    if not (math.isfinite(capacity_factor) and capacity_factor > 0):
        raise InvalidInputError(op.name, "capacity_factor", f"is {capacity_factor}", "a finite capacity_factor > 0")
    if min_capacity < 0:
        raise InvalidInputError(op.name, "min_capacity", f"is {min_capacity}", "min_capacity >= 0")
    slots = capacity(tokens, experts, k, capacity_factor, min_capacity)
    if experts * slots >= 2**31:
        raise InvalidInputError(op.name, "capacity_factor", f"gives {slots} slots for each of {experts} experts",
                                "E * C below 2**31 (token_rearranged_ec_idx is int32)")


def example(sizes: dict[str, int], dtype: torch.dtype, device: torch.device,
            generator: torch.Generator) -> tuple:
    """Router logits ``[tokens, experts]`` of a trained router's spread (standard deviation 2), top ``k``."""
    logits = 2 * torch.randn(sizes["tokens"], sizes["experts"], generator=generator)
    return (logits.to(device=device, dtype=dtype), sizes["topk"], 1.0, 2)


def cost(args: tuple, mode: str = "fwd") -> tuple[int, int]:
    """Forward: read the logits; write the weights and ec indices (4 bytes per choice each) and the
    token of every slot (8 bytes); a softmax (about five flops per logit) and ``k`` rounds of a
    maximum and a minimum over each row. Backward: read the logits, the weight gradients and the
    kept experts, write the logits' gradient; the softmax again and its backward (about four
    flops per logit)."""
    logits, k, capacity_factor, min_capacity = args
    tokens, experts, slots = _sizes(logits, k, capacity_factor, min_capacity)
    logit_bytes = logits.numel() * logits.element_size()
    if mode == "bwd":
        return 2 * logit_bytes + 8 * k * tokens + 4 * experts, 9 * logits.numel()
    return logit_bytes + 8 * k * tokens + 8 * experts * slots + 4, (5 + 2 * k) * logits.numel()


OP = Op(
    name="topk_gating",
    args=(
        TensorArg("logits", DTYPES, min_rank=2, max_rank=2, layouts=ANY_LAYOUT, bucket="rows"),
        ScalarArg("k", (int,), keyed=True),
        ScalarArg("capacity_factor", (float, int), default=1.0),
        ScalarArg("min_capacity", (int,), default=2),
    ),
    reference=topk_gating_reference,
    doc="GShard top-k gating with expert capacity over logits [S, E]: (l_aux, token_rearranged_ec_idx, "
        "token_exp_weights, expert_select_token_idx), the choices ranked j-major",
    check=check,
    example=example,
    example_sizes={"tokens": 37, "experts": 8, "topk": 2},
    example_paths={"prefill": {"tokens": 300, "experts": 64},
                   "many experts": {"tokens": 300, "experts": 256, "topk": 8}},
    cost=cost,
    baselines={"torch": lambda: topk_gating_reference},
)


def _gradients(backward, saved, grads, needs) -> dict:
    d_l_aux, d_weights = grads[0], grads[2]
    # an output given no gradient takes zeros, float64 with float64 logits: the backward op takes its
    # reference path by its first tensor's dtype (float32 zeros sent float64 CPU logits to the kernels)
    dtype = torch.float64 if saved.logits.dtype == torch.float64 else torch.float32
    if d_l_aux is None:
        d_l_aux = torch.zeros((), dtype=dtype, device=saved.logits.device)
    if d_weights is None:
        d_weights = torch.zeros(saved.kept_experts.shape, dtype=dtype, device=saved.logits.device)
    return {"logits": backward(d_l_aux, d_weights, saved.logits, saved.kept_experts, saved.expert_counts, saved.k)}


KERNEL = define_kernel(
    OP, plan,
    kernels=(topk_gating_route_kernel, topk_gating_scan_kernel, topk_gating_assign_kernel,
             topk_gating_backward_kernel),
    results=outputs,
    outputs=("l_aux", "token_rearranged_ec_idx", "token_exp_weights", "expert_select_token_idx"),
    default_config=default_config,
    space=space,
    backward=Backward(
        _gradients, saved=("logits", "k", "kept_experts", "expert_counts"), plan=backward_plan,
        reference=topk_gating_backward_reference, results=backward_results,
        residuals=Residuals(("kept_experts", "expert_counts"), training_plan, training_outputs,
                            topk_gating_training_reference)),
    doc="three launches: softmax and top-k per token block, a scan of per-block expert counts in rank "
        "order, slots and weights per token block; backward one launch per token block",
)
topk_gating = KERNEL.function
dlcore_ops, dlcore_implementations = KERNEL.dlcore_ops, KERNEL.dlcore_implementations
