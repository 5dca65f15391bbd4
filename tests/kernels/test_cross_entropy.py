from __future__ import annotations

import dlblas_kernels
import pytest
import torch
from conftest import ON_GPU
from dlblas_kernels.kernels.cross_entropy import (
    KERNEL,
    OP,
    backward_plan,
    cross_entropy,
    cross_entropy_reference,
    row_config,
    training_plan,
)
from gradients import leaves

import dlcore
from dlcore import InvalidInputError
from dlcore.errors import NoDoubleBackwardError
from dlcore.testing import assert_close, randn

TRITON = KERNEL.implementation
# Rows longer than the block: the online pass loops.
LOOPING = {"BLOCK_V": 16, "num_warps": 1}
OPTIONS = {
    "plain": {},
    "smoothing": {"label_smoothing": 0.1},
    "softcap": {"logit_softcap": 3.0},
    "both, ignore 7": {"label_smoothing": 0.25, "logit_softcap": 5.0, "ignore_index": 7},
}


def logits(*shape, dtype, device, gen):
    """Spread as a language model's are: a few dominate each row."""
    return randn(*shape, dtype=dtype, device=device, generator=gen, scale=4.0)


def labels(rows, vocab, device, gen, ignore_index=-100, dtype=torch.int64):
    """Random labels, every third row ignored, the first and last classes among them."""
    found = torch.randint(0, vocab, (rows,), generator=gen)
    found[::3] = ignore_index
    found[1], found[-1] = 0, vocab - 1
    return found.to(device=device, dtype=dtype)


def check_backward(fn, reference, args, wrt, gen, reduce_dim):
    """The loss (float32, the reference's tolerance whatever the inputs' dtype) and the gradients of
    ``args[i]`` for ``i`` in ``wrt`` (in their dtype), for a random loss gradient, against float64."""
    inputs = leaves(args, wrt)
    loss = fn(*inputs)
    dloss = randn(*loss.shape, generator=gen).to(loss.device)
    grads = torch.autograd.grad(loss, [inputs[i] for i in wrt], dloss)
    inputs64 = leaves([a.double() if a.is_floating_point() else a for a in args], wrt)
    expected = reference(*inputs64)
    expected_grads = torch.autograd.grad(expected, [inputs64[i] for i in wrt], dloss.double())
    assert_close(loss, expected, torch.float32, reduce_dim)
    for i, grad, ref in zip(wrt, grads, expected_grads):
        assert_close(grad, ref, args[i].dtype, reduce_dim)


def args_of(x, y, reduction="mean", label_smoothing=0.0, logit_softcap=None, ignore_index=-100):
    return (x, y, ignore_index, reduction, label_smoothing, logit_softcap)


def test_forward_and_backward_match_the_reference_in_brief(device, gen):
    """The fast lane's case: every option at once; the whole matrix is the slow lane's."""
    x = logits(13, 100, dtype=torch.float32, device=device, gen=gen)
    y = labels(13, 100, device, gen, 7)
    options = OPTIONS["both, ignore 7"]
    check_backward(lambda x: cross_entropy(x, y, **options), lambda x: cross_entropy_reference(x, y, **options),
                   (x,), (0,), gen, reduce_dim=100)


@pytest.mark.slow
@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_forward_and_backward_match_the_reference(reduction, options, dtype, device, gen):
    x = logits(13, 100, dtype=dtype, device=device, gen=gen)
    y = labels(13, 100, device, gen, options.get("ignore_index", -100))
    check_backward(lambda x: cross_entropy(x, y, reduction=reduction, **options),
                   lambda x: cross_entropy_reference(x, y, reduction=reduction, **options), (x,), (0,), gen,
                   reduce_dim=100)


@pytest.mark.slow
@pytest.mark.parametrize("config", [LOOPING, {"BLOCK_V": 128, "num_warps": 2}], ids=["looped", "one block"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_plans_write_every_output(config, reduction, dtype, device, gen, run, launch, profile):
    """Forward and backward plans, outputs poisoned first; rows longer than a block loop."""
    x = logits(9, 100, dtype=dtype, device=device, gen=gen)
    y = labels(9, 100, device, gen, dtype=torch.int32)
    args = args_of(x, y, reduction, 0.1, 4.0)
    expected = cross_entropy_reference(x.double(), y, -100, reduction, 0.1, 4.0)
    assert_close(run(OP, TRITON, args, config), expected, torch.float32, reduce_dim=100)
    loss, lse, scale = launch(training_plan(args, config, profile))
    dloss = randn(*loss.shape, device=device, generator=gen)
    dx = launch(backward_plan((dloss, x, y, lse, scale, -100, reduction, 0.1, 4.0), config, profile))
    x64 = x.double().requires_grad_()
    cross_entropy_reference(x64, y, -100, reduction, 0.1, 4.0).backward(dloss.double())
    assert_close(dx, x64.grad, dtype, reduce_dim=100)


def test_non_contiguous_logits(dtype, device, gen, relayout):
    x = relayout(logits(7, 60, dtype=dtype, device=device, gen=gen))
    y = labels(7, 60, device, gen)[::1]
    check_backward(lambda x: cross_entropy(x, y), lambda x: cross_entropy_reference(x, y), (x,), (0,), gen,
                   reduce_dim=60)


def test_every_row_ignored_is_torchs_nan_mean_and_zero_gradient(device, gen):
    x = logits(5, 30, dtype=torch.float32, device=device, gen=gen).requires_grad_()
    y = torch.full((5,), -100, device=device)
    loss = cross_entropy(x, y)
    assert torch.isnan(loss) and torch.isnan(torch.nn.functional.cross_entropy(x, y))
    loss.backward()
    assert torch.equal(x.grad, torch.zeros_like(x))
    assert cross_entropy(x, y, reduction="sum").item() == 0.0


def test_no_rows(device):
    x = torch.empty(0, 30, device=device, requires_grad=True)
    y = torch.empty(0, dtype=torch.int64, device=device)
    assert torch.isnan(cross_entropy(x, y))
    assert cross_entropy(x, y, reduction="sum").item() == 0.0
    assert cross_entropy(x, y, reduction="none").shape == (0,)
    cross_entropy(x, y, reduction="sum").backward()
    assert x.grad.shape == (0, 30)


@pytest.mark.parametrize("bad, where", [(30, "holds 30"), (-1, "holds -1")])
def test_labels_out_of_range_are_refused_before_a_launch(bad, where, device, gen, no_launch):
    x = logits(4, 30, dtype=torch.float32, device=device, gen=gen)
    y = torch.tensor([1, bad, -100, 2], device=device)
    with pytest.raises(InvalidInputError, match=f"labels.*{where}"):
        cross_entropy(x, y)
    with pytest.raises(InvalidInputError, match="labels"):
        cross_entropy(x, y[:3].clone())  # one label per row
    with pytest.raises(InvalidInputError, match="label_smoothing"):
        cross_entropy(x, y.clamp(min=0), label_smoothing=1.5)
    with pytest.raises(InvalidInputError, match="logit_softcap"):
        cross_entropy(x, y.clamp(min=0), logit_softcap=0.0)


def test_the_float64_reference_path_checks_the_labels_too(gen):
    """float64 inputs take the reference (gradcheck's path); a label out of range is named there
    as it is for the kernels, not left to torch's IndexError."""
    x = logits(4, 30, dtype=torch.float64, device="cpu", gen=gen)
    with pytest.raises(InvalidInputError, match="labels.*holds 30"):
        cross_entropy(x.requires_grad_(), torch.tensor([1, 30, -100, 2]))


def test_a_bound_op_reused_with_an_out_of_range_label_counts_its_row_as_ignored(device, gen):
    """A bound op does not check the labels again: the kernel never reads at such a label."""
    x = logits(4, 30, dtype=torch.float32, device=device, gen=gen)
    good = torch.tensor([1, 2, 3, 4], device=device)
    op = dlcore.get_op("cross_entropy", (x, good))
    op(x, good)  # the first call of these input metadata checks them; later ones do not
    bad = torch.tensor([1, 10**9, 3, -5], device=device)
    ignored = torch.tensor([1, -100, 3, -100], device=device)
    assert_close(op(x, bad), cross_entropy_reference(x.double(), ignored), torch.float32, reduce_dim=30)


def test_public_function_is_the_package_s(device, gen, run):
    x = logits(3, 20, dtype=torch.float16, device=device, gen=gen)
    y = labels(3, 20, device, gen)
    assert dlblas_kernels.cross_entropy is cross_entropy
    assert torch.equal(cross_entropy(x, y), run(OP, TRITON, args_of(x, y)))
    assert cross_entropy(x, y).dtype == torch.float32


def test_default_configs():
    assert row_config(100) == {"BLOCK_V": 128, "num_warps": 1}
    assert row_config(128256) == {"BLOCK_V": 4096, "num_warps": 16}


def test_second_order_is_refused(device, gen):
    x = logits(3, 20, dtype=torch.float32, device=device, gen=gen).requires_grad_()
    (grad,) = torch.autograd.grad(cross_entropy(x, labels(3, 20, device, gen)), x, create_graph=True)
    with pytest.raises(NoDoubleBackwardError):
        grad.sum().backward()


@pytest.mark.slow
def test_custom_op_passes_opcheck(device, gen):
    x = logits(5, 24, dtype=torch.float32, device=device, gen=gen).requires_grad_()
    y = labels(5, 24, device, gen)
    torch.library.opcheck(torch.ops.dlblas.cross_entropy.default, (x, y, -100, "mean", 0.0, None, 0, 0))


@pytest.mark.skipif(not ON_GPU, reason="real sizes in bfloat16: a GPU's")
@pytest.mark.parametrize("softcap", [None, 30.0], ids=["plain", "softcap"])
def test_real_sizes_in_bfloat16(softcap):
    """LLaMA-3's vocabulary at 4096 tokens: loss and gradient against the float32 composite."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (4 * torch.randn(4096, 128256, device="cuda", generator=gen)).bfloat16().requires_grad_()
    y = torch.randint(0, 128256, (4096,), device="cuda", generator=gen)
    y[::7] = -100
    loss = cross_entropy(x, y, label_smoothing=0.1, logit_softcap=softcap)
    loss.backward()
    x32 = x.detach().float().requires_grad_()
    expected = cross_entropy_reference(x32, y, label_smoothing=0.1, logit_softcap=softcap)
    expected.backward()
    assert_close(loss, expected.detach(), torch.float32, reduce_dim=128256)
    assert_close(x.grad, x32.grad, torch.bfloat16)
