"""Each kernel module is a dlcore plugin of its own: one entry point, and hooks that match the specs."""

from __future__ import annotations

import importlib
from pathlib import Path

import pluggy
import pytest

import dlcore.hookspecs
from dlcore.implementation import TritonImplementation
from dlcore.op import Op

KERNELS = ["silu_and_mul", "rms_norm", "ffn"]
PYPROJECT = Path(__file__).parents[2] / "plugins" / "dlblas_kernels" / "pyproject.toml"


@pytest.mark.parametrize("name", KERNELS)
def test_module_registers_its_op_and_implementation(name):
    module = importlib.import_module(f"dlblas_kernels.{name}")
    pm = pluggy.PluginManager("dlcore")
    pm.add_hookspecs(dlcore.hookspecs)
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
    assert project["entry-points"]["dlcore.kernels"] == {name: f"dlblas_kernels.{name}" for name in KERNELS}
    assert not any(dep.startswith("triton") for dep in project["dependencies"])
