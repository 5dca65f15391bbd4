"""ffn: the gate and up half of a LLaMA MLP, fused: RMSNorm, two projections and SwiGLU.

    xn  = x * rsqrt(mean(x**2, -1) + eps) * rms_w          x: [M, K], rms_w: [K]
    out = silu(xn @ w1.T) * (xn @ w3.T)                     w1, w3: [N, K] (nn.Linear layout)

One tiled GEMM kernel computes it without writing ``xn``: the row scale factors out of the
product, ``xn @ w.T = rstd[:, None] * ((x * rms_w) @ w.T)``, so each program accumulates the
two products of ``x * rms_w`` with its tiles of ``w1`` and ``w3`` and the sum of squares of its
rows during the same K loop, then scales both accumulators by ``rstd`` at the end.
The ``tl.dot`` inputs keep the input dtype (float16 / bfloat16 tensor cores, exact float32 for
float32 inputs), accumulating in float32.

Forward only: ``dlblas::ffn`` is a PyTorch custom op (one node under ``torch.compile``) without an
autograd formula, so a backward through it raises.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from dlcore import InvalidInputError
from dlcore.declarations.device import DeviceProfile
from dlcore.declarations.implementation import Config, KernelCall, LaunchPlan
from dlcore.declarations.layout import as_rows
from dlcore.declarations.op import Op, ScalarArg, TensorArg
from dlcore.declarations.signature import Signature, cdiv, next_power_of_2
from dlcore.declarations.space import Choice, Constraint, PowerOfTwo, SearchSpace, num_stages, num_warps
from dlcore.runtime.template import define_kernel

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def ffn_kernel(
    x_ptr, w1_ptr, w3_ptr, rms_w_ptr, out_ptr,
    M, N, K, eps,
    stride_xm, stride_xk,
    stride_w1n, stride_w1k,
    stride_w3n, stride_w3k,
    stride_rms_w,
    stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Grouped order: GROUP_M row blocks sweep the column blocks together, so the w1/w3 tiles
    # they share are read from L2 rather than memory.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pids_per_group = GROUP_M * num_pid_n
    first_pid_m = (pid // pids_per_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % pids_per_group) % group_size_m
    pid_n = (pid % pids_per_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N

    # 64-bit offsets along M and N: row * stride may pass 2**31 elements.
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk
    # The w tiles are read as [BLOCK_K, BLOCK_N], i.e. tiles of w.T.
    w1_ptrs = w1_ptr + offs_k[:, None] * stride_w1k + offs_n.to(tl.int64)[None, :] * stride_w1n
    w3_ptrs = w3_ptr + offs_k[:, None] * stride_w3k + offs_n.to(tl.int64)[None, :] * stride_w3n
    rms_w_ptrs = rms_w_ptr + offs_k * stride_rms_w

    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        g = tl.load(rms_w_ptrs, mask=mask_k, other=0.0).to(tl.float32)
        w1 = tl.load(w1_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        w3 = tl.load(w3_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)

        xf = x.to(tl.float32)
        sum_sq += tl.sum(xf * xf, axis=1)
        a = (xf * g[None, :]).to(x.dtype)
        # "ieee": exact float32 products for float32 inputs (TF32 would miss float32 tolerances);
        # float16 / bfloat16 inputs use the tensor cores either way.
        acc1 = tl.dot(a, w1, acc1, input_precision="ieee")
        acc3 = tl.dot(a, w3, acc3, input_precision="ieee")

        x_ptrs += BLOCK_K * stride_xk
        w1_ptrs += BLOCK_K * stride_w1k
        w3_ptrs += BLOCK_K * stride_w3k
        rms_w_ptrs += BLOCK_K * stride_rms_w

    rstd = tl.rsqrt(sum_sq / K + eps)
    gate = acc1 * rstd[:, None]
    up = acc3 * rstd[:, None]
    # silu(gate) * up, with silu(g) = g * sigmoid(g)
    out = gate * tl.sigmoid(gate) * up

    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def output(x: torch.Tensor, w1: torch.Tensor, *_: Any) -> torch.Tensor:
    return torch.empty(*x.shape[:-1], w1.shape[0], dtype=x.dtype, device=x.device)


def plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    x, w1, w3, rms_w, eps = args
    n = w1.shape[0]
    out = output(x, w1)
    if out.numel() == 0:
        return LaunchPlan(calls=[], result=out)
    x2, out2 = as_rows(x), as_rows(out)
    m, k = x2.shape
    block_m, block_n = config["BLOCK_M"], config["BLOCK_N"]
    grid = (cdiv(m, block_m) * cdiv(n, block_n),)
    call = KernelCall(
        ffn_kernel, grid,
        (x2, w1, w3, rms_w, out2, m, n, k, float(eps),
         x2.stride(0), x2.stride(1), w1.stride(0), w1.stride(1), w3.stride(0), w3.stride(1),
         rms_w.stride(0), out2.stride(0), out2.stride(1)),
        {
            "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": config["BLOCK_K"],
            "GROUP_M": config["GROUP_M"],
            "num_warps": config["num_warps"], "num_stages": config["num_stages"],
        },
    )
    return LaunchPlan(calls=[call], result=out)


def ffn_reference(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, rms_w: torch.Tensor,
                  eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm, gate and up projections and SwiGLU, in float32 (or wider), returned in ``x``'s dtype."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute)
    xn = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps) * rms_w.to(compute)
    gate = xn @ w1.to(compute).T
    up = xn @ w3.to(compute).T
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def default_config(sig: Signature, profile: DeviceProfile) -> Config:
    m = sig.tensor("x").shape[0]  # rows, rounded up to a power of two
    # Few rows (decoding): a thin row block, wasting fewer masked rows.
    block_m = min(max(next_power_of_2(m), 16), 64)
    return {"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}


# Declared for 16-bit inputs; a float32 config that overflows shared memory fails to compile and the
# tuner records it as failed.
SPACE_ELEMENT_BYTES = 2


def _shared_memory_bytes(c: Config) -> int:
    # Per stage: the x tile, the w1 and w3 tiles and the BLOCK_K slice of rms_w.
    return c["num_stages"] * (c["BLOCK_M"] + 2 * c["BLOCK_N"] + 1) * c["BLOCK_K"] * SPACE_ELEMENT_BYTES


def _accumulators_per_thread(c: Config) -> float:
    # Two float32 accumulators (gate and up), BLOCK_M x BLOCK_N each.
    return 2 * c["BLOCK_M"] * c["BLOCK_N"] / (32 * c["num_warps"])


def space(profile: DeviceProfile) -> SearchSpace:
    """Tile shapes, program order, warps and pipelining depth of the fused GEMM; the pipelined tiles
    within the shared memory a program may use on the device (no bound where the profile knows none)."""
    shared = profile.shared_memory_per_program
    fits = [Constraint(
        f"num_stages * (BLOCK_M + 2 * BLOCK_N + 1) * BLOCK_K * {SPACE_ELEMENT_BYTES} bytes <= {shared} "
        f"(the pipelined x, w1, w3 and rms_w tiles fit in shared memory)",
        lambda c: _shared_memory_bytes(c) <= shared,
    )] if shared else []
    return SearchSpace(
        [
            PowerOfTwo("BLOCK_M", 16, 128),
            PowerOfTwo("BLOCK_N", 32, 256),
            PowerOfTwo("BLOCK_K", 32, 128),
            Choice("GROUP_M", (1, 8)),
            num_warps(4, 8),
            num_stages(2, 3, 4),
        ],
        [
            *fits,
            Constraint("2 * BLOCK_M * BLOCK_N / (32 * num_warps) <= 128 (both float32 accumulators fit in registers)",
                       lambda c: _accumulators_per_thread(c) <= 128),
            Constraint("2 * BLOCK_M * BLOCK_N / (32 * num_warps) >= 16 (every warp has enough of the tile to work on)",
                       lambda c: _accumulators_per_thread(c) >= 16),
        ],
    )


def check(op: Op, args: dict[str, Any]) -> None:
    x, w1 = args["x"], args["w1"]
    k = x.shape[-1]
    if k == 0:
        raise InvalidInputError(op.name, "x", f"has an empty last dimension (shape {tuple(x.shape)})",
                                "x with at least one feature to normalise")
    op.expect_shape("w1", w1, (w1.shape[0], k), "nn.Linear layout [N, K], K being x's last dimension")
    op.expect_shape("w3", args["w3"], tuple(w1.shape), "the shape of w1")
    op.expect_shape("rms_w", args["rms_w"], (k,), "one scale per feature of x's last dimension")


def example(sizes: dict[str, int], dtype: torch.dtype, device: torch.device,
            generator: torch.Generator) -> tuple:
    """Random ``x [tokens, hidden]``, ``w1, w3 [inter, hidden]`` scaled like trained layers
    (variance 1/hidden), and a norm weight near 1."""
    tokens, hidden, inter = sizes["tokens"], sizes["hidden"], sizes["inter"]
    x = torch.randn(tokens, hidden, generator=generator)
    w1 = torch.randn(inter, hidden, generator=generator) / hidden**0.5
    w3 = torch.randn(inter, hidden, generator=generator) / hidden**0.5
    rms_w = 1 + 0.2 * torch.randn(hidden, generator=generator)
    return (*(t.to(device=device, dtype=dtype) for t in (x, w1, w3, rms_w)), 1e-6)


def cost(args: tuple) -> tuple[int, int]:
    """Read x, w1, w3 and rms_w, write the output; two GEMMs of 2*M*N*K flops each."""
    x, w1, w3, rms_w, _ = args
    m, k, n = x.numel() // max(x.shape[-1], 1), x.shape[-1], w1.shape[0]
    moved = (x.numel() * x.element_size() + (w1.numel() + w3.numel()) * w1.element_size()
             + rms_w.numel() * rms_w.element_size() + m * n * x.element_size())
    return moved, 4 * m * n * k


def torch_ffn(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, rms_w: torch.Tensor,
              eps: float = 1e-6) -> torch.Tensor:
    """What a model runs in eager torch: LlamaRMSNorm, then LlamaMLP's ``act_fn(gate_proj(h)) * up_proj(h)``."""
    h = x.to(torch.float32)
    h = rms_w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return torch.nn.functional.silu(h @ w1.T) * (h @ w3.T)


OP = Op(
    name="ffn",
    args=(
        TensorArg("x", DTYPES, bucket="rows"),
        TensorArg("w1", DTYPES, min_rank=2, max_rank=2, same_dtype_as="x"),
        TensorArg("w3", DTYPES, min_rank=2, max_rank=2, same_dtype_as="x"),
        TensorArg("rms_w", DTYPES, max_rank=1),
        ScalarArg("eps", (float, int), default=1e-6),
    ),
    reference=ffn_reference,
    doc="silu(rms_norm(x) @ w1.T) * (rms_norm(x) @ w3.T): fused RMSNorm + gate/up projections + SwiGLU",
    check=check,
    example=example,
    example_sizes={"tokens": 37, "hidden": 256, "inter": 96},
    cost=cost,
    baselines={"torch": lambda: torch_ffn},
)


KERNEL = define_kernel(
    OP, plan,
    kernels=(ffn_kernel,),
    results=output,
    default_config=default_config,
    space=space,
    doc="one tiled GEMM with two accumulators; the RMSNorm scale applied after the K loop",
)
ffn = KERNEL.function
dlcore_ops, dlcore_implementations = KERNEL.dlcore_ops, KERNEL.dlcore_implementations
