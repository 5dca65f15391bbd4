"""Selection, tuning and ``dlcore check --training`` check gradients against the float64 reference's:
a kernel plugin whose backward is wrong is refused, naming the input whose gradient is off; one
whose backward is right is chosen and passes."""

from __future__ import annotations

import re

import pytest
import torch
import triton
import triton.language as tl
from test_dispatch import OpsPlugin, with_plugins

import dlcore
from dlcore.api import Backward, KernelCall, LaunchPlan, Op, PowerOfTwo, SearchSpace, TensorArg, define_kernel
from dlcore.cli import main
from dlcore.errors import NoKernelError
from dlcore.tuning.verify import Reference, UncheckedWarning, mismatch

F32 = (torch.float32,)


@triton.jit
def _mul(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x * y, mask=mask)


@triton.jit
def _mul_backward(dout_ptr, x_ptr, y_ptr, dx_ptr, dy_ptr, n, WRONG: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dout = tl.load(dout_ptr + offs, mask=mask)
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(dx_ptr + offs, dout * y, mask=mask)
    if WRONG:  # y's gradient, as a careless author might write it: the product's, not dout's
        tl.store(dy_ptr + offs, x * y, mask=mask)
    else:
        tl.store(dy_ptr + offs, dout * x, mask=mask)


def mul_reference(x, y):
    return x * y


def mul_backward_reference(dout: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return dout * y, dout * x


OP = Op("grad_check_mul", args=(TensorArg("x", F32, layouts=("contiguous",)),
                                TensorArg("y", F32, layouts=("contiguous",))),
        reference=mul_reference,
        example=lambda sizes, dtype, device, generator: tuple(
            torch.randn(sizes["n"], generator=generator).to(device=device, dtype=dtype) for _ in range(2)),
        example_sizes={"n": 300})


def _plan(args, config, profile):
    x, y = args
    out = torch.empty_like(x)
    grid = (triton.cdiv(x.numel(), config["BLOCK"]),)
    return LaunchPlan([KernelCall(_mul, grid, (x, y, out, x.numel()), {"BLOCK": config["BLOCK"]})], out)


def _backward_launches(args, config, wrong):
    dout, x, y = args
    dx, dy = torch.empty_like(x), torch.empty_like(y)
    grid = (triton.cdiv(x.numel(), config["BLOCK"]),)
    call = KernelCall(_mul_backward, grid, (dout.contiguous(), x, y, dx, dy, x.numel()),
                      {"WRONG": wrong, "BLOCK": config["BLOCK"]})
    return LaunchPlan([call], (dx, dy))


def _right_backward(args, config, profile):
    return _backward_launches(args, config, False)


def _wrong_backward(args, config, profile):
    return _backward_launches(args, config, True)


def _wrong_at_64(args, config, profile):
    """Right at the default BLOCK, wrong at 64: what only a check of every config finds."""
    return _backward_launches(args, config, config["BLOCK"] == 64)


def _gradients(backward, saved, grads, needs):
    dx, dy = backward(grads[0], saved.x, saved.y)
    return {"x": dx, "y": dy}


def _kernel(name, backward_plan):
    return define_kernel(
        OP, _plan, kernels=(_mul, _mul_backward), namespace=f"dlcore_test_{name}", name=name,
        results=lambda x, y: torch.empty_like(x),
        default_config=lambda signature, profile: {"BLOCK": 128},
        space=lambda profile: SearchSpace([PowerOfTwo("BLOCK", 64, 256)]),
        backward=Backward(_gradients, saved=("x", "y"), plan=backward_plan, reference=mul_backward_reference,
                          results=lambda dout, x, y: (torch.empty_like(x), torch.empty_like(y))))


RIGHT = _kernel("right", _right_backward)
WRONG = _kernel("wrong", _wrong_backward)
WRONG_AT_64 = _kernel("wrong_at_64", _wrong_at_64)


def register(monkeypatch, *kernels):
    with_plugins(monkeypatch, OpsPlugin([OP], [k.implementation for k in kernels]))


def training_inputs(device, n=300):
    gen = torch.Generator().manual_seed(1)
    return tuple(torch.randn(n, generator=gen).to(device).requires_grad_() for _ in range(2))


def test_check_training_names_the_wrong_gradient(monkeypatch, capsys, kernel_device):
    register(monkeypatch, WRONG)
    assert main(["check", "grad_check_mul", "--training", "--device", kernel_device]) == 1
    out = capsys.readouterr().out
    assert re.search(r"against the float64 reference: max abs error \S+: OK", out), out  # the forward is right
    assert re.search(r"\n  gradient of x: max abs error \S+: OK\n", out), out
    wrong = r"\n  gradient of y: max abs error \S+: MISMATCH: gradient of y: \d+ of 300 elements off"
    assert re.search(wrong, out), out


def test_check_training_passes_a_right_kernel(monkeypatch, capsys, kernel_device):
    register(monkeypatch, RIGHT)
    assert main(["check", "grad_check_mul", "--training", "--device", kernel_device]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\n  gradient of x: max abs error \S+: OK\n  gradient of y: max abs error \S+: OK\n", out), out


def test_tuning_does_not_pick_a_wrong_backward(monkeypatch, kernel_device):
    register(monkeypatch, WRONG, RIGHT)
    args = training_inputs(kernel_device)
    op = dlcore.get_op("grad_check_mul", args, tune="quick")
    assert op.impl.name == "right", op.explain()
    assert "gradient of y" in op.selection.failed["wrong"]
    out = op(*args)
    grads = torch.autograd.grad(out, args, torch.ones_like(out))
    torch.testing.assert_close(grads[1], args[0].detach())


def test_selection_without_tuning_rejects_a_wrong_backward(monkeypatch, kernel_device):
    register(monkeypatch, WRONG, RIGHT)
    op = dlcore.get_op("grad_check_mul", training_inputs(kernel_device))
    assert op.impl.name == "right", op.explain()
    assert op.selection.failed["wrong"].startswith("wrong result: gradient of y: ")


def test_a_reference_too_large_for_memory_leaves_selection_unchecked(monkeypatch, kernel_device):
    """At training shapes whose float64 reference does not fit beside the inputs (attention's scores
    at long sequences), selection still chooses, and says that it did so unchecked."""
    register(monkeypatch, WRONG, RIGHT)

    def too_large(self, grads_out):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")

    monkeypatch.setattr(Reference, "gradients", too_large)
    with pytest.warns(UncheckedWarning, match="grad_check_mul .*does not fit in memory"):
        op = dlcore.get_op("grad_check_mul", training_inputs(kernel_device))
    assert set(op.selection.measured) == {"wrong", "right"} and not op.selection.failed


def test_inference_is_not_blamed_for_the_backward(monkeypatch, kernel_device):
    register(monkeypatch, WRONG, RIGHT)
    op = dlcore.get_op("grad_check_mul", tuple(a.detach() for a in training_inputs(kernel_device)))
    assert "wrong" in op.selection.measured and not op.selection.failed


def test_a_lone_wrong_backward_is_not_tuned(monkeypatch, kernel_device):
    register(monkeypatch, WRONG)
    with pytest.raises(NoKernelError, match="gradient of y: .* elements off"):
        dlcore.get_op("grad_check_mul", training_inputs(kernel_device), tune="quick")


def test_every_config_s_gradients_are_checked(monkeypatch, kernel_device):
    register(monkeypatch, WRONG_AT_64)
    seen = []
    op = dlcore.get_op("grad_check_mul", training_inputs(kernel_device), tune="full", strategy="grid",
                       progress=seen.append)
    assert {e.config["BLOCK"] for e in seen} == {64, 128, 256}
    for evaluation in seen:
        if evaluation.config["BLOCK"] == 64:
            assert evaluation.failed and "gradient of y" in evaluation.reason, evaluation
        else:
            assert not evaluation.failed, evaluation
    assert op.config["BLOCK"] != 64


@pytest.mark.parametrize("op, shape", [("matmul", "tokens=5,hidden=32,inter=24"),
                                       ("ffn", "tokens=5,hidden=32,inter=24")])
def test_check_training_of_ops_with_optional_inputs(capsys, op, shape, kernel_device):
    """matmul's bias and ffn's optional inputs are None in the example: no gradient asked of them."""
    assert main(["check", op, "--shape", shape, "--training", "--device", kernel_device]) == 0
    out = capsys.readouterr().out
    wanted = ("a", "b") if op == "matmul" else ("x", "w1", "w3")
    for name in wanted:
        assert f"  gradient of {name}: max abs error" in out, out
    assert "MISMATCH" not in out


def test_check_of_float8_outputs(capsys, kernel_device):
    """Float8 outputs are compared upcast; under Triton's interpreter, whose float8 conversions are
    wrong, the check refuses in one line."""
    code = main(["check", "quantize_fp8", "--shape", "tokens=5,hidden=128", "--device", kernel_device])
    captured = capsys.readouterr()
    if kernel_device == "cpu":
        assert code == 2
        assert captured.err.count("\n") == 1 and "TRITON_INTERPRET=1" in captured.err, captured.err
    else:
        assert code == 0 and ": OK" in captured.out, captured.out


def test_a_gradient_s_tolerance_follows_its_largest_element():
    """A gradient element that sums terms which cancel keeps the rounding of the terms: in 16-bit
    dtypes it is held to the tolerance of the gradient's largest element, not its own."""
    expected = torch.tensor([1000.0, 0.0], dtype=torch.float64)
    rounded = torch.tensor([1000.0, 0.5], dtype=torch.bfloat16)
    assert "1 of 2 elements off" in mismatch((rounded,), (expected,))
    assert mismatch((rounded,), (expected,), by_largest=True) is None
    wrong = torch.tensor([1000.0, 40.0], dtype=torch.bfloat16)
    problem = mismatch((wrong,), (expected,), labels=("gradient of w",), by_largest=True)
    assert problem.startswith("gradient of w: 1 of 2 elements off"), problem
