"""Property-based tests of the public API: every op, called as a hostile or careless user would.

Each example starts from the op's own example inputs (small sizes) and spoils at most one thing:
a tensor's dtype, rank, strides (a transposed, sliced, expanded or zero-stride view), device, or
a scalar's value; or the call's arity. Called through the kernel's public function or through
``get_op``, the call must either raise a :class:`~dlcore.errors.DlcoreError` that names an
argument, or return what the float64 reference returns for the same inputs; and it must leave
its inputs as they were unless it was asked to write into them.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import dlcore
from dlcore.errors import DlcoreError, InvalidCallError, InvalidInputError
from dlcore.plugins.registry import registry
from dlcore.testing import tolerance, upcast

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

# Every example runs Triton kernels in the interpreter.
pytestmark = pytest.mark.slow

OPS = sorted(registry().ops)
#: sizes small enough for the interpreter, drawn per example for the names ops use
SMALL = {"tokens": (1, 2, 5), "batch": (1, 2), "seq": (1, 3, 9), "kv_seq": (0, 4), "hidden": (16, 40),
         "inter": (8, 24), "vocab": (7, 33), "heads": (2, 4), "kv_heads": (1, 2)}
SCALARS = [None, "x", -1, 0, 2.5, float("nan"), float("inf"), 10**400, True, [1]]


def public_function(op: str):
    """The kernel's public function (``dlblas_kernels.<op>``)."""
    return getattr(importlib.import_module("dlblas_kernels"), op)


def spoil_tensor(t: torch.Tensor, how: str) -> torch.Tensor:
    if how == "dtype_int":
        return t.to(torch.int32)
    if how == "dtype_double":
        return t.double()
    if how == "rank_up":
        return t.unsqueeze(0)
    if how == "rank_down":
        return t[0] if t.dim() > 0 and t.shape[0] > 0 else t
    if how == "transposed" and t.dim() >= 2:
        return t.transpose(-1, -2)
    if how == "strided" and t.dim() >= 1:
        wide = torch.randn(*t.shape[:-1], t.shape[-1] * 2).to(t.dtype) if t.is_floating_point() else t
        return wide[..., ::2] if wide is not t else t
    if how == "expanded" and t.dim() >= 1:
        return t[..., :1].expand(t.shape)
    if how == "meta":
        return t.to("meta")
    if how == "nan" and t.is_floating_point() and t.numel():
        t = t.clone()
        t[(0,) * t.dim()] = float("nan")
        return t
    return t


TENSOR_SPOILS = ["dtype_int", "dtype_double", "rank_up", "rank_down", "transposed", "strided", "expanded", "meta",
                 "nan"]


@st.composite
def requests(draw, name: str):
    """(args, what was spoiled) for op ``name``."""
    op = registry().op(name)
    sizes = {k: draw(st.sampled_from(v)) for k, v in SMALL.items() if k in op.example_sizes}
    dtype = draw(st.sampled_from([torch.float32, torch.float16]))
    args = list(op.example(({**op.example_sizes, **sizes}), dtype, torch.device("cpu"),
                           torch.Generator().manual_seed(draw(st.integers(0, 2**16)))))
    kind = draw(st.sampled_from(["none", "tensor", "scalar", "arity"]))
    tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    scalars = [i for i, a in enumerate(args) if not isinstance(a, torch.Tensor) and i < len(op.args)]
    what = "none"
    if kind == "tensor" and tensors:
        i, how = draw(st.sampled_from(tensors)), draw(st.sampled_from(TENSOR_SPOILS))
        args[i] = spoil_tensor(args[i], how)
        what = f"{op.args[i].name}:{how}"
    elif kind == "scalar" and scalars:
        i, value = draw(st.sampled_from(scalars)), draw(st.sampled_from(SCALARS))
        args[i] = value
        what = f"{op.args[i].name}={value!r:.40}"
    elif kind == "arity":
        if draw(st.booleans()):
            args.append(args[0])
            what = "one argument too many"
        elif args:
            args.pop(0)
            what = "the first argument missing"
    return op, args, what


def snapshot(args: list) -> list:
    return [a.clone() if isinstance(a, torch.Tensor) and a.device.type != "meta" else a for a in args]


def comparable(t: torch.Tensor) -> torch.Tensor:
    """``t`` with NaN made equal to NaN (in float64: fp8 has no nan_to_num)."""
    return t.double().nan_to_num(1.5) if t.is_floating_point() else t


def unchanged(before: list, after: list) -> bool:
    for b, a in zip(before, after):
        if isinstance(b, torch.Tensor) and b.device.type != "meta" and not torch.equal(comparable(b), comparable(a)):
            return False
    return True


def as_tuple(result) -> tuple:
    return result if isinstance(result, tuple) else (result,)


def check_request(op, args: list, what: str, through: str) -> None:
    before = snapshot(args)
    try:
        if through == "direct":
            result = public_function(op.name)(*args)
        else:
            result = dlcore.get_op(op.name, tuple(args))(*args)
    except (InvalidInputError, InvalidCallError) as exc:
        names = {a.name for a in op.args} | {"call", "args", "name"}
        assert any(n in str(exc) for n in names), f"{what}: {exc} names no argument"
        return
    except TypeError as exc:
        # the public function is a plain Python function: Python itself names a wrong arity
        assert through == "direct" and what.startswith(("one argument", "the first")), f"{what}: {exc!r}"
        return
    except DlcoreError:
        return
    except Exception as exc:  # noqa: BLE001 - the property: nothing else escapes
        raise AssertionError(f"{op.name} ({through}) with {what} raised {type(exc).__name__}: {exc}") from exc
    written = any(isinstance(a, bool) and a for s, a in zip(op.args, args) if getattr(s, "writes", ()))
    if not written:
        assert unchanged(before, args), f"{op.name} ({through}) with {what} changed its inputs"
    if any(isinstance(a, torch.Tensor) and a.device.type == "meta" for a in args):
        return
    reference = as_tuple(op.reference(*upcast(*before)))
    got = as_tuple(result)
    assert len(got) == len(reference), what
    reduce_dim = max((max(a.shape, default=1) for a in args if isinstance(a, torch.Tensor)), default=1)
    for g, r in zip(got, reference):
        if not isinstance(r, torch.Tensor):
            continue
        assert g.shape == r.shape, f"{op.name} ({through}) with {what}: shape {tuple(g.shape)} vs {tuple(r.shape)}"
        if g.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            continue
        atol, rtol = tolerance(g.dtype, reduce_dim)
        # where a NaN input makes the reference NaN, any value is as good; everywhere else it must match
        finite = torch.isfinite(r)
        close = torch.isclose(g.double()[finite], r.double()[finite], atol=atol * 4, rtol=rtol * 4)
        assert bool(close.all()), f"{op.name} ({through}) with {what}: {int((~close).sum())} elements off"


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("through", ["direct", "get_op"])
def test_each_call_raises_a_named_error_or_matches_the_reference(name, through):
    @settings(max_examples=12, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(requests(name))
    def run(request):
        op, args, what = request
        check_request(op, args, what, through)

    run()


def every_single_spoil(op) -> list[tuple[list, str]]:
    """Each spoil of one argument of the op's small example inputs, one at a time."""
    sizes = {k: v[-1] for k, v in SMALL.items() if k in op.example_sizes}
    base = op.example({**op.example_sizes, **sizes}, torch.float32, torch.device("cpu"),
                      torch.Generator().manual_seed(0))
    cases = []
    for i, a in enumerate(base):
        spoils = TENSOR_SPOILS if isinstance(a, torch.Tensor) else SCALARS
        for spoil in spoils:
            args = list(base)
            args[i] = spoil_tensor(a, spoil) if isinstance(a, torch.Tensor) else spoil
            label = spoil if isinstance(a, torch.Tensor) else f"{spoil!r:.40}"
            cases.append((args, f"{op.args[i].name}:{label}"))
    cases.append(([*base, base[0]], "one argument too many"))
    cases.append((list(base[1:]), "the first argument missing"))
    return cases


@pytest.mark.parametrize("name", OPS)
def test_every_single_spoil_raises_a_named_error_or_matches_the_reference(name):
    op = registry().op(name)
    for args, what in every_single_spoil(op):
        check_request(op, args, what, "direct")
