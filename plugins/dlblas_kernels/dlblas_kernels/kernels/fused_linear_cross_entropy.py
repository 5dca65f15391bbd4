"""fused_linear_cross_entropy: a language model's loss from its last hidden states, without its logits.

    loss = F.cross_entropy(softcap(hidden @ weight.T + bias), labels, ignore_index, reduction, label_smoothing)

``hidden [T, H]`` (any strides: a view of the last hidden states), ``weight [V, H]`` (the LM head's)
and ``bias [V]`` (optional) in float16, bfloat16 or float32; ``labels [T]`` and the options as
:mod:`dlblas_kernels.kernels.cross_entropy` (whose validation, loss dtype and ignored-row rules
this op shares).

The rows go in chunks of ``CHUNK``: a chunk's logits ``[CHUNK, V]`` (one buffer in hidden's dtype,
reused by every chunk) live only while the cross-entropy rows kernel reads them; nothing of size
``T x V`` is ever allocated. Per chunk, through the GEMM block (:mod:`dlblas_kernels.blocks.gemm`):

1. ``logits = hidden[c] @ weight.T (+ bias)``;
2. the rows kernel: each row's loss and log-sum-exp; under autograd it also overwrites the logits
   with their gradient for a loss gradient of 1 (``softmax - target``, smoothing and the soft
   cap's derivative folded in);
3. under autograd: ``dhidden[c] = dlogits @ weight``, ``dweight (+)= dlogits.T @ hidden[c]`` (the
   GEMM's accumulate epilogue), ``dbias (+)= column sums of dlogits`` (float32).

One program then reduces the row losses (and counts the rows not ignored for ``"mean"``).

**The gradients are made in the forward** for ``"mean"`` and ``"sum"`` (Liger-Kernel's choice):
three GEMMs in all, where recomputing the logits in the backward takes four; the backward only
scales the saved gradients by the loss gradient times the reduction's scale, in place (their
memory is the gradients' own). So a second backward through the same loss (``retain_graph=True``)
is refused, by torch's own check of saved tensors modified in place. ``"none"`` gives each row its
own loss gradient, which the forward cannot know: its forward keeps the log-sum-exps, and its
backward recomputes each chunk's logits (four GEMMs). Under autograd every gradient is made, also
for a weight that does not require one (a frozen LM head costs the forward one GEMM more than it
needs). The decision rests on the GEMM count; timing both
on a GPU is still to be done (docs/performance.md).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from dlblas_kernels.blocks import cross_entropy as ce
from dlblas_kernels.blocks import gemm as gemm_block
from dlblas_kernels.blocks.gemm import Epilogue, gemm_calls
from dlblas_kernels.kernels import cross_entropy as xent
from dlblas_kernels.kernels.matmul import heuristic as gemm_heuristic
from dlcore.api import (
    Backward,
    Config,
    DeviceProfile,
    KernelCall,
    LaunchPlan,
    Op,
    PowerOfTwo,
    Residuals,
    SearchSpace,
    Signature,
    TensorArg,
    cdiv,
    define_kernel,
    next_power_of_2,
    num_warps,
    prev_power_of_2,
)

DTYPES = xent.DTYPES
ANY_LAYOUT = xent.ANY_LAYOUT
#: the chunk rows the default config keeps within (see default_chunk)
MIN_CHUNK, MAX_CHUNK = 16, 1024
#: the most a chunk's logits take by default (a 262144-token vocabulary in bfloat16: 512 rows)
LOGITS_BYTES = 512 << 20
#: the bias gradient's column-sum tile
BIAS_BLOCK_R, BIAS_BLOCK_V = 32, 128


def default_chunk(rows: int, vocab: int, element_size: int = 2) -> int:
    """Rows per chunk: MAX_CHUNK, fewer where the rows are fewer (one chunk) or a chunk's logits
    would pass LOGITS_BYTES; at least MIN_CHUNK.

    Each chunk reads and writes the whole weight gradient once (its accumulating GEMM), ``4 V H``
    bytes in bfloat16, against the chunk's ``6 rows V H`` FLOPs: on an H100 (about 230 FLOPs a
    byte) that traffic is about ``310 / rows`` of the GEMM time when nothing hides it. Liger's rule
    (a chunk's logits as large as ``hidden``: 256 rows at LLaMA-3's head and 4096 tokens) makes four
    times the chunks, and the traffic most of the gap to the eager composite measured in
    docs/performance.md; 1024 rows of LLaMA-3's bfloat16 logits are 263 MB, a small part of what
    the composite holds."""
    by_memory = prev_power_of_2(LOGITS_BYTES // max(vocab * element_size, 1))
    return max(min(MAX_CHUNK, by_memory, next_power_of_2(rows)), MIN_CHUNK)


def _gemm_config(m: int, n: int, k: int, profile: DeviceProfile, element_size: int) -> Config:
    """matmul's heuristic tile for one of the chunk GEMMs, without split-K (accumulating GEMMs take none)."""
    return {**gemm_heuristic(m, n, k, profile, element_size), "SPLIT_K": 1}


class _Chunks:
    """The launches of one call, chunk by chunk (see the module doc)."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None,
                 options: tuple, config: Config, profile: DeviceProfile):
        self.hidden, self.weight, self.labels, self.bias = hidden, weight, labels, bias
        self.options, self.profile = options, profile
        rows, vocab = hidden.shape[0], weight.shape[0]
        self.chunk = min(config["CHUNK"], max(rows, 1))
        self.rows_config = {"BLOCK_V": config["BLOCK_V"], "num_warps": config["num_warps"]}
        self.logits = torch.empty((self.chunk, vocab), dtype=hidden.dtype, device=hidden.device)
        self.calls: list[KernelCall] = []
        self.scratch: list[torch.Tensor] = [self.logits]

    def ranges(self) -> list[tuple[int, int]]:
        rows = self.hidden.shape[0]
        return [(start, min(start + self.chunk, rows)) for start in range(0, rows, self.chunk)]

    def _gemm(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, epilogue: Epilogue | None = None) -> None:
        config = _gemm_config(a.shape[0], b.shape[1], a.shape[1], self.profile, a.element_size())
        calls, scratch = gemm_calls(a, b, c, config, self.profile, epilogue=epilogue or Epilogue())
        self.calls += calls
        self.scratch += scratch

    def logits_of(self, start: int, end: int) -> torch.Tensor:
        """The chunk's logits (a view of the buffer), after the launch computing them."""
        logits = self.logits[:end - start]
        self._gemm(self.hidden[start:end], self.weight.T, logits, Epilogue(bias=self.bias))
        return logits

    def gradients(self, logits: torch.Tensor, start: int, end: int, dhidden: torch.Tensor, dweight: torch.Tensor,
                  dbias: torch.Tensor | None) -> None:
        """The launches of the chunk's gradients from its logits' gradient (in ``logits``)."""
        first = start == 0
        self._gemm(logits, self.weight, dhidden[start:end])
        self._gemm(logits.T, self.hidden[start:end], dweight, Epilogue(accumulate=not first))
        if dbias is not None:
            rows, vocab = logits.shape
            self.calls.append(KernelCall(ce.column_sum_kernel, (cdiv(vocab, BIAS_BLOCK_V),), (
                logits, dbias, rows, vocab, logits.stride(0), logits.stride(1),
            ), {"BLOCK_R": BIAS_BLOCK_R, "BLOCK_V": BIAS_BLOCK_V, "ACCUMULATE": not first, "num_warps": 4}))


def training_outputs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None = None,
                     ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                     logit_softcap: float | None = None) -> tuple:
    """``(loss, dhidden, dweight, dbias, scale, lse)``: the loss (float32: 0-dim, or ``[T]`` for
    ``"none"``); for ``"mean"`` and ``"sum"`` the gradients for a loss gradient of 1 before the
    reduction's scale (``dbias`` float32, ``[0]`` without a bias) and that scale ``[1]``; for
    ``"none"`` each row's log-sum-exp ``[T]``. What a reduction does not keep is ``[0]``."""
    rows, vocab, device = hidden.shape[0], weight.shape[0], hidden.device
    none = reduction == "none"

    def empty(shape, dtype=torch.float32):
        return torch.empty(shape, dtype=dtype, device=device)

    loss = empty((rows,) if none else ())
    if none:
        return loss, empty(0, hidden.dtype), empty(0, weight.dtype), empty(0), empty(0), empty(rows)
    dbias = empty(vocab if bias is not None else 0)
    return loss, empty(hidden.shape, hidden.dtype), empty(weight.shape, weight.dtype), dbias, empty(1), empty(0)


def output(*args: Any) -> torch.Tensor:
    return training_outputs(*args)[0]


def _forward(args: tuple, config: Config, profile: DeviceProfile, grads: bool) -> LaunchPlan:
    """The forward's launches; ``grads``: the training plan, whose result is :func:`training_outputs`'
    tuple (else the loss alone, the rest scratch)."""
    hidden, weight, labels, bias, ignore_index, reduction, smoothing, softcap = args
    outs = training_outputs(*args)
    loss, dhidden, dweight, dbias, scale, lse = outs
    rows, vocab = hidden.shape[0], weight.shape[0]
    none = reduction == "none"
    make_grads = grads and not none

    def rows_buffer() -> torch.Tensor:
        return torch.empty(rows, dtype=torch.float32, device=hidden.device)

    loss_rows, lse_rows = (loss, lse) if none else (rows_buffer(), rows_buffer())
    extra = [] if none else [loss_rows, lse_rows]
    if not grads:  # what the training plan returns for the backward is scratch here
        extra.append(lse if none else scale)
    if rows == 0 and make_grads:  # no chunk: the gradients of an empty sum, filled here
        dweight.zero_()
        dbias.zero_()
    chunks = _Chunks(hidden, weight, labels, bias, (ignore_index, smoothing, softcap), config, profile)
    for start, end in chunks.ranges():
        logits = chunks.logits_of(start, end)
        chunks.calls.append(xent.forward_call(logits, labels[start:end], loss_rows[start:end], lse_rows[start:end],
                                              logits if make_grads else None, chunks.options, chunks.rows_config))
        if make_grads:
            chunks.gradients(logits, start, end, dhidden, dweight, dbias if bias is not None else None)
    if not none:
        chunks.calls.append(xent.finish_call(loss_rows, labels, loss, scale, vocab, ignore_index, reduction))
    return LaunchPlan(calls=chunks.calls, result=outs if grads else loss, scratch=tuple(chunks.scratch + extra))


def plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    """The loss alone (inference, or no input requiring grad)."""
    return _forward(args, config, profile, grads=False)


def training_plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    """The loss and what the backward reads (:func:`training_outputs`)."""
    return _forward(args, config, profile, grads=True)


def backward_results(dloss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, *rest: Any) -> tuple:
    """``(dhidden, dweight, dbias)``; ``dbias`` float32, ``[0]`` without a bias."""
    bias = rest[1]
    return (torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device),
            torch.empty(weight.shape, dtype=weight.dtype, device=hidden.device),
            torch.empty(weight.shape[0] if bias is not None else 0, dtype=torch.float32, device=hidden.device))


def backward_plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    """``reduction="none"``'s backward: each chunk's logits again, their gradient for the rows' own
    loss gradients ``dloss [T]``, then the chunk's gradient GEMMs."""
    dloss, hidden, weight, labels, bias, lse, ignore_index, smoothing, softcap = args
    dhidden, dweight, dbias = backward_results(dloss, hidden, weight, labels, bias)
    if hidden.shape[0] == 0:
        return LaunchPlan(calls=[], result=(dhidden, dweight, dbias))
    chunks = _Chunks(hidden, weight, labels, bias, (ignore_index, smoothing, softcap), config, profile)
    for start, end in chunks.ranges():
        logits = chunks.logits_of(start, end)
        chunks.calls.append(xent.backward_call(logits, labels[start:end], lse[start:end], dloss[start:end], None,
                                               logits, chunks.options, chunks.rows_config))
        chunks.gradients(logits, start, end, dhidden, dweight, dbias if bias is not None else None)
    return LaunchPlan(calls=chunks.calls, result=(dhidden, dweight, dbias), scratch=tuple(chunks.scratch))


def logits_reference(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    compute = torch.promote_types(hidden.dtype, torch.float32)
    logits = hidden.to(compute) @ weight.to(compute).T
    return logits if bias is None else logits + bias.to(compute)


def fused_linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                         bias: torch.Tensor | None = None, ignore_index: int = -100,
                                         reduction: str = "mean", label_smoothing: float = 0.0,
                                         logit_softcap: float | None = None) -> torch.Tensor:
    """The eager composite in float32 (or wider): the LM head, then ``F.cross_entropy``."""
    return xent.cross_entropy_reference(logits_reference(hidden, weight, bias), labels, ignore_index, reduction,
                                        label_smoothing, logit_softcap)


def _gradients_reference(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None,
                         dloss: torch.Tensor, ignore_index: int, label_smoothing: float,
                         logit_softcap: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dhidden, dweight, dbias)`` in float32 (or wider) for the row losses' gradients ``dloss``
    (``[T]``, or 0-dim for all), through the logits' gradient (no autograd: a custom op's body runs below it)."""
    compute = torch.promote_types(hidden.dtype, torch.float32)
    dz = xent.logits_gradient_reference(logits_reference(hidden, weight, bias), labels, dloss, ignore_index,
                                        label_smoothing, logit_softcap)
    dbias = dz.sum(0) if bias is not None else torch.empty(0, dtype=compute, device=hidden.device)
    return dz @ weight.to(compute), dz.T @ hidden.to(compute), dbias


def fused_linear_cross_entropy_training_reference(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                                  bias: torch.Tensor | None = None, ignore_index: int = -100,
                                                  reduction: str = "mean", label_smoothing: float = 0.0,
                                                  logit_softcap: float | None = None) -> tuple:
    """:func:`training_outputs` in torch."""
    loss = fused_linear_cross_entropy_reference(hidden, weight, labels, bias, ignore_index, reduction,
                                                label_smoothing, logit_softcap)
    compute = loss.dtype

    def empty(n, dtype=compute):
        return torch.empty(n, dtype=dtype, device=hidden.device)

    if reduction == "none":
        z = xent.softcap_reference(logits_reference(hidden, weight, bias), logit_softcap)
        return loss, empty(0, hidden.dtype), empty(0, weight.dtype), empty(0), empty(0), torch.logsumexp(z, -1)
    one = torch.ones((), dtype=compute, device=hidden.device)
    dhidden, dweight, dbias = _gradients_reference(hidden, weight, labels, bias, one, ignore_index, label_smoothing,
                                                   logit_softcap)
    scale = xent.count_scale(labels, weight.shape[0], ignore_index, reduction, compute)
    return loss, dhidden.to(hidden.dtype), dweight.to(weight.dtype), dbias, scale, empty(0)


def fused_linear_cross_entropy_backward_reference(
        dloss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
        bias: torch.Tensor | None, lse: torch.Tensor, ignore_index: int, label_smoothing: float,
        logit_softcap: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``reduction="none"``'s backward: ``(dhidden, dweight, dbias)``, ``dbias`` float32 (or wider)."""
    dhidden, dweight, dbias = _gradients_reference(hidden, weight, labels, bias, dloss, ignore_index,
                                                   label_smoothing, logit_softcap)
    return dhidden.to(hidden.dtype), dweight.to(weight.dtype), dbias


def default_config(sig: Signature, profile: DeviceProfile) -> Config:
    hidden = sig.tensor("hidden")
    vocab = sig.tensor("weight").shape[0]
    return {"CHUNK": default_chunk(hidden.shape[0], vocab, hidden.dtype.itemsize), **xent.row_config(vocab)}


def space(profile: DeviceProfile) -> SearchSpace:
    """Rows per chunk, and the rows kernel's block and warps (the GEMMs take matmul's heuristic tiles)."""
    return SearchSpace([PowerOfTwo("CHUNK", MIN_CHUNK, 4096), PowerOfTwo("BLOCK_V", 16, 16384),
                        num_warps(1, 2, 4, 8, 16)])


def check(op: Op, args: dict[str, Any]) -> None:
    hidden, weight, bias = args["hidden"], args["weight"], args["bias"]
    rows, width = hidden.shape
    vocab = weight.shape[0]
    op.expect_shape("weight", weight, (vocab, width), "[V, H], H being hidden's last dimension")
    if bias is not None:
        op.expect_shape("bias", bias, (vocab,), "[V], V being weight's first dimension")
    xent.check_labels(op, args["labels"], rows, vocab, args["ignore_index"], args["label_smoothing"],
                      args["logit_softcap"])


def example(sizes: dict[str, int], dtype: torch.dtype, device: torch.device, generator: torch.Generator) -> tuple:
    """Last hidden states ``[tokens, hidden]`` of unit variance, an LM head scaled like a trained one
    (variance 1/hidden), random labels."""
    tokens, width, vocab = sizes["tokens"], sizes["hidden"], sizes["vocab"]
    hidden = torch.randn(tokens, width, generator=generator).to(device=device, dtype=dtype)
    weight = (torch.randn(vocab, width, generator=generator) / width ** 0.5).to(device=device, dtype=dtype)
    return (hidden, weight, xent.example_labels(tokens, vocab, device, generator), None, -100, "mean", 0.0, None)


def cost(args: tuple, mode: str = "fwd") -> tuple[int, int]:
    """Forward: hidden and the weight read once, one GEMM (``2 T V H``). Backward: two more GEMMs
    and both gradients written (made in the forward; counted here, where they belong)."""
    hidden, weight = args[0], args[1]
    rows, width = hidden.shape
    vocab = weight.shape[0]
    size = hidden.numel() * hidden.element_size() + weight.numel() * weight.element_size()
    flops = 2 * rows * vocab * width
    return (2 * size, 2 * flops) if mode == "bwd" else (size, flops)


def torch_composite(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                    bias: torch.Tensor | None = None, ignore_index: int = -100, reduction: str = "mean",
                    label_smoothing: float = 0.0, logit_softcap: float | None = None) -> torch.Tensor:
    """What a model runs in eager torch: the LM head in the hidden dtype, then ``F.cross_entropy`` in float32."""
    logits = F.linear(hidden, weight, bias)
    return xent.cross_entropy_reference(logits, labels, ignore_index, reduction, label_smoothing, logit_softcap)


def liger():
    """Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss`` with this op's arguments, or None."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None

    def run(hidden, weight, labels, bias=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
            logit_softcap=None):
        loss = LigerFusedLinearCrossEntropyLoss(ignore_index=ignore_index, reduction=reduction,
                                                label_smoothing=label_smoothing, softcap=logit_softcap)
        return loss(weight, hidden, labels, bias)

    return run


OP = Op(
    name="fused_linear_cross_entropy",
    args=(
        TensorArg("hidden", DTYPES, min_rank=2, max_rank=2, layouts=ANY_LAYOUT, bucket="rows"),
        TensorArg("weight", DTYPES, min_rank=2, max_rank=2, layouts=ANY_LAYOUT, same_dtype_as="hidden"),
        TensorArg("labels", xent.LABEL_DTYPES, max_rank=1, layouts=ANY_LAYOUT, differentiable=False),
        TensorArg("bias", DTYPES, max_rank=1, layouts=ANY_LAYOUT, same_dtype_as="hidden", optional=True),
        *xent.label_args(),
    ),
    reference=fused_linear_cross_entropy_reference,
    doc="F.cross_entropy(softcap(hidden @ weight.T + bias), labels) in row chunks, the logits never whole; "
        "the loss in float32",
    check=check,
    example=example,
    example_sizes={"tokens": 37, "hidden": 64, "vocab": 500},
    example_paths={"chunks": {"tokens": 300}},
    cost=cost,
    baselines={"torch": lambda: torch_composite, "liger": liger},
)


def _scaled(t: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``t * factor`` in ``t``'s dtype: in place (the forward made ``t`` for this backward alone, so
    its memory becomes the gradient's), except for float64 (the references' path, which gradcheck
    runs backward through repeatedly) and while compiling (traced functionally)."""
    if t.dtype == torch.float64 or torch.compiler.is_compiling():
        return (t * factor).to(t.dtype)
    return t.mul_(factor)


def _gradients(backward, saved, grads, needs) -> dict:
    if saved.reduction == "none":
        dhidden, dweight, dbias = backward(grads[0], saved.hidden, saved.weight, saved.labels, saved.bias, saved.lse,
                                           saved.ignore_index, saved.label_smoothing, saved.logit_softcap)
    else:
        factor = saved.scale * grads[0]
        dhidden, dweight, dbias = (_scaled(t, factor) for t in (saved.dhidden, saved.dweight, saved.dbias))
    found = {"hidden": dhidden, "weight": dweight}
    if saved.bias is not None:
        found["bias"] = dbias.to(saved.bias.dtype)
    return found


KERNEL = define_kernel(
    OP, plan,
    kernels=(*gemm_block.KERNELS, ce.ce_forward_kernel, ce.ce_backward_kernel, ce.ce_finish_kernel,
             ce.column_sum_kernel),
    results=output,
    default_config=default_config,
    space=space,
    backward=Backward(_gradients, saved=("hidden", "weight", "labels", "bias", "ignore_index", "reduction",
                                         "label_smoothing", "logit_softcap", "dhidden", "dweight", "dbias", "scale",
                                         "lse"),
                      plan=backward_plan, reference=fused_linear_cross_entropy_backward_reference,
                      results=backward_results,
                      residuals=Residuals(("dhidden", "dweight", "dbias", "scale", "lse"), training_plan,
                                          training_outputs, fused_linear_cross_entropy_training_reference)),
    doc="row chunks: the LM head GEMM into one chunk buffer, the cross-entropy rows (under autograd their "
        "gradient in place), the gradient GEMMs (the weight's accumulated); one program reduces",
)
fused_linear_cross_entropy = KERNEL.function
dlcore_ops, dlcore_implementations = KERNEL.dlcore_ops, KERNEL.dlcore_implementations
