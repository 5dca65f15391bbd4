"""Optional tensor arguments and string scalars through the kernel template: ``shift(x, b=None,
activation=None) = act(x + b)``, differentiable in x and b, ``b`` optional, ``activation`` one of a
few names."""

from __future__ import annotations

import inspect

import pytest
import torch
import triton
import triton.language as tl
from gradients import check_backward

from dlcore import InvalidInputError
from dlcore.declarations.device import DeviceProfile
from dlcore.declarations.implementation import Config, KernelCall, LaunchPlan
from dlcore.declarations.op import Op, ScalarArg, TensorArg
from dlcore.declarations.signature import Signature, cdiv, make_signature
from dlcore.declarations.space import PowerOfTwo, SearchSpace
from dlcore.dispatch.dispatcher import Dispatcher
from dlcore.errors import DeclarationError
from dlcore.plugins.discovery import PluginRecord, PluginStatus, discover
from dlcore.plugins.registry import Registry
from dlcore.runtime.template import Backward, define_kernel
from dlcore.testing import randn

NAMESPACE = "dlc_template_optional_test"
ACTIVATIONS = (None, "relu")


@triton.jit
def _shift_kernel(x_ptr, b_ptr, y_ptr, n, HAS_B: tl.constexpr, RELU: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    y = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    if HAS_B:
        y += tl.load(b_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    if RELU:
        y = tl.maximum(y, 0.0)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=offs < n)


def plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    x, b, activation = args
    y = torch.empty_like(x)
    call = KernelCall(_shift_kernel, (cdiv(x.numel(), config["BLOCK"]),), (x, b, y, x.numel()),
                      {"HAS_B": b is not None, "RELU": activation == "relu", "BLOCK": config["BLOCK"]})
    return LaunchPlan([call], y)


def shift_reference(x: torch.Tensor, b: torch.Tensor | None = None, activation: str | None = None) -> torch.Tensor:
    y = x.to(torch.promote_types(x.dtype, torch.float32))
    if b is not None:
        y = y + b
    return (torch.relu(y) if activation == "relu" else y).to(x.dtype)


def shift_backward_reference(dy: torch.Tensor, y: torch.Tensor, activation: str | None) -> torch.Tensor:
    return dy * (y > 0) if activation == "relu" else dy.clone()


def backward_plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    dy, y, activation = args
    return LaunchPlan([], shift_backward_reference(dy, y, activation))


def _gradients(backward, saved, grads, needs) -> dict:
    dx = backward(grads[0], saved.out, saved.activation)
    return {"x": dx, "b": dx if needs["b"] else None}


def default_config(signature: Signature, profile: DeviceProfile) -> Config:
    return {"BLOCK": 32 if signature.optional("b") is None else 64}


OP = Op("shift", args=(TensorArg("x", (torch.float16, torch.float32), layouts=("contiguous",)),
                       TensorArg("b", (torch.float16, torch.float32), layouts=("contiguous",), same_dtype_as="x",
                                 optional=True),
                       ScalarArg("activation", (str, type(None)), default=None, keyed=True, choices=ACTIVATIONS)),
        reference=shift_reference, doc="act(x + b)")
KERNEL = define_kernel(
    OP, plan, kernels=(_shift_kernel,), results=lambda x, b, activation: torch.empty_like(x),
    default_config=default_config, space=lambda profile: SearchSpace([PowerOfTwo("BLOCK", 16, 64)]),
    namespace=NAMESPACE, replayable=False,
    backward=Backward(_gradients, saved=("out", "activation"), plan=backward_plan, reference=shift_backward_reference,
                      results=lambda dy, y, activation: torch.empty_like(dy), renames={"x": "dy"}),
)
ops = getattr(torch.ops, NAMESPACE)


def test_schema_has_optional_tensors_and_strings():
    assert str(ops.shift.default._schema) == (
        f"{NAMESPACE}::shift(Tensor x, Tensor? b, str? activation, int block) -> Tensor")
    assert str(inspect.signature(KERNEL.function)) == "(x, b=None, activation=None)"
    assert OP.usage() == "shift(x, b=None, activation=None)"


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("with_b", [False, True])
def test_public_function_with_and_without_the_optional_tensor(device, gen, with_b, activation):
    x = randn(75, device=device, generator=gen)
    b = randn(75, device=device, generator=gen) if with_b else None
    torch.testing.assert_close(KERNEL.function(x, b, activation), shift_reference(x, b, activation))
    torch.testing.assert_close(ops.shift(x, b, activation, 16), shift_reference(x, b, activation))


def test_signature_records_an_absent_optional_tensor(device):
    x = torch.empty(8, device=device)
    absent = make_signature(OP, (x, None, None), x.device)
    present = make_signature(OP, (x, torch.empty(8, device=device), "relu"), x.device)
    assert absent.absent == ("b",) and absent.optional("b") is None and "b=None" in absent.key()
    assert present.absent == () and present.optional("b").shape == (8,) and "activation='relu'" in present.key()
    assert absent.key() != present.key()


def test_bad_values_name_the_argument(device):
    x = torch.empty(8, device=device)
    with pytest.raises(InvalidInputError, match="activation.*'gelu'.*one of None, 'relu'"):
        KERNEL.function(x, None, "gelu")
    with pytest.raises(InvalidInputError, match="activation.*int"):
        KERNEL.function(x, None, 3)
    with pytest.raises(InvalidInputError, match="b has dtype torch.float16"):
        KERNEL.function(x, x.half())
    with pytest.raises(InvalidInputError, match="b is a list"):
        KERNEL.function(x, [1.0])


def test_get_op_takes_the_optional_arguments_by_name(device, gen, tmp_path):
    record = PluginRecord("dlcore.kernels", "shift", "tests")
    record.status = PluginStatus.LOADED
    found = discover()
    found.records.append(record)
    found.manager.register(KERNEL, name=record.id)
    reg = Registry(found)
    x = randn(40, device=device, generator=gen)
    b = randn(40, device=device, generator=gen)
    dispatcher = Dispatcher(lambda: reg, tmp_path)
    for kwargs in ({"b": b, "activation": "relu"}, {}, {"activation": None}):
        bound = dispatcher.get_op("shift", (x,), kwargs)
        torch.testing.assert_close(bound(x, **kwargs), shift_reference(x, **kwargs))
    assert "b=None" in dispatcher.get_op("shift", (x,)).explain()


@pytest.mark.parametrize("with_b", [False, True])
def test_autograd_with_and_without_the_optional_tensor(device, gen, with_b):
    x = randn(37, device=device, generator=gen)
    b = randn(37, device=device, generator=gen) if with_b else None
    check_backward(lambda x, b, a: KERNEL.function(x, b, a), shift_reference, (x, b, "relu"),
                   (0, 1) if with_b else (0,), gen)


def test_an_optional_first_tensor_is_refused():
    op = Op("shift_bad", args=(TensorArg("b", (torch.float32,), optional=True), TensorArg("x", (torch.float32,))),
            reference=shift_reference)
    with pytest.raises(DeclarationError, match="not optional"):
        define_kernel(op, plan, kernels=(_shift_kernel,), results=lambda b, x: x, default_config=default_config,
                      namespace=NAMESPACE)
