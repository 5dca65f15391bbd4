"""Each kernel module is a dlcore plugin of its own: one entry point, and hooks that match the specs."""

from __future__ import annotations

import importlib
from pathlib import Path

import pluggy
import pytest
import torch

import dlcore.plugins.hookspecs
from dlcore.declarations.implementation import TritonImplementation
from dlcore.declarations.op import Op
from dlcore.runtime.torch_ops import CustomOpTritonImplementation
from dlcore.testing import assert_close

KERNELS = ["silu_and_mul", "rms_norm", "ffn", "add_rms_norm", "apply_rotary_pos_emb", "partial_rotary_emb", "matmul"]
# Every kernel is a PyTorch custom op (torch.ops.dlblas.<name>); their baselines.
CUSTOM_OPS = {
    "silu_and_mul": {"torch", "liger"},
    "rms_norm": {"torch", "liger"},
    "ffn": {"torch"},
    "add_rms_norm": {"torch", "liger"},
    "apply_rotary_pos_emb": {"torch", "liger"},
    "partial_rotary_emb": {"torch"},
    "matmul": {"torch"},
}
PYPROJECT = Path(__file__).parents[2] / "plugins" / "dlblas_kernels" / "pyproject.toml"


@pytest.mark.parametrize("name", KERNELS)
def test_module_registers_its_op_and_implementation(name):
    module = importlib.import_module(f"dlblas_kernels.kernels.{name}")
    pm = pluggy.PluginManager("dlcore")
    pm.add_hookspecs(dlcore.plugins.hookspecs)
    pm.register(module, name=name)
    pm.check_pending()
    [[op]] = pm.hook.dlcore_ops()
    [[impl]] = pm.hook.dlcore_implementations()
    assert isinstance(op, Op) and op.name == name
    assert isinstance(impl, TritonImplementation) and impl.op == name
    assert impl.kernels and all(hasattr(k, "__getitem__") for k in impl.kernels)


def test_one_entry_point_per_kernel_module():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert project["entry-points"]["dlcore.kernels"] == {name: f"dlblas_kernels.kernels.{name}" for name in KERNELS}
    assert not any(dep.startswith("triton") for dep in project["dependencies"])


@pytest.mark.parametrize("name", sorted(CUSTOM_OPS))
def test_custom_op_cost_and_baselines(name):
    module = importlib.import_module(f"dlblas_kernels.kernels.{name}")
    op, impl = module.OP, module.KERNEL.implementation
    assert isinstance(impl, CustomOpTritonImplementation)
    assert hasattr(torch.ops.dlblas, name)
    args = op.example(op.example_sizes, torch.float16, torch.device("cpu"), torch.Generator().manual_seed(0))
    moved, flops = op.cost(args)
    inputs = sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))
    assert isinstance(moved, int) and isinstance(flops, int) and moved > inputs and flops > 0
    if name != "ffn":  # the differentiable ops rate their backward too
        moved, flops = op.cost(args, mode="bwd")
        assert isinstance(moved, int) and isinstance(flops, int) and moved > inputs and flops > 0
    assert set(op.baselines) == CUSTOM_OPS[name]
    # The eager torch baseline computes the op in the input dtype, as a model does.
    float_args = op.example(op.example_sizes, torch.float32, torch.device("cpu"), torch.Generator().manual_seed(0))
    baseline = op.baselines["torch"]()
    expected = op.reference(*(a.double() if isinstance(a, torch.Tensor) else a for a in float_args))
    for out, ref in zip(*(r if isinstance(r, tuple) else (r,) for r in (baseline(*float_args), expected))):
        assert_close(out, ref, torch.float32, reduce_dim=float_args[0].shape[-1])
    if "liger" in op.baselines:
        liger = op.baselines["liger"]()
        assert liger is None or callable(liger)
