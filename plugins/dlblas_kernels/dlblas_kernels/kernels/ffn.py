"""ffn: the gate and up half of a LLaMA MLP, fused: RMSNorm, two projections and SwiGLU, with its backward.

    xn  = x * rsqrt(mean(x**2, -1) + eps) * rms_w          x: [M, K], rms_w: [K]
    out = silu(xn @ w1.T) * (xn @ w3.T)                     w1, w3: [N, K] (nn.Linear layout)

The weights come either as ``w1`` and ``w3``, or as one ``w13`` of shape ``[2N, K]`` (rows ``0..N-1``
being ``w1``, ``N..2N-1`` being ``w3``: what vLLM and SGLang keep) with ``w1 = w3 = None``. Both
forms run the same kernels: ``w13``'s halves are two views.

The row scale factors out of the product, ``xn @ w.T = rstd[:, None] * ((x * rms_w) @ w.T)``, so the
normalised input is never written at full precision and the GEMMs need only ``rstd`` per row. Two
regimes, chosen by the config: when one row block holds every row (``rows <= BLOCK_M``),

- **weight streaming** (decoding, a few tokens; :mod:`dlblas_kernels.blocks.ffn_decode`): one kernel, one
  program per ``BLOCK_N`` columns of both weights (fewer where N spreads evenly over whole waves of
  the cores), every row in it. Each program computes the rows' sums of squares and ``x * rms_w``
  in its K loop from ``x`` (a few kilobytes, read from L2), and streams its slices of ``w1`` and
  ``w3`` once from memory (loads marked evict-first: nothing reads them again; on sm_90 through
  tensor descriptors where that measured faster), so the kernel reads the weights once at close to
  the copy bandwidth;

otherwise

- **prefill** (many tokens): a row kernel writes ``xs = x * rms_w`` (input dtype) and ``rstd``
  (float32), then one GEMM computes ``xs @ w1.T`` and ``xs @ w3.T`` in the same program, scales both
  by ``rstd`` and applies SwiGLU in its epilogue: the ``[M, 2N]`` pre-activations never reach
  memory. On sm_90 (``JOINT``, where the copy engine takes the operands) it is the pair-tile kernel
  (:func:`dlblas_kernels.blocks.swiglu_pair.swiglu_pair_calls`): persistent, w1's and w3's tiles loaded as the two
  planes of one tensor descriptor, so each K step is ONE ``[BLOCK_M, 2 * BLOCK_N]`` product, the
  matmul's loop, faster than two accumulators fed from the same ``xs`` tile (the GEMM block's
  :func:`dlblas_kernels.blocks.gemm.swiglu_calls`, which runs everywhere else).

The ``tl.dot`` inputs keep the input dtype (float16 / bfloat16 tensor cores, exact float32 for
float32 inputs), accumulating in float32.

Backward, with ``g = xn @ w1.T``, ``u = xn @ w3.T``, ``s = sigmoid(g)`` and ``dout`` the output
gradient::

    dg = dout * u * s * (1 + g * (1 - s))      du = dout * g * s          dh = [dg | du]   [M, 2N]
    dxn = dg @ w1 + du @ w3                    dw1 = dg.T @ xn            dw3 = du.T @ xn
    dx, drms_w = rms_norm's backward of dxn

The pre-activations ``g`` and ``u`` are saved, not recomputed (what ``torch.compile`` of the
composite keeps too): recomputing them would cost the backward a third GEMM of the forward's
size. The op's custom op, which autograd and ``torch.compile`` call, runs
:func:`training_plan`: the forward with ``g`` and ``u`` stored by the GEMM's (or the streaming
kernel's) epilogue, returned as the template's residuals (:class:`~dlcore.runtime.template.Residuals`)
and saved; that costs the forward an ``[M, 2N]`` write (about 3% at 4096 tokens). It saves the
normalised input ``xn`` (input dtype) too, which its row kernel writes in place of ``x * rms_w``
(the GEMM then takes no row scale), so the backward does not write it again (what
``torch.compile`` keeps too). The public function without autograd and bound ops run
:func:`plan`, which stores none of them. The backward: ``dh`` elementwise from the saved
``g``, ``u`` and ``dout``, ``dxn = dh @ w13`` (for separate ``w1`` and ``w3``,
:func:`~dlblas_kernels.blocks.ffn_backward.ffn_input_grad_kernel` reduces over both without a
concatenated copy), ``dw13 = dh.T @ xn`` (GEMMs through the GEMM block; these launches are
:mod:`dlblas_kernels.blocks.ffn_backward`'s, the prefill's :mod:`dlblas_kernels.blocks.ffn_prefill`'s),
then ``dx`` and ``drms_w`` from rms_norm's backward kernels. The weights' gradient is one
``[2N, K]`` buffer; with ``w1`` and ``w3`` given, their gradients are its two halves (views).
"""

from __future__ import annotations

from typing import Any

import torch

from dlblas_kernels.blocks import ffn_backward, swiglu_pair
from dlblas_kernels.blocks import gemm as gemm_block
from dlblas_kernels.blocks.ffn_backward import backward_gemm_config, gradient_calls
from dlblas_kernels.blocks.ffn_backward import input_grad_splits as input_grad_splits
from dlblas_kernels.blocks.ffn_backward import weight_grad_config as weight_grad_config
from dlblas_kernels.blocks.ffn_decode import DECODE_KERNELS, decode_calls
from dlblas_kernels.blocks.ffn_prefill import (
    PREFILL_TILE,
    SPACE_ELEMENT_BYTES,
    fit_stages,
    prefill_calls,
    rms_scale_call,
    rms_scale_kernel,
    shared_memory_bytes,
    weights,
)
from dlblas_kernels.kernels import rms_norm
from dlcore.api import (
    Backward,
    Choice,
    Config,
    Constraint,
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
    as_rows,
    cdiv,
    define_kernel,
    num_stages,
    num_warps,
)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Most rows the heuristic default streams the weights for (decoding, :mod:`dlblas_kernels.blocks.ffn_decode`);
# more take the prefill GEMM.
DECODE_ROWS = 64
def output(x: torch.Tensor, w1: torch.Tensor | None, w3: torch.Tensor | None, rms_w: torch.Tensor,
           eps: float = 1e-6, w13: torch.Tensor | None = None) -> torch.Tensor:
    n = (w1 if w13 is None else w13).shape[0] // (1 if w13 is None else 2)
    return torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)


def _forward(args: tuple, config: Config, profile: DeviceProfile, out: torch.Tensor,
             gate: torch.Tensor | None = None, up: torch.Tensor | None = None,
             xn: torch.Tensor | None = None) -> tuple[list[KernelCall], tuple]:
    """The forward's launches and scratch into ``out`` (and the pre-activations ``gate`` and ``up``,
    and the normalised input ``xn``, the residuals of :func:`training_plan`). With ``xn`` the row
    kernel writes it, and the prefill GEMM reads it without a row scale; without, the row kernel
    writes ``x * rms_w`` and the GEMM scales its rows by ``rstd``."""
    x, w1, w3, rms_w, eps, w13 = args
    x2, out2 = as_rows(x), as_rows(out)
    gate2, up2 = (None, None) if gate is None else (as_rows(gate), as_rows(up))
    m, k = x2.shape
    if m <= config["BLOCK_M"]:
        calls, scratch = decode_calls(x2, rms_w, w1, w3, w13, out2, eps, config, profile, gate2, up2)
        if xn is None:
            return calls, scratch
        rstd = torch.empty(m, dtype=torch.float32, device=x.device)
        return [*calls, rms_scale_call(x2, rms_w, as_rows(xn), rstd, eps, normalise=True)], (*scratch, rstd)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    xs = torch.empty((m, k), dtype=x.dtype, device=x.device) if xn is None else as_rows(xn)
    gemm, scratch = prefill_calls(xs, w1, w3, None if xn is not None else rstd, out2, config, profile, w13, gate2, up2)
    counters = scratch[1] if scratch else None  # the pair kernel's split last wave (swiglu_pair.pair_tail)
    row = rms_scale_call(x2, rms_w, xs, rstd, eps, normalise=xn is not None, zero=counters)
    return [row, *gemm], (xs, rstd, *scratch) if xn is None else (rstd, *scratch)


def plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    """Weight streaming when one row block holds every row; otherwise the row kernel and the GEMM
    block's SwiGLU GEMM (:func:`dlblas_kernels.blocks.gemm.swiglu_calls`)."""
    out = output(*args)
    if out.numel() == 0:
        return LaunchPlan(calls=[], result=out)
    calls, scratch = _forward(args, config, profile, out)
    return LaunchPlan(calls=calls, result=out, scratch=scratch)


def training_outputs(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, gate, up, xn)``: the output and the pre-activations, each of the output's shape, and
    the normalised input ``xn`` of ``x``'s."""
    x = args[0]
    return output(*args), output(*args), output(*args), torch.empty(x.shape, dtype=x.dtype, device=x.device)


def training_plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    """:func:`plan`, the pre-activations and ``xn`` stored too (the custom op's body: autograd saves
    them). ``xn`` is what the prefill GEMM reads in place of ``x * rms_w`` (the same bytes written);
    the decode path writes it by one more row launch."""
    out, gate, up, xn = training_outputs(*args)
    if out.numel() == 0:
        return LaunchPlan(calls=[], result=(out, gate, up, xn))
    calls, scratch = _forward(args, config, profile, out, gate, up, xn)
    return LaunchPlan(calls=calls, result=(out, gate, up, xn), scratch=scratch)


def backward_outputs(dout: torch.Tensor, x: torch.Tensor, w1: torch.Tensor | None, w3: torch.Tensor | None,
                     rms_w: torch.Tensor, eps: float, w13: torch.Tensor | None, gate: torch.Tensor,
                     up: torch.Tensor, xn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dw13 [2N, K], drms_w)``: the weights' gradient in one buffer, w1's rows first."""
    w = w1 if w13 is None else w13
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device),
            torch.empty((2 * gate.shape[-1], x.shape[-1]), dtype=w.dtype, device=x.device),
            torch.empty(rms_w.shape, dtype=rms_w.dtype, device=x.device))


def backward_plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    """Launches for ``(dx, dw13, drms_w)`` from ``args = (dout, x, w1, w3, rms_w, eps, w13, gate, up,
    xn)``: ``dh`` from the saved pre-activations; ``dxn`` from ``dh`` and both weights (the forward
    config's tile, both weights' columns in one); ``dw13 = dh.T @ xn`` from the saved ``xn``
    (:func:`weight_grad_config`'s tile); rms_norm's backward of ``dxn``."""
    dout, x, w1, w3, rms_w, eps, w13, gate, up, xn = args
    dx, dw13, drms_w = backward_outputs(*args)
    n = gate.shape[-1]
    x2 = as_rows(x)
    m, k = x2.shape
    if m == 0 or n == 0:
        return LaunchPlan(calls=[], result=(dx.zero_(), dw13.zero_(), drms_w.zero_()))
    gemm = fit_stages(backward_gemm_config(config), profile, x.element_size(), operands=1)
    # dout comes from autograd in any layout (even expanded); reshape copies only when it must.
    calls, dxn, scratch = gradient_calls(dout.reshape(m, n), as_rows(gate), as_rows(up), as_rows(xn), w1, w3, w13,
                                         dw13, gemm, profile)
    norm = rms_norm.backward_plan((dxn, x2, rms_w, None, eps), rms_norm.heuristic_config(m, k), profile)
    dx_rows, drms = norm.result
    return LaunchPlan(calls=[*calls, *norm.calls], result=(dx_rows.view(x.shape), dw13, drms),
                      scratch=(*scratch, *norm.scratch))


def _composite(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, rms_w: torch.Tensor, eps: float
               ) -> tuple[torch.Tensor, ...]:
    """``(xf, rstd, xn, gate, up)`` in float32 (or wider)."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute)
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    xn = xf * rstd * rms_w.to(compute)
    return xf, rstd, xn, xn @ w1.to(compute).T, xn @ w3.to(compute).T


def ffn_reference(x: torch.Tensor, w1: torch.Tensor | None, w3: torch.Tensor | None, rms_w: torch.Tensor,
                  eps: float = 1e-6, w13: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm, gate and up projections and SwiGLU, in float32 (or wider), returned in ``x``'s dtype."""
    return ffn_training_reference(x, w1, w3, rms_w, eps, w13)[0]


def ffn_training_reference(x: torch.Tensor, w1: torch.Tensor | None, w3: torch.Tensor | None, rms_w: torch.Tensor,
                           eps: float = 1e-6, w13: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, gate, up, xn)``: :func:`ffn_reference`, the pre-activations and the normalised input,
    in ``x``'s dtype."""
    _, _, xn, gate, up = _composite(x, *weights(w1, w3, w13), rms_w, eps)
    return tuple(t.to(x.dtype) for t in (torch.nn.functional.silu(gate) * up, gate, up, xn))


def ffn_backward_reference(dout: torch.Tensor, x: torch.Tensor, w1: torch.Tensor | None, w3: torch.Tensor | None,
                           rms_w: torch.Tensor, eps: float, w13: torch.Tensor | None, gate: torch.Tensor,
                           up: torch.Tensor, xn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward formulas of the module docstring in torch, in float32 (or wider), from the
    saved pre-activations (``xn`` recomputed from ``x``: the saved one is its rounding)."""
    w1, w3 = weights(w1, w3, w13)
    xf, rstd, xn, _, _ = _composite(x, w1, w3, rms_w, eps)
    compute = xf.dtype
    d, gate, up = dout.to(compute), gate.to(compute), up.to(compute)
    s = torch.sigmoid(gate)
    d_gate = d * up * s * (1 + gate * (1 - s))
    d_up = d * gate * s
    dxn = d_gate @ w1.to(compute) + d_up @ w3.to(compute)
    k, n = x.shape[-1], w1.shape[0]
    dw13 = torch.cat([d_gate.reshape(-1, n).T, d_up.reshape(-1, n).T]) @ xn.reshape(-1, k)
    xhat = xf * rstd
    g = dxn * rms_w.to(compute)
    dx = rstd * (g - xhat * (g * xhat).mean(dim=-1, keepdim=True))
    drms_w = (dxn * xhat).reshape(-1, k).sum(dim=0)
    return dx.to(x.dtype), dw13.to(w1.dtype), drms_w.to(rms_w.dtype)


def _columns(sig: Signature) -> int:
    """N, the columns of each weight."""
    w1 = sig.optional("w1")
    return w1.shape[0] if w1 is not None else sig.tensor("w13").shape[0] // 2


def few_rows_block_n(m: int, n: int, cores: int) -> int:
    """The columns of each weight per 64-row tile for 65 to 128 rows: 64 (K slices of 128) where
    those tiles fill the multiprocessors at least once (or no core count is known), else 32: with
    fewer tiles than cores, narrower ones put more of the cores to work."""
    if not cores or cdiv(m, 64) * cdiv(n, 64) >= cores:
        return 64
    return 32


def default_config(sig: Signature, profile: DeviceProfile) -> Config:
    """By the row count (rounded up to a power of two), from sweeps at LLaMA-3-8B's shape (K 4096,
    N 14336, bfloat16; docs/performance.md, ffn):

    - up to DECODE_ROWS: weight streaming (:mod:`dlblas_kernels.blocks.ffn_decode`), at most 128 columns
      of each weight per program, spread over whole waves of the multiprocessors
      (``decode_columns``), 64-wide K slices four stages deep; on sm_90, where the programs'
      columns nearly fill the tile and K is not sliced, the weights through tensor descriptors in
      128-wide K slices three deep (``decode_tma``). Deeper pipelines, 256 or 64 columns, 32-wide
      K slices and, for 1 row, products on the cores without tl.dot are slower;
    - up to 128: the GEMM with 64-row tiles (128-row tiles, or streaming with 128 rows, leave
      multiprocessors idle or spill), 64 columns of each weight by K slices of 128, 32 where 64
      leave multiprocessors idle (:func:`few_rows_block_n`);
    - more: :data:`PREFILL_TILE`, 128 x 128 tiles of each weight (a 128 x 256 output tile).

    On sm_90 the pair-tile kernel splits its last, partial wave over K
    (:func:`dlblas_kernels.blocks.swiglu_pair.pair_tail`), so that the wave's SMs are not left idle.

    The GEMM takes the pair-tile kernel (``JOINT``) where the copy engine takes the operands;
    float32 inputs take K slices half as wide. Pipelining stages are dropped while the tiles
    overflow the device's shared memory (the profile's bound; none where it knows none)."""
    m = sig.tensor("x").shape[0]
    if m <= DECODE_ROWS:
        config = {"BLOCK_M": DECODE_ROWS, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 4,
                  "JOINT": 1}
    elif m <= 128:
        block_n = few_rows_block_n(m, _columns(sig), profile.cores if profile is not None else 0)
        config = {"BLOCK_M": 64, "BLOCK_N": block_n, "BLOCK_K": 128, "GROUP_M": 8,
                  "num_warps": 4, "num_stages": 4, "JOINT": 1}
    else:
        config = dict(PREFILL_TILE)
    if sig.dtype.itemsize > 2 and m > DECODE_ROWS:
        config["BLOCK_K"] = 32
    return fit_stages(config, profile, sig.dtype.itemsize)


def _accumulators_per_thread(c: Config) -> float:
    # Two float32 accumulators (gate and up), BLOCK_M x BLOCK_N each.
    return 2 * c["BLOCK_M"] * c["BLOCK_N"] / (32 * c["num_warps"])


def space(profile: DeviceProfile) -> SearchSpace:
    """Tile shapes, program order, warps and pipelining depth of both paths, and the prefill GEMM's
    kernel (``JOINT``: 1 the pair-tile kernel where the copy engine takes the operands, 0 the GEMM
    block's two accumulators); the pipelined tiles within the shared memory a program may use on
    the device (no bound where the profile knows none). BLOCK_M at or above the row count selects
    weight streaming (see the module docstring)."""
    shared = profile.shared_memory_per_program
    fits = [Constraint(
        f"num_stages * (BLOCK_M + 2 * BLOCK_N) * BLOCK_K * {SPACE_ELEMENT_BYTES} bytes <= {shared} "
        f"(the pipelined x, w1 and w3 tiles fit in shared memory)",
        lambda c: shared_memory_bytes(c) <= shared,
    )] if shared else []
    return SearchSpace(
        [
            PowerOfTwo("BLOCK_M", 16, 256),
            PowerOfTwo("BLOCK_N", 16, 256),
            PowerOfTwo("BLOCK_K", 32, 256),
            Choice("GROUP_M", (1, 8)),
            Choice("JOINT", (0, 1)),
            num_warps(4, 8),
            num_stages(2, 3, 4, 5),
        ],
        [
            *fits,
            Constraint("2 * BLOCK_M * BLOCK_N / (32 * num_warps) <= 128 (both float32 accumulators fit in registers)",
                       lambda c: _accumulators_per_thread(c) <= 128),
            Constraint("2 * BLOCK_M * BLOCK_N / (32 * num_warps) >= 8 (every warp has enough of the tile to work on)",
                       lambda c: _accumulators_per_thread(c) >= 8),
        ],
    )


def check(op: Op, args: dict[str, Any]) -> None:
    x, w1, w3, w13 = args["x"], args["w1"], args["w3"], args["w13"]
    k = x.shape[-1]
    if k == 0:
        raise InvalidInputError(op.name, "x", f"has an empty last dimension (shape {tuple(x.shape)})",
                                "x with at least one feature to normalise")
    if w13 is not None:
        for name in ("w1", "w3"):
            if args[name] is not None:
                raise InvalidInputError(op.name, name, "is given together with w13",
                                        "either w1 and w3, or w13 alone (w1 = w3 = None)")
        if w13.shape[0] % 2:
            raise InvalidInputError(op.name, "w13", f"has an odd number of rows (shape {tuple(w13.shape)})",
                                    "[2N, K]: w1's N rows, then w3's")
        op.expect_shape("w13", w13, (w13.shape[0], k), "[2N, K], K being x's last dimension")
    else:
        for name in ("w1", "w3"):
            if args[name] is None:
                raise InvalidInputError(op.name, name, "is None and w13 is not given",
                                        "w1 and w3 of shape [N, K], or w13 of shape [2N, K]")
        op.expect_shape("w1", w1, (w1.shape[0], k), "nn.Linear layout [N, K], K being x's last dimension")
        op.expect_shape("w3", w3, tuple(w1.shape), "the shape of w1")
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
    return (*(t.to(device=device, dtype=dtype) for t in (x, w1, w3, rms_w)), 1e-6, None)


def cost(args: tuple, mode: str = "fwd") -> tuple[int, int]:
    """Forward: read x, the weights and rms_w, write the output; two GEMMs of 2*M*N*K flops each.
    Backward: read dout, x, the weights and rms_w, write dx, the weights' gradient and drms_w;
    ``dh @ w13`` and ``dh.T @ xn``, 4*M*N*K flops each (the pre-activations are saved)."""
    x, w1, w3, rms_w, _, w13 = args
    w1, w3 = weights(w1, w3, w13)
    m, k, n = x.numel() // max(x.shape[-1], 1), x.shape[-1], w1.shape[0]
    size = x.element_size()
    moved = (x.numel() * size + (w1.numel() + w3.numel()) * w1.element_size()
             + rms_w.numel() * rms_w.element_size() + m * n * size)
    if mode == "bwd":
        return moved + (x.numel() + w1.numel() + w3.numel()) * size + rms_w.numel() * rms_w.element_size(), \
            8 * m * n * k
    return moved, 4 * m * n * k


def torch_ffn(x: torch.Tensor, w1: torch.Tensor | None, w3: torch.Tensor | None, rms_w: torch.Tensor,
              eps: float = 1e-6, w13: torch.Tensor | None = None) -> torch.Tensor:
    """What a model runs in eager torch: LlamaRMSNorm, then LlamaMLP's ``act_fn(gate_proj(h)) * up_proj(h)``."""
    w1, w3 = weights(w1, w3, w13)
    h = x.to(torch.float32)
    h = rms_w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return torch.nn.functional.silu(h @ w1.T) * (h @ w3.T)


def ffn_w13_composite(x: torch.Tensor, w13: torch.Tensor, rms_w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The best composite (``dlcore bench``'s ``compile`` baseline): ``F.rms_norm``, one GEMM over
    ``[w1; w3]`` concatenated once (as vLLM and SGLang keep it), SwiGLU."""
    gate, up = (torch.nn.functional.rms_norm(x, (x.shape[-1],), rms_w, eps) @ w13.T).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def concatenate_w13(args: tuple) -> tuple:
    """``(x, w1, w3, rms_w, eps, w13)`` -> ``(x, w13, rms_w, eps)``, ``w13 = [w1; w3]`` unless given."""
    x, w1, w3, rms_w, eps, *rest = args
    w13 = rest[0] if rest and rest[0] is not None else torch.cat([w1, w3])
    return x, w13, rms_w, eps


ffn_w13_composite.prepare = concatenate_w13  # type: ignore[attr-defined]


OP = Op(
    name="ffn",
    args=(
        TensorArg("x", DTYPES, bucket="rows"),
        TensorArg("w1", DTYPES, min_rank=2, max_rank=2, same_dtype_as="x", optional=True),
        TensorArg("w3", DTYPES, min_rank=2, max_rank=2, same_dtype_as="x", optional=True),
        TensorArg("rms_w", DTYPES, max_rank=1),
        ScalarArg("eps", (float, int), default=1e-6, finite=True, minimum=0.0),
        TensorArg("w13", DTYPES, min_rank=2, max_rank=2, same_dtype_as="x", optional=True),
    ),
    reference=ffn_reference,
    doc="silu(rms_norm(x) @ w1.T) * (rms_norm(x) @ w3.T): fused RMSNorm + gate/up projections + SwiGLU; "
        "w13 [2N, K] (w1's rows, then w3's) may replace w1 and w3",
    check=check,
    example=example,
    example_sizes={"tokens": 37, "hidden": 256, "inter": 96},
    example_paths={"decode": {"tokens": 1, "hidden": 2048, "inter": 512},
                   "prefill": {"tokens": 300, "hidden": 256, "inter": 512}},
    cost=cost,
    baselines={"torch": lambda: torch_ffn, "compile": lambda: ffn_w13_composite},
)


def _gradients(backward, saved, grads, needs) -> dict:
    dx, dw13, drms_w = backward(grads[0], saved.x, saved.w1, saved.w3, saved.rms_w, saved.eps, saved.w13,
                                saved.gate, saved.up, saved.xn)
    if saved.w13 is not None:
        return {"x": dx, "w13": dw13, "rms_w": drms_w}
    n = saved.w1.shape[0]
    return {"x": dx, "w1": dw13[:n], "w3": dw13[n:], "rms_w": drms_w}


KERNEL = define_kernel(
    OP, plan,
    kernels=(*DECODE_KERNELS, rms_scale_kernel, ffn_backward.swiglu_backward_kernel, ffn_backward.ffn_input_grad_kernel,
             ffn_backward.ffn_input_grad_tma_kernel, *gemm_block.KERNELS, *swiglu_pair.KERNELS,
             rms_norm.rms_norm_backward_kernel, rms_norm.column_sum_kernel),
    results=output,
    default_config=default_config,
    space=space,
    backward=Backward(_gradients, saved=("x", "w1", "w3", "rms_w", "eps", "w13", "gate", "up", "xn"),
                      plan=backward_plan, reference=ffn_backward_reference, results=backward_outputs,
                      residuals=Residuals(("gate", "up", "xn"), training_plan, training_outputs,
                                          ffn_training_reference)),
    doc="weight streaming for a few rows; else x * rms_w and rstd, then one GEMM over both weights (on sm_90 "
        "their tiles side by side in one product), rstd and SwiGLU in its epilogue; backward: dh from the saved "
        "pre-activations, the input and weight GEMMs (the latter over the saved xn), rms_norm's backward",
)
ffn = KERNEL.function
dlcore_ops, dlcore_implementations = KERNEL.dlcore_ops, KERNEL.dlcore_implementations
