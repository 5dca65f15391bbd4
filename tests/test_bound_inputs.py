"""A bound op given inputs it was not made for raises InvalidInputError before anything runs: the
op's validation and the bound signature, checked once per exact input metadata."""

import dlblas_kernels
import pytest
import torch

import dlcore
from dlcore.declarations.op import Op
from dlcore.errors import InvalidCallError, InvalidInputError, InvalidOptionError

FP8 = torch.float8_e4m3fn
g = torch.Generator().manual_seed(11)


def rnd(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)


def moe(experts, w2_experts, ids):
    """fused_moe's arguments: 2 tokens, hidden 16, 8 intermediate, the given expert ids (one a token)."""
    return (rnd(2, 16), rnd(experts, 16, 16), rnd(w2_experts, 16, 8), torch.ones(2, 1),
            torch.tensor(ids, dtype=torch.int32).view(2, 1))


def fp8(m, a_scale, b_scale):
    """fp8_gemm's arguments: a [m, 256], b [160, 256] (K two blocks of 128, N two), the scales' shapes."""
    return rnd(m, 256).to(FP8), rnd(160, 256).to(FP8), torch.rand(a_scale), torch.rand(b_scale), torch.float32


# op, the inputs get_op binds for, the inconsistent inputs the bound op is then called with, the
# argument named: each case of the issue that used to read past the end of a tensor and return numbers
INCONSISTENT = [
    ("matmul", (rnd(3, 64), rnd(64, 8)), (rnd(3, 64), rnd(16, 8)), "b"),
    ("ffn", (rnd(4, 32), rnd(32, 32), rnd(32, 32), rnd(32)), (rnd(4, 32), rnd(32, 32), rnd(4, 32), rnd(32)), "w3"),
    ("fused_moe", moe(4, 4, [3, 1]), moe(4, 1, [3, 1]), "w2"),
    ("fp8_gemm", fp8(5, (5, 2), (2, 2)), fp8(5, (1, 2), (1, 1)), "a_scale"),
]


@pytest.mark.parametrize("name, bound_for, called_with, arg", INCONSISTENT, ids=[c[0] for c in INCONSISTENT])
def test_a_bound_op_refuses_inconsistent_inputs(name, bound_for, called_with, arg):
    bound = dlcore.get_op(name, bound_for)
    with pytest.raises(InvalidInputError) as info:
        bound(*called_with)
    assert info.value.arg == arg, str(info.value)


@pytest.mark.parametrize("name, bound_for, called_with, arg", INCONSISTENT, ids=[c[0] for c in INCONSISTENT])
def test_the_public_functions_refuse_them_too(name, bound_for, called_with, arg):
    with pytest.raises(InvalidInputError) as info:
        getattr(dlblas_kernels, name)(*called_with)
    assert info.value.arg == arg, str(info.value)


def test_inconsistent_inputs_that_require_grad_are_refused_before_the_custom_op():
    bound = dlcore.get_op("matmul", (rnd(3, 64), rnd(64, 8)))
    with pytest.raises(InvalidInputError) as info:
        bound(rnd(3, 64).requires_grad_(), rnd(16, 8))
    assert info.value.arg == "b"


def test_another_dtype_than_the_bound_one_is_refused():
    x, w = rnd(4, 16), rnd(16)
    bound = dlcore.get_op("rms_norm", (x, w))
    with pytest.raises(InvalidInputError, match="has dtype torch.int32"):
        bound(torch.randint(0, 9, (4, 16), dtype=torch.int32), w)
    with pytest.raises(InvalidInputError) as info:  # a dtype rms_norm takes, but not this bound op
        bound(x.half(), w.half())
    assert info.value.arg == "x"
    assert "dtype torch.float32 through this bound op" in str(info.value)
    assert "Call dlcore.get_op again" in str(info.value)


def test_another_exact_dimension_or_an_optional_tensor_given_is_refused():
    bound = dlcore.get_op("rms_norm", (rnd(4, 16), rnd(16)))
    with pytest.raises(InvalidInputError) as info:
        bound(rnd(4, 32), rnd(32))
    assert info.value.arg == "x" and "x of shape [*, 16]" in str(info.value)
    matmul = dlcore.get_op("matmul", (rnd(3, 64), rnd(64, 8)))
    with pytest.raises(InvalidInputError) as info:
        matmul(rnd(3, 64), rnd(64, 8), rnd(8))
    assert info.value.arg == "bias" and "is given" in str(info.value)


def test_another_row_count_runs_and_is_right():
    """Rows are bucketed: one config serves every row count, so another bucket's runs."""
    w = rnd(16)
    bound = dlcore.get_op("rms_norm", (rnd(4, 16), w))
    x = rnd(3, 13, 16)
    expected = dlblas_kernels.kernels.rms_norm.OP.reference(x.double(), w.double(), 1e-6)
    torch.testing.assert_close(bound(x, w).double(), expected, rtol=1e-5, atol=1e-5)


def test_inputs_are_validated_once_per_exact_metadata(monkeypatch):
    calls = []
    validate = Op.validate
    monkeypatch.setattr(Op, "validate", lambda self, bound: calls.append(bound) or validate(self, bound))
    x, w = rnd(4, 16), rnd(16)
    bound = dlcore.get_op("rms_norm", (x, w))
    calls.clear()
    for _ in range(3):
        bound(rnd(4, 16), w)
    assert len(calls) == 1, "calls with metadata seen before are not validated again"
    bound(rnd(5, 16), w)
    assert len(calls) == 2


def test_op_arguments_given_as_options_name_the_kwargs_dict():
    x, w = rnd(4, 16), rnd(16)
    with pytest.raises(InvalidCallError) as info:
        dlcore.get_op("rms_norm", (x, w), eps=1e-5)
    assert isinstance(info.value, TypeError)
    assert "eps=1e-05 is no option of get_op" in str(info.value)
    assert "kwargs dict" in str(info.value) and "{'eps': 1e-05}" in str(info.value)


@pytest.mark.parametrize("options, named", [
    ({"tune": "quick", "budget": "x"}, "budget='x'"),
    ({"tune": "quick", "budget": [1]}, "budget=[1]"),
    ({"tune": "quick", "budget": True}, "budget=True"),
    ({"tune": "quick", "strategy": 5}, "strategy=5"),
    ({"tune": 1}, "tune=1"),
])
def test_options_of_the_wrong_type_are_named(options, named):
    with pytest.raises(InvalidOptionError) as info:
        dlcore.get_op("rms_norm", (rnd(4, 16), rnd(16)), **options)
    assert str(info.value).startswith(named), str(info.value)


@pytest.mark.parametrize("name, bound_for, called_with, arg", INCONSISTENT[:3], ids=[c[0] for c in INCONSISTENT[:3]])
def test_the_custom_op_called_directly_refuses_them_too(name, bound_for, called_with, arg):
    """``torch.ops.dlblas.<op>`` with every argument, then the config's integers (zero: the default)."""
    getattr(dlblas_kernels, name)(*bound_for)  # the kernel module imported: its custom op registered
    custom_op = getattr(torch.ops.dlblas, name).default
    values = dlcore.get_op(name, bound_for).op.bind(called_with, None)
    ints = (0,) * (len(custom_op._schema.arguments) - len(values))
    with pytest.raises(InvalidInputError) as info:
        custom_op(*values, *ints)
    assert info.value.arg == arg, str(info.value)
