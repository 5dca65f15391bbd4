"""Each kernel module is a dlcore plugin of its own: its installed entry point loads a module whose
hooks declare one op and implementations of that op, and get_op selects such an implementation.
The vendor candidates (``dlblas_kernels/vendor.py``) have entry points of their own, one per op."""

from __future__ import annotations

import importlib
import importlib.metadata

import pluggy
import pytest
import torch

import dlcore
import dlcore.plugins.hookspecs
import dlcore.plugins.registry
from dlcore.declarations.implementation import TritonImplementation, VendorImplementation
from dlcore.declarations.op import Op
from dlcore.runtime.torch_ops import CustomOpTritonImplementation
from dlcore.testing import assert_close

#: the entry points of the installed dlblas-kernels distribution, as pip wrote them: the kernels, and
#: the vendor implementations
INSTALLED = sorted(
    (ep for ep in importlib.metadata.distribution("dlblas-kernels").entry_points if ep.group == "dlcore.kernels"),
    key=lambda ep: ep.name,
)
ENTRY_POINTS = [ep for ep in INSTALLED if ep.value.startswith("dlblas_kernels.kernels.")]
VENDOR_ENTRY_POINTS = [ep for ep in INSTALLED if ep not in ENTRY_POINTS]
# The kernels that are PyTorch custom ops (torch.ops.dlblas.<name>), with their baselines.
CUSTOM_OPS = {
    "silu_and_mul": {"torch", "liger"},
    "rms_norm": {"torch", "liger"},
    "ffn": {"torch", "compile"},
    "add_rms_norm": {"torch", "liger"},
    "apply_rotary_pos_emb": {"torch", "liger"},
    "partial_rotary_emb": {"torch"},
    "matmul": {"torch"},
    "softmax": {"torch"},
    "flash_attention_v2": {"torch", "sdpa_flash", "sdpa_cudnn"},
    "fused_rotary_and_fa": {"composite"},
    "fused_moe": {"torch", "bf16"},
    "topk_gating": {"torch"},
}


@pytest.mark.parametrize("entry_point", ENTRY_POINTS, ids=lambda ep: ep.name)
def test_each_entry_point_provides_an_op_that_get_op_selects(entry_point, device, monkeypatch):
    module = entry_point.load()
    pm = pluggy.PluginManager("dlcore")
    pm.add_hookspecs(dlcore.plugins.hookspecs)
    pm.register(module, name=entry_point.name)
    pm.check_pending()
    [[op]] = pm.hook.dlcore_ops()
    impls = [impl for found in pm.hook.dlcore_implementations() for impl in found]
    assert isinstance(op, Op) and op.name == entry_point.name
    assert impls and all(isinstance(i, TritonImplementation) and i.op == op.name for i in impls)
    assert all(impl.kernels and all(hasattr(k, "__getitem__") for k in impl.kernels) for impl in impls)
    # on the device the kernels run on (a CPU tensor on a GPU host would get the reference), with the
    # vendor's implementations of the op left out: they may rightly be faster
    vendors = [i.name for i in dlcore.plugins.registry.registry().implementations_of(op.name)
               if isinstance(i, VendorImplementation)]
    monkeypatch.setenv("DLCORE_DISABLE_IMPLS", ",".join(f"{op.name}:{name}" for name in vendors))
    args = op.example(op.example_sizes, torch.float32, torch.device(device), torch.Generator().manual_seed(0))
    bound = dlcore.get_op(op.name, args)
    assert bound.impl.plugin == f"{entry_point.group}:{entry_point.name}", bound.explain()
    assert bound.impl.name in {i.name for i in impls}


#: vendor entry point -> the op and the name of the one implementation it provides
VENDOR = {
    "vendor_ffn": ("ffn", "torch"),
    "vendor_fused_moe": ("fused_moe", "torch"),
    "vendor_fp8_gemm": ("fp8_gemm", "scaled_mm"),
    "vendor_fused_rotary_and_fa": ("fused_rotary_and_fa", "composite"),
    "vendor_matmul": ("matmul", "torch"),
    "vendor_sdpa_cudnn": ("flash_attention_v2", "sdpa_cudnn"),
    "vendor_sdpa_flash": ("flash_attention_v2", "sdpa_flash"),
}


def test_each_vendor_entry_point_provides_one_vendor_implementation_of_a_kernel_op():
    assert sorted(ep.name for ep in VENDOR_ENTRY_POINTS) == sorted(VENDOR)
    for entry_point in VENDOR_ENTRY_POINTS:
        pm = pluggy.PluginManager("dlcore")
        pm.add_hookspecs(dlcore.plugins.hookspecs)
        pm.register(entry_point.load(), name=entry_point.name)
        pm.check_pending()
        [[impl]] = pm.hook.dlcore_implementations()
        assert isinstance(impl, VendorImplementation)
        assert (impl.op, impl.name) == VENDOR[entry_point.name] and impl.op in {ep.name for ep in ENTRY_POINTS}


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
    moved, flops = op.cost(args, mode="bwd")  # every op is differentiable: its backward is rated too
    assert isinstance(moved, int) and isinstance(flops, int) and moved > inputs and flops > 0
    assert set(op.baselines) == CUSTOM_OPS[name]
    # The eager torch baseline computes the op in the input dtype, as a model does (fused_rotary_and_fa
    # has none: its baseline is a composite of two ops, tested in its own file).
    float_args = op.example(op.example_sizes, torch.float32, torch.device("cpu"), torch.Generator().manual_seed(0))
    expected = op.reference(*(a.double() if isinstance(a, torch.Tensor) else a for a in float_args))
    if "torch" in op.baselines:
        baseline = op.baselines["torch"]()
        for out, ref in zip(*(r if isinstance(r, tuple) else (r,) for r in (baseline(*float_args), expected))):
            if out.is_floating_point():
                assert_close(out, ref, torch.float32, reduce_dim=float_args[0].shape[-1])
            else:  # indices (topk_gating's) exactly
                assert torch.equal(out, ref)
    if "compile" in op.baselines:  # a declared compile baseline computes the op too (on its prepared arguments)
        composite = op.baselines["compile"]()
        prepared = getattr(composite, "prepare", lambda args: args)(float_args)
        assert_close(composite(*prepared), expected, torch.float32, reduce_dim=float_args[0].shape[-1])
    if "liger" in op.baselines:
        liger = op.baselines["liger"]()
        assert liger is None or callable(liger)
