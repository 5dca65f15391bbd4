"""The vendor's library as a candidate: ``matmul`` and ``ffn`` computed by the torch calls a user
would write, which reach cuBLAS and cuBLASLt on CUDA (CANN through torch_npu on Ascend, CNNL
through torch_mlu on Cambricon); ``flash_attention_v2`` by ``F.scaled_dot_product_attention`` with
one backend, FlashAttention-2 (``sdpa_flash``) or cuDNN's (``sdpa_cudnn``); ``fused_rotary_and_fa``
by its unfused composite (``composite``: apply_rotary_pos_emb, then SDPA).

Each is a :class:`~dlcore.declarations.implementation.VendorImplementation` (``matmul`` and
``ffn``'s named ``torch``): timed against the Triton kernels like any candidate, so ``get_op``
never returns something slower than the library it measured; ``DLCORE_DISABLE_IMPLS=matmul:torch``
leaves one out. The ops' float64 references stay the correctness oracle. The cpu backend declines
them (its kernels run in the interpreter). An SDPA candidate's ``supports`` declines what its
backend refuses (float32, ``return_lse=True``, key padding, head dimensions SDPA does not take, cuDNN's
bottom-right causal mask, devices other than NVIDIA GPUs from sm_80), so that selection never
times a call that would raise.

One plugin object per implementation, each named by its own entry point (``vendor_matmul``,
``vendor_ffn``, ``vendor_sdpa_flash``, ``vendor_sdpa_cudnn``): a kernel plugin is imported when one
of the ops it provides is asked for, and asking for ``matmul`` must not import the ffn kernel. An
implementation whose op is not declared (its kernel plugin disabled) is left out by the registry
without harm to the rest.

The functions take the arguments the ops declare and the ones they are gaining (``bias``,
``activation``, ``allow_tf32``; ``w13``), each with the default that means "not given".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from dlblas_kernels.blocks.fp8_scales import BLOCK, Granularity, granularity, signature_granularity
from dlblas_kernels.blocks.gemm import ACTIVATIONS
from dlblas_kernels.blocks.sdpa import sdpa_attention
from dlcore.api import (
    DeviceProfile,
    Implementation,
    InvalidInputError,
    Signature,
    VendorImplementation,
    cdiv,
    hookimpl,
)


def _grad_wanted(*tensors: torch.Tensor) -> bool:
    """Whether autograd records ops on ``tensors`` (in-place updates would then break the backward)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _activate(out: torch.Tensor, activation: str | None) -> torch.Tensor:
    """``activation`` applied to the fresh GEMM output, in place when autograd does not need it."""
    if activation is None:
        return out
    inplace = not _grad_wanted(out)
    if activation == "relu":
        return out.relu_() if inplace else torch.relu(out)
    if activation == "silu":
        return F.silu(out, inplace=inplace)
    if activation == "gelu_tanh":
        return F.gelu(out, approximate="tanh")
    raise InvalidInputError("matmul", "activation", repr(activation), ", ".join(map(repr, ACTIVATIONS)))


def _product(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # With a bias, F.linear: one cuBLASLt call adds it in the GEMM's epilogue (b.T is the
    # nn.Linear weight, no copy either way).
    if bias is None:
        return torch.matmul(a, b)
    return F.linear(a, b.T, bias.to(a.dtype))


def _product_fp32_cuda(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, allow_tf32: bool) -> torch.Tensor:
    """:func:`_product` in float32 on CUDA: TF32 tensor cores only when asked, exact (IEEE) float32
    otherwise, whatever the process set; torch's flag is restored after the call. The flag is the
    process's: another thread's float32 GEMM launched meanwhile sees this call's setting."""
    flags = torch.backends.cuda.matmul
    if hasattr(flags, "fp32_precision"):  # torch >= 2.9; mixing it with allow_tf32 raises there
        before = flags.fp32_precision
        flags.fp32_precision = "tf32" if allow_tf32 else "ieee"
        try:
            return _product(a, b, bias)
        finally:
            flags.fp32_precision = before
    before = flags.allow_tf32
    flags.allow_tf32 = allow_tf32
    try:
        return _product(a, b, bias)
    finally:
        flags.allow_tf32 = before


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = None,
           allow_tf32: bool = False) -> torch.Tensor:
    """``activation(a @ b + bias)`` for ``a [..., M, K]``, ``b [K, N]`` of any strides, ``bias [N]``:
    one cuBLAS or cuBLASLt call, the activation after it. ``allow_tf32`` counts for float32 on CUDA;
    elsewhere float32 stays exact."""
    if a.dtype == torch.float32 and a.device.type == "cuda":
        out = _product_fp32_cuda(a, b, bias, allow_tf32)
    else:
        out = _product(a, b, bias)
    return _activate(out, activation)


def ffn(x: torch.Tensor, w1: torch.Tensor | None, w3: torch.Tensor | None, rms_w: torch.Tensor,
        eps: float = 1e-6, w13: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(xn @ w1.T) * (xn @ w3.T)``, ``xn = F.rms_norm(x, rms_w)``: with ``w13 [2N, K]`` (rows
    0..N-1 are w1, N..2N-1 w3: what vLLM and SGLang keep) one GEMM for both, else one over each."""
    xn = F.rms_norm(x, (x.shape[-1],), rms_w.to(x.dtype), float(eps))
    if w13 is not None:
        gate, up = F.linear(xn, w13).chunk(2, dim=-1)
    else:
        gate, up = F.linear(xn, w1), F.linear(xn, w3)
    if _grad_wanted(gate, up):
        return F.silu(gate) * up
    return F.silu(gate).mul_(up)  # silu allocates the (contiguous) output; the product adds no other


#: the widest head dimension SDPA's flash and cuDNN backends take (in multiples of 8)
SDPA_MAX_HEAD_DIM = 256


def _no_lse(return_lse: bool, kv_start: torch.Tensor | None, kv_end: torch.Tensor | None) -> None:
    if return_lse:
        raise InvalidInputError("flash_attention_v2", "return_lse", "is True",
                                "return_lse=False from an SDPA candidate (SDPA returns no log-sum-exp)")
    for name, bound in (("kv_start", kv_start), ("kv_end", kv_end)):
        if bound is not None:
            raise InvalidInputError("flash_attention_v2", name, "is given",
                                    f"{name}=None from an SDPA candidate (its flash and cuDNN backends take no mask)")


def sdpa_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
               softmax_scale: float | None = None, return_lse: bool = False, kv_start: torch.Tensor | None = None,
               kv_end: torch.Tensor | None = None) -> torch.Tensor:
    """flash_attention_v2 by SDPA's FlashAttention-2 backend (:func:`sdpa_attention`)."""
    _no_lse(return_lse, kv_start, kv_end)
    return sdpa_attention(q, k, v, causal, softmax_scale, SDPBackend.FLASH_ATTENTION)


def sdpa_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
               softmax_scale: float | None = None, return_lse: bool = False, kv_start: torch.Tensor | None = None,
               kv_end: torch.Tensor | None = None) -> torch.Tensor:
    """flash_attention_v2 by SDPA's cuDNN backend (:func:`sdpa_attention`). cuDNN has no bottom-right
    causal mask: a causal call with Sq != Sk runs the flash backend instead (the candidate declines
    such signatures, but lengths rounded into one bucket may still bring one here)."""
    _no_lse(return_lse, kv_start, kv_end)
    bottom_right = causal and q.shape[1] != k.shape[1]
    backend = SDPBackend.FLASH_ATTENTION if bottom_right else SDPBackend.CUDNN_ATTENTION
    return sdpa_attention(q, k, v, causal, softmax_scale, backend)


def _sm(profile: DeviceProfile) -> int:
    """The compute capability of an NVIDIA profile (``sm_90`` -> 90); 0 where the arch says none."""
    digits = profile.arch.removeprefix("sm_")
    return int(digits) if digits.isdigit() else 0


def _off_sdpa_devices(signature: Signature, profile: DeviceProfile) -> str | None:
    """Why ``signature``'s device is none SDPA's flash and cuDNN backends run on, or None."""
    if signature.device_type != "cuda" or profile.vendor != "nvidia" or _sm(profile) < 80:
        return (f"SDPA's flash and cuDNN backends run on NVIDIA GPUs from sm_80 (this is {profile.vendor} "
                f"{profile.arch or signature.device_type})")
    return None


def _head_dim_declines(signature: Signature) -> str | None:
    """Why q's head dimension is none SDPA's flash and cuDNN backends take, or None."""
    d = signature.tensor("q").shape[-1]
    if d > SDPA_MAX_HEAD_DIM or d % 8:
        return f"head dimension {d}: SDPA takes multiples of 8 up to {SDPA_MAX_HEAD_DIM}"
    return None


def _sdpa_declines(signature: Signature, profile: DeviceProfile) -> str | None:
    """Why neither SDPA backend takes ``signature``, or None."""
    off = _off_sdpa_devices(signature, profile)
    if off is not None:
        return off
    if signature.scalar("return_lse"):
        return "SDPA returns no log-sum-exp (return_lse=True)"
    if any(name in ("kv_start", "kv_end") for name, _ in signature.tensors):
        return "SDPA's flash and cuDNN backends take no key padding (kv_start, kv_end)"
    return _head_dim_declines(signature)


def _cudnn_declines(signature: Signature, profile: DeviceProfile) -> str | None:
    """Why SDPA's cuDNN backend does not take ``signature``, or None. Sq and Sk are rounded up to
    powers of two in signatures: lengths that differ within one bucket reach :func:`sdpa_cudnn`."""
    reason = _sdpa_declines(signature, profile)
    lengths_differ = signature.tensor("q").shape[1] != signature.tensor("k").shape[1]
    if reason is None and signature.scalar("causal") and lengths_differ:
        return "cuDNN has no bottom-right causal mask (causal with Sq != Sk)"
    return reason


class VendorPlugin:
    """A kernel plugin providing one vendor implementation (an entry point names the object)."""

    def __init__(self, implementation: Implementation):
        self.implementation = implementation

    @hookimpl
    def dlcore_implementations(self) -> list[Implementation]:
        return [self.implementation]


MATMUL = VendorImplementation(
    "matmul", "torch", matmul,
    library="torch.matmul, F.linear with a bias (cuBLAS/cuBLASLt, CANN, CNNL)",
    doc="the vendor's GEMM through torch, the activation after it",
)
FFN = VendorImplementation(
    "ffn", "torch", ffn,
    library="F.rms_norm, F.linear, SwiGLU (cuBLAS/cuBLASLt, CANN, CNNL)",
    doc="the eager composite: RMSNorm, the gate and up GEMMs, SwiGLU",
)
matmul_plugin = VendorPlugin(MATMUL)
ffn_plugin = VendorPlugin(FFN)
SDPA_FLASH = VendorImplementation(
    "flash_attention_v2", "sdpa_flash", sdpa_flash,
    library="F.scaled_dot_product_attention, flash backend (FlashAttention-2)",
    dtypes=(torch.float16, torch.bfloat16), supports=_sdpa_declines,
    doc="SDPA's FlashAttention-2 on [B, H, S, D] views; causal bottom-right by causal_lower_right",
)
SDPA_CUDNN = VendorImplementation(
    "flash_attention_v2", "sdpa_cudnn", sdpa_cudnn,
    library="F.scaled_dot_product_attention, cuDNN backend",
    dtypes=(torch.float16, torch.bfloat16), supports=_cudnn_declines,
    doc="SDPA's cuDNN attention on [B, H, S, D] views; no bottom-right causal mask",
)
sdpa_flash_plugin = VendorPlugin(SDPA_FLASH)
sdpa_cudnn_plugin = VendorPlugin(SDPA_CUDNN)


# --- fused_rotary_and_fa: the unfused composite (apply_rotary_pos_emb, then SDPA) ------------------------


def fused_rotary_and_fa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        causal: bool = False, softmax_scale: float | None = None,
                        interleaved: bool = False) -> torch.Tensor:
    """The op's ``composite`` baseline as a candidate: dlblas ``apply_rotary_pos_emb`` on q and k
    (the rotated copies written), then ``F.scaled_dot_product_attention``, cuDNN's backend first
    (:func:`dlblas_kernels.kernels.fused_rotary_and_fa.composite`). Causal with ``Sq > Sk``: the
    first ``Sq - Sk`` queries see no key (zeros), the others are the composite of the last Sk."""
    # Imported on the first call: asking for another op's vendor candidate must not import this kernel.
    from dlblas_kernels.kernels.fused_rotary_and_fa import composite

    sq, sk = q.shape[1], k.shape[1]
    if causal and sq > sk:
        seen = composite(q[:, sq - sk:], k, v, cos, sin, True, softmax_scale, interleaved) if sk else None
        blind = q.new_zeros(q.shape[0], sq - sk, q.shape[2], v.shape[3])
        return blind if seen is None else torch.cat([blind, seen], dim=1)
    return composite(q, k, v, cos, sin, causal, softmax_scale, interleaved)


def _composite_declines(signature: Signature, profile: DeviceProfile) -> str | None:
    """Why the composite is no vendor candidate for ``signature``: SDPA reaches cuDNN and
    FlashAttention-2 on NVIDIA GPUs from sm_80 only, for head dimensions in multiples of 8 up to
    :data:`SDPA_MAX_HEAD_DIM` (elsewhere it would time the memory-efficient or math kernel)."""
    return _off_sdpa_devices(signature, profile) or _head_dim_declines(signature)


FUSED_ROTARY_AND_FA = VendorImplementation(
    "fused_rotary_and_fa", "composite", fused_rotary_and_fa,
    library="dlblas apply_rotary_pos_emb, then F.scaled_dot_product_attention (cuDNN, then FlashAttention-2)",
    dtypes=(torch.float16, torch.bfloat16), supports=_composite_declines,
    doc="the unfused composite: q and k rotated into new tensors, then SDPA's fastest backend that takes them",
)
fused_rotary_and_fa_plugin = VendorPlugin(FUSED_ROTARY_AND_FA)


# --- fused_moe: the composite a model runs ------------------------------------------------------------

def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The op's grouped-GEMM composite as a candidate (:func:`dlblas_kernels.kernels.fused_moe.composite`):
    the slots sorted by expert, ``torch._grouped_mm`` (or a GEMM per expert) with SwiGLU, the rows
    summed into their tokens; fp8 weights dequantised first."""
    # Imported on the first call: asking for another op's vendor candidate must not import this kernel.
    from dlblas_kernels.kernels.fused_moe import composite

    return composite(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)


FUSED_MOE = VendorImplementation(
    "fused_moe", "torch", fused_moe,
    library="argsort, index gathers, torch._grouped_mm on sm_90 (else torch.matmul per expert), index_add_",
    dtypes=(torch.float16, torch.bfloat16, torch.float32),
    doc="the grouped-GEMM composite: sort by expert, gather, grouped GEMMs with SwiGLU, weighted index_add_; fp8 "
        "weights dequantised first",
)
fused_moe_plugin = VendorPlugin(FUSED_MOE)


# --- fp8_gemm: torch._scaled_mm (cuBLASLt's fp8 GEMM) ----------------------------------------------

#: the first compute capability whose tensor cores take fp8, and the first where _scaled_mm scales per row
FP8_MIN_SM, FP8_ROWWISE_MIN_SM = 89, 90
#: cuBLASLt scales 1x128 blocks of a and 128x128 blocks of b on Hopper (sm_90) from CUDA 12.9
FP8_BLOCKWISE_SM, FP8_BLOCKWISE_CUDA = 90, (12, 9)
#: cuBLASLt reads the block scales in 16-byte aligned runs of 4 floats, with no padding between them
_SCALE_ALIGN = 4


def _cuda_version() -> tuple[int, ...]:
    """The CUDA version torch was built with, ``(12, 9)``; ``()`` for a build without CUDA."""
    return tuple(int(part) for part in (torch.version.cuda or "").split(".")[:2] if part.isdigit())


def blockwise_scales(a_scale: torch.Tensor, b_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_gemm's block scales in the layouts cuBLASLt takes them through ``torch._scaled_mm(a, b.T)``:
    ``a_scale [M, K/128]`` outer-dim-major (strides ``(1, M)``: what quantize_fp8 gives, kept
    without a copy) and ``b.T``'s ``[K/128, N/128]`` with unit K stride (``b_scale [N/128, K/128]``
    row-major, transposed without a copy). K/128 a multiple of 4 (the candidate declines others)."""
    m = a_scale.shape[0]
    if a_scale.stride(0) != 1 or a_scale.stride(1) != max(m, 1):
        a_scale = a_scale.T.contiguous().T
    return a_scale, b_scale.contiguous().T


def _blockwise_scaled_mm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                         out_dtype: torch.dtype) -> torch.Tensor:
    """cuBLASLt's blockwise product; ``a``'s rows padded with zeros to a multiple of 4 where they are
    not one (the M-major scales' column stride is M: 16-byte aligned only so)."""
    m = a.shape[0]
    rows = cdiv(m, _SCALE_ALIGN) * _SCALE_ALIGN
    if rows != m:
        a = torch.cat([a, a.new_zeros(rows - m, a.shape[1])])
        padded = a_scale.new_ones(a_scale.shape[1], rows)  # M-major as it is made: blockwise_scales keeps it
        padded[:, :m] = a_scale.T
        a_scale = padded.T
    scale_a, scale_b = blockwise_scales(a_scale, b_scale)
    out = torch._scaled_mm(a, b.T, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    return out if rows == m else out[:m]


def fp8_gemm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
             out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """fp8_gemm by ``torch._scaled_mm``: ``b.T`` is the column-major operand it wants; per-row scales
    go in as ``[M, 1]`` and ``[1, N]``, per-tensor as they are, block scales as
    :func:`blockwise_scales` lays them out."""
    found = granularity(a_scale, b_scale, a.shape[0], b.shape[0], a.shape[1])
    if found is Granularity.BLOCK:
        return _blockwise_scaled_mm(a, b, a_scale, b_scale, out_dtype)
    scale_b = b_scale.T if found is Granularity.ROW else b_scale
    return torch._scaled_mm(a, b.T, scale_a=a_scale, scale_b=scale_b, out_dtype=out_dtype)


def _blockwise_declines(signature: Signature, profile: DeviceProfile) -> str | None:
    """Why cuBLASLt's blockwise fp8 GEMM does not take ``signature``'s block scales, or None."""
    if _sm(profile) != FP8_BLOCKWISE_SM:
        return f"cuBLASLt scales fp8 in 1x128 and 128x128 blocks on sm_90 only (this is {profile.arch})"
    if _cuda_version() < FP8_BLOCKWISE_CUDA:
        return (f"cuBLASLt scales fp8 in blocks from CUDA 12.9; torch {torch.__version__} is built with "
                f"CUDA {torch.version.cuda}")
    if signature.scalar("out_dtype") != torch.bfloat16:
        return "torch._scaled_mm scales in blocks with a bfloat16 output only"
    k = signature.tensor("b").shape[1]
    if cdiv(k, BLOCK) % _SCALE_ALIGN:
        return (f"cuBLASLt's block scales need ceil(K/128) a multiple of {_SCALE_ALIGN} (K a multiple of 512; "
                f"K is {k})")
    return None


def _scaled_mm_declines(signature: Signature, profile: DeviceProfile) -> str | None:
    """Why ``torch._scaled_mm`` does not take ``signature``, or None: it runs on NVIDIA GPUs from
    sm_89, scales per tensor (any output dtype) or, from sm_90, per row (bfloat16 output only);
    in 1x128 / 128x128 blocks on sm_90 from CUDA 12.9 (bfloat16 output only); row-major ``a``
    and ``b`` (``b.T`` column-major), N and K multiples of 16."""
    if signature.device_type != "cuda" or profile.vendor != "nvidia" or _sm(profile) < FP8_MIN_SM:
        return f"torch._scaled_mm runs on NVIDIA GPUs from sm_{FP8_MIN_SM} (this is {profile.arch or 'none'})"
    n, k = signature.tensor("b").shape
    if signature.tensor("a").layout != "contiguous" or signature.tensor("b").layout != "contiguous":
        return "torch._scaled_mm takes row-major a and b"
    if n % 16 or k % 16:
        return f"torch._scaled_mm needs N and K multiples of 16 (N {n}, K {k})"
    found = signature_granularity(signature)
    if found is Granularity.TENSOR:
        return None
    if found is Granularity.ROW:
        if _sm(profile) < FP8_ROWWISE_MIN_SM or signature.scalar("out_dtype") != torch.bfloat16:
            return "torch._scaled_mm scales per row on sm_90 and later, with a bfloat16 output only"
        return None
    return _blockwise_declines(signature, profile)


FP8_GEMM = VendorImplementation(
    "fp8_gemm", "scaled_mm", fp8_gemm,
    library="torch._scaled_mm (cuBLASLt fp8 GEMM)", supports=_scaled_mm_declines,
    doc="cuBLASLt's fp8 GEMM through torch._scaled_mm: per-tensor and per-row scales; 1x128 / 128x128 blocks on "
        "sm_90 from CUDA 12.9",
)
fp8_gemm_plugin = VendorPlugin(FP8_GEMM)
