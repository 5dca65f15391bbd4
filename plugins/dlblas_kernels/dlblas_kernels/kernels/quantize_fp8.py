"""quantize_fp8: ``x [M, K]`` (bfloat16, float16, float32) to float8_e4m3fn with float32 scales,
the inputs :func:`~dlblas_kernels.kernels.fp8_gemm.fp8_gemm` takes: ``x ~ x_fp8 * scale``.

Each group of elements gets ``scale = amax / 448`` (448 the largest e4m3 value; ``amax`` the
group's largest magnitude; 1 for a group of zeros, whose elements quantise to 0), and each element
``x_fp8 = round_to_nearest_even(clamp(x / scale, -448, 448))``. ``granularity`` names the groups:

- ``"block"``: 1x128 of each row (DeepSeek-V3's activations, ``a_scale``): scale ``[M,
  ceil(K/128)]``, stored M-major (strides ``(1, M)``) so that the GEMM reads a tile's row scales
  in one coalesced load;
- ``"block_128x128"``: 128x128 blocks (DeepSeek-V3's weights, ``b_scale``): scale
  ``[ceil(M/128), ceil(K/128)]``;
- ``"row"``: each row: scale ``[M, 1]``;
- ``"tensor"``: the whole tensor: a 0-dim scale. Two passes (no atomics): the largest magnitude of
  each block of rows into a workspace, then every program reduces the workspace and quantises its
  rows.

The last groups of a row or column are partial where K or M is no multiple of 128. A NaN is left
out of its group's largest magnitude, as the GPU's ``max`` leaves it (IEEE maxNum), so the rest of
the group keeps its scale; the NaN's own fp8 value is not specified (the clamp to [-448, 448] on a
GPU makes it -448). An infinity makes its group's scale infinite.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dlblas_kernels.blocks.fp8 import FP8_MAX, quantise, scale_of
from dlcore.api import (
    Config,
    DeviceProfile,
    KernelCall,
    LaunchPlan,
    LoweringLimit,
    Op,
    ScalarArg,
    Signature,
    TensorArg,
    cdiv,
    define_kernel,
    next_power_of_2,
)

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GRANULARITIES = ("block", "block_128x128", "row", "tensor")
FP8 = torch.float8_e4m3fn
#: the K extent of a block (and the M extent of a 128x128 one)
GROUP = 128
#: the widest K step of the row kernels
MAX_BLOCK_K = 1024


@triton.jit
def block_quantize_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_xk, stride_qm, stride_sm, stride_sk,
                          BLOCK_M: tl.constexpr, SQUARE: tl.constexpr):
    """Program ``(i, j)``: rows ``[i * BLOCK_M, (i + 1) * BLOCK_M)`` by the 128 columns of group
    ``j``; one scale per row (1x128), or with SQUARE one for the tile (BLOCK_M = 128: a 128x128
    block)."""
    pid_m, kb = tl.program_id(0), tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_k = kb * 128 + tl.arange(0, 128)
    mask_m = offs_m < M
    mask = mask_m[:, None] & (offs_k < K)[None, :]
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk, mask=mask, other=0.0)
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    if SQUARE:
        scale = scale_of(tl.max(amax, axis=0))
        q = quantise(x, scale)
        tl.store(s_ptr + pid_m * stride_sm + kb * stride_sk, scale)
    else:
        scale = scale_of(amax)
        q = quantise(x, scale[:, None])
        tl.store(s_ptr + offs_m * stride_sm + kb * stride_sk, scale, mask=mask_m)
    tl.store(q_ptr + offs_m[:, None] * stride_qm + offs_k[None, :], q, mask=mask)


@triton.jit
def amax_kernel(x_ptr, ws_ptr, M, K, stride_xm, stride_xk, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """``ws[i]``: the largest magnitude of rows ``[i * BLOCK_M, (i + 1) * BLOCK_M)``."""
    offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        mask = mask_m[:, None] & (offs_k < K - k)[None, :]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k + offs_k)[None, :] * stride_xk, mask=mask, other=0.0)
        acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
    tl.store(ws_ptr + tl.program_id(0), tl.max(tl.max(acc, axis=1), axis=0))


@triton.jit
def row_quantize_kernel(x_ptr, q_ptr, s_ptr, ws_ptr, M, K, parts, stride_xm, stride_xk, stride_qm, stride_sm,
                        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
                        PER_TENSOR: tl.constexpr):
    """Rows ``[i * BLOCK_M, (i + 1) * BLOCK_M)`` of program ``i``: each row's scale from its
    largest magnitude (a first sweep along K), or with PER_TENSOR the tensor's from the ``parts``
    maxima of :func:`amax_kernel` in ``ws`` (program 0 stores it); then the quantised rows."""
    pid = tl.program_id(0)
    offs_m = (pid * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    if PER_TENSOR:
        offs_p = tl.arange(0, BLOCK_P)
        maxima = tl.zeros((BLOCK_P,), dtype=tl.float32)
        for p in range(0, parts, BLOCK_P):
            maxima = tl.maximum(maxima, tl.load(ws_ptr + p + offs_p, mask=offs_p < parts - p, other=0.0))
        whole = scale_of(tl.max(maxima, axis=0))
        tl.store(s_ptr, whole, mask=pid == 0)
        scale = tl.zeros((BLOCK_M,), dtype=tl.float32) + whole
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            mask = mask_m[:, None] & (offs_k < K - k)[None, :]
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k + offs_k)[None, :] * stride_xk, mask=mask,
                        other=0.0)
            acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
        scale = scale_of(tl.max(acc, axis=1))
        tl.store(s_ptr + offs_m * stride_sm, scale, mask=mask_m)
    for k in range(0, K, BLOCK_K):
        mask = mask_m[:, None] & (offs_k < K - k)[None, :]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k + offs_k)[None, :] * stride_xk, mask=mask, other=0.0)
        q = quantise(x.to(tl.float32), scale[:, None])
        tl.store(q_ptr + offs_m[:, None] * stride_qm + (k + offs_k)[None, :], q, mask=mask)


def outputs(x: torch.Tensor, granularity: str = "block") -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_fp8, scale)`` allocated: ``x_fp8`` row-major, ``scale`` as the module doc lays it out."""
    (m, k), like = x.shape, {"device": x.device}
    q = torch.empty(m, k, dtype=FP8, **like)
    if granularity == "block":
        scale = torch.empty(cdiv(k, GROUP), m, dtype=torch.float32, **like).T
    elif granularity == "block_128x128":
        scale = torch.empty(cdiv(m, GROUP), cdiv(k, GROUP), dtype=torch.float32, **like)
    elif granularity == "row":
        scale = torch.empty(m, 1, dtype=torch.float32, **like)
    else:
        scale = torch.empty((), dtype=torch.float32, **like)
    return q, scale


def plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    x, granularity = args
    q, scale = outputs(x, granularity)
    (m, k) = x.shape
    if x.numel() == 0:
        return LaunchPlan(calls=[], result=(q, scale.fill_(1.0)))  # groups of no element (K 0): scale 1
    strides = (x.stride(0), x.stride(1), q.stride(0))
    warps = {"num_warps": config["num_warps"]}
    if granularity in ("block", "block_128x128"):
        square = granularity == "block_128x128"
        block_m = GROUP if square else config["BLOCK_M"]
        calls = [KernelCall(block_quantize_kernel, (cdiv(m, block_m), cdiv(k, GROUP)),
                            (x, q, scale, m, k, *strides, scale.stride(0), scale.stride(1)),
                            {"BLOCK_M": block_m, "SQUARE": square, **warps})]
        return LaunchPlan(calls=calls, result=(q, scale))
    block_m, block_k = config["BLOCK_M"], config["BLOCK_K"]
    parts = cdiv(m, block_m)
    per_tensor = granularity == "tensor"
    tiles = {"BLOCK_M": block_m, "BLOCK_K": block_k, **warps}
    calls, scratch = [], ()
    ws = x  # read only under PER_TENSOR
    if per_tensor:
        ws = torch.empty(parts, dtype=torch.float32, device=x.device)
        scratch = (ws,)
        calls.append(KernelCall(amax_kernel, (parts,), (x, ws, m, k, x.stride(0), x.stride(1)), tiles))
    calls.append(KernelCall(row_quantize_kernel, (parts,), (
        x, q, scale, ws, m, k, parts, *strides, scale.stride(0) if scale.dim() else 0,
    ), {**tiles, "BLOCK_P": min(next_power_of_2(parts), 1024), "PER_TENSOR": per_tensor}))
    return LaunchPlan(calls=calls, result=(q, scale), scratch=scratch)


def heuristic(m: int, k: int, granularity: str) -> Config:
    """Block tiles of 32 rows (4096 elements, 4 warps); row and tensor: 4 rows a program (16 for
    a tensor, whose workspace holds one maximum a program), K steps up to 1024."""
    if granularity in ("block", "block_128x128"):
        return {"BLOCK_M": 32, "BLOCK_K": GROUP, "num_warps": 8 if granularity == "block_128x128" else 4}
    return {"BLOCK_M": 16 if granularity == "tensor" else 4, "BLOCK_K": min(next_power_of_2(k), MAX_BLOCK_K),
            "num_warps": 4}


def default_config(sig: Signature, profile: DeviceProfile) -> Config:
    m, k = sig.tensor("x").shape
    return heuristic(m, k, sig.scalar("granularity"))


def _group_amax(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The largest magnitude of each ``rows x cols`` group of ``x [M, K]`` (partial at the ends)."""
    m, k = x.shape
    padded = torch.zeros(cdiv(m, rows) * rows, cdiv(k, cols) * cols, dtype=x.dtype, device=x.device)
    padded[:m, :k] = x.abs().nan_to_num(0.0, posinf=float("inf"))  # NaN left out, as the kernels' max does
    return padded.view(cdiv(m, rows), rows, cdiv(k, cols), cols).amax(dim=(1, 3))


def quantize_fp8_reference(x: torch.Tensor, granularity: str = "block") -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_fp8, scale)`` in torch (float32 arithmetic, as the kernels do)."""
    x = x.float()
    m, k = x.shape
    if granularity == "tensor":
        amax = x.abs().nan_to_num(0.0, posinf=float("inf")).amax() if x.numel() else torch.zeros((), device=x.device)
        rows, cols = m, k
    else:
        rows, cols = {"block": (1, GROUP), "block_128x128": (GROUP, GROUP), "row": (1, max(k, 1))}[granularity]
        # a row's scale even without columns (K 0), as the plan allocates one
        amax = x.new_zeros(m, 1) if granularity == "row" and k == 0 else _group_amax(x, rows, cols)
    # A tensor divisor: torch divides a CUDA tensor by a Python number as a product with its
    # reciprocal, which is not the correctly rounded quotient the kernels compute.
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    full = scale.expand(m, k) if scale.dim() == 0 else (
        scale.repeat_interleave(rows, 0)[:m].repeat_interleave(cols, 1)[:, :k])
    q = (x / full).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def cost(args: tuple) -> tuple[int, int]:
    """x read once, x_fp8 and the scales written once; a division per element."""
    x, granularity = args
    q, scale = outputs(x.to("meta"), granularity)
    return x.numel() * x.element_size() + q.numel() + 4 * scale.numel(), x.numel()


def example(sizes: dict[str, int], dtype: torch.dtype, device: torch.device,
            generator: torch.Generator) -> tuple:
    """Random activations ``x [tokens, hidden]``, quantised with block scales."""
    x = torch.randn(sizes["tokens"], sizes["hidden"], generator=generator)
    return x.to(device=device, dtype=dtype), "block"


OP = Op(
    name="quantize_fp8",
    args=(
        TensorArg("x", DTYPES, min_rank=2, max_rank=2, bucket="rows", differentiable=False),
        ScalarArg("granularity", (str,), default="block", keyed=True, choices=GRANULARITIES),
    ),
    reference=quantize_fp8_reference,
    doc="x [M, K] to float8_e4m3fn with float32 scales amax/448 per 1x128 (block), 128x128 (block_128x128), row "
        "or tensor: (x_fp8, scale), the inputs of fp8_gemm",
    example=example,
    example_sizes={"tokens": 37, "hidden": 272},
    example_paths={"rows": {"tokens": 300, "hidden": 512}},
    cost=cost,
)

#: the kernels that store float8_e4m3fn (the per-tensor maxima pass stores float32 only)
FP8_STORES = ("block_quantize_kernel", "row_quantize_kernel")

KERNEL = define_kernel(
    OP, plan,
    kernels=(block_quantize_kernel, amax_kernel, row_quantize_kernel),
    results=outputs,
    outputs=("x_fp8", "scale"),
    default_config=default_config,
    doc="one pass per 1x128 / 128x128 group or row; per tensor a maxima pass, then the quantising pass",
    limits=(
        LoweringLimit("npu", FP8_STORES, "ttir",
                      "they store float8_e4m3fn, which the Ascend 910B has no type for: upstream Triton 3.6, making "
                      "the npu pipeline's ttir at its sm_80 target, rejects it ('type fp8e4nv not supported in this "
                      "architecture')"),
        LoweringLimit("cuda", FP8_STORES, "ttir",
                      "they store float8_e4m3fn, which needs sm_89 or later: Triton 3.6 rejects fp8e4nv on sm_80",
                      archs=("80",)),
    ),
)
quantize_fp8 = KERNEL.function
dlcore_ops, dlcore_implementations = KERNEL.dlcore_ops, KERNEL.dlcore_implementations
