"""matmul: ``a @ b`` for ``a`` of shape ``[..., M, K]`` and ``b`` of shape ``[K, N]``, in ``a``'s dtype.

``a`` is viewed as ``[rows, K]`` (its leading dimensions collapse into the rows) and the output as
``[rows, N]``. One classic tiled kernel: each program computes a ``BLOCK_M x BLOCK_N`` tile of the
output, accumulating ``BLOCK_K``-wide slices of the product in float32. The ``tl.dot`` inputs keep
the input dtype (float16 / bfloat16 tensor cores, exact float32 for float32 inputs).

The kernel exists above all for its search space: the tile sizes, the program order, the warps and
the pipelining depth of a GEMM, the pipelined tiles bounded by the device's shared memory.

Backward, with ``dc`` the output gradient viewed as ``[rows, N]``: ``da = dc @ b^T`` and
``db = a^T @ dc``, two launches of the same kernel on transposed views (it takes any strides).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from dlcore.declarations.device import DeviceProfile
from dlcore.declarations.implementation import Config, KernelCall, LaunchPlan
from dlcore.declarations.layout import as_rows
from dlcore.declarations.op import Op, TensorArg
from dlcore.declarations.signature import Signature, cdiv
from dlcore.declarations.space import Choice, Constraint, PowerOfTwo, SearchSpace, num_stages, num_warps
from dlcore.runtime.template import Backward, define_kernel

DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# The space is declared for 16-bit inputs (what GEMMs are tuned for); a float32 config that
# overflows shared memory fails to compile and the tuner records it as failed.
SPACE_ELEMENT_BYTES = 2
# float32 accumulator values per thread: above 128 the accumulator alone takes half of a thread's
# 255 registers and the kernel spills; below 16 a warp has too little of the tile to keep its
# tensor cores busy.
MAX_ACC_PER_THREAD = 128
MIN_ACC_PER_THREAD = 16


@triton.jit
def matmul_kernel(
    a_ptr, b_ptr, c_ptr,
    M, N, K,
    stride_am, stride_ak,
    stride_bk, stride_bn,
    stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Grouped order: GROUP_M row blocks sweep the column blocks together, so the b tiles they
    # share are read from L2 rather than memory.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pids_per_group = GROUP_M * num_pid_n
    first_pid_m = (pid // pids_per_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % pids_per_group) % group_size_m
    pid_n = (pid % pids_per_group) // group_size_m

    # 64-bit offsets: row * row stride, column * column stride and the K step (BLOCK_K * a K
    # stride, e.g. the row count of a column-major a) may each pass 2**31 elements.
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    stride_ak = tl.cast(stride_ak, tl.int64)
    stride_bk = tl.cast(stride_bk, tl.int64)
    mask_m = offs_m < M
    mask_n = offs_n < N

    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        # Masked-off elements load as 0, so a ragged last K slice adds nothing to the sum.
        mask_k = offs_k < K - k
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        # "ieee": exact float32 products for float32 inputs (TF32 would miss float32 tolerances);
        # float16 / bfloat16 inputs use the tensor cores either way.
        acc = tl.dot(a, b, acc, input_precision="ieee")
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def gemm_call(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, config: Config) -> KernelCall:
    """The launch of ``c = a @ b`` for 2-D ``a [M, K]``, ``b [K, N]`` and ``c [M, N]`` of any strides."""
    (m, k), n = a.shape, b.shape[1]
    block_m, block_n = config["BLOCK_M"], config["BLOCK_N"]
    return KernelCall(
        matmul_kernel, (cdiv(m, block_m) * cdiv(n, block_n),),
        (a, b, c, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1)),
        {
            "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": config["BLOCK_K"],
            "GROUP_M": config["GROUP_M"],
            "num_warps": config["num_warps"], "num_stages": config["num_stages"],
        },
    )


def output(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.empty(*a.shape[:-1], b.shape[1], dtype=a.dtype, device=a.device)


def plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    a, b = args
    out = output(a, b)
    if out.numel() == 0:
        return LaunchPlan(calls=[], result=out)
    return LaunchPlan(calls=[gemm_call(as_rows(a), b, as_rows(out), config)], result=out)


def backward_outputs(dc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(a.shape, dtype=a.dtype, device=a.device),
            torch.empty(b.shape, dtype=b.dtype, device=b.device))


def backward_plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    """The launches for ``(da, db)`` from ``args = (dc, a, b)``: ``da = dc @ b^T``, ``db = a^T @ dc``."""
    dc, a, b = args
    da, db = backward_outputs(dc, a, b)
    k = a.shape[-1]
    if da.numel() == 0 or db.numel() == 0 or dc.numel() == 0:
        return LaunchPlan(calls=[], result=(da.zero_(), db.zero_()))
    # dc comes from autograd in any layout (even expanded); reshape copies only when it must.
    dc2, a2 = dc.reshape(-1, dc.shape[-1]), as_rows(a)
    return LaunchPlan(calls=[gemm_call(dc2, b.T, da.view(-1, k), config), gemm_call(a2.T, dc2, db, config)],
                      result=(da, db))


def matmul_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` computed in float32 (or wider) and returned in ``a``'s dtype."""
    compute = torch.promote_types(a.dtype, torch.float32)
    return torch.matmul(a.to(compute), b.to(compute)).to(a.dtype)


def matmul_backward_reference(dc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dc @ b^T, a^T @ dc)`` in float32 (or wider), in the dtypes of ``a`` and ``b``."""
    compute = torch.promote_types(a.dtype, torch.float32)
    dc2 = dc.to(compute).reshape(-1, dc.shape[-1])
    da = (dc2 @ b.to(compute).T).reshape(a.shape)
    db = a.to(compute).reshape(-1, a.shape[-1]).T @ dc2
    return da.to(a.dtype), db.to(b.dtype)


def default_config(sig: Signature, profile: DeviceProfile) -> Config:
    m = sig.tensor("a").shape[0]  # rows, rounded up to a power of two
    if m <= 64:
        # Few rows (decoding): a thin row block wastes fewer masked rows, and a deeper pipeline
        # keeps the loads of b, which dominate, in flight.
        return {"BLOCK_M": max(m, 32), "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 4}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}


def _shared_memory_bytes(c: Config) -> int:
    return c["num_stages"] * (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * SPACE_ELEMENT_BYTES


def _accumulator_per_thread(c: Config) -> float:
    return c["BLOCK_M"] * c["BLOCK_N"] / (32 * c["num_warps"])


def space(profile: DeviceProfile) -> SearchSpace:
    """The tile shapes, program order, warps and pipelining depth of the GEMM; the pipelined tiles
    within the shared memory a program may use on the device (no bound where the profile knows none)."""
    shared = profile.shared_memory_per_program
    fits = [Constraint(
        f"num_stages * (BLOCK_M + BLOCK_N) * BLOCK_K * {SPACE_ELEMENT_BYTES} bytes <= {shared} "
        f"(the pipelined a and b tiles fit in shared memory)",
        lambda c: _shared_memory_bytes(c) <= shared,
    )] if shared else []
    return SearchSpace(
        [
            PowerOfTwo("BLOCK_M", 32, 256),
            PowerOfTwo("BLOCK_N", 32, 256),
            PowerOfTwo("BLOCK_K", 32, 128),
            Choice("GROUP_M", (1, 8)),
            num_warps(4, 8),
            num_stages(2, 3, 4),
        ],
        [
            *fits,
            Constraint(
                f"BLOCK_M * BLOCK_N / (32 * num_warps) <= {MAX_ACC_PER_THREAD} "
                f"(the float32 accumulator fits in registers)",
                lambda c: _accumulator_per_thread(c) <= MAX_ACC_PER_THREAD,
            ),
            Constraint(
                f"BLOCK_M * BLOCK_N / (32 * num_warps) >= {MIN_ACC_PER_THREAD} "
                f"(every warp has enough of the tile to work on)",
                lambda c: _accumulator_per_thread(c) >= MIN_ACC_PER_THREAD,
            ),
        ],
    )


def check(op: Op, args: dict[str, Any]) -> None:
    a, b = args["a"], args["b"]
    op.expect_shape("b", b, (a.shape[-1], b.shape[1]), "[K, N], K being a's last dimension")


def example(sizes: dict[str, int], dtype: torch.dtype, device: torch.device,
            generator: torch.Generator) -> tuple:
    """Random ``a [tokens, hidden]`` and ``b [hidden, inter]`` (an MLP's up projection, row-major),
    ``b`` scaled like a trained layer (variance 1/hidden) so the outputs stay O(1)."""
    tokens, hidden, inter = sizes["tokens"], sizes["hidden"], sizes["inter"]
    a = torch.randn(tokens, hidden, generator=generator)
    b = torch.randn(hidden, inter, generator=generator) / hidden**0.5
    return (a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype))


def cost(args: tuple, mode: str = "fwd") -> tuple[int, int]:
    """Forward: a and b read once, the output written once; one multiply and one add per product
    term. Backward: the output gradient, a and b read, da and db written; two such products."""
    a, b = args
    m, k = a.numel() // a.shape[-1], a.shape[-1]
    n = b.shape[1]
    nbytes = (a.numel() + b.numel() + m * n) * a.element_size()
    if mode == "bwd":
        return nbytes + (a.numel() + b.numel()) * a.element_size(), 4 * m * n * k
    return nbytes, 2 * m * n * k


OP = Op(
    name="matmul",
    args=(
        TensorArg("a", DTYPES, min_rank=2, bucket="rows"),
        TensorArg("b", DTYPES, min_rank=2, max_rank=2, same_dtype_as="a"),
    ),
    reference=matmul_reference,
    doc="a @ b for a [..., M, K] and b [K, N], in a's dtype with float32 accumulation",
    check=check,
    example=example,
    example_sizes={"tokens": 37, "hidden": 256, "inter": 96},
    cost=cost,
    baselines={"torch": lambda: torch.matmul},
)

def _gradients(backward, saved, grads, needs) -> dict:
    da, db = backward(grads[0], saved.a, saved.b)
    return {"a": da, "b": db}


KERNEL = define_kernel(
    OP, plan,
    kernels=(matmul_kernel,),
    results=output,
    default_config=default_config,
    space=space,
    backward=Backward(_gradients, saved=("a", "b"), plan=backward_plan, reference=matmul_backward_reference,
                      results=backward_outputs),
    doc="classic tiled GEMM: grouped program order, float32 accumulator, any strides; "
        "backward: the same kernel on transposed views",
)
matmul = KERNEL.function
dlcore_ops, dlcore_implementations = KERNEL.dlcore_ops, KERNEL.dlcore_implementations
