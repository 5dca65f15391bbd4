"""flash_attention_v2: ``softmax(scale * q k^T) v`` over ``[B, S, H, D]`` tensors, causal or not, with GQA.

    q [B, Sq, Hq, D], k and v [B, Sk, Hk, D]      Hq a multiple of Hk: query head h reads kv head h // (Hq / Hk)
    out[b, i, h] = sum_j softmax_j(scale * q[b, i, h] . k[b, j, g]) v[b, j, g]        [B, Sq, Hq, D], q's dtype
    lse[b, h, i] = log sum_j exp(scale * q[b, i, h] . k[b, j, g])                     [B, Hq, Sq], float32

``scale`` is ``softmax_scale`` or ``D ** -0.5``. With ``causal`` query ``i`` sees the keys
``j <= i + Sk - Sq`` (the mask aligned bottom-right: decoding with a KV cache is ``Sq = 1`` against
``Sk = n``); a row that sees no key (``Sq > Sk``) gets ``out = 0`` and ``lse = -inf``. D is any size up
to 256 (64, 96, 128, 192 and 256 in models). q, k and v take any strides, read in place (a packed
qkv projection ``[B, S, 3, H, D]`` sliced into three views costs no copy).

The kernel is the attention block's (:mod:`dlblas_kernels.blocks.attention`): flash attention 2, one program
per block of query rows, the online softmax in float32, causal blocks above the diagonal skipped
and only the diagonal's masked, tiles moved by the copy engine on Hopper. ``return_lse=True`` also
returns ``lse``; the custom op computes it always, for the backward
(:class:`~dlcore.runtime.template.Residuals` shown by ``return_lse``). Backward: the attention
block's backward kernels (:mod:`dlblas_kernels.blocks.attention_grad`), from q, k, v, out and lse.

Key padding (FlashAttention's varlen API in a padded batch): ``kv_start`` and ``kv_end``, each
None or int32 ``[B]``, restrict batch ``b`` to the keys ``kv_start[b] <= j < kv_end[b]`` (bounds
clamped to ``[0, Sk]``; absent: 0 and Sk). Left padding (transformers' ``generate``) is a
``kv_start``, right padding a ``kv_end``. The causal mask stays bottom-right over the whole ``Sk``;
a query row that sees no key (a left-padded row under the causal mask) gets ``out = 0``,
``lse = -inf``, and masked keys get zero ``dk`` and ``dv``. Without them the kernels compile
without the padding code (constexpr-gated). SDPA's flash and cuDNN candidates decline key padding.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.attention import SDPBackend

from dlblas_kernels.blocks import attention_decode, attention_grad
from dlblas_kernels.blocks.attention import FORWARD_KERNELS, block_d, fit, forward_calls, shared_memory_bytes
from dlblas_kernels.blocks.gemm import TMA_ARCHS
from dlblas_kernels.blocks.sdpa import sdpa_attention
from dlcore.api import (
    Backward,
    Choice,
    Config,
    Constraint,
    DeviceProfile,
    InvalidInputError,
    LaunchPlan,
    Op,
    PowerOfTwo,
    Residuals,
    ScalarArg,
    SearchSpace,
    Signature,
    TensorArg,
    define_kernel,
    num_stages,
    num_warps,
)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ANY_LAYOUT = ("contiguous", "rows", "strided")
MAX_HEAD_DIM = 256
# The space's shared-memory constraint is declared for 16-bit heads of 128 (the common case); the
# block drops stages, then narrows the blocks, of a config that overflows for wider heads or float32
# (attention.fit).
SPACE_HEAD_DIM = 128
SPACE_ELEMENT_BYTES = 2
# float32 values per thread of the accumulator (BLOCK_M x D) or of the scores (BLOCK_M x BLOCK_N):
# beyond 128 one of them alone takes half a thread's registers and the kernel spills.
MAX_PER_THREAD = 128


# --- reference -----------------------------------------------------------------------------------

def flash_attention_v2_training_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                                          softmax_scale: float | None = None, return_lse: bool = False,
                                          kv_start: torch.Tensor | None = None, kv_end: torch.Tensor | None = None
                                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of ``softmax(scale * q k^T) v`` in float32 (or wider), the causal mask aligned
    bottom-right, keys outside ``[kv_start[b], kv_end[b])`` masked; rows that see no key give
    ``out = 0``, ``lse = -inf``. ``out`` in q's dtype, ``lse`` in float32 (float64 for float64 inputs)."""
    compute = torch.promote_types(q.dtype, torch.float32)
    sq, hq, d = q.shape[1:]
    sk, hk = k.shape[1:3]
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    group = hq // hk
    qf = q.to(compute).transpose(1, 2)
    kf = k.to(compute).transpose(1, 2).repeat_interleave(group, dim=1)
    vf = v.to(compute).transpose(1, 2).repeat_interleave(group, dim=1)
    scores = qf @ kf.transpose(-1, -2) * scale
    if causal:
        rows = torch.arange(sq, device=q.device)[:, None]
        keys = torch.arange(sk, device=q.device)[None, :]
        scores = scores.masked_fill(keys > rows + (sk - sq), float("-inf"))
    padded = key_padding_mask(kv_start, kv_end, q.shape[0], sk, q.device)
    if padded is not None:
        scores = scores.masked_fill(~padded[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # exp(-inf - -inf) is NaN on the rows that see no key: their weights are 0 (a NaN from the inputs stays NaN).
    weights = torch.exp(scores - lse[..., None]).masked_fill(torch.isneginf(lse)[..., None], 0.0)
    out = (weights @ vf).transpose(1, 2)
    return out.to(q.dtype), lse.to(compute)


def key_padding_mask(kv_start: torch.Tensor | None, kv_end: torch.Tensor | None, batch: int, sk: int,
                     device: torch.device) -> torch.Tensor | None:
    """The boolean ``[B, Sk]`` mask of the keys ``kv_start[b] <= j < kv_end[b]`` each batch sees,
    or None without either bound."""
    if kv_start is None and kv_end is None:
        return None
    keys = torch.arange(sk, device=device)[None, :]
    seen = torch.ones(batch, sk, dtype=torch.bool, device=device)
    if kv_start is not None:
        seen &= keys >= kv_start.to(device=device, dtype=torch.int64)[:, None]
    if kv_end is not None:
        seen &= keys < kv_end.to(device=device, dtype=torch.int64)[:, None]
    return seen


def flash_attention_v2_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                                 softmax_scale: float | None = None, return_lse: bool = False,
                                 kv_start: torch.Tensor | None = None, kv_end: torch.Tensor | None = None
                                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``out``, or ``(out, lse)`` with ``return_lse``: see :func:`flash_attention_v2_training_reference`."""
    out, lse = flash_attention_v2_training_reference(q, k, v, causal, softmax_scale, False, kv_start, kv_end)
    return (out, lse) if return_lse else out


# --- plans ---------------------------------------------------------------------------------------

def training_outputs(q: torch.Tensor, *_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Sq, Hq, D]`` in q's dtype, ``lse [B, Hq, Sq])`` in float32 (float64 for float64 q),
    both contiguous."""
    batch, sq, hq, d = q.shape
    return (torch.empty((batch, sq, hq, d), dtype=q.dtype, device=q.device),
            torch.empty((batch, hq, sq), dtype=torch.promote_types(q.dtype, torch.float32), device=q.device))


def outputs(q: torch.Tensor, *_: Any) -> torch.Tensor:
    return training_outputs(q)[0]


def scale_of(q: torch.Tensor, softmax_scale: float | None) -> float:
    return q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)


def _calls(args: tuple, config: Config, profile: DeviceProfile, out: torch.Tensor,
           lse: torch.Tensor) -> tuple[list, tuple]:
    """The launches and the scratch tensors they use (the decode block's split partials)."""
    q, k, v, causal, softmax_scale = args[:5]
    kv_start, kv_end = (*args[6:], None, None)[:2]  # trailing optional bounds may be left off
    scale = scale_of(q, softmax_scale)
    if attention_decode.use_decode(q, k, profile):
        return attention_decode.decode_calls(q, k, v, out, lse, causal=causal, scale=scale, profile=profile,
                                             kv_start=kv_start, kv_end=kv_end)
    return forward_calls(q, k, v, out, lse, causal=causal, scale=scale, config=config, profile=profile,
                         kv_start=kv_start, kv_end=kv_end), ()


def training_plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    """``(out, lse)``: what the custom op runs (autograd saves lse for the backward)."""
    out, lse = training_outputs(*args)
    calls, scratch = _calls(args, config, profile, out, lse)
    return LaunchPlan(calls=calls, result=(out, lse), scratch=scratch)


def plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    """``out``, or ``(out, lse)`` with ``return_lse``; otherwise lse is scratch (the kernel writes it
    either way: ``B * Hq * Sq`` floats, a 1/(2D) part of out's bytes in 16-bit). Every tensor a launch
    is handed is an input, a result or declared scratch, so that a bound op's calls replay their
    recorded launches (:class:`dlcore.runtime.replay.Replay`) instead of planning again."""
    out, lse = training_outputs(*args)
    calls, scratch = _calls(args, config, profile, out, lse)
    if args[5]:
        return LaunchPlan(calls=calls, result=(out, lse), scratch=scratch)
    return LaunchPlan(calls=calls, result=out, scratch=(lse, *scratch))


# --- config --------------------------------------------------------------------------------------

def default_config(sig: Signature, profile: DeviceProfile) -> Config:
    """By the head's tile width, the fastest of a sweep at B 2, H 16, S 8192 (bfloat16, descriptor
    loads; docs/performance.md, flash_attention_v2):

    - up to 64: 128 x 128 blocks, 4 warps, 3 stages;
    - up to 128: 128 x 128 blocks, 8 warps, 3 stages;
    - wider: 128 x 64 blocks, 8 warps, 2 stages (what fits).

    Short sequences take query blocks no taller than the sequence. Fitted to the device's shared
    memory (:func:`fit`: float32 heads take narrower blocks)."""
    _, sq, _, d = sig.tensor("q").shape
    width = block_d(d)
    if width <= 64:
        config = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3, "WARP_SPECIALIZE": 0}
    elif width <= 128:
        config = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "WARP_SPECIALIZE": 0}
    else:
        config = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "WARP_SPECIALIZE": 0}
    config["BLOCK_M"] = min(config["BLOCK_M"], max(sq, 16))
    return fit(config, d, sig.dtype.itemsize, profile)


def _threads(c: Config) -> int:
    """The threads holding a program's rows: its warps, twice over when warp-specialised (two
    consumer warpgroups of ``num_warps`` each, 64 rows apiece)."""
    return 32 * c["num_warps"] * (2 if c.get("WARP_SPECIALIZE", 0) else 1)


def space(profile: DeviceProfile, *, warp_specialize: bool = False) -> SearchSpace:
    """Query and key block heights, warps and pipelining depth; the tiles within the shared memory
    of the device for 16-bit heads of 128 (wider heads: the plan fits the config, see :func:`fit`),
    the accumulator and the scores within half a thread's registers.

    ``warp_specialize`` (default off) also offers the warp-specialised loop (4-warp programs of 128
    query rows on sm_90, what Triton specialises). It is off because on sm_90 with Triton 3.6.0 the
    specialised program gives wrong outputs at B 2, H 16, S 8192, D 128 (``SWEEP_D=128 python3
    .ci/sweep_attention.py sweep``; NaN, or a relative error of 0.19 under the causal mask) and the
    right one is no faster than the plain default (docs/performance.md, Other measurements: Warp
    specialisation). Small shapes pass their GPU tests,
    so the tuner's check on small inputs would not catch it."""
    shared = profile.shared_memory_per_program
    fits = [Constraint(
        f"(BLOCK_M * (1 + WARP_SPECIALIZE) + 2 * num_stages * BLOCK_N) * {SPACE_HEAD_DIM} * {SPACE_ELEMENT_BYTES} "
        f"bytes <= {shared} (the q tile (twice when warp-specialised) and the pipelined k and v tiles fit in "
        f"shared memory)",
        lambda c: shared_memory_bytes(c, SPACE_HEAD_DIM, SPACE_ELEMENT_BYTES) <= shared,
    )] if shared else []
    specialise = warp_specialize and profile.arch in TMA_ARCHS
    return SearchSpace(
        [PowerOfTwo("BLOCK_M", 16, 256), PowerOfTwo("BLOCK_N", 16, 256), num_warps(4, 8), num_stages(1, 2, 3, 4, 5),
         Choice("WARP_SPECIALIZE", (0, 1) if specialise else (0,))],
        [
            *fits,
            Constraint(f"BLOCK_M * {SPACE_HEAD_DIM} / (32 * num_warps * (1 + WARP_SPECIALIZE)) <= {MAX_PER_THREAD} "
                       f"(the accumulator fits)",
                       lambda c: c["BLOCK_M"] * SPACE_HEAD_DIM / _threads(c) <= MAX_PER_THREAD),
            Constraint(f"BLOCK_M * BLOCK_N / (32 * num_warps * (1 + WARP_SPECIALIZE)) <= {MAX_PER_THREAD} "
                       f"(the scores fit)",
                       lambda c: c["BLOCK_M"] * c["BLOCK_N"] / _threads(c) <= MAX_PER_THREAD),
            Constraint("WARP_SPECIALIZE == 0 or (num_warps == 4 and BLOCK_M == 128) (Triton specialises 4-warp "
                       "programs into two 64-row consumer warpgroups)",
                       lambda c: not c["WARP_SPECIALIZE"] or (c["num_warps"] == 4 and c["BLOCK_M"] == 128)),
        ],
    )


# --- the op --------------------------------------------------------------------------------------

def check(op: Op, args: dict[str, Any]) -> None:
    q, k, v = args["q"], args["k"], args["v"]
    batch, _, hq, d = q.shape
    if not 1 <= d <= MAX_HEAD_DIM:
        raise InvalidInputError(op.name, "q", f"has head dimension {d} (shape {tuple(q.shape)})",
                                f"q [B, Sq, Hq, D] with 1 <= D <= {MAX_HEAD_DIM}")
    if k.shape[0] != batch or k.shape[3] != d:
        raise InvalidInputError(op.name, "k", f"has shape {tuple(k.shape)}",
                                f"k [B, Sk, Hk, D] with q's batch B = {batch} and head dimension D = {d}")
    hk = k.shape[2]
    if hk == 0 or hq % hk:
        raise InvalidInputError(op.name, "k", f"has {hk} heads, which do not divide q's {hq}",
                                "k [B, Sk, Hk, D] with Hk dividing Hq (grouped-query attention)")
    op.expect_shape("v", v, tuple(k.shape), "[B, Sk, Hk, D]: the shape of k")
    for name in ("kv_start", "kv_end"):
        if args.get(name) is not None:  # fused_rotary_and_fa shares these checks and has no bounds
            op.expect_shape(name, args[name], (batch,), f"[B]: one bound per batch of q (B = {batch})")


def example(sizes: dict[str, int], dtype: torch.dtype, device: torch.device, generator: torch.Generator) -> tuple:
    """Random ``q [batch, seq, heads, head_dim]``, ``k, v [batch, kv_seq, kv_heads, head_dim]``
    (``kv_seq`` 0: ``seq``); ``causal`` 0 or 1."""
    batch, seq, d = sizes["batch"], sizes["seq"], sizes["head_dim"]
    kv_seq = sizes["kv_seq"] or seq
    q = torch.randn(batch, seq, sizes["heads"], d, generator=generator)
    k = torch.randn(batch, kv_seq, sizes["kv_heads"], d, generator=generator)
    v = torch.randn(batch, kv_seq, sizes["kv_heads"], d, generator=generator)
    return (*(t.to(device=device, dtype=dtype) for t in (q, k, v)), bool(sizes["causal"]), None, False, None, None)


def attended_pairs(sq: int, sk: int, causal: bool) -> int:
    """The (query, key) pairs a head attends: ``Sq * Sk``, or under the bottom-right causal mask
    ``sum_i clamp(i + Sk - Sq + 1, 0, Sk)`` (``S (S + 1) / 2`` for ``Sq = Sk = S``)."""
    if not causal:
        return sq * sk
    offset = sk - sq
    first = max(0, -offset)  # the first row that sees a key
    rows = sq - first
    return rows * (first + offset + 1) + rows * (rows - 1) // 2 if rows > 0 else 0


def cost(args: tuple, mode: str = "fwd") -> tuple[int, int]:
    """Forward: read q, k and v, write out (and lse when returned); ``q . k`` and ``p . v`` for each
    attended pair, ``4 * D`` flops (halved by the causal mask at Sq = Sk). Backward: read dout, q,
    k, v, out and lse, write dq, dk and dv; 2.5 times the forward's flops (recomputing ``q . k``, then
    ``dv``, ``dp``, ``dq`` and ``dk``)."""
    q, k, v, causal, _, return_lse = args[:6]
    batch, sq, hq, d = q.shape
    size = q.element_size()
    lse = batch * hq * sq * 4
    flops = 4 * batch * hq * attended_pairs(sq, k.shape[1], causal) * d
    qkv = (q.numel() + k.numel() + v.numel()) * size
    if mode == "bwd":
        return 2 * qkv + 2 * q.numel() * size + lse, int(2.5 * flops)
    return qkv + q.numel() * size + (lse if return_lse else 0), flops


def torch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    softmax_scale: float | None = None, return_lse: bool = False,
                    kv_start: torch.Tensor | None = None, kv_end: torch.Tensor | None = None) -> torch.Tensor:
    """What a model runs in eager torch: ``F.scaled_dot_product_attention`` on ``[B, H, S, D]`` views,
    the backend torch picks (flash, cuDNN, memory-efficient or math); key padding as a boolean mask."""
    if return_lse:
        raise NotImplementedError("SDPA returns no log-sum-exp")
    return sdpa_attention(q, k, v, causal, softmax_scale,
                          key_mask=key_padding_mask(kv_start, kv_end, q.shape[0], k.shape[1], q.device))


def _sdpa_baseline(name: str):
    """A baseline factory: SDPA with one backend (``FLASH_ATTENTION``, ``CUDNN_ATTENTION``), or None
    where torch lacks it or no GPU is present."""

    def factory():
        backend = getattr(SDPBackend, name, None)
        if backend is None or not torch.cuda.is_available():
            return None

        def run(q, k, v, causal=False, softmax_scale=None, return_lse=False, kv_start=None, kv_end=None):
            if return_lse:
                raise NotImplementedError("SDPA returns no log-sum-exp")
            if kv_start is not None or kv_end is not None:
                raise NotImplementedError("SDPA's flash and cuDNN backends take no key padding here")
            return sdpa_attention(q, k, v, causal, softmax_scale, backend)

        return run

    return factory


OP = Op(
    name="flash_attention_v2",
    args=(
        TensorArg("q", DTYPES, min_rank=4, max_rank=4, layouts=ANY_LAYOUT, bucket="sequence"),
        TensorArg("k", DTYPES, min_rank=4, max_rank=4, layouts=ANY_LAYOUT, same_dtype_as="q", bucket="sequence"),
        TensorArg("v", DTYPES, min_rank=4, max_rank=4, layouts=ANY_LAYOUT, same_dtype_as="q", bucket="sequence"),
        ScalarArg("causal", (bool,), default=False, keyed=True),
        ScalarArg("softmax_scale", (float, int, type(None)), default=None, finite=True),
        ScalarArg("return_lse", (bool,), default=False, keyed=True),
        TensorArg("kv_start", (torch.int32,), max_rank=1, layouts=("contiguous",), differentiable=False,
                  optional=True),
        TensorArg("kv_end", (torch.int32,), max_rank=1, layouts=("contiguous",), differentiable=False,
                  optional=True),
    ),
    reference=flash_attention_v2_reference,
    doc="softmax(scale * q k^T) v, q [B, Sq, Hq, D], k and v [B, Sk, Hk, D] (GQA), causal bottom-right; "
        "return_lse: also the log-sum-exp [B, Hq, Sq]; kv_start, kv_end: int32 [B], the keys each batch sees "
        "(key padding)",
    check=check,
    example=example,
    example_sizes={"batch": 2, "seq": 37, "kv_seq": 0, "heads": 4, "kv_heads": 2, "head_dim": 64, "causal": 0},
    example_paths={"decode": {"seq": 1, "kv_seq": 4096, "heads": 32, "kv_heads": 8},
                   "prefill": {"seq": 300},
                   "causal, heads of 128": {"seq": 300, "heads": 16, "kv_heads": 4, "head_dim": 128, "causal": 1},
                   "heads of 256": {"seq": 300, "heads": 16, "kv_heads": 4, "head_dim": 256}},
    cost=cost,
    baselines={"torch": lambda: torch_attention, "sdpa_flash": _sdpa_baseline("FLASH_ATTENTION"),
               "sdpa_cudnn": _sdpa_baseline("CUDNN_ATTENTION")},
)


def _gradients(backward, saved, grads, needs) -> dict:
    dq, dk, dv = backward(grads[0], saved.q, saved.k, saved.v, saved.out, saved.lse, grads[1], saved.causal,
                          saved.softmax_scale, saved.kv_start, saved.kv_end)
    return {"q": dq, "k": dk, "v": dv}


BACKWARD = Backward(
    _gradients, saved=("q", "k", "v", "out", "lse", "causal", "softmax_scale", "kv_start", "kv_end"),
    plan=attention_grad.backward_plan,
    reference=attention_grad.backward_reference, results=attention_grad.backward_results,
    residuals=Residuals(("lse",), training_plan, training_outputs, flash_attention_v2_training_reference,
                        shown_by="return_lse"),
)

KERNEL = define_kernel(
    OP, plan,
    kernels=(*FORWARD_KERNELS, *attention_decode.DECODE_KERNELS, *attention_grad.BACKWARD_KERNELS),
    results=outputs,
    default_config=default_config,
    space=space,
    backward=BACKWARD,
    doc="flash attention 2: a program per query block and head, online softmax in float32, causal blocks "
        "above the diagonal skipped; tiles through tensor descriptors on Hopper",
)
flash_attention_v2 = KERNEL.function
dlcore_ops, dlcore_implementations = KERNEL.dlcore_ops, KERNEL.dlcore_implementations
