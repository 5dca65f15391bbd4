"""The GEMM building block: ``c = epilogue(a @ b)`` for every GEMM of dlblas-kernels.

One tile loop, written in two kernels (tensor descriptors, pointers), either of them split along
K, chosen per call from the config and the device profile:

- **tensor descriptors, persistent** (:func:`gemm_tma_kernel`): on Hopper (``profile.arch ==
  "sm_90"``) when every operand suits the bulk tensor copy engine (16-byte aligned base, unit
  inner stride, other strides multiples of 16 bytes; ``a`` and ``b`` either way round: an
  nn.Linear weight's ``w.T`` is read through a ``[N, K]`` descriptor, a transposed ``a`` through
  a ``[K, M]`` one). ``min(units, profile.cores * OCCUPANCY)`` programs, each walking the output tiles
  ``pid, pid + programs, ...`` in the grouped order, the tiles loaded
  through descriptors built on the device (``tl.make_tensor_descriptor``, which asks Triton's
  allocator for 128 bytes of global memory per descriptor and program: dlcore's
  :func:`~dlcore.runtime.allocator.ensure_allocator` installs one backed by torch where none is
  set, before the plan and before every launch of such a kernel, whatever the thread).
  ``WARP_SPECIALIZE`` (a config's, default off) warp-specialises the persistent tile loop: Triton
  (3.6 and 3.9, sm_90) then gives the program a producer partition issuing the copies and two
  consumer warpgroups of 4 warps, each taking half of the tile's rows, so that one consumer's
  epilogue or block-scale arithmetic runs while the other's ``wgmma`` does (the ping-pong of
  FlashAttention-3 and DeepGEMM). Triton does so only for 4-warp programs whose tile loop is not
  flattened (with ``FLATTEN`` or 8 warps the cubin is the one without it, so a warp-specialised
  loop is never flattened), and fails to compile 64 x 256 tiles so
  (:func:`warp_specialize_constraints`). The descriptors
  are made in the kernel, not on the host, because a launch's arguments must stay plain tensors
  and numbers: dlcore's launch templates replay a launch with new tensors in the same slots,
  which a host-side descriptor (holding its tensor) would defeat.
- **pointers** (:func:`gemm_kernel`): everything else, the interpreter included (pre-Hopper chips,
  strides or alignments the copy engine cannot take): one program per output tile, masked loads
  of any strides, software-pipelined by Triton (``num_stages``).
- **split-K** (``SPLIT_K > 1``, either kernel): for few rows and a long K (decoding, a few
  hundred rows), where the output tiles alone are too few to keep every multiprocessor busy.
  Each of ``SPLIT_K`` work units per tile sums one K range into a float32 workspace
  ``[SPLIT_K, M, N]`` (a plan's scratch); :func:`splitk_reduce_kernel` adds the slices and
  applies the epilogue (deterministic: no atomics).

The heuristics that choose among them for ``matmul`` live in
:func:`dlblas_kernels.kernels.matmul.heuristic`; :func:`shared_memory_bytes` is what a config
takes of shared memory (the spaces' constraint), and the descriptor kernel drops pipeline stages
of a config that would not fit beside its epilogue.

The epilogue, selected by constexprs, runs in float32 on the accumulator before the one store:

    z   = acc * scale[m]  (HAS_SCALE)  * col_scale[n]  (HAS_COL_SCALE)  + bias[n]  (HAS_BIAS)
                                       float32 scales of any stride; stride 0: one for the tensor
    out = act(z)                       act in None, "relu", "silu", "gelu_tanh"
    out = silu(z) * z3                 SWIGLU: z3 from a second operand b3 accumulated alongside
    out = dc * act'(z)                 ACT_GRAD: the gradient through the activation (backward)
    c   = out cast to c's dtype; z (and z3) stored too when pre-activations are asked for
    c   = (c + out) cast to c's dtype instead, under ACCUMULATE (a sum over row chunks)

**fp8** (``fp8_gemm``, e4m3 operands): the same two kernels and loops with ``tl.dot`` on fp8
tiles (sm_89 and later; Hopper's ``wgmma`` takes 8-bit tiles K-major only, so the descriptor
kernel runs fp8 only for a row-major ``a`` and ``b = w.T`` of an nn.Linear weight, the pointer
kernel anything else). Per-tensor and per-row dequantisation scales are the epilogue's row and
column scales (a 0-dim scale read with stride 0). Blockwise scales (DeepSeek-V3: ``a_scale [M,
ceil(K/128)]`` per 1x128 of a row, ``b_scale [ceil(N/128), ceil(K/128)]`` per 128x128 block of
``b``; :class:`BlockScales`) are the loop's constexpr ``BLOCK_SCALED``: each K step's product is
summed on its own and added scaled by its block's scales (:func:`block_scaled_dot`), which needs
``BLOCK_K`` dividing 128 (a step inside one K block) and ``BLOCK_N`` dividing 128 or of 256 (one
or two b-scales per tile: scalar loads per step rather than a vector of per-column ones); under split-K the slices
are scaled before the reduce. The row scales of a tile are one load per step: an M-major
``a_scale`` (what ``quantize_fp8`` gives) makes it coalesced. For non-fp8 calls the new
constexprs are off and the kernels compile as before (unused scale pointers and strides).

How the later GEMMs use it:

- **MoE** (grouped GEMM): the rows of ``a`` come sorted by expert; a table of (expert, row
  block) pairs replaces the grouped order's ``tile -> (pid_m, pid_n)`` map, ``b`` is offset by
  the expert's weight in the loop's first descriptor / pointer, and the routing weight of each
  row is the row scale. The persistent loop walks that table instead of the rectangle.

Host side, :func:`gemm_calls` turns operands, outputs, epilogue and a config into the
:class:`~dlcore.declarations.implementation.KernelCall` list (and the scratch tensors) of a
launch plan; :func:`swiglu_calls` / :func:`swiglu` are the prefill ffn's entry point (on sm_90 its
pair-tile kernel, :mod:`dlblas_kernels.blocks.swiglu_pair`, built on this module's loop pieces).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dlblas_kernels.blocks.gemm_kernels import KERNELS as KERNELS
from dlblas_kernels.blocks.gemm_kernels import SCALE_BLOCK as SCALE_BLOCK
from dlblas_kernels.blocks.gemm_kernels import activate as activate
from dlblas_kernels.blocks.gemm_kernels import activation_grad as activation_grad
from dlblas_kernels.blocks.gemm_kernels import block_scaled_dot as block_scaled_dot
from dlblas_kernels.blocks.gemm_kernels import dot_range as dot_range
from dlblas_kernels.blocks.gemm_kernels import dot_range_pair as dot_range_pair
from dlblas_kernels.blocks.gemm_kernels import epilogue as epilogue
from dlblas_kernels.blocks.gemm_kernels import gemm_kernel as gemm_kernel
from dlblas_kernels.blocks.gemm_kernels import gemm_tma_kernel as gemm_tma_kernel
from dlblas_kernels.blocks.gemm_kernels import grouped_tile as grouped_tile
from dlblas_kernels.blocks.gemm_kernels import splitk_reduce_kernel as splitk_reduce_kernel
from dlblas_kernels.blocks.gemm_kernels import store_tile as store_tile
from dlcore.api import Config, Constraint, DeviceProfile, KernelCall, LaunchPlan, cdiv, ensure_allocator

#: what ``activation`` may be
ACTIVATIONS = (None, "relu", "silu", "gelu_tanh")
#: the architectures whose programs take the tensor-descriptor (TMA) path
TMA_ARCHS = ("sm_90",)
#: row blocks per group of the grouped program order where a config names none
GROUP_M = 8
#: the copy engine's alignment of a base address and of every stride but the unit one, in bytes
TMA_ALIGNMENT = 16
#: the fp8 formats ``tl.dot`` takes on the tensor cores (sm_89 and later)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)




# --- host side -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Epilogue:
    """What :func:`gemm_calls` applies to the float32 tile before the store (see the module doc).

    :param bias: ``[N]``, added after the scales.
    :param activation: one of :data:`ACTIVATIONS`.
    :param row_scale: ``[M]`` float32 of any stride, multiplies row ``m`` of the product (and of
        ``b3``'s); 0-dim: one scale for every row (a per-tensor scale).
    :param col_scale: ``[N]`` float32 of any stride, multiplies column ``n`` (not with ``b3``); 0-dim:
        one for every column. With ``row_scale``, the dequantisation of per-row / per-tensor fp8.
    :param act_grad: ``dc [M, N]`` with the output's strides: the output is ``dc * act'(z)``.
    :param pre: ``[M, N]`` with the output's strides: receives ``z`` (the pre-activation).
    :param pre3: with ``pre``, under SwiGLU: receives ``z3``.
    :param accumulate: ``c`` receives its old value plus the result (added in float32; a sum over
        row chunks, such as a weight gradient); not under split-K.
    """

    bias: torch.Tensor | None = None
    activation: str | None = None
    row_scale: torch.Tensor | None = None
    col_scale: torch.Tensor | None = None
    act_grad: torch.Tensor | None = None
    pre: torch.Tensor | None = None
    pre3: torch.Tensor | None = None
    accumulate: bool = False


@dataclass(frozen=True)
class BlockScales:
    """DeepSeek-V3's blockwise dequantisation scales, float32 of any strides, applied to each K
    step's product inside the loop (see the module doc).

    :param a: ``[M, ceil(K/128)]``: one scale per 1x128 of a row of ``a``.
    :param b: ``[ceil(N/128), ceil(K/128)]``: one per 128x128 block of ``b`` (``b``'s columns by K).
    """

    a: torch.Tensor
    b: torch.Tensor


def _scale_stride(t: torch.Tensor | None) -> int:
    """The stride of a row or column scale: its own for a vector, 0 for a 0-dim (per-tensor) one."""
    return 0 if t is None or t.dim() == 0 else t.stride(0)


def tma_aligned(t: torch.Tensor) -> bool:
    """``t`` is 2-D with a unit inner stride, its base and outer stride 16-byte aligned."""
    size = t.element_size()
    return (t.dim() == 2 and t.stride(1) == 1 and t.data_ptr() % TMA_ALIGNMENT == 0
            and (t.stride(0) * size) % TMA_ALIGNMENT == 0)


def transposed(t: torch.Tensor) -> bool | None:
    """How the copy engine reads 2-D ``t``: False row by row, True as ``t.T`` row by row, None not at all."""
    if tma_aligned(t):
        return False
    return True if tma_aligned(t.T) else None


def takes_tma(profile: DeviceProfile, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
              b3: torch.Tensor | None = None, epilogue: Epilogue = Epilogue()) -> bool:
    """Whether the persistent tensor-descriptor kernel can run ``c = a @ b`` (and ``b3``) here:
    a Hopper profile with its core count, and operands the copy engine takes (``a``, ``b`` and
    ``b3`` either way round, ``b3`` as ``b``; ``c`` row-major; ``dc`` and the pre-activations with
    ``c``'s strides; fp8 ``a`` K-major and ``b`` given as ``w.T``)."""
    if profile.arch not in TMA_ARCHS or profile.cores <= 0:
        return False
    if transposed(a) is None or transposed(b) is None or not tma_aligned(c):
        return False
    if a.dtype in FP8_DTYPES and (transposed(a) or not transposed(b)):
        return False  # wgmma takes 8-bit operands K-major only: a row-major, b = w.T
    if b3 is not None and transposed(b3) != transposed(b):
        return False
    outputs = (epilogue.pre, epilogue.pre3, epilogue.act_grad)
    return all(t is None or (t.stride() == c.stride() and t.data_ptr() % TMA_ALIGNMENT == 0) for t in outputs)


def shared_memory_bytes(config: Config, element_size: int = 2, *, second_operand: bool = False,
                        act_grad: bool = False, out_element_size: int | None = None) -> int:
    """What one program of ``config`` takes of shared memory, as Triton 3.6 lays it out for sm_90
    (read off compiled kernels): the pipelined operand tiles (``element_size`` bytes an element),
    and for the descriptor kernel (``TMA``) the output tile staged for its store
    (``out_element_size``, default ``element_size``; float32 under split-K, where it also passes
    through shared memory) plus as much again for an ``act_grad`` tile or the old output of an
    ``accumulate`` epilogue (loaded by pointers and converted to the accumulator's layout; bounded
    from above: the dweight GEMM of fused_linear_cross_entropy at 128 x 256, 3 stages, asked
    278 600 bytes, which is this count plus 72)."""
    stages, block_m, block_n = config["num_stages"], config["BLOCK_M"], config["BLOCK_N"]
    loads = stages * (block_m + block_n * (2 if second_operand else 1)) * config["BLOCK_K"] * element_size
    if not config.get("TMA", 1):
        return loads
    if config.get("SPLIT_K", 1) > 1:
        return loads + block_m * block_n * 4
    return loads + block_m * block_n * (out_element_size or element_size) * (2 if act_grad else 1)


#: float32 accumulator values per thread a tile may take: above 128 the accumulator alone takes half
#: of a thread's 255 registers and the kernel spills; below 8 a warp has too little of the tile to work on
MAX_ACC_PER_THREAD = 128
MIN_ACC_PER_THREAD = 8


#: the consumer warpgroups of a warp-specialised descriptor-kernel program (Triton's split of the tile's rows)
WS_CONSUMERS = 2


def accumulator_per_thread(config: Config) -> float:
    """The float32 accumulator values each thread of a ``config`` program holds (under
    ``WARP_SPECIALIZE``, each of the :data:`WS_CONSUMERS` warpgroups holds its share of the tile)."""
    consumers = WS_CONSUMERS if config.get("WARP_SPECIALIZE", 0) else 1
    return config["BLOCK_M"] * config["BLOCK_N"] / (32 * config["num_warps"] * consumers)


def accumulator_constraints() -> list[Constraint]:
    """A GEMM space's bounds on :func:`accumulator_per_thread`."""
    return [
        Constraint(f"BLOCK_M * BLOCK_N / (32 * num_warps) <= {MAX_ACC_PER_THREAD} "
                   f"(the float32 accumulator fits in registers)",
                   lambda c: accumulator_per_thread(c) <= MAX_ACC_PER_THREAD),
        Constraint(f"BLOCK_M * BLOCK_N / (32 * num_warps) >= {MIN_ACC_PER_THREAD} "
                   f"(every warp has enough of the tile to work on)",
                   lambda c: accumulator_per_thread(c) >= MIN_ACC_PER_THREAD),
    ]


def kernel_constraints() -> list[Constraint]:
    """A GEMM space's rules for ``SPLIT_K`` and ``TMA`` (the kernel a config picks)."""
    return [
        Constraint("SPLIT_K == 1 or BLOCK_M <= 128 (split-K is for few rows)",
                   lambda c: c["SPLIT_K"] == 1 or c["BLOCK_M"] <= 128),
        Constraint("TMA == 0 or BLOCK_M >= 64 (the descriptor kernel's wgmma takes 64 rows a warpgroup)",
                   lambda c: c["TMA"] == 0 or c["BLOCK_M"] >= 64),
    ]


#: shared memory the hardware keeps back per resident program on sm_90 (what two programs of one
#: multiprocessor leave each other: 228 KiB a multiprocessor, 227 KiB a program at most)
RESERVED_SHARED_BYTES = 1024
#: registers a thread takes beside its accumulators (addresses, indices, scales; read off the
#: compiled fp8 kernels: 175 registers at 64 float32 values of each of two accumulators a thread)
OTHER_REGISTERS = 48


def occupancy_constraints(profile: DeviceProfile | None, footprint: Callable[[Config], int],
                          accumulators: int = 1) -> list[Constraint]:
    """A persistent space's rule for ``OCCUPANCY`` (programs resident on one multiprocessor, see
    :func:`gemm_calls`): above 1, that many programs' shared memory (``footprint``, plus what the
    hardware keeps back for each) and registers (``accumulators`` float32 tiles a thread, beside
    :data:`OTHER_REGISTERS`) fit on one multiprocessor, and the config is the descriptor kernel's
    (the pointer kernel launches a program a tile: as many stay resident as fit)."""
    shared = profile.shared_memory_per_program if profile is not None else 0
    registers = profile.registers_per_core if profile is not None else 0

    def fits(c: Config) -> bool:
        occupancy = c.get("OCCUPANCY", 1)
        if occupancy == 1:
            return True
        per_thread = accumulators * accumulator_per_thread(c) + OTHER_REGISTERS
        return (c["TMA"] == 1 and (not shared or occupancy * (footprint(c) + RESERVED_SHARED_BYTES)
                                   <= shared + RESERVED_SHARED_BYTES)
                and (not registers or occupancy * 32 * c["num_warps"] * per_thread <= registers))
    return [Constraint(f"OCCUPANCY == 1 or (TMA == 1 and OCCUPANCY programs' shared memory ({shared} bytes and "
                       f"{RESERVED_SHARED_BYTES} kept back each) and registers ({registers}) fit one multiprocessor)",
                       fits)]


def warp_specialize_constraints(profile: DeviceProfile | None) -> list[Constraint]:
    """A space's rule for ``WARP_SPECIALIZE``: only where Triton specialises the loop (the
    descriptor kernel, so a profile of :data:`TMA_ARCHS` or none known; 4 warps; rows for two
    64-row consumer warpgroups: 64 x 256 tiles do not compile so), so that no config repeats
    another's cubin under another name."""
    if profile is not None and profile.arch not in TMA_ARCHS:
        return [Constraint(f"WARP_SPECIALIZE == 0 (only the descriptor kernel of {', '.join(TMA_ARCHS)} takes it)",
                           lambda c: not c.get("WARP_SPECIALIZE", 0))]
    return [
        Constraint("WARP_SPECIALIZE == 0 or (TMA == 1 and num_warps == 4 and BLOCK_M >= 128) (Triton "
                   "warp-specialises 4-warp descriptor-kernel programs, their rows split between two "
                   "64-row warpgroups)",
                   lambda c: not c.get("WARP_SPECIALIZE", 0) or (c["TMA"] == 1 and c["num_warps"] == 4
                                                                 and c["BLOCK_M"] >= 128)),
    ]


def fit_stages(config: Config, limit: int, footprint: Callable[[Config], int]) -> Config:
    """``config`` with one pipelining stage less at a time, down to 2, while ``footprint(config)``
    (the shared memory one program takes, e.g. :func:`shared_memory_bytes`) passes ``limit``
    (0: no bound). A new dict; ``config`` is not changed."""
    config = dict(config)
    while limit and config["num_stages"] > 2 and footprint(config) > limit:
        config["num_stages"] -= 1
    return config


def loop_flags(config: Config, store_pre: bool = False, eight_bit: bool = False) -> dict[str, bool]:
    """The descriptor kernel's ``FLATTEN`` and ``WARP_SPECIALIZE`` from ``config`` (defaults 1 and
    0): a warp-specialised loop is never flattened (Triton would drop the specialisation), never
    stores pre-activations (``store_pre``: a specialised program stages those stores apart, 64 KiB
    more shared memory at 128 x 128 than :func:`shared_memory_bytes` counts; 197 080 bytes in 2
    stages, 262 808 in 3), and never takes 8-bit operands (``eight_bit``: on sm_90 with Triton 3.6.0
    the specialised loop over fp8 tiles gives wrong products at the DeepSeek-V3 shapes of
    ``.ci/sweep_fp8_gemm.py``, where over bf16 tiles it is right; docs/performance.md, Other
    measurements)."""
    specialise = bool(config.get("WARP_SPECIALIZE", 0)) and not store_pre and not eight_bit
    return {"FLATTEN": bool(config.get("FLATTEN", 1)) and not specialise, "WARP_SPECIALIZE": specialise}


def _check_combination(e: Epilogue, swiglu: bool, split_k: int, block_scales: BlockScales | None, block_k: int,
                       block_n: int) -> None:
    """A ``ValueError`` for what :func:`gemm_calls` cannot combine (see its parameters)."""
    if e.activation not in ACTIVATIONS:
        raise ValueError(f"activation {e.activation!r} is none of {ACTIVATIONS}")
    if split_k > 1 and (swiglu or e.pre is not None or e.accumulate):
        raise ValueError("split-K takes no second operand, stores no pre-activations and does not accumulate")
    if (e.col_scale is not None or block_scales is not None) and swiglu:
        raise ValueError("column and block scales take no second operand")
    if block_scales is not None:
        if e.row_scale is not None or e.col_scale is not None:
            raise ValueError("block scales replace the epilogue's row and column scales")
        if SCALE_BLOCK.value % block_k or (SCALE_BLOCK.value % block_n and block_n != 2 * SCALE_BLOCK.value):
            raise ValueError(f"block scales need BLOCK_K dividing {SCALE_BLOCK.value} (one K block per step) and "
                             f"BLOCK_N dividing it or of {2 * SCALE_BLOCK.value} (one or two column blocks per tile), "
                             f"not {block_k} and {block_n}")


def _tma_call(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, tensors: tuple, swiglu: bool, e: Epilogue,
              config: Config, tile: dict, flags: dict, scale_strides: tuple, programs: int,
              profile: DeviceProfile) -> KernelCall:
    """The persistent descriptor kernel's launch (:func:`gemm_calls`): ``tensors`` are ``(b3, target,
    pre, pre3, dc, bias, scale, col)``, each a tensor (``c`` where absent)."""
    b3, target, *rest = tensors
    ensure_allocator()

    # A config tuned for the plain product may not fit beside an epilogue's tiles (the backward's
    # act_grad, an accumulated output's old value): one pipeline stage less at a time until it does.
    def footprint(tiles: Config) -> int:
        return shared_memory_bytes(tiles, a.element_size(), second_operand=swiglu,
                                   act_grad=e.act_grad is not None or e.accumulate, out_element_size=c.element_size())

    tile = {**tile, "num_stages": fit_stages({**config, **tile}, profile.shared_memory_per_program,
                                             footprint)["num_stages"]}
    a_m_major, b_k_major = bool(transposed(a)), bool(transposed(b))
    stride_a = a.stride(1) if a_m_major else a.stride(0)
    stride_b = b.stride(1) if b_k_major else b.stride(0)
    stride_b3 = (b3.stride(1) if b_k_major else b3.stride(0)) if swiglu else stride_b
    (m, k), n = a.shape, b.shape[1]
    return KernelCall(gemm_tma_kernel, (programs,), (
        a, b, b3, target, *rest, m, n, k, stride_a, stride_b, stride_b3, c.stride(0), *scale_strides,
    ), {"A_M_MAJOR": a_m_major, "B_K_MAJOR": b_k_major, **tile,
        **loop_flags(config, e.pre is not None, a.element_size() == 1), **flags})


def gemm_calls(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, config: Config, profile: DeviceProfile,
               *, b3: torch.Tensor | None = None, epilogue: Epilogue = Epilogue(),
               block_scales: BlockScales | None = None,
               input_precision: str = "ieee") -> tuple[list[KernelCall], tuple]:
    """The launches of ``c = epilogue(a @ b [, a @ b3])`` and the scratch tensors they use.

    :param a: ``[M, K]``, any strides.
    :param b: ``[K, N]``, any strides (row-major, or ``w.T`` of an nn.Linear weight ``w [N, K]``).
    :param c: ``[M, N]``, written.
    :param config: ``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K``, ``num_warps``, ``num_stages``; optional
        ``GROUP_M`` (default :data:`GROUP_M`), ``SPLIT_K`` (default 1; above 1 the products go to a float32
        workspace and a reduce applies the epilogue: not with ``b3`` or pre-activations), ``TMA``
        (default 1: the persistent tensor-descriptor kernel where :func:`takes_tma`, else the
        pointer kernel), ``FLATTEN`` (default 1: the persistent loop's tile and K loops
        software-pipelined as one), ``WARP_SPECIALIZE`` (default 0: the descriptor kernel's tile
        loop warp-specialised, and then not flattened; not with pre-activations: :func:`loop_flags`),
        ``OCCUPANCY`` (default 1: the descriptor kernel's persistent grid is ``OCCUPANCY`` programs a
        multiprocessor, so that as many stay resident where they fit (:func:`occupancy_constraints`):
        one program's wgmma then runs while another's scales or epilogue do, the ping-pong of
        a warp-specialised loop by other means).
    :param profile: the device's: its architecture picks the kernel, its cores the persistent grid.
    :param b3: a second ``[K, N]`` operand (SwiGLU: ``c = silu(z) * z3``, ``z3`` from ``a @ b3``).
    :param epilogue: see :class:`Epilogue`.
    :param block_scales: see :class:`BlockScales` (fp8 ``a`` and ``b``; not with ``b3`` or the
        epilogue's scales): ``BLOCK_K`` and ``BLOCK_N`` must divide 128.
    :param input_precision: ``tl.dot``'s for float32 operands: ``"ieee"`` (exact) or ``"tf32"``.
    """
    (m, k), n = a.shape, b.shape[1]
    e = epilogue
    swiglu = b3 is not None
    split_k = config.get("SPLIT_K", 1)
    block_m, block_n, block_k = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    _check_combination(e, swiglu, split_k, block_scales, block_k, block_n)
    flags = {
        "HAS_BIAS": e.bias is not None, "HAS_SCALE": e.row_scale is not None,
        "HAS_COL_SCALE": e.col_scale is not None, "ACTIVATION": e.activation, "ACT_GRAD": e.act_grad is not None,
    }
    tile = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": config.get("GROUP_M", GROUP_M),
            "SPLIT_K": split_k, "INPUT_PRECISION": input_precision,
            "num_warps": config["num_warps"], "num_stages": config["num_stages"]}
    # Absent tensors: any pointer the constexprs keep the kernel from reading.
    row_scale, col_scale = (block_scales.a, block_scales.b) if block_scales is not None else (e.row_scale, e.col_scale)
    b3_, pre, pre3, dc, bias, scale, col = (t if t is not None else c for t in (b3, e.pre, e.pre3, e.act_grad, e.bias,
                                                                                row_scale, col_scale))
    # The scales' strides: (row, K block) of a's and (column or column block, K block) of b's.
    stride_sm, stride_tn = _scale_stride(row_scale), _scale_stride(col_scale)
    stride_sk, stride_tk = (block_scales.a.stride(1), block_scales.b.stride(1)) if block_scales is not None else (0, 0)
    scale_strides = (stride_sm, stride_sk, stride_tn, stride_tk)
    if split_k > 1:
        # The products alone into the workspace; the reduce runs the epilogue.
        target = torch.empty(split_k, m, n, dtype=torch.float32, device=c.device)
        gemm_flags = {"HAS_BIAS": False, "HAS_SCALE": False, "HAS_COL_SCALE": False, "ACTIVATION": None,
                      "ACT_GRAD": False, "SWIGLU": False, "STORE_PRE": False, "ACCUMULATE": False}
        scratch: tuple = (target,)
    else:
        target, gemm_flags, scratch = c, {**flags, "SWIGLU": swiglu, "STORE_PRE": e.pre is not None,
                                          "ACCUMULATE": e.accumulate}, ()
    gemm_flags["BLOCK_SCALED"] = block_scales is not None
    tiles = cdiv(m, block_m) * cdiv(n, block_n)
    if config.get("TMA", 1) and takes_tma(profile, a, b, c, b3, e):
        gemm = _tma_call(a, b, c, (b3_, target, pre, pre3, dc, bias, scale, col), swiglu, e, config, tile,
                         gemm_flags, scale_strides, min(tiles * split_k, profile.cores * config.get("OCCUPANCY", 1)),
                         profile)
    else:
        stride_cm, stride_cn = (n, 1) if split_k > 1 else (c.stride(0), c.stride(1))
        gemm = KernelCall(gemm_kernel, (tiles, split_k), (
            a, b, b3_, target, pre, pre3, dc, bias, scale, col, m, n, k, a.stride(0), a.stride(1),
            b.stride(0), b.stride(1), b3_.stride(0), b3_.stride(1), stride_cm, stride_cn, *scale_strides,
        ), {**tile, **gemm_flags})
    if split_k == 1:
        return [gemm], scratch
    reduce = KernelCall(splitk_reduce_kernel, (cdiv(m, block_m), cdiv(n, block_n)), (
        target, c, dc, bias, scale, col, m, n, c.stride(0), c.stride(1), stride_sm, stride_tn,
    ), {"BLOCK_M": block_m, "BLOCK_N": block_n, "SPLIT_K": split_k, **flags, "num_warps": 4})
    return [gemm, reduce], scratch


# --- the prefill ffn -----------------------------------------------------------------------------

def swiglu_calls(a: torch.Tensor, w1: torch.Tensor | None, w3: torch.Tensor | None, rstd: torch.Tensor | None,
                 out: torch.Tensor, config: Config, profile: DeviceProfile, *, w13: torch.Tensor | None = None,
                 gate: torch.Tensor | None = None, up: torch.Tensor | None = None) -> list[KernelCall]:
    """The launch of the prefill ffn's GEMM pair, one kernel:
    ``out = silu(rstd[:, None] * (a @ w1.T)) * (rstd[:, None] * (a @ w3.T))``.

    :param a: ``[M, K]`` (the rows already multiplied by the norm weight ``rms_w``; with ``rstd``
        None, already normalised too), any strides.
    :param w1: ``[N, K]`` (nn.Linear layout), any strides; None with ``w13``.
    :param w3: ``[N, K]``, like ``w1``; None with ``w13``.
    :param rstd: ``[M]`` float32, each row's ``rsqrt(mean(x**2) + eps)``; None where ``a`` is
        normalised already (no row scale).
    :param out: ``[M, N]``, written.
    :param config: see :func:`gemm_calls` (``SPLIT_K`` must be 1: both products share the program).
    :param w13: ``[2N, K]``: rows ``0..N-1`` are w1, ``N..2N-1`` w3 (the halves are views, no copy).
    :param gate: ``[M, N]`` with ``out``'s strides, optional: receives ``rstd * (a @ w1.T)`` (for
        the backward); ``up`` (with ``gate``) receives ``rstd * (a @ w3.T)``.
    """
    if w13 is not None:
        n = w13.shape[0] // 2
        w1, w3 = w13[:n], w13[n:]
    if (gate is None) != (up is None):
        raise ValueError("gate and up are stored together or not at all")
    calls, _ = gemm_calls(a, w1.T, out, {**config, "SPLIT_K": 1}, profile, b3=w3.T,
                          epilogue=Epilogue(row_scale=rstd, pre=gate, pre3=up))
    return calls


def swiglu(a: torch.Tensor, w1: torch.Tensor | None, w3: torch.Tensor | None, rstd: torch.Tensor,
           config: Config, profile: DeviceProfile, *, w13: torch.Tensor | None = None,
           preactivations: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run :func:`swiglu_calls` on a new ``out [M, N]`` in ``a``'s dtype; with ``preactivations``
    returns ``(out, gate, up)``."""
    n = (w13.shape[0] // 2) if w13 is not None else w1.shape[0]
    new = lambda: torch.empty(a.shape[0], n, dtype=a.dtype, device=a.device)  # noqa: E731
    out = new()
    gate, up = (new(), new()) if preactivations else (None, None)
    LaunchPlan(calls=swiglu_calls(a, w1, w3, rstd, out, config, profile, w13=w13, gate=gate, up=up),
               result=out).run()
    return (out, gate, up) if preactivations else out
