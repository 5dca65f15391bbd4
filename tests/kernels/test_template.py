"""The kernel template itself (dlcore.runtime.template), on a kernel of its own in a third-party
namespace: ``scale(x, alpha) = alpha * x``, differentiable in x."""

from __future__ import annotations

import dataclasses
import inspect
import warnings

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
from dlcore.errors import DeclarationError, NoDoubleBackwardError
from dlcore.plugins.registry import registry
from dlcore.runtime import torch_ops
from dlcore.runtime.template import UNKNOWN_DEVICE, Backward, define_kernel, device_profile
from dlcore.runtime.torch_ops import NoGradientWarning
from dlcore.testing import assert_close, randn

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


def test_plans_take_the_profile_the_registry_holds(monkeypatch):
    # the profile is the registry's state (dlcore.reset() forgets it), not a cache of the template's
    cpu = torch.device("cpu")
    other = dataclasses.replace(device_profile(cpu), name="another cpu")
    monkeypatch.setitem(registry()._profiles, cpu, other)
    assert device_profile(cpu) is other


def test_the_public_function_binds_as_python_does(device, gen):
    x = randn(10, device=device, generator=gen)
    torch.testing.assert_close(KERNEL.function(alpha=0.5, x=x), x / 2)
    assert inspect.isroutine(KERNEL.function) and KERNEL.__class__.forward.__qualname__ == "Kernel.forward"
    for args, kwargs, words in (((x, 1.0, 2), {}, "takes 2 positional arguments but 3 were given"),
                                ((), {"alpha": 1.0}, "missing 1 required argument(s): 'x'"),
                                ((x,), {"x": x}, "multiple values for argument 'x'"),
                                ((x,), {"beta": 1.0}, "unexpected keyword argument 'beta'")):
        with pytest.raises(TypeError, match=words.replace("(", r"\(").replace(")", r"\)")):
            KERNEL.function(*args, **kwargs)


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
    (call,) = KERNEL.implementation.backward_plan((x, 2.0), config, UNKNOWN_DEVICE).calls
    assert call.kernel is _scale_kernel and call.grid == (1,)


# -- gradients the backward does not give, and gradients of gradients ---------------------------------


@triton.jit
def _scale_by_kernel(x_ptr, t_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    t = tl.load(t_ptr).to(tl.float32)
    tl.store(y_ptr + offs, (t * x).to(y_ptr.dtype.element_ty), mask=offs < n)


def _scale_by(x: torch.Tensor, t: torch.Tensor) -> LaunchPlan:
    y = torch.empty_like(x)
    return LaunchPlan([KernelCall(_scale_by_kernel, (cdiv(x.numel(), 64),), (x, t, y, x.numel()), {"BLOCK": 64})], y)


def scale_by_reference(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return t * x


def scale_by_backward_reference(dy: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return t * dy


def _scale_by_op(name: str, second_order: bool):
    """``t * x`` with ``t`` a one-element tensor declared not differentiable: its backward gives x's
    gradient alone (``t * dy``, the same kernel)."""
    op = Op(name, args=(TensorArg("x", (torch.float32,)), TensorArg("t", (torch.float32,), differentiable=False)),
            reference=scale_by_reference)
    return define_kernel(
        op, lambda args, config, profile: _scale_by(*args), kernels=(_scale_by_kernel,),
        results=lambda x, t: torch.empty_like(x), default_config=lambda sig, profile: {}, namespace=NAMESPACE,
        backward=Backward(lambda backward, saved, grads, needs: {"x": backward(grads[0], saved.t)}, saved=("t",),
                          plan=lambda args, config, profile: _scale_by(args[0].contiguous(), args[1]),
                          reference=scale_by_backward_reference, results=lambda dy, t: torch.empty_like(dy),
                          renames={"x": "dy"}, second_order=second_order))


SCALE_BY = _scale_by_op("scale_by", second_order=False)
SCALE_BY_TWICE = _scale_by_op("scale_by_twice", second_order=True)


def test_an_argument_the_backward_gives_no_gradient_is_named_once(device, gen):
    """t requires grad and the backward gives it none: one NoGradientWarning naming the op and t;
    x's gradient is still right, t.grad stays None. Without t requiring grad, no warning (even once
    the warnings given are forgotten)."""
    x = randn(37, device=device, generator=gen).requires_grad_()
    t = torch.full((1,), 1.5, device=device, requires_grad=True)
    with pytest.warns(NoGradientWarning, match=r"scale_by: t requires grad") as caught:
        SCALE_BY.function(x, t).sum().backward()
        SCALE_BY.function(x, t).sum().backward()
    assert len(caught) == 1 and t.grad is None
    torch.testing.assert_close(x.grad, torch.full_like(x, 3.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch_ops.clear()
        SCALE_BY.function(x, t.detach()).sum().backward()


def test_a_gradient_of_gradients_raises_unless_declared(device, gen):
    """create_graph=True gives differentiable gradients; a backward through them raises
    NoDoubleBackwardError for a first-order backward, naming the ops of each kind."""
    x = randn(37, device=device, generator=gen).requires_grad_()
    t = torch.full((1,), 1.5, device=device)
    (dx,) = torch.autograd.grad((SCALE_BY.function(x, t) ** 2).sum(), x, create_graph=True)
    torch.testing.assert_close(dx, 2 * 1.5 ** 2 * x)
    with pytest.raises(NoDoubleBackwardError, match=r"^scale_by: .*First order only: .*\bscale_by\b.*"
                                                     r"second order too: .*\bscale_by_twice\b"):
        dx.sum().backward()


def test_a_declared_second_order_is_autograd_through_the_backward_reference(device, gen):
    """With Backward.second_order, the gradient of the gradients matches float64 autograd through
    the references (test_softmax checks a nonlinear one, and that a third order raises)."""
    x = randn(37, device=device, generator=gen)
    t, v = torch.full((1,), 1.5, device=device), randn(37, device=device, generator=gen)

    def second(fn, x, t):
        x = x.detach().requires_grad_()
        (dx,) = torch.autograd.grad((fn(x, t) ** 2).sum(), x, create_graph=True)
        (ddx,) = torch.autograd.grad((dx * v.to(x.dtype)).sum(), x)
        return dx, ddx

    got, want = second(SCALE_BY_TWICE.function, x, t), second(scale_by_reference, x.double(), t.double())
    for g, w in zip(got, want):
        assert_close(g, w, torch.float32)
