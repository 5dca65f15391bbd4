"""The kernel template itself (dlcore.runtime.template), on a kernel of its own in a third-party
namespace: ``scale(x, alpha) = alpha * x``, differentiable in x."""

from __future__ import annotations

import inspect

import pluggy
import pytest
import torch
import triton
import triton.language as tl
from gradients import check_backward, leaves

import dlcore.plugins.hookspecs
from dlcore import InvalidInputError
from dlcore.declarations.device import DeviceProfile
from dlcore.declarations.implementation import Config, KernelCall, LaunchPlan
from dlcore.declarations.op import Op, ScalarArg, TensorArg
from dlcore.declarations.signature import Signature, cdiv, make_signature
from dlcore.declarations.space import PowerOfTwo, SearchSpace
from dlcore.errors import DeclarationError
from dlcore.runtime.template import UNKNOWN_DEVICE, Backward, define_kernel, device_profile
from dlcore.testing import randn

NAMESPACE = "dlc_template_test"
#: the profiles the plans were given, in order
PROFILES: list[DeviceProfile] = []


@triton.jit
def _scale_kernel(x_ptr, y_ptr, n, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (alpha * x).to(y_ptr.dtype.element_ty), mask=offs < n)


def _launch(x: torch.Tensor, alpha: float, config: Config) -> LaunchPlan:
    y = torch.empty_like(x)
    call = KernelCall(_scale_kernel, (cdiv(x.numel(), config["BLOCK"]),), (x, y, x.numel(), float(alpha)),
                      {"BLOCK": config["BLOCK"]})
    return LaunchPlan([call], y)


def plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    PROFILES.append(profile)
    x, alpha = args
    return _launch(x, alpha, config)


def backward_plan(args: tuple, config: Config, profile: DeviceProfile) -> LaunchPlan:
    dy, alpha = args
    return _launch(dy.contiguous(), alpha, config)


def scale_reference(x: torch.Tensor, alpha: float = 2.0) -> torch.Tensor:
    return (alpha * x.to(torch.promote_types(x.dtype, torch.float32))).to(x.dtype)


def scale_backward_reference(dy: torch.Tensor, alpha: float) -> torch.Tensor:
    return alpha * dy


def default_config(signature: Signature, profile: DeviceProfile) -> Config:
    return {"BLOCK": 64}


def space(profile: DeviceProfile) -> SearchSpace:
    return SearchSpace([PowerOfTwo("BLOCK", 16, 128)])


def _gradients(backward, saved, grads, needs) -> dict:
    return {"x": backward(grads[0], saved.alpha)}


OP = Op("scale", args=(TensorArg("x", (torch.float16, torch.float32), layouts=("contiguous",)),
                       ScalarArg("alpha", (float, int), default=2.0)),
        reference=scale_reference, doc="alpha * x")
KERNEL = define_kernel(
    OP, plan, kernels=(_scale_kernel,), results=lambda x, alpha: torch.empty_like(x),
    default_config=default_config, space=space, namespace=NAMESPACE,
    backward=Backward(_gradients, saved=("alpha",), plan=backward_plan, reference=scale_backward_reference,
                      results=lambda dy, alpha: torch.empty_like(dy), renames={"x": "dy"}),
)
ops = getattr(torch.ops, NAMESPACE)


def test_schema_comes_from_the_declaration_and_the_space():
    """Tensor and scalar arguments by their declared names and types; the config as ints named after
    the space's parameters; the backward's from its reference's annotations."""
    assert str(ops.scale.default._schema) == f"{NAMESPACE}::scale(Tensor x, float alpha, int block) -> Tensor"
    assert str(ops.scale_backward.default._schema) == (
        f"{NAMESPACE}::scale_backward(Tensor dy, float alpha, int block) -> Tensor")
    assert not hasattr(torch.ops.dlblas, "scale")  # a third party's namespace, not dlblas


def test_config_ints_are_named_after_the_config_keys():
    def wide(profile):
        return SearchSpace([PowerOfTwo("BLOCK_N", 16, 64), PowerOfTwo("num_warps", 1, 4)])

    op = Op("scale_wide", args=OP.args, reference=scale_reference)
    kernel = define_kernel(op, plan, kernels=(_scale_kernel,), results=lambda x, alpha: torch.empty_like(x),
                           default_config=lambda sig, profile: {"BLOCK_N": 64, "num_warps": 1}, space=wide,
                           namespace=NAMESPACE)
    assert [a.name for a in ops.scale_wide.default._schema.arguments] == ["x", "alpha", "block_n", "num_warps"]
    assert kernel.backward_op is None
    clash = Op("scale_clash", args=(TensorArg("x", (torch.float32,)), ScalarArg("block", (int,))),
               reference=scale_reference)
    with pytest.raises(DeclarationError, match="collide"):
        define_kernel(clash, plan, kernels=(_scale_kernel,), results=lambda x, block: x, default_config=default_config,
                      space=space, namespace=NAMESPACE)


def test_the_public_function_has_the_op_signature_and_runs_the_plan(device, gen):
    x = randn(100, device=device, generator=gen)
    assert str(inspect.signature(KERNEL.function)) == "(x, alpha=2.0)"
    assert KERNEL.function.__name__ == "scale" and KERNEL.function.__module__ == __name__
    PROFILES.clear()
    torch.testing.assert_close(KERNEL.function(x), 2 * x)
    torch.testing.assert_close(KERNEL.function(x, alpha=0.5), x / 2)
    # The plans get the profile of the inputs' device, as its backend describes it.
    assert PROFILES == [device_profile(torch.device(device))] * 2 and PROFILES[0] is not UNKNOWN_DEVICE
    with pytest.raises(InvalidInputError, match="int32"):
        KERNEL.function(x.to(torch.int32))


def test_fake_validates(device):
    x = torch.empty(16, 4, device=device, dtype=torch.float32)[:, 0]  # not contiguous
    with torch._subclasses.FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.empty(8, device=device))
        assert ops.scale(fake, 2.0, 0).shape == (8,)
        with pytest.raises(InvalidInputError, match="strides"):
            ops.scale(mode.from_tensor(x), 2.0, 0)


def test_autograd_through_the_generated_op_matches_the_reference(device, gen):
    x = randn(37, device=device, generator=gen)
    check_backward(lambda x, alpha: KERNEL.function(x, alpha), scale_reference, (x, 3.0), (0,), gen)
    torch.library.opcheck(ops.scale.default, (leaves((x,), (0,))[0], 3.0, 16))


def test_float64_takes_the_reference(device, no_launch):
    """No launch: the custom op's body and its backward run the torch reference (gradcheck's path)."""
    x = torch.randn(10, dtype=torch.float64, device=device, requires_grad=True)
    y = ops.scale(x, 3.0, 0)
    torch.testing.assert_close(y, 3 * x)
    (dx,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(dx, torch.full_like(x, 3.0))
    assert torch.autograd.gradcheck(lambda x: ops.scale(x, 3.0, 0), (x,))


def test_the_hooks_register_the_op_and_its_implementation():
    pm = pluggy.PluginManager("dlcore")
    pm.add_hookspecs(dlcore.plugins.hookspecs)
    pm.register(KERNEL, name="scale")
    pm.check_pending()
    assert pm.hook.dlcore_ops() == [[OP]]
    [[impl]] = pm.hook.dlcore_implementations()
    assert impl is KERNEL.implementation and impl.op == "scale" and impl.custom_op is not None


def test_space_and_backward_plan_take_a_profile(device):
    assert KERNEL.implementation.space().names == ("BLOCK",)
    x = torch.empty(50, device="meta")
    config = KERNEL.implementation.default_config(make_signature(OP, (x, 2.0), x.device), UNKNOWN_DEVICE)
    # The backward's launches for lowering: the formula run on made-up gradients, its call planned.
    (call,) = KERNEL.implementation.backward_plan((x, 2.0), config).calls
    assert call.kernel is _scale_kernel and call.grid == (1,)
