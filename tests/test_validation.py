"""Every bad input raises InvalidInputError naming the argument, and nothing is launched."""

import dlblas_kernels
import pytest
import torch

import dlcore
from dlcore.declarations.implementation import KernelCall, ReferenceImplementation, TorchImplementation
from dlcore.errors import InvalidInputError

g = torch.Generator().manual_seed(7)


def rnd(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)


def permuted(*shape):
    """A 3-D tensor whose leading dims cannot be flattened without a copy."""
    return rnd(shape[1], shape[0], shape[2]).transpose(0, 1)


@pytest.fixture(autouse=True)
def nothing_runs(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("something was launched")

    monkeypatch.setattr(KernelCall, "launch", fail)
    monkeypatch.setattr(ReferenceImplementation, "run", fail)
    monkeypatch.setattr(TorchImplementation, "run", fail)


CASES = [
    # op, args, argument named, words in the message
    ("silu_and_mul", (rnd(4, 8, dtype=torch.int32),), "x", "has dtype torch.int32; silu_and_mul accepts float16"),
    ("silu_and_mul", (rnd(4, 7),), "x", "even"),
    ("silu_and_mul", (torch.tensor(1.0),), "x", "0 dimensions"),
    ("silu_and_mul", ([1.0, 2.0],), "x", "is a list"),
    ("silu_and_mul", (permuted(3, 4, 8),), "x", "Call x.contiguous() first"),
    ("rms_norm", (rnd(4, 8, dtype=torch.float64), rnd(8)), "x", "has dtype torch.float64"),
    ("rms_norm", (rnd(4, 8), rnd(9)), "weight", "has shape (9,)"),
    ("rms_norm", (rnd(4, 8), rnd(2, 8)), "weight", "2 dimensions"),
    ("rms_norm", (rnd(4, 8), rnd(8, device="meta")), "weight", "is on meta while x is on cpu"),
    ("rms_norm", (rnd(4, 8), rnd(8), "1e-6"), "eps", "is a str"),
    ("rms_norm", (rnd(4, 8), rnd(8), -1e-6), "eps", "eps >= 0.0"),
    ("rms_norm", (rnd(4, 8), rnd(8), float("nan")), "eps", "a finite number"),
    ("ffn", (rnd(4, 16), rnd(8, 16), rnd(8, 16), rnd(16), float("inf")), "eps", "a finite number"),
    ("softmax", (rnd(4, 8), 1.0), "dim", "is a float; softmax accepts an int for dim"),
    ("flash_attention_v2", (rnd(1, 3, 2, 8), rnd(1, 3, 2, 8), rnd(1, 3, 2, 8), False, float("nan")),
     "softmax_scale", "a finite number"),
    ("rms_norm", (rnd(4, 8),), "weight", "is missing"),
    ("rms_norm", (rnd(4, 8), rnd(8), 1e-6, 2), "call", "got 4 positional arguments"),
    ("ffn", (rnd(4, 16), rnd(8, 16), rnd(8, 17), rnd(16)), "w3", "has shape (8, 17)"),
    ("ffn", (rnd(4, 16), rnd(8, 12), rnd(8, 12), rnd(16)), "w1", "has shape (8, 12)"),
    ("ffn", (rnd(4, 16), rnd(8, 16), rnd(8, 16), rnd(15)), "rms_w", "has shape (15,)"),
    ("ffn", (rnd(4, 16), rnd(8, 16, dtype=torch.float16), rnd(8, 16), rnd(16)), "w1", "has dtype torch.float16 but x"),
    ("ffn", (rnd(4, 16), rnd(8, 16), rnd(8, 16), rnd(16)[None]), "rms_w", "2 dimensions"),
    ("ffn", (permuted(2, 3, 16), rnd(8, 16), rnd(8, 16), rnd(16)), "x", "strides"),
]


@pytest.mark.parametrize("name, args, arg, words", CASES, ids=[f"{c[0]}-{c[2]}-{i}" for i, c in enumerate(CASES)])
def test_get_op_rejects(name, args, arg, words):
    with pytest.raises(InvalidInputError) as info:
        dlcore.get_op(name, args)
    assert info.value.arg == arg
    assert words in str(info.value), str(info.value)


@pytest.mark.parametrize("name, args, arg, words", CASES, ids=[f"{c[0]}-{c[2]}-{i}" for i, c in enumerate(CASES)])
def test_direct_use_rejects(name, args, arg, words):
    if arg == "call" or words == "is missing":
        with pytest.raises(TypeError):  # a plain Python function: Python checks its arity
            getattr(dlblas_kernels, name)(*args)
        return
    with pytest.raises(InvalidInputError) as info:
        getattr(dlblas_kernels, name)(*args)
    assert info.value.arg == arg
    assert words in str(info.value), str(info.value)


def test_message_says_what_to_do():
    with pytest.raises(InvalidInputError) as info:
        dlcore.get_op("rms_norm", (rnd(4, 8, dtype=torch.int32), rnd(8)))
    assert str(info.value) == (
        "rms_norm: x has dtype torch.int32; rms_norm accepts float16, bfloat16, float32. Convert with x.to(...)."
    )


def test_unexpected_keyword():
    with pytest.raises(InvalidInputError, match="unexpected argument 'epsilon'"):
        dlcore.get_op("rms_norm", (rnd(4, 8), rnd(8)), {"epsilon": 1e-5})


@pytest.mark.parametrize("name, args, kwargs, words", [
    (None, ([1],), None, "name is None"),
    (7, ([1],), None, "name is 7"),
    ("rms_norm", None, None, "args is a NoneType"),
    ("rms_norm", "xw", None, "args is a str"),
    ("rms_norm", (), [("eps", 1.0)], "kwargs is a list"),
])
def test_get_op_names_a_wrong_kind_of_request(name, args, kwargs, words):
    from dlcore.errors import InvalidCallError

    with pytest.raises(InvalidCallError, match=words) as caught:
        dlcore.get_op(name, args, kwargs)
    assert isinstance(caught.value, TypeError)  # what Python itself would have raised


def test_a_scalar_beyond_float_range_is_named():
    from dlblas_kernels import rms_norm

    x, w = torch.randn(2, 16), torch.randn(16)
    for call in (lambda: rms_norm(x, w, eps=10**400), lambda: dlcore.get_op("rms_norm", (x, w, 10**400))):
        with pytest.raises(InvalidInputError, match="eps is an integer of 1329 bits"):
            call()


def test_direct_functions_on_meta_tensors_give_shapes_like_torch():
    from dlblas_kernels import matmul, rms_norm

    x, w = torch.randn(5, 16, device="meta"), torch.randn(16, device="meta")
    out = rms_norm(x, w)
    assert out.device.type == "meta" and out.shape == (5, 16)
    assert matmul(x, torch.randn(16, 3, device="meta")).shape == (5, 3)


def test_compiled_kernels_called_on_cpu_tensors_name_the_argument_and_the_interpreter():
    """Without the interpreter a public function on CPU tensors would hand host pointers to a compiled
    kernel (Triton's own error, or a crash): it names the argument and says what runs on the CPU."""
    from isolated import run_json

    found = run_json(
        "import json, torch, dlblas_kernels\n"
        "from dlcore.errors import InvalidInputError\n"
        "try:\n"
        "    dlblas_kernels.rms_norm(torch.randn(3, 8), torch.ones(8))\n"
        "    print(json.dumps({'raised': None}))\n"
        "except InvalidInputError as e:\n"
        "    print(json.dumps({'raised': str(e), 'arg': e.arg}))\n",
        TRITON_INTERPRET="0",
    )
    assert found["arg"] == "x", found
    assert "on the CPU" in found["raised"] and "TRITON_INTERPRET=1" in found["raised"]
