from __future__ import annotations

import dlblas_kernels
import pytest
import torch
from conftest import ON_GPU
from dlblas_kernels.kernels.fused_linear_cross_entropy import (
    KERNEL,
    OP,
    backward_plan,
    default_chunk,
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_reference,
    training_plan,
)
from gradients import leaves

from dlcore import InvalidInputError
from dlcore.testing import assert_close, randn, tolerance

TRITON = KERNEL.implementation
CHUNKED = {"CHUNK": 16, "BLOCK_V": 32, "num_warps": 1}  # ragged chunks, rows looping over blocks
OPTIONS = {
    "plain": {},
    "bias, smoothing": {"bias": True, "label_smoothing": 0.1},
    "bias, softcap, ignore 3": {"bias": True, "logit_softcap": 4.0, "label_smoothing": 0.2, "ignore_index": 3},
}


def inputs(rows, width, vocab, dtype, device, gen, bias=False, ignore_index=-100):
    hidden = randn(rows, width, dtype=dtype, device=device, generator=gen)
    weight = randn(vocab, width, dtype=dtype, device=device, generator=gen, scale=width ** -0.5)
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    labels[::3] = ignore_index
    labels[1] = vocab - 1
    b = randn(vocab, dtype=dtype, device=device, generator=gen) if bias else None
    return hidden, weight, labels.to(device), b


def check(hidden, weight, labels, bias, gen, **options):
    """Loss (float32 tolerance) and the gradients of hidden, weight and bias (their dtype's) for a
    random loss gradient, against autograd through the float64 composite."""
    args = (hidden, weight, labels, bias)
    wrt = [0, 1] + ([3] if bias is not None else [])
    ins = leaves(args, wrt)
    loss = fused_linear_cross_entropy(*ins, **options)
    dloss = randn(*loss.shape, generator=gen).to(loss.device)
    grads = torch.autograd.grad(loss, [ins[i] for i in wrt], dloss)
    ins64 = leaves([a.double() if a is not None and a.is_floating_point() else a for a in args], wrt)
    expected = fused_linear_cross_entropy_reference(*ins64, **options)
    expected_grads = torch.autograd.grad(expected, [ins64[i] for i in wrt], dloss.double())
    width, vocab = weight.shape[1], weight.shape[0]
    assert_close(loss, expected, torch.float32, reduce_dim=vocab)
    for i, grad, ref in zip(wrt, grads, expected_grads):
        assert_close(grad, ref, args[i].dtype, reduce_dim=max(width, hidden.shape[0]))


def test_matches_the_composite_in_brief(device, gen):
    """The fast lane's case: three ragged chunks, a bias, smoothing and a soft cap; the matrix is slow."""
    hidden, weight, labels, bias = inputs(37, 24, 100, torch.float32, device, gen, bias=True)
    check(hidden, weight, labels, bias, gen, label_smoothing=0.1, logit_softcap=4.0)


@pytest.mark.slow
@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_the_composite(reduction, options, dtype, device, gen):
    options = dict(options)
    hidden, weight, labels, bias = inputs(37, 24, 100, dtype, device, gen, options.pop("bias", False),
                                          options.get("ignore_index", -100))
    check(hidden, weight, labels, bias, gen, reduction=reduction, **options)


def test_non_contiguous_hidden(device, gen, relayout):
    """A view of the last hidden states (padded rows, or every other column)."""
    hidden, weight, labels, _ = inputs(21, 16, 50, torch.float32, device, gen)
    check(relayout(hidden), weight, labels, None, gen)


@pytest.mark.parametrize("reduction", ["sum", pytest.param("none", marks=pytest.mark.slow)])
def test_plans_in_chunks_never_hold_the_whole_logits(reduction, device, gen, run, launch, profile):
    """Every tensor a launch takes is at most a chunk of logits (CHUNK x V), never T x V; the
    training and backward plans give the composite's gradients, outputs poisoned first."""
    hidden, weight, labels, bias = inputs(40, 16, 60, torch.float32, device, gen, bias=True)
    args = (hidden, weight, labels, bias, -100, reduction, 0.0, None)
    for made in (TRITON.plan(args, CHUNKED, profile), training_plan(args, CHUNKED, profile)):
        sizes = [t.numel() for call in made.calls for t in call.args if isinstance(t, torch.Tensor)]
        assert max(sizes) < 40 * 60 and 16 * 60 in sizes
    expected = fused_linear_cross_entropy_reference(*(a.double() if isinstance(a, torch.Tensor) and
                                                      a.is_floating_point() else a for a in args))
    assert_close(run(OP, TRITON, args, CHUNKED), expected, torch.float32, reduce_dim=60)
    outs = launch(training_plan(args, CHUNKED, profile))
    assert_close(outs[0], expected, torch.float32, reduce_dim=60)
    if reduction == "none":
        dloss = randn(40, device=device, generator=gen)
        grads = launch(backward_plan((dloss, hidden, weight, labels, bias, outs[5], -100, 0.0, None), CHUNKED,
                                     profile))
        wrt = leaves([hidden.double(), weight.double(), labels, bias.double()], [0, 1, 3])
        fused_linear_cross_entropy_reference(*wrt, reduction="none").backward(dloss.double())
        for grad, ref in zip(grads, (wrt[0].grad, wrt[1].grad, wrt[3].grad)):
            assert_close(grad, ref, torch.float32, reduce_dim=40)


def test_every_row_ignored_and_no_rows(device, gen):
    hidden, weight, _, _ = inputs(5, 8, 20, torch.float32, device, gen)
    ignored = torch.full((5,), -100, device=device)
    h, w = leaves((hidden, weight), [0, 1])
    loss = fused_linear_cross_entropy(h, w, ignored)
    assert torch.isnan(loss)
    loss.backward()
    assert torch.equal(h.grad, torch.zeros_like(h)) and torch.equal(w.grad, torch.zeros_like(w))
    h, w = leaves((hidden[:0], weight), [0, 1])
    none = torch.empty(0, dtype=torch.int64, device=device)
    assert torch.isnan(fused_linear_cross_entropy(h, w, none))
    fused_linear_cross_entropy(h, w, none, reduction="sum").backward()
    assert h.grad.shape == (0, 8) and torch.equal(w.grad, torch.zeros_like(w))
    assert fused_linear_cross_entropy(h, w, none, reduction="none").shape == (0,)


def test_bad_inputs_are_refused_by_name(device, gen, no_launch):
    hidden, weight, labels, _ = inputs(6, 8, 20, torch.float32, device, gen)
    with pytest.raises(InvalidInputError, match="labels holds 20"):
        fused_linear_cross_entropy(hidden, weight, torch.tensor([1, 2, 20, 3, 4, 5], device=device))
    with pytest.raises(InvalidInputError, match="weight"):
        fused_linear_cross_entropy(hidden, weight[:, :4], labels)
    with pytest.raises(InvalidInputError, match="bias"):
        fused_linear_cross_entropy(hidden, weight, labels, torch.zeros(19, device=device))
    with pytest.raises(InvalidInputError, match="labels"):
        fused_linear_cross_entropy(hidden, weight, labels[:5])


def test_a_second_backward_through_one_loss_is_refused(device, gen):
    """The gradients made in the forward are scaled in place by the first backward."""
    hidden, weight, labels, _ = inputs(6, 8, 20, torch.float32, device, gen)
    h = hidden.requires_grad_()
    loss = fused_linear_cross_entropy(h, weight, labels)
    torch.autograd.grad(loss, h, retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(loss, h)


def test_float64_takes_the_references_and_gradchecks(gen):
    hidden, weight, labels, bias = inputs(6, 5, 12, torch.float64, "cpu", gen, bias=True)
    for reduction in ("mean", "none"):
        def loss(h, w, b, reduction=reduction):
            return fused_linear_cross_entropy(h, w, labels, b, reduction=reduction, label_smoothing=0.1,
                                              logit_softcap=3.0)

        assert torch.autograd.gradcheck(loss, leaves((hidden, weight, bias), [0, 1, 2]))


def test_default_chunk():
    assert default_chunk(16384, 128256, 2) == 1024  # LLaMA-3: 263 MB of bf16 logits a chunk
    assert default_chunk(4096, 128256, 2) == 1024
    assert default_chunk(4096, 128256, 4) == 1024
    assert default_chunk(4096, 2 * 262144, 2) == 512  # the logits' budget: 512 MiB
    assert default_chunk(300, 128256, 2) == 512  # fewer rows: one chunk
    assert default_chunk(5, 100, 4) == 16
    assert dlblas_kernels.fused_linear_cross_entropy is fused_linear_cross_entropy


@pytest.mark.skipif(not ON_GPU, reason="real sizes in bfloat16: a GPU's")
@pytest.mark.parametrize("rows, width, vocab", [(4096, 4096, 128256), (1000, 3584, 152064)],
                         ids=["llama3-8b-4096", "qwen2.5-7b-1000"])
def test_real_sizes_in_bfloat16_hold_one_chunk_of_logits_above_the_gradients(rows, width, vocab):
    """The loss and gradients against the float32 composite, and the peak memory of forward and
    backward above the inputs and their gradients: one chunk's logits and small change, where the
    composite holds the whole logits several times."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(rows, width, device="cuda", generator=gen).bfloat16().requires_grad_()
    weight = (torch.randn(vocab, width, device="cuda", generator=gen) / width ** 0.5).bfloat16().requires_grad_()
    labels = torch.randint(0, vocab, (rows,), device="cuda", generator=gen)
    labels[::7] = -100
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = fused_linear_cross_entropy(hidden, weight, labels)
    loss.backward()
    torch.cuda.synchronize()
    above = torch.cuda.max_memory_allocated() - base - 2 * (hidden.numel() + weight.numel())
    chunk = default_chunk(rows, vocab, 2) * vocab * 2
    assert above <= 1.1 * chunk + 2**24, f"{above / 2**20:.0f} MiB above the gradients, a chunk {chunk / 2**20:.0f}"
    h, w = (t.detach().float().requires_grad_() for t in (hidden, weight))
    expected = torch.nn.functional.cross_entropy(h @ w.T, labels)
    expected.backward()
    atol, rtol = tolerance(torch.bfloat16, width)
    torch.testing.assert_close(loss.float(), expected, atol=atol, rtol=rtol)
    torch.testing.assert_close(hidden.grad.float(), h.grad, atol=atol, rtol=rtol)
    torch.testing.assert_close(weight.grad.float(), w.grad, atol=atol, rtol=rtol)
