"""cross_entropy: ``F.cross_entropy(softcap(logits), labels, ...)`` on logits a caller already has,
with its backward.

``logits [T, V]`` (float16, bfloat16, float32; any row stride), ``labels [T]`` (int64 or int32);
``ignore_index``, ``reduction`` (``"mean"``, ``"sum"``, ``"none"``), ``label_smoothing`` and
``logit_softcap`` (``z = c * tanh(logits / c)`` before the loss, as Gemma 2 does) mean what they
mean in ``F.cross_entropy``. The loss is float32 whatever the logits' dtype (torch returns the
logits' dtype; float32 keeps the sum's precision). With every row ignored, ``"mean"`` is NaN and
the gradient 0, as in torch.

Launches (:mod:`dlblas_kernels.blocks.cross_entropy`): the rows kernel (each row's loss and
log-sum-exp, one read of the logits), then for ``"mean"`` and ``"sum"`` one program summing the
rows and counting those not ignored. Under autograd the log-sum-exp and the reduction's scale are
kept for the backward (the template's residuals), which reads the logits once and writes their
gradient once.

Validation reads the labels (one read back from the device: the public function pays it per call,
``get_op``'s bound ops when bound and at the first call of each exact input metadata): a label
outside ``[0, V)`` that is not ``ignore_index`` is refused. The kernels never use such a label as an
address; they count its row as ignored.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake  # torch's own test for fake tensors; no public one

from dlblas_kernels.blocks import cross_entropy as ce
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
    define_kernel,
    next_power_of_2,
    num_warps,
)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LABEL_DTYPES = (torch.int64, torch.int32)
REDUCTIONS = ("mean", "sum", "none")
ANY_LAYOUT = ("contiguous", "rows", "strided")
#: widest block of a row the default config takes per step (longer rows loop)
MAX_BLOCK_V = 4096
#: elements per thread the default config gives a block
ELEMENTS_PER_THREAD = 8
#: the finishing program's block of rows
FINISH_BLOCK = 1024


def label_args() -> tuple:
    """The loss options every cross-entropy op declares after its tensors."""
    return (
        ScalarArg("ignore_index", (int,), default=-100),
        ScalarArg("reduction", (str,), default="mean", keyed=True, choices=REDUCTIONS),
        ScalarArg("label_smoothing", (float, int), default=0.0, finite=True, minimum=0.0),
        ScalarArg("logit_softcap", (float, int, type(None)), default=None, finite=True),
    )


def check_labels(op: Op, labels: torch.Tensor, rows: int, vocab: int, ignore_index: int, smoothing: float,
                 softcap: float | None) -> None:
    """The options and the labels: one per row, each in ``[0, vocab)`` or ``ignore_index``."""
    if not -2**63 <= ignore_index < 2**63:
        raise InvalidInputError(op.name, "ignore_index", f"is {ignore_index}", "an int64 (labels are compared with it)")
    if smoothing > 1:
        raise InvalidInputError(op.name, "label_smoothing", f"is {smoothing}", "a number in [0, 1]")
    if softcap is not None and softcap <= 0:
        raise InvalidInputError(op.name, "logit_softcap", f"is {softcap}", "a positive cap, or None for none")
    if labels.dim() != 1 or labels.shape[0] != rows:
        raise InvalidInputError(op.name, "labels", f"has shape {tuple(labels.shape)}",
                                f"[{rows}]: one label per row of the logits")
    if vocab == 0:
        raise InvalidInputError(op.name, "labels", "name classes of an empty vocabulary (V = 0)", "V >= 1")
    if labels.numel() and labels.device.type != "meta" and not is_fake(labels):
        bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
        if bool(bad.any()):
            value = int(labels[bad][0])
            raise InvalidInputError(op.name, "labels", f"holds {value}",
                                    f"class indices in [0, {vocab}), or ignore_index ({ignore_index})")


def row_config(vocab: int) -> Config:
    """The rows kernel's block (the row, up to MAX_BLOCK_V) and warps (ELEMENTS_PER_THREAD a thread)."""
    block = min(max(next_power_of_2(vocab), 16), MAX_BLOCK_V)
    return {"BLOCK_V": block, "num_warps": min(max(block // (32 * ELEMENTS_PER_THREAD), 1), 16)}


def _flags(smoothing: float, softcap: float | None) -> dict[str, bool]:
    return {"SOFTCAP": softcap is not None, "SMOOTH": smoothing > 0}


def _options(ignore_index: int, smoothing: float, softcap: float | None) -> tuple:
    return int(ignore_index), float(smoothing), float(softcap or 1.0)


def forward_call(x: torch.Tensor, labels: torch.Tensor, loss_rows: torch.Tensor, lse: torch.Tensor,
                 grad: torch.Tensor | None, options: tuple, config: Config) -> KernelCall:
    """The rows kernel over ``x [rows, V]``: losses and log-sum-exps, and the gradient (``g = 1``)
    into ``grad`` when given (``x`` itself: in place)."""
    ignore_index, smoothing, softcap = options
    target = x if grad is None else grad
    return KernelCall(ce.ce_forward_kernel, (x.shape[0],), (
        x, labels, loss_rows, lse, target, x.shape[1], x.stride(0), x.stride(1), labels.stride(0),
        target.stride(0), target.stride(1), *_options(ignore_index, smoothing, softcap),
    ), {"BLOCK_V": config["BLOCK_V"], **_flags(smoothing, softcap), "GRAD": grad is not None,
        "num_warps": config["num_warps"]})


def backward_call(x: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, dloss: torch.Tensor,
                  scale: torch.Tensor | None, dx: torch.Tensor, options: tuple, config: Config) -> KernelCall:
    """The gradient of ``x [rows, V]`` into ``dx`` (``x`` itself: in place) from the saved
    log-sum-exps: ``dloss`` per row (``[rows]``) or one for all (0-dim), times ``scale`` when given."""
    ignore_index, smoothing, softcap = options
    return KernelCall(ce.ce_backward_kernel, (x.shape[0],), (
        x, labels, lse, dloss, dloss if scale is None else scale, dx, x.shape[1], x.stride(0), x.stride(1),
        labels.stride(0), 0 if dloss.dim() == 0 else dloss.stride(0), dx.stride(0), dx.stride(1),
        *_options(ignore_index, smoothing, softcap),
    ), {"BLOCK_V": config["BLOCK_V"], **_flags(smoothing, softcap), "SCALED": scale is not None,
        "num_warps": config["num_warps"]})


def finish_call(loss_rows: torch.Tensor, labels: torch.Tensor, loss: torch.Tensor, scale: torch.Tensor,
                vocab: int, ignore_index: int, reduction: str) -> KernelCall:
    """The loss (sum or mean of the rows) and the gradient's scale, one program."""
    return KernelCall(ce.ce_finish_kernel, (1,), (
        loss_rows, labels, loss, scale, loss_rows.shape[0], vocab, labels.stride(0), int(ignore_index),
    ), {"BLOCK": FINISH_BLOCK, "MEAN": reduction == "mean", "num_warps": 4})


def training_outputs(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100, reduction: str = "mean",
                     label_smoothing: float = 0.0, logit_softcap: float | None = None) -> tuple:
    """``(loss, lse, scale)``: the loss (0-dim, or ``[T]`` for ``"none"``), float32; each row's
    log-sum-exp ``[T]``; the reduction's gradient scale ``[1]`` (``[0]`` for ``"none"``)."""
    rows, device = logits.shape[0], logits.device
    loss = torch.empty((rows,) if reduction == "none" else (), dtype=torch.float32, device=device)
    scale = torch.empty(0 if reduction == "none" else 1, dtype=torch.float32, device=device)
    return loss, torch.empty(rows, dtype=torch.float32, device=device), scale


def output(*args: Any) -> torch.Tensor:
    return training_outputs(*args)[0]


def training_plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    """The loss, and the log-sum-exps and scale the backward reads."""
    logits, labels, ignore_index, reduction, smoothing, softcap = args
    loss, lse, scale = training_outputs(*args)
    rows, vocab = logits.shape
    if reduction == "none":
        options = (ignore_index, smoothing, softcap)
        calls = [forward_call(logits, labels, loss, lse, None, options, config)] if rows else []
        return LaunchPlan(calls=calls, result=(loss, lse, scale))
    loss_rows = torch.empty(rows, dtype=torch.float32, device=logits.device)
    options = (ignore_index, smoothing, softcap)
    calls = [forward_call(logits, labels, loss_rows, lse, None, options, config)] if rows else []
    calls.append(finish_call(loss_rows, labels, loss, scale, vocab, ignore_index, reduction))
    return LaunchPlan(calls=calls, result=(loss, lse, scale), scratch=(loss_rows,))


def plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    """The loss alone: the log-sum-exps (and scale) are scratch."""
    made = training_plan(args, config, profile)
    loss, lse, scale = made.result
    keep = (lse,) if args[3] == "none" else (lse, scale)
    return LaunchPlan(calls=made.calls, result=loss, scratch=made.scratch + keep)


def backward_results(dloss: torch.Tensor, logits: torch.Tensor, *rest: Any) -> torch.Tensor:
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


def backward_plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    """``dlogits`` from ``(dloss, logits, labels, lse, scale, ignore_index, reduction, label_smoothing,
    logit_softcap)``."""
    dloss, logits, labels, lse, scale, ignore_index, reduction, smoothing, softcap = args
    dx = backward_results(dloss, logits)
    if dx.numel() == 0:
        return LaunchPlan(calls=[], result=dx)
    scaled = None if reduction == "none" else scale
    call = backward_call(logits, labels, lse, dloss, scaled, dx, (ignore_index, smoothing, softcap), config)
    return LaunchPlan(calls=[call], result=dx)


def softcap_reference(x: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return x if softcap is None else softcap * torch.tanh(x / softcap)


def cross_entropy_reference(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                            reduction: str = "mean", label_smoothing: float = 0.0,
                            logit_softcap: float | None = None) -> torch.Tensor:
    """``F.cross_entropy`` of the soft-capped logits in float32 (or wider): the loss in that dtype."""
    compute = torch.promote_types(logits.dtype, torch.float32)
    z = softcap_reference(logits.to(compute), logit_softcap)
    return F.cross_entropy(z, labels.long(), ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)


def count_scale(labels: torch.Tensor, vocab: int, ignore_index: int, reduction: str,
                dtype: torch.dtype) -> torch.Tensor:
    """The reduction's gradient scale ``[1]`` (``[0]`` for ``"none"``): 1, or for ``"mean"`` one over
    the rows not ignored (0 for none)."""
    if reduction == "none":
        return torch.empty(0, dtype=dtype, device=labels.device)
    if reduction == "sum":
        return torch.ones(1, dtype=dtype, device=labels.device)
    count = ((labels != ignore_index) & (labels >= 0) & (labels < vocab)).sum().to(dtype)
    return torch.where(count > 0, 1 / count.clamp(min=1), 0).reshape(1)


def cross_entropy_training_reference(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                                     reduction: str = "mean", label_smoothing: float = 0.0,
                                     logit_softcap: float | None = None) -> tuple:
    """``(loss, lse, scale)`` in torch (see :func:`training_outputs`)."""
    loss = cross_entropy_reference(logits, labels, ignore_index, reduction, label_smoothing, logit_softcap)
    compute = loss.dtype
    lse = torch.logsumexp(softcap_reference(logits.to(compute), logit_softcap), dim=-1)
    return loss, lse, count_scale(labels, logits.shape[-1], ignore_index, reduction, compute)


def logits_gradient_reference(logits: torch.Tensor, labels: torch.Tensor, dloss: torch.Tensor, ignore_index: int,
                              label_smoothing: float, logit_softcap: float | None) -> torch.Tensor:
    """The gradient of each row's loss with respect to its (raw) logits, times ``dloss`` (per row
    ``[T]``, or 0-dim for all), in float32 (or wider): the module doc's formula, without autograd
    (a custom op's body runs below it)."""
    compute = torch.promote_types(logits.dtype, torch.float32)
    rows, vocab = logits.shape
    z = softcap_reference(logits.to(compute), logit_softcap)
    valid = (labels != ignore_index) & (labels >= 0) & (labels < vocab)
    target = torch.zeros_like(z)
    target[valid, labels[valid].long()] = 1.0 - label_smoothing
    d = torch.softmax(z, dim=-1) - target - label_smoothing / vocab
    if logit_softcap is not None:
        d = d * (1 - (z / logit_softcap) ** 2)
    g = dloss.to(compute).reshape(-1, 1) if dloss.dim() else dloss.to(compute)
    return torch.where(valid[:, None], d * g, 0.0)


def cross_entropy_backward_reference(dloss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor,
                                     lse: torch.Tensor, scale: torch.Tensor, ignore_index: int, reduction: str,
                                     label_smoothing: float, logit_softcap: float | None) -> torch.Tensor:
    """The gradient of the logits (:func:`logits_gradient_reference`, times the reduction's scale),
    in the logits' dtype."""
    g = dloss if reduction == "none" else dloss * scale.to(dloss.dtype).reshape(())
    return logits_gradient_reference(logits, labels, g, ignore_index, label_smoothing,
                                     logit_softcap).to(logits.dtype)


def default_config(sig: Signature, profile: DeviceProfile) -> Config:
    return row_config(sig.tensor("logits").shape[-1])


def space(profile: DeviceProfile) -> SearchSpace:
    """The rows kernel's block and warps (the backward takes the same)."""
    return SearchSpace([PowerOfTwo("BLOCK_V", 16, 16384), num_warps(1, 2, 4, 8, 16)])


def check(op: Op, args: dict[str, Any]) -> None:
    logits = args["logits"]
    check_labels(op, args["labels"], logits.shape[0], logits.shape[1], args["ignore_index"],
                 args["label_smoothing"], args["logit_softcap"])


def example_labels(rows: int, vocab: int, device: torch.device, generator: torch.Generator) -> torch.Tensor:
    """Random labels, one row in eight ignored (-100: padding, or a prompt's tokens)."""
    labels = torch.randint(0, vocab, (rows,), generator=generator)
    labels[torch.rand(rows, generator=generator) < 0.125] = -100
    return labels.to(device)


def example(sizes: dict[str, int], dtype: torch.dtype, device: torch.device, generator: torch.Generator) -> tuple:
    """Logits ``[tokens, vocab]`` spread as a language model's (standard deviation 4), random labels."""
    logits = (4 * torch.randn(sizes["tokens"], sizes["vocab"], generator=generator)).to(device=device, dtype=dtype)
    return (logits, example_labels(sizes["tokens"], sizes["vocab"], device, generator), -100, "mean", 0.0, None)


def cost(args: tuple, mode: str = "fwd") -> tuple[int, int]:
    """Forward: the logits read once; per element a maximum, a difference, an exponential and a sum.
    Backward: the logits read and their gradient written; an exponential and a few products each."""
    logits = args[0]
    size = logits.numel() * logits.element_size()
    if mode == "bwd":
        return 2 * size, 5 * logits.numel()
    return size, 4 * logits.numel()


def torch_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                        reduction: str = "mean", label_smoothing: float = 0.0,
                        logit_softcap: float | None = None) -> torch.Tensor:
    """What a model runs in eager torch: ``F.cross_entropy`` on the logits upcast to float32."""
    return cross_entropy_reference(logits, labels, ignore_index, reduction, label_smoothing, logit_softcap)


OP = Op(
    name="cross_entropy",
    args=(
        TensorArg("logits", DTYPES, min_rank=2, max_rank=2, layouts=ANY_LAYOUT, bucket="rows"),
        TensorArg("labels", LABEL_DTYPES, max_rank=1, layouts=ANY_LAYOUT, differentiable=False),
        *label_args(),
    ),
    reference=cross_entropy_reference,
    doc="F.cross_entropy of (soft-capped) logits [T, V] against labels [T]: ignore_index, mean/sum/none, "
        "label smoothing; the loss in float32",
    check=check,
    example=example,
    example_sizes={"tokens": 37, "vocab": 1000},
    example_paths={"looped rows": {"tokens": 4, "vocab": 10000}},
    cost=cost,
    baselines={"torch": lambda: torch_cross_entropy},
)


def _gradients(backward, saved, grads, needs) -> dict:
    return {"logits": backward(grads[0], saved.logits, saved.labels, saved.lse, saved.scale, saved.ignore_index,
                               saved.reduction, saved.label_smoothing, saved.logit_softcap)}


KERNEL = define_kernel(
    OP, plan,
    kernels=(ce.ce_forward_kernel, ce.ce_backward_kernel, ce.ce_finish_kernel),
    results=output,
    default_config=default_config,
    space=space,
    backward=Backward(_gradients, saved=("logits", "labels", "ignore_index", "reduction", "label_smoothing",
                                         "logit_softcap", "lse", "scale"),
                      plan=backward_plan, reference=cross_entropy_backward_reference, results=backward_results,
                      residuals=Residuals(("lse", "scale"), training_plan, training_outputs,
                                          cross_entropy_training_reference)),
    doc="a program per row: an online pass for the log-sum-exp, the label's logit read once; one program "
        "reduces; backward: one pass per row from the saved log-sum-exp",
)
cross_entropy = KERNEL.function
dlcore_ops, dlcore_implementations = KERNEL.dlcore_ops, KERNEL.dlcore_implementations
