"""The kernels as PyTorch custom ops: opcheck, gradcheck, get_op under autograd, torch.compile."""

from __future__ import annotations

import dlblas_kernels
import pytest
import torch
from gradients import check_backward, leaves

import dlcore
import dlcore.dispatch.dispatcher
import dlcore.runtime.template
from dlcore import InvalidInputError
from dlcore.plugins.registry import registry
from dlcore.testing import randn

ops = torch.ops.dlblas

# op -> (small example sizes, positions of the differentiable arguments)
CASES = {
    "rms_norm": ({"tokens": 5, "hidden": 24}, (0, 1)),
    "silu_and_mul": ({"tokens": 5, "inter": 12}, (0,)),
    "add_rms_norm": ({"tokens": 5, "hidden": 24}, (0, 1, 2)),
    "apply_rotary_pos_emb": ({"tokens": 5, "heads": 3, "kv_heads": 1, "head_dim": 8}, (0, 1, 2, 3)),
    "partial_rotary_emb": ({"tokens": 3, "heads": 2, "nope_dim": 8, "rope_dim": 4, "v_dim": 6}, (0, 1, 2, 3, 4)),
    "matmul": ({"tokens": 5, "hidden": 16, "inter": 8}, (0, 1)),
    "softmax": ({"tokens": 5, "vocab": 12}, (0,)),
}
DIFFERENTIABLE = sorted(CASES)


def example(name: str, dtype: torch.dtype, device: str, gen: torch.Generator) -> tuple:
    sizes = {**CASES, "ffn": ({"tokens": 5, "hidden": 16, "inter": 8}, ())}[name][0]
    return registry().op(name).example(sizes, dtype, torch.device(device), gen)


def custom_op_call(name: str, args: tuple, config: tuple | None = None) -> tuple:
    """The custom op of ``name`` and its arguments for bound ``args`` (config ints: all zero by default)."""
    if name == "apply_rotary_pos_emb":
        args = args[:5]  # the custom op is functional; inplace is the caller's copy
    op = getattr(ops, name).default
    # the config ints follow the op's own arguments in the custom op's schema
    width = len(op._schema.arguments) - len(args)
    return op, (*args, *(config or (0,) * width))


# -- opcheck ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [*DIFFERENTIABLE, "ffn"])
def test_opcheck_forward(name, device, gen):
    args = example(name, torch.float32, device, gen)
    op, op_args = custom_op_call(name, args)
    # With inputs requiring grad, opcheck also runs the registered backward (ffn has none).
    op_args = leaves(op_args, CASES.get(name, ({}, ()))[1])
    torch.library.opcheck(op, op_args)


def test_opcheck_forward_with_config(device, gen):
    x, w, eps = leaves(example("rms_norm", torch.float32, device, gen), (0, 1))
    torch.library.opcheck(ops.rms_norm.default, (x, w, eps, 2, 16, 1))


@pytest.mark.parametrize("name", ["rms_norm", "add_rms_norm", "silu_and_mul", "apply_rotary_pos_emb",
                                  "partial_rotary_emb", "matmul"])
def test_opcheck_backward(name, device, gen):
    def r(*shape):
        return randn(*shape, device=device, generator=gen)

    if name in ("rms_norm", "add_rms_norm"):
        x, w, _ = example("rms_norm", torch.float32, device, gen)
        dres = r(*x.shape) if name == "add_rms_norm" else None
        op, args = ops.rms_norm_backward.default, (r(*x.shape), x, w, dres, 1e-6, 1, 16, 1)
    elif name == "silu_and_mul":
        (x,) = example(name, torch.float32, device, gen)
        op, args = ops.silu_and_mul_backward.default, (r(5, 12), x, 0, 0)
    elif name == "apply_rotary_pos_emb":
        q, k, cos, sin, *_ = example(name, torch.float32, device, gen)
        op, args = ops.apply_rotary_pos_emb_backward.default, (r(*q.shape), r(*k.shape), cos, sin, True, 2, 1)
    elif name == "matmul":
        a, b, *_ = example(name, torch.float32, device, gen)
        op, args = ops.matmul_backward.default, (r(5, 8), a, b, r(8), "silu", False, 16, 16, 16, 1, 1, 1, 1, 0)
    else:
        q, k_pe, kv, cos, sin, *dims = example(name, torch.float32, device, gen)
        op = ops.partial_rotary_emb_backward.default
        args = (r(*q.shape), r(1, 3, 2, 2, 12), cos, sin, k_pe, kv, *dims, 0, 0)
    torch.library.opcheck(op, args)


# -- gradcheck -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_gradcheck_float64(name, device, gen):
    """The kernels take 16- and 32-bit floats; float64 inputs take the custom ops' torch reference
    path, so this checks the registered autograd formulas (forward op, backward op, the wiring of
    saved tensors and gradients) against finite differences. The kernels' backward is checked
    against torch autograd of the reference in the other tests."""
    args = example(name, torch.float64, device, gen)
    op, op_args = custom_op_call(name, args)
    wrt = CASES[name][1]
    assert torch.autograd.gradcheck(lambda *a: op(*a), leaves(op_args, wrt))


def test_public_functions_take_float64_through_the_references(device):
    """What docs/plugins.md tells a plugin author: ``gradcheck`` on a public function with float64
    inputs checks the backward formula against finite differences (the references run, no kernel);
    get_op still refuses float64, which no kernel computes."""
    x = torch.randn(3, 8, dtype=torch.float64, device=device, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, device=device, requires_grad=True)
    torch.testing.assert_close(dlblas_kernels.rms_norm(x, w, 1e-6),
                               x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w)
    assert torch.autograd.gradcheck(dlblas_kernels.rms_norm, (x, w))
    with pytest.raises(InvalidInputError, match="float64"):
        dlcore.get_op("rms_norm", (x.detach(), w.detach()))
    with pytest.raises(InvalidInputError, match="float64"):  # beside a float32 weight: a mistake, refused
        dlblas_kernels.rms_norm(x, w.float())
    with pytest.raises(InvalidInputError, match="float64"):  # forward only: nothing for gradcheck to check
        dlblas_kernels.quantize_fp8(x.detach(), "row")


# -- get_op under autograd -------------------------------------------------------------------------


@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_get_op_output_is_differentiable(name, device, gen):
    op = registry().op(name)
    args = example(name, torch.float32, device, gen)
    bound = dlcore.get_op(name, args)
    assert bound.impl.name == "triton", bound.explain()
    check_backward(bound, op.reference, args, CASES[name][1], gen, reduce_dim=8)


def test_autograd_path_launches_the_given_config(device, gen, launches):
    x, w, eps = example("rms_norm", torch.float32, device, gen)
    impl = dlcore.get_op("rms_norm", (x, w, eps)).impl
    config = {"BLOCK_M": 2, "BLOCK_N": 16, "num_warps": 1}  # not the default: rows of 24 loop in blocks of 16
    y = impl.run(leaves((x, w, eps), (0, 1)), config)
    y.sum().backward()
    forward, backward, _ = launches
    assert forward == ("rms_norm_kernel", {"BLOCK_M": 2, "BLOCK_N": 16, "ONE_BLOCK": False, "num_warps": 1})
    assert backward[0] == "rms_norm_backward_kernel" and backward[1]["BLOCK_N"] == 16
    assert y.grad_fn is not None


def test_inference_path_skips_the_custom_op(device, gen, monkeypatch):
    args = example("rms_norm", torch.float32, device, gen)
    impl = next(i for i in registry().implementations_of("rms_norm") if i.name == "triton")

    def no_custom_op(args, config):
        raise AssertionError("the inference path went through the custom op")

    # The bound op takes the implementation's custom op when it is made: patched first, then bound afresh.
    monkeypatch.setattr(impl, "custom_op", no_custom_op)
    dlcore.dispatch.dispatcher.default().clear()
    bound = dlcore.get_op("rms_norm", args)
    assert bound.impl is impl
    assert bound(*args).grad_fn is None
    with torch.no_grad():
        assert bound(*leaves(args, (0, 1))).grad_fn is None
    with pytest.raises(AssertionError, match="inference path"):
        bound(*leaves(args, (0, 1)))
    dlcore.dispatch.dispatcher.default().clear()


# -- torch.compile ---------------------------------------------------------------------------------


def block(x, w, residual, q, k, cos, sin, gate_up, q_mla, k_pe, kv, cos_r, sin_r, w1, w3):
    """A transformer block's worth of the ops, as a model would call them."""
    y, residual = dlblas_kernels.add_rms_norm(x, w, residual)
    q, k = dlblas_kernels.apply_rotary_pos_emb(q * y.mean(), k, cos, sin)
    q_mla, out_kv = dlblas_kernels.partial_rotary_emb(q_mla, k_pe, kv, cos_r, sin_r, 8, 4, 6)
    act = dlblas_kernels.silu_and_mul(gate_up)
    z = dlblas_kernels.rms_norm(residual, w)
    mlp = dlblas_kernels.ffn(z.detach(), w1, w3, w.detach())  # forward only
    down = dlblas_kernels.matmul(z, w3.T.contiguous())
    return (z.sum() + q.sum() + k.square().sum() + act.sum() + q_mla.sum() + out_kv.square().sum()
            + residual.sum() + mlp.sum() + down.square().sum())


@pytest.mark.slow
def test_compiles_without_graph_breaks(device, gen):
    torch._dynamo.reset()
    x, w, residual = example("add_rms_norm", torch.float32, device, gen)[:3]
    rotary = example("apply_rotary_pos_emb", torch.float32, device, gen)[:4]
    (gate_up,) = example("silu_and_mul", torch.float32, device, gen)
    mla = example("partial_rotary_emb", torch.float32, device, gen)[:5]
    w1, w3 = (randn(8, 24, device=device, generator=gen) for _ in range(2))
    args = (x, w, residual, *rotary, gate_up, *mla, w1, w3)
    wrt = tuple(range(13))

    eager_inputs = leaves(args, wrt)
    block(*eager_inputs).backward()
    compiled_inputs = leaves(args, wrt)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    out = compiled(*compiled_inputs)  # fullgraph=True: any graph break raises
    out.backward()
    torch.testing.assert_close(out, block(*args))
    for a, b in zip(compiled_inputs[:13], eager_inputs[:13]):
        torch.testing.assert_close(a.grad, b.grad)


def test_compile_validates_while_tracing(device):
    torch._dynamo.reset()
    x, w = torch.randn(4, 16, device=device), torch.randn(15, device=device)
    with pytest.raises(Exception) as info:  # noqa: B017 - dynamo wraps the error; its cause is checked below
        torch.compile(dlblas_kernels.rms_norm, fullgraph=True, backend="eager")(x, w)
    chain = [info.value]
    while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    assert any(isinstance(e, InvalidInputError) for e in chain), chain


@pytest.mark.parametrize("name", ["silu_and_mul", "apply_rotary_pos_emb", "partial_rotary_emb"])
def test_eager_backward_launches_directly_and_tracers_see_the_backward_op(name, device, gen, monkeypatch):
    """In plain eager autograd a backward formula launches its plan at once; with a graph being built
    (create_graph) it goes through its backward custom op."""
    args = example(name, torch.float32, device, gen)
    op = registry().op(name)
    leaves_args = leaves(args, op.differentiable())
    through_op = []
    backward_op = getattr(torch.ops.dlblas, f"{name}_backward")
    monkeypatch.setattr(torch.ops.dlblas, f"{name}_backward", lambda *a: through_op.append(1) or backward_op(*a),
                        raising=False)
    out = getattr(dlblas_kernels, name)(*leaves_args)
    outs = [o for o in (out if isinstance(out, tuple) else (out,))]
    wrt = [leaves_args[i] for i in op.differentiable()]
    first = torch.autograd.grad(outs, wrt, [torch.ones_like(o) for o in outs], retain_graph=True)
    assert not through_op
    second = torch.autograd.grad(outs, wrt, [torch.ones_like(o) for o in outs], create_graph=True)
    assert through_op
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)


class PassThrough(torch.utils._python_dispatch.TorchDispatchMode):
    """A dispatch mode that runs every op as is, counting the dlblas ones it sees."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "dlblas" in str(func):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["rms_norm", "softmax", "matmul"])
def test_eager_forward_skips_the_dispatcher_and_tracers_see_the_custom_op(name, device, gen, monkeypatch):
    """In plain eager autograd the forward runs as a torch.autograd.Function made of the custom op's
    body and formula (without the dispatcher's tens of microseconds a call); under a dispatch mode
    the custom op runs, as it does for torch.compile and functorch; the outputs and gradients are
    the same bit for bit."""
    args = example(name, torch.float32, device, gen)
    wrt = [i for i in registry().op(name).differentiable() if isinstance(args[i], torch.Tensor)]

    def run():
        inputs = leaves(args, wrt)
        out = getattr(dlblas_kernels, name)(*inputs)
        return out, torch.autograd.grad(out, [inputs[i] for i in wrt], torch.ones_like(out))

    out, grads = run()
    assert type(out.grad_fn).__name__ == f"{name}_eagerBackward"
    with PassThrough() as mode:
        traced, traced_grads = run()
    assert f"dlblas.{name}.default" in mode.seen and type(traced.grad_fn).__name__ != f"{name}_eagerBackward"
    monkeypatch.setattr(dlcore.runtime.template, "plain_eager_forward", lambda values: False)
    dispatched, dispatched_grads = run()
    assert type(dispatched.grad_fn).__name__ != f"{name}_eagerBackward"
    for a, b, c in zip((out, *grads), (traced, *traced_grads), (dispatched, *dispatched_grads)):
        assert torch.equal(a, b) and torch.equal(a, c)
