"""matmul: ``act(a @ b + bias)`` for ``a [..., M, K]``, ``b [K, N]``, ``bias [N]``, in ``a``'s dtype.

``a`` is viewed as ``[rows, K]`` (its leading dimensions collapse into the rows) and the output as
``[rows, N]``. ``b`` takes any two strides: row-major, or ``w.T`` of an nn.Linear weight
``w [N, K]`` (strides ``(1, K)``), read as it lies, no copy. ``activation`` is one of ``None``,
``"relu"``, ``"silu"``, ``"gelu_tanh"``, applied with the bias in the GEMM's epilogue.

The GEMM is :mod:`dlblas_kernels.blocks.gemm`'s: on sm_90 a persistent kernel over the multiprocessors
moving tiles through tensor descriptors, elsewhere a tiled pointer kernel, and split-K for few
rows and a long K (decoding); the config (``TMA``, ``SPLIT_K``) chooses, the heuristic default
by the row regime and a wave-count model of the device's cores (see :func:`heuristic`).

Precision: float32 accumulation. float16 / bfloat16 products on the tensor cores; float32 inputs
exact (``tl.dot(input_precision="ieee")``) unless ``allow_tf32=True``, which takes the tf32
tensor cores (10-bit mantissa products, about 3e-4 relative error: what ``torch.backends.cuda.
matmul.allow_tf32`` trades).

Backward, with ``dc`` the output gradient viewed as ``[rows, N]``: the pre-activation is
**recomputed**, not saved (saving it would cost an ``[rows, N]`` tensor per layer for the whole
backward): one GEMM of the forward's size whose epilogue writes ``dz = dc * act'(a @ b + bias)``
(without an activation ``dz = dc`` and no GEMM); then ``da = dz @ b^T``, ``db = a^T @ dz`` (as
``db^T = dz^T @ a`` when ``b`` is ``w.T``, so that ``db`` comes back in ``b``'s layout and the
copy engine stores it row by row) and ``dbias = dz.sum(0)`` (a column-sum kernel).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from dlblas_kernels.blocks import gemm
from dlcore.api import (
    Backward,
    Choice,
    Config,
    Constraint,
    DeviceProfile,
    KernelCall,
    LaunchPlan,
    Op,
    PowerOfTwo,
    ScalarArg,
    SearchSpace,
    Signature,
    TensorArg,
    as_rows,
    cdiv,
    define_kernel,
    next_power_of_2,
    num_stages,
    num_warps,
)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ACTIVATIONS = gemm.ACTIVATIONS

# The space is declared for 16-bit inputs (what GEMMs are tuned for); a float32 config that
# overflows shared memory fails to compile and the tuner records it as failed.
SPACE_ELEMENT_BYTES = 2
#: rows up to which a call counts as decoding: thin row blocks, weight streaming, split-K
DECODE_ROWS = 64

# The persistent kernel's tiles the heuristic weighs (BLOCK_M, BLOCK_N, BLOCK_K, num_warps,
# num_stages) with their throughput relative to the best at 4096 rows on sm_90 (bf16,
# .ci/sweep_gemm.py): 128x256 leads; smaller tiles pay ~7% but fill more multiprocessors
# (the two smallest, for a few hundred rows, estimated from 128 rows).
TILES = (
    ((128, 256, 64, 8, 3), 1.0),
    ((256, 128, 64, 8, 3), 0.95),
    ((128, 128, 64, 4, 4), 0.93),
    ((64, 256, 64, 4, 4), 0.93),
    ((128, 64, 128, 4, 4), 0.8),
    ((64, 64, 128, 4, 4), 0.7),
)
# the H200's dense bf16 rate per multiprocessor and copy bandwidth, for the model's time units
PEAK_FLOPS_PER_CORE = 790e12 / 132
BANDWIDTH = 3.5e12
LAUNCH_SECONDS = 3e-6


@triton.jit
def column_sum_kernel(x_ptr, out_ptr, M, N, stride_xm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``out[n] = sum_m x[m, n]`` in float32, one column block per program (unit column stride)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_n[None, :]
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for m in range(0, M, BLOCK_M):
        x = tl.load(ptrs, mask=(offs_m < M - m)[:, None] & mask_n[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32), axis=0)
        ptrs += BLOCK_M * stride_xm
    tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


def _precision(dtype: torch.dtype, allow_tf32: bool) -> str:
    return "tf32" if allow_tf32 and dtype == torch.float32 else "ieee"


def output(a: torch.Tensor, b: torch.Tensor, *_: Any) -> torch.Tensor:
    return torch.empty(*a.shape[:-1], b.shape[1], dtype=a.dtype, device=a.device)


def plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    a, b, bias, activation, allow_tf32 = args
    out = output(a, b)
    if out.numel() == 0:
        return LaunchPlan(calls=[], result=out)
    if a.shape[-1] == 0:  # no K: act(bias) from the epilogue alone, no descriptor of an empty K
        config = {**config, "TMA": 0, "SPLIT_K": 1}
    calls, scratch = gemm.gemm_calls(as_rows(a), b, as_rows(out), config, profile,
                                     epilogue=gemm.Epilogue(bias=bias, activation=activation),
                                     input_precision=_precision(a.dtype, allow_tf32))
    return LaunchPlan(calls=calls, result=out, scratch=scratch)


def backward_outputs(dc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                     activation: str | None, allow_tf32: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(da, db, dbias)``: ``db`` in ``b``'s layout (``w.T`` stays ``w.T``), ``dbias`` empty without a bias."""
    da = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    (k, n), like = b.shape, {"dtype": b.dtype, "device": b.device}
    db = torch.empty(n, k, **like).T if b.stride(0) == 1 and b.stride(1) != 1 else torch.empty(k, n, **like)
    dbias = torch.empty(n if bias is not None else 0, **like)
    return da, db, dbias


def column_sum_call(x: torch.Tensor, out: torch.Tensor) -> KernelCall:
    block_n = 64
    return KernelCall(column_sum_kernel, (cdiv(x.shape[1], block_n),), (x, out, x.shape[0], x.shape[1], x.stride(0)),
                      {"BLOCK_M": 32, "BLOCK_N": block_n, "num_warps": 4})


def backward_plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    """The launches for ``(da, db, dbias)`` from ``args = (dc, a, b, bias, activation, allow_tf32)``
    (see the module doc); ``config`` is the forward's, for the GEMM of the forward's shape."""
    dc, a, b, bias, activation, allow_tf32 = args
    da, db, dbias = backward_outputs(*args)
    (k, n), rows = b.shape, a.numel() // max(a.shape[-1], 1)
    if rows == 0 or n == 0:
        return LaunchPlan(calls=[], result=(da.zero_(), db.zero_(), dbias.zero_()))
    precision = _precision(a.dtype, allow_tf32)
    a2 = as_rows(a)
    # dc comes from autograd in any layout (even expanded): the GEMMs take a row-major one.
    dc2 = dc.reshape(-1, n)
    if dc2.stride(1) != 1 or dc2.stride(0) != n:
        dc2 = dc2.contiguous()
    calls: list[KernelCall] = []
    scratch: list[torch.Tensor] = []
    if activation is None:
        dz = dc2
    else:
        dz = torch.empty(rows, n, dtype=dc.dtype, device=dc.device)
        found, extra = gemm.gemm_calls(a2, b, dz, config, profile, input_precision=precision,
                                       epilogue=gemm.Epilogue(bias=bias, activation=activation, act_grad=dc2))
        calls += found
        scratch += [dz, *extra]
    if k:
        found, extra = gemm.gemm_calls(dz, b.T, da.view(rows, k), heuristic(rows, k, n, profile, a.element_size()),
                                       profile, input_precision=precision)
        calls += found
        scratch += extra
        if db.stride(0) == 1 and db.stride(1) != 1:  # db^T = dz^T @ a, row-major
            operands = (dz.T, a2, db.T)
        else:
            operands = (a2.T, dz, db)
        out_rows, out_cols = operands[2].shape
        found, extra = gemm.gemm_calls(*operands, heuristic(out_rows, out_cols, rows, profile, a.element_size()),
                                       profile, input_precision=precision)
        calls += found
        scratch += extra
    else:
        da.zero_()
        db.zero_()
    if bias is not None:
        calls.append(column_sum_call(dz, dbias))
    return LaunchPlan(calls=calls, result=(da, db, dbias), scratch=tuple(scratch))


def matmul_reference(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
                     activation: str | None = None, allow_tf32: bool = False) -> torch.Tensor:
    """``act(a @ b + bias)`` computed in float32 (or wider) and returned in ``a``'s dtype."""
    compute = torch.promote_types(a.dtype, torch.float32)
    z = torch.matmul(a.to(compute), b.to(compute))
    if bias is not None:
        z = z + bias.to(compute)
    return activate(z, activation).to(a.dtype)


def activate(z: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation == "relu":
        return torch.relu(z)
    if activation == "silu":
        return torch.nn.functional.silu(z)
    if activation == "gelu_tanh":
        return torch.nn.functional.gelu(z, approximate="tanh")
    return z


def activation_grad(z: torch.Tensor, activation: str | None) -> torch.Tensor:
    """``act'(z)``, written out (a custom op's body records no autograd graph to differentiate)."""
    if activation == "relu":
        return (z > 0).to(z.dtype)
    if activation == "silu":
        s = torch.sigmoid(z)
        return s * (1 + z * (1 - s))
    if activation == "gelu_tanh":
        c = math.sqrt(2 / math.pi)
        t = torch.tanh(c * (z + 0.044715 * z**3))
        return 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * c * (1 + 3 * 0.044715 * z * z)
    return torch.ones_like(z)


def matmul_backward_reference(dc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                              activation: str | None, allow_tf32: bool
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(da, db, dbias)`` in float32 (or wider), in the inputs' dtypes (``dbias`` empty without a
    bias): ``dz = dc * act'(a @ b + bias)``, ``da = dz @ b^T``, ``db = a^T @ dz``, ``dbias = sum dz``."""
    compute = torch.promote_types(a.dtype, torch.float32)
    a2, bf = a.to(compute).reshape(-1, a.shape[-1]), b.to(compute)
    z = a2 @ bf
    if bias is not None:
        z = z + bias.to(compute)
    dz = dc.to(compute).reshape(z.shape) * activation_grad(z, activation)
    da = (dz @ bf.T).reshape(a.shape)
    dbias = dz.sum(0).to(b.dtype) if bias is not None else torch.empty(0, dtype=b.dtype, device=b.device)
    return da.to(a.dtype), (a2.T @ dz).to(b.dtype), dbias


def _tile(block_m: int, block_n: int, block_k: int, warps: int, stages: int, **extra: int) -> Config:
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": warps, "num_stages": stages,
            "SPLIT_K": 1, "TMA": 1, "WARP_SPECIALIZE": 0, **extra}


def heuristic(m: int, n: int, k: int, profile: DeviceProfile | None, element_size: int = 2) -> Config:
    """A config for ``[m, k] @ [k, n]`` on the device of ``profile``; the rules follow sweeps of the
    LLM presets (bf16, `python3 .ci/sweep_gemm.py sweep|bench`).

    - Decoding (``m <= 64``): the time is reading ``b`` once. A row block of the rows (16 at least,
      what ``tl.dot`` takes), 64-column tiles; split-K by 4 when the column tiles fill under half
      the multiprocessors (and K gives each split 8 steps); K steps of 256 for rows of ``b`` of
      8192 and more (more bytes in flight per program), else 128 (pointer kernel, 4 stages).
    - A few hundred rows (``m <= 512``): too few output tiles to fill the chip with the large
      tiles. K of 2048 or less at up to 128 rows: the pointer kernel's 64x128 tiles. Otherwise the
      persistent descriptor kernel's tile (no taller than the rows) and split (1 or 2) making the
      most work units within one wave (1.15 x ``cores``), ties to the larger tile, then to no split.
    - More rows, or nothing fits one wave: the persistent tile (and split) of least modelled time:
      waves of ``cores`` programs, each tile's FLOPs over the tile's measured rate, plus the
      split-K reduce's traffic.
    Configs whose tiles overflow the profile's shared memory are never chosen.
    """
    cores = profile.cores if profile is not None else 0
    limit = profile.shared_memory_per_program if profile is not None else 0
    narrow = element_size > 2  # float32 tiles take twice the shared memory: half the K step

    def fits(config: Config) -> bool:
        return not limit or gemm.shared_memory_bytes(config, element_size) <= limit

    if m <= DECODE_ROWS:
        block_m = max(16, next_power_of_2(m))
        tiles = cdiv(m, block_m) * cdiv(n, 64)
        if cores and 2 * tiles <= cores and k >= 4 * 8 * 128:
            return _tile(block_m, 64, 64 if narrow else 128, 4, 4, SPLIT_K=4, TMA=0)
        if k >= 8192 and block_m <= 32:
            return _tile(block_m, 64, 128 if narrow else 256, 4, 3, TMA=0)
        return _tile(block_m, 64, 64 if narrow else 128, 4, 4, TMA=0)
    if profile is None or profile.arch not in gemm.TMA_ARCHS or not cores:
        return _tile(128, 128, 32 if narrow else 64, 8, 3, TMA=0)
    if m <= 128 and k <= 2048:
        return _tile(64, 128, 64 if narrow else 128, 4, 4, TMA=0)
    if m <= 512:
        one_wave = []
        for (block_m, block_n, block_k, warps, stages), _ in TILES:
            for split in (1, 2):
                config = _tile(block_m, block_n, block_k // 2 if narrow else block_k, warps, stages, SPLIT_K=split)
                units = cdiv(m, block_m) * cdiv(n, block_n) * split
                if block_m <= m and fits(config) and units <= 1.15 * cores and k >= split * 8 * block_k:
                    one_wave.append((units, block_m * block_n, -split, config))
        if one_wave:
            return max(one_wave, key=lambda found: found[:3])[3]
    best: tuple[float, Config] | None = None
    for (block_m, block_n, block_k, warps, stages), rate in TILES:
        tiles = cdiv(m, block_m) * cdiv(n, block_n)
        for split in (1, 2, 4):
            config = _tile(block_m, block_n, block_k // 2 if narrow else block_k, warps, stages, SPLIT_K=split)
            if not fits(config) or (split > 1 and k < split * 8 * block_k):
                continue
            waves = math.ceil(tiles * split / cores)
            seconds = waves * 2 * block_m * block_n * k / split / (rate * PEAK_FLOPS_PER_CORE)
            if split > 1:
                seconds += (split + 1) * m * n * 4 / BANDWIDTH + LAUNCH_SECONDS
            if best is None or seconds < best[0]:
                best = (seconds, config)
    return best[1]


def default_config(sig: Signature, profile: DeviceProfile) -> Config:
    a, b = sig.tensor("a"), sig.tensor("b")
    rows = a.shape[0]  # rounded up to a power of two
    return heuristic(rows, b.shape[1], b.shape[0], profile, a.dtype.itemsize)


def _shared_memory_bytes(c: Config) -> int:
    return gemm.shared_memory_bytes(c, SPACE_ELEMENT_BYTES)


def space(profile: DeviceProfile) -> SearchSpace:
    """The tile shapes, warps and pipelining depth of the GEMM (the grouped program order fixed at
    groups of 8 row blocks, :data:`dlblas_kernels.blocks.gemm.GROUP_M`), the persistent
    descriptor kernel or the pointer kernel (``TMA``; the descriptor kernel runs on sm_90 only,
    elsewhere TMA=1 runs the pointer kernel), the descriptor kernel warp-specialised or not, and
    split-K; the pipelined tiles within the shared memory a program may use on the device (no
    bound where the profile knows none)."""
    shared = profile.shared_memory_per_program
    fits = [Constraint(
        f"(num_stages * (BLOCK_M + BLOCK_N) * BLOCK_K + TMA * BLOCK_M * BLOCK_N * (2 if SPLIT_K > 1 else 1)) * "
        f"{SPACE_ELEMENT_BYTES} bytes <= {shared} (the pipelined a and b tiles and the staged output tile fit in "
        f"shared memory)",
        lambda c: _shared_memory_bytes(c) <= shared,
    )] if shared else []
    return SearchSpace(
        [
            PowerOfTwo("BLOCK_M", 16, 256),
            PowerOfTwo("BLOCK_N", 32, 256),
            PowerOfTwo("BLOCK_K", 32, 256),
            num_warps(4, 8),
            num_stages(3, 4, 5),
            Choice("SPLIT_K", (1, 2, 4, 8)),
            Choice("TMA", (0, 1)),
            Choice("WARP_SPECIALIZE", (0, 1)),
        ],
        [
            *fits,
            *gemm.accumulator_constraints(),
            Constraint("BLOCK_K <= 128 or BLOCK_M <= 32 (K steps of 256 only for the thin tiles of decoding)",
                       lambda c: c["BLOCK_K"] <= 128 or c["BLOCK_M"] <= 32),
            *gemm.kernel_constraints(),
            *gemm.warp_specialize_constraints(profile),
        ],
    )


def check(op: Op, args: dict[str, Any]) -> None:
    a, b, bias = args["a"], args["b"], args["bias"]
    op.expect_shape("b", b, (a.shape[-1], b.shape[1]), "[K, N], K being a's last dimension")
    if bias is not None:
        op.expect_shape("bias", bias, (b.shape[1],), "[N], one per column of b")


def example(sizes: dict[str, int], dtype: torch.dtype, device: torch.device,
            generator: torch.Generator) -> tuple:
    """Random ``a [tokens, hidden]`` and ``b = w.T`` of an nn.Linear weight ``w [inter, hidden]``
    scaled like a trained layer (variance 1/hidden) so the outputs stay O(1); no bias, no activation."""
    tokens, hidden, inter = sizes["tokens"], sizes["hidden"], sizes["inter"]
    a = torch.randn(tokens, hidden, generator=generator)
    w = torch.randn(inter, hidden, generator=generator) / hidden**0.5
    return (a.to(device=device, dtype=dtype), w.to(device=device, dtype=dtype).T, None, None, False)


def cost(args: tuple, mode: str = "fwd") -> tuple[int, int]:
    """Forward: a, b (and bias) read once, the output written once; one multiply and one add per
    product term. Backward: the output gradient, a and b read, da and db written; two such
    products (three with an activation: the pre-activation is recomputed)."""
    a, b, bias, activation = args[:4]
    m, k = a.numel() // max(a.shape[-1], 1), a.shape[-1]
    n = b.shape[1]
    extra = n * a.element_size() if bias is not None else 0
    nbytes = (a.numel() + b.numel() + m * n) * a.element_size() + extra
    if mode == "bwd":
        products = 3 if activation is not None else 2
        return nbytes + (a.numel() + b.numel()) * a.element_size() + extra, 2 * products * m * n * k
    return nbytes, 2 * m * n * k


OP = Op(
    name="matmul",
    args=(
        TensorArg("a", DTYPES, min_rank=2, bucket="rows"),
        TensorArg("b", DTYPES, min_rank=2, max_rank=2, same_dtype_as="a"),
        TensorArg("bias", DTYPES, max_rank=1, same_dtype_as="a", optional=True, layouts=("contiguous",)),
        ScalarArg("activation", (str, type(None)), default=None, keyed=True, choices=ACTIVATIONS),
        ScalarArg("allow_tf32", (bool,), default=False, keyed=True),
    ),
    reference=matmul_reference,
    doc="act(a @ b + bias) for a [..., M, K], b [K, N] (row-major or w.T), bias [N]; float32 accumulation",
    check=check,
    example=example,
    example_sizes={"tokens": 37, "hidden": 256, "inter": 96},
    example_paths={"split-K": {"tokens": 1, "hidden": 8192, "inter": 256},
                   "tiles": {"tokens": 300, "hidden": 256, "inter": 512}},
    cost=cost,
    baselines={"torch": lambda: torch_matmul},
)


def torch_matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
                 activation: str | None = None, allow_tf32: bool = False) -> torch.Tensor:
    """What a model runs in eager torch (cuBLAS): ``act(a @ b + bias)``."""
    z = torch.matmul(a, b) if bias is None else torch.addmm(bias, a.reshape(-1, a.shape[-1]), b).view(
        *a.shape[:-1], b.shape[1])
    return activate(z, activation)


def _gradients(backward, saved, grads, needs) -> dict:
    da, db, dbias = backward(grads[0], saved.a, saved.b, saved.bias, saved.activation, saved.allow_tf32)
    return {"a": da, "b": db, "bias": dbias if saved.bias is not None else None}


KERNEL = define_kernel(
    OP, plan,
    kernels=(*gemm.KERNELS, column_sum_kernel),
    results=output,
    default_config=default_config,
    space=space,
    backward=Backward(_gradients, saved=("a", "b", "bias", "activation", "allow_tf32"), plan=backward_plan,
                      reference=matmul_backward_reference, results=backward_outputs),
    doc="the GEMM block: persistent tensor-descriptor kernel on sm_90, tiled pointers elsewhere, split-K for "
        "decoding; bias and activation in the epilogue; backward recomputes the pre-activation",
)
matmul = KERNEL.function
dlcore_ops, dlcore_implementations = KERNEL.dlcore_ops, KERNEL.dlcore_implementations
