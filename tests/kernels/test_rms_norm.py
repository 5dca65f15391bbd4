from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import dlblas_kernels
import pytest
import torch
from dlblas_kernels.kernels.rms_norm import (
    KERNEL,
    OP,
    backward_plan,
    rms_norm,
    rms_norm_backward_reference,
    rms_norm_reference,
)
from gradients import check_backward

from dlcore import InvalidInputError
from dlcore.compiler.lowering import planning_for, target_profile
from dlcore.declarations.signature import make_signature
from dlcore.runtime.profile import device_profile
from dlcore.runtime.template import UNKNOWN_DEVICE
from dlcore.runtime.torch_ops import plain_eager
from dlcore.testing import assert_close, poison, randn, upcast

TRITON = KERNEL.implementation
rms_norm_module = sys.modules["dlblas_kernels.kernels.rms_norm"]


def inputs(lead, k, dtype, device, gen, w_dtype=None):
    x = randn(*lead, k, dtype=dtype, device=device, generator=gen)
    w = randn(k, dtype=w_dtype or dtype, device=device, generator=gen)
    return x, w


def expected(x, w, eps=1e-6):
    return rms_norm_reference(*upcast(x, w), eps)


@pytest.mark.parametrize("lead, k", [((7,), 33), ((3, 5), 100), ((2,), 1000), ((), 65), ((4,), 1)])
def test_matches_reference(lead, k, dtype, device, gen, run):
    x, w = inputs(lead, k, dtype, device, gen)
    out = run(OP, TRITON, (x, w, 1e-6))
    assert_close(out, expected(x, w), dtype)


def test_weight_in_another_dtype(device, gen, run):
    x, w = inputs((5,), 48, torch.float16, device, gen, w_dtype=torch.float32)
    assert_close(run(OP, TRITON, (x, w, 1e-6)), expected(x, w), torch.float16)


def test_non_contiguous_inputs(dtype, device, gen, run, relayout):
    x, w = inputs((3, 5), 100, dtype, device, gen)
    x_strided = relayout(x)
    w_strided = torch.stack([w, torch.full_like(w, float("nan"))], dim=1)[:, 0]
    assert not x_strided.is_contiguous() and w_strided.stride() == (2,)
    args = (x_strided, w_strided, 1e-6)
    assert_close(run(OP, TRITON, args), expected(x, w), dtype)
    assert_close(run(OP, TRITON, args, {"BLOCK_M": 2, "BLOCK_N": 32, "num_warps": 1}), expected(x, w), dtype)  # looping


def test_eps_is_applied(device, gen, run):
    x, w = inputs((4,), 40, torch.float32, device, gen)
    x = x * 0.05  # mean(x**2) ~ eps: a kernel that dropped eps would be far off
    assert_close(run(OP, TRITON, (x, w, 0.01)), expected(x, w, 0.01), torch.float32)


@pytest.mark.parametrize("block_m, block_n, num_warps", [(1, 16, 1), (2, 32, 2), (1, 64, 1), (4, 128, 4)])
def test_configs_agree(block_m, block_n, num_warps, dtype, device, gen, run):
    x, w = inputs((7,), 100, dtype, device, gen)
    args = (x, w, 1e-6)
    out = run(OP, TRITON, args, {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": num_warps})
    assert_close(out, expected(x, w), dtype)
    assert_close(out, run(OP, TRITON, args).double(), dtype)


def test_public_function_runs_the_plan(device, gen, run):
    x, w = inputs((3, 5), 100, torch.float16, device, gen)
    out = dlblas_kernels.rms_norm(x, w)
    assert dlblas_kernels.rms_norm is rms_norm
    assert torch.equal(out, run(OP, TRITON, (x, w, 1e-6)))
    assert torch.equal(rms_norm(x, w, eps=0.5), run(OP, TRITON, (x, w, 0.5)))


def test_zero_rows_launch_nothing(device, no_launch):
    x = torch.empty(0, 33, device=device)
    out = rms_norm(x, torch.ones(33, device=device))
    assert out.shape == (0, 33) and out.dtype == x.dtype


def test_plan_on_meta_tensors_reads_no_data():
    x, w = torch.empty(6, 4, 100, device="meta"), torch.empty(100, device="meta", dtype=torch.float16)
    plan = TRITON.plan((x, w, 1e-6), {"BLOCK_M": 4, "BLOCK_N": 64, "num_warps": 2}, device_profile(x.device))
    assert plan.result.device.type == "meta" and plan.result.shape == x.shape
    (call,) = plan.calls
    assert call.grid == (6,) and call.kwargs == {"BLOCK_M": 4, "BLOCK_N": 64, "ONE_BLOCK": False, "num_warps": 2}
    dx, dw = backward_plan((x, x, w, None, 1e-6), {"BLOCK_M": 4, "BLOCK_N": 64, "num_warps": 2}, UNKNOWN_DEVICE).result
    assert dx.shape == x.shape and dw.shape == w.shape and dw.dtype == torch.float16


def test_default_config_packs_short_rows():
    sig = make_signature(OP, (torch.empty(8192, 128, device="meta"), torch.empty(128, device="meta"), 1e-6),
                         torch.device("meta"))
    assert TRITON.default_config(sig, None) == {"BLOCK_M": 8, "BLOCK_N": 128, "num_warps": 2}
    sig = make_signature(OP, (torch.empty(3, 5000, device="meta"), torch.empty(5000, device="meta"), 1e-6),
                         torch.device("meta"))
    assert TRITON.default_config(sig, None) == {"BLOCK_M": 1, "BLOCK_N": 8192, "num_warps": 16}


# -- backward --------------------------------------------------------------------------------------


@pytest.mark.parametrize("lead, k", [((7,), 33), ((3, 5), 100), ((), 65), ((40,), 8)])
def test_backward_matches_reference(lead, k, dtype, device, gen):
    x, w = inputs(lead, k, dtype, device, gen)
    check_backward(rms_norm, rms_norm_reference, (x, w, 1e-6), (0, 1), gen, reduce_dim=max(k, x.numel() // k))


@pytest.mark.slow
@pytest.mark.parametrize("config", [
    {"BLOCK_M": 4, "BLOCK_N": 128, "num_warps": 2},  # several rows per tile, ragged last tile
    {"BLOCK_M": 1, "BLOCK_N": 32, "num_warps": 1},  # rows longer than a block
    {"BLOCK_M": 2, "BLOCK_N": 16, "num_warps": 1},
], ids=lambda c: "{BLOCK_M}x{BLOCK_N}".format(**c))
def test_backward_plan_writes_every_output(config, dtype, device, gen, launch, profile):
    x, w = inputs((3, 9), 100, dtype, device, gen)
    dy, dres = (randn(*x.shape, dtype=dtype, device=device, generator=gen) for _ in range(2))
    for extra in (None, dres):
        dx, dw = launch(backward_plan((dy, x, w, extra, 1e-6), config, profile))
        ref_dx, ref_dw = rms_norm_backward_reference(*upcast(dy, x, w, extra), 1e-6)
        assert_close(dx, ref_dx, dtype, reduce_dim=100)
        assert_close(dw, ref_dw, dtype, reduce_dim=27)


def test_backward_non_contiguous_inputs(dtype, device, gen, relayout):
    x, w = inputs((3, 5), 100, dtype, device, gen)
    w_strided = torch.stack([w, torch.full_like(w, float("nan"))], dim=1)[:, 0]
    check_backward(rms_norm, rms_norm_reference, (relayout(x), w_strided, 1e-6), (0, 1), gen, reduce_dim=100)


def test_backward_weight_in_another_dtype(device, gen):
    x, w = inputs((5,), 48, torch.float16, device, gen, w_dtype=torch.float32)
    dx, dw = check_backward(rms_norm, rms_norm_reference, (x, w, 1e-6), (0, 1), gen, reduce_dim=48)
    assert dx.dtype == torch.float16 and dw.dtype == torch.float32


def test_backward_of_a_broadcast_gradient(device, gen):
    """``y.sum().backward()`` hands the kernel an expanded gradient (all strides 0)."""
    x, w = inputs((4, 3), 40, torch.float32, device, gen)
    x.requires_grad_()
    rms_norm(x, w).sum().backward()
    x64 = x.detach().double().requires_grad_()
    rms_norm_reference(x64, w.double()).sum().backward()
    assert_close(x.grad, x64.grad, torch.float32, reduce_dim=40)


def test_inference_records_no_graph(device, gen):
    x, w = inputs((3,), 40, torch.float32, device, gen)
    with torch.no_grad():
        assert rms_norm(x, w.requires_grad_()).grad_fn is None
    assert rms_norm(x, w.detach()).grad_fn is None
    assert rms_norm(x, w.requires_grad_()).grad_fn is not None


@pytest.mark.parametrize("case", ["int32 x", "int32 weight", "rank-0 x", "2-D weight", "weight size",
                                  "interleaved rows", "eps a tensor"])
def test_bad_inputs_raise_before_launch(case, device, no_launch):
    x, w, eps = torch.randn(4, 6, 32, device=device), torch.randn(32, device=device), 1e-6
    if case == "int32 x":
        x = x.to(torch.int32)
    elif case == "int32 weight":
        w = w.to(torch.int32)
    elif case == "rank-0 x":
        x = x[0, 0, 0]
    elif case == "2-D weight":
        w = w[None]
    elif case == "weight size":
        w = w[:31]
    elif case == "interleaved rows":
        x = x.transpose(0, 1)  # leading dims do not flatten into one stride
    elif case == "eps a tensor":
        eps = torch.tensor(1e-6)
    with pytest.raises(InvalidInputError):
        rms_norm(x, w, eps)


# -- backward launch: persistent grid, prefetch, partials ------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("lead, k, config, programs", [
    ((29,), 100, {"BLOCK_M": 1, "BLOCK_N": 128, "num_warps": 4}, 1),  # one program, 29 row blocks
    ((29,), 100, {"BLOCK_M": 1, "BLOCK_N": 128, "num_warps": 4}, 3),  # 10, 10 and 9 row blocks
    ((3, 9), 100, {"BLOCK_M": 4, "BLOCK_N": 128, "num_warps": 1}, 2),  # ragged last block, 7 blocks
    ((5, 7), 100, {"BLOCK_M": 2, "BLOCK_N": 32, "num_warps": 1}, 3),  # two passes, partials read back
    ((5, 7), 100, {"BLOCK_M": 2, "BLOCK_N": 32, "num_warps": 1}, 1),  # two passes, one program
    ((1,), 100, {"BLOCK_M": 1, "BLOCK_N": 32, "num_warps": 1}, 1),  # two passes, one row block
    ((2,), 70, {"BLOCK_M": 8, "BLOCK_N": 16384, "num_warps": 1}, 1),  # tile narrowed, rows < BLOCK_M
], ids=["prefetch-1", "prefetch-3", "ragged", "two-pass-3", "two-pass-1", "two-pass-direct", "narrowed"])
def test_backward_persistent_programs(lead, k, config, programs, dtype, device, gen, monkeypatch, profile):
    monkeypatch.setattr(rms_norm_module, "backward_programs", lambda blocks, *_: min(blocks, programs))
    x, w = inputs(lead, k, dtype, device, gen)
    dy, dres = (randn(*x.shape, dtype=dtype, device=device, generator=gen) for _ in range(2))
    rows = x.numel() // k
    for extra in (None, dres):
        plan = backward_plan((dy, x, w, extra, 1e-6), config, profile)
        main = plan.calls[0]
        assert main.grid == (programs,)
        # One program writes dweight itself when nothing accumulates across row blocks in memory.
        one_block, blocks = k <= main.kwargs["BLOCK_N"], -(-rows // main.kwargs["BLOCK_M"])
        assert len(plan.calls) == (1 if programs == 1 and (one_block or blocks == 1) else 2)
        dx, dw = plan.result
        # Outputs and the partials' buffer poisoned: each element must be written before it is read.
        for t in (dx, dw, main.args[5]):
            poison(t)
        plan.run()
        ref_dx, ref_dw = rms_norm_backward_reference(*upcast(dy, x, w, extra), 1e-6)
        assert_close(dx, ref_dx, dtype, reduce_dim=k)
        assert_close(dw, ref_dw, dtype, reduce_dim=rows)


def test_backward_more_programs_than_rows(dtype, device, gen, profile):
    """Rows fewer than the programs the device holds: one program per row block, none idle."""
    x, w = inputs((3,), 64, dtype, device, gen)
    dy = randn(*x.shape, dtype=dtype, device=device, generator=gen)
    plan = backward_plan((dy, x, w, None, 1e-6), {"BLOCK_M": 1, "BLOCK_N": 64, "num_warps": 1}, profile)
    assert plan.calls[0].grid == (3,) and plan.calls[1].kernel.__name__ == "column_sum_kernel"
    dx, dw = plan.result
    for t in (dx, dw, plan.calls[0].args[5]):
        poison(t)
    plan.run()
    ref_dx, ref_dw = rms_norm_backward_reference(*upcast(dy, x, w, None), 1e-6)
    assert_close(dx, ref_dx, dtype, reduce_dim=64)
    assert_close(dw, ref_dw, dtype, reduce_dim=3)


def test_backward_launch_for_llama_shapes():
    """The default configs of hidden 4096 and 8192 give the backward 16 elements per thread (no
    spills on sm_90: 117-128 registers), a whole row in registers, and a grid the device holds at
    once, by the device profile: two programs per multiprocessor at 8 warps, one at 16."""
    h100 = target_profile("cuda:90")
    for k, warps, per_sm in ((4096, 8, 2), (8192, 16, 1)):
        config = rms_norm_module.heuristic_config(4096, k)
        assert rms_norm_module.backward_config(config) == (1, k, warps)
        assert rms_norm_module.backward_programs(4096, k, warps, h100) == h100.cores * per_sm
        assert rms_norm_module.backward_programs(3, k, warps, h100) == 3
        # Twice the registers per core: twice the programs (the threads and RESIDENT_ELEMENTS allow them).
        roomy = dataclasses.replace(h100, registers_per_core=2 * h100.registers_per_core)
        assert rms_norm_module.backward_programs(4096, k, warps, roomy) == h100.cores * 2 * per_sm
    # Limits the profile does not know bound nothing: RESIDENT_ELEMENTS per core, or with no core
    # count one program per row block.
    cpu = dataclasses.replace(UNKNOWN_DEVICE, cores=2)
    assert rms_norm_module.backward_programs(4096, 4096, 8, cpu) == 2 * 4
    assert rms_norm_module.backward_programs(4096, 4096, 8, UNKNOWN_DEVICE) == 4096
    # A wide forward tile is narrowed, and gets warps for 16 elements per thread at most.
    assert rms_norm_module.backward_config({"BLOCK_M": 4, "BLOCK_N": 4096, "num_warps": 16}) == (2, 4096, 16)
    assert rms_norm_module.backward_config({"BLOCK_M": 1, "BLOCK_N": 16384, "num_warps": 16}) == (1, 8192, 16)
    assert rms_norm_module.backward_config({"BLOCK_M": 8, "BLOCK_N": 128, "num_warps": 1}) == (8, 128, 2)


def test_backward_tile_within_the_npu_unified_buffer():
    """On npu the backward's tile is at most 4096 elements: bishengir-compile 1.2 overflowed the
    Ascend 910B's 192 KiB unified buffer with hidden 8192 whole (245824 bytes; 262208 with
    add_rms_norm's residual gradient), so wider rows take the two-pass path; CUDA keeps 8192."""
    npu, hopper = target_profile("npu:Ascend910B2"), target_profile("cuda:90")
    wide = rms_norm_module.heuristic_config(4096, 8192)
    assert rms_norm_module.backward_config(wide, hopper) == (1, 8192, 16)
    assert rms_norm_module.backward_config(wide, npu) == (1, 4096, 16)
    assert rms_norm_module.backward_config({"BLOCK_M": 8, "BLOCK_N": 1024, "num_warps": 4}, npu) == (4, 1024, 8)
    x = torch.empty(4096, 8192, dtype=torch.bfloat16, device="meta")
    with planning_for(npu):
        plan = rms_norm_module.backward_plan((x, x, x[0], None, 1e-6), wide, npu)
    assert plan.calls[0].kwargs["BLOCK_N"] == 4096 and not plan.calls[0].kwargs["ONE_BLOCK"]


def test_eager_backward_skips_the_dispatcher(device, gen, monkeypatch):
    """Plain eager autograd launches the backward plan directly; a graph being built (create_graph)
    or a tracer goes through the custom op."""
    x, w = inputs((4,), 48, torch.float32, device, gen)
    x, w = x.requires_grad_(), w.requires_grad_()
    through_op = []
    op = torch.ops.dlblas.rms_norm_backward
    monkeypatch.setattr(torch.ops.dlblas, "rms_norm_backward",
                        lambda *a: through_op.append(1) or op(*a), raising=False)
    y = rms_norm(x, w)
    torch.autograd.grad(y, (x, w), torch.ones_like(y), retain_graph=True)
    assert not through_op
    torch.autograd.grad(y, (x, w), torch.ones_like(y), create_graph=True)
    assert through_op
    with torch.no_grad():
        assert plain_eager((x, x, w, None))
    assert not plain_eager((x, x, w, None))  # grad mode on
    fake = torch._subclasses.FakeTensorMode().from_tensor(x.detach())
    with torch.no_grad():
        assert not plain_eager((fake, fake, w, None))  # a tensor subclass
    with torch.no_grad():
        assert not plain_eager((x.double(), x.double(), w, None))


COMPILE_SCRIPT = """
import importlib, json, torch
from triton.backends.compiler import GPUTarget
from dlcore.compiler.lowering import compile_call, target_profile

rms = importlib.import_module("dlblas_kernels.kernels.rms_norm")
found = {}
for dtype, capability in ((torch.bfloat16, 90), (torch.float16, 80), (torch.float32, 80)):
    for rows, k, config in ((4096, 4096, None), (64, 8192, None), (1, 4096, None),
                            (37, 300, {"BLOCK_M": 2, "BLOCK_N": 128, "num_warps": 2})):
        x, w = torch.empty(rows, k, device="meta", dtype=dtype), torch.empty(k, device="meta", dtype=dtype)
        for dres in (None, x):
            plan = rms.backward_plan((x, x, w, dres, 1e-6), config or rms.heuristic_config(rows, k),
                                     target_profile(f"cuda:{capability}"))
            for call in plan.calls:
                kernel = compile_call(call, GPUTarget("cuda", capability, 32))
                name = f"{rows}x{k}/{dres is not None}/{call.kernel.__name__}/{str(dtype)[6:]}/sm_{capability}"
                found[name] = len(kernel.asm.get("cubin", b""))
print(json.dumps(found))
"""


@pytest.mark.slow
def test_backward_compiles_for_nvidia_targets():
    """Every backward variant (persistent one-block rows at hidden 4096 and 8192, one program writing
    dweight directly, two passes, each with and without dres) compiles to a cubin for sm_80/sm_90."""
    from isolated import run_json

    found = run_json(COMPILE_SCRIPT, None, TRITON_INTERPRET="0")
    assert len(found) == 3 * (3 * 4 + 2), sorted(found)  # the 1-row plans launch one kernel
    assert all(size > 0 for size in found.values()), found


TTIR_SCRIPT = """
import json, sys, torch
from triton.backends.compiler import GPUTarget
from dlcore.compiler.lowering import compile_call, target_profile
import dlblas_kernels.kernels.rms_norm as rms

x, w = torch.empty(37, 1000, device="meta", dtype=torch.float16), torch.empty(1000, device="meta", dtype=torch.float16)
found = {}
for name, config in (("one_block", {"BLOCK_M": 2, "BLOCK_N": 1024, "num_warps": 4}),
                     ("looping", {"BLOCK_M": 1, "BLOCK_N": 256, "num_warps": 2})):
    for dres in (None, x):
        call = rms.backward_plan((x, x, w, dres, 1e-6), config, target_profile("cuda:90")).calls[0]
        key = name + ("+dres" if dres is not None else "")
        found[key] = compile_call(call, GPUTarget("cuda", 90, 32)).asm["ttir"]
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def backward_ttir() -> dict[str, str]:
    """The backward row kernel's TTIR from upstream Triton for sm_90 (what dlc-ascend's pipeline
    lowers too): rows in one block and rows in two passes, each with and without dres."""
    from isolated import run_json

    return run_json(TTIR_SCRIPT, None, TRITON_INTERPRET="0")


def test_backward_reduces_one_operand_at_a_time(backward_ttir):
    """triton-ascend's adapter leaves a multi-operand tt.reduce unlowered (and exits 0): the
    backward sums x**2 and g*x with two single-operand reductions."""
    assert set(backward_ttir) == {"one_block", "one_block+dres", "looping", "looping+dres"}
    for name, ttir in backward_ttir.items():
        operands = re.findall(r'"tt\.reduce"\(([^)]*)\)', ttir)
        assert operands, f"{name}: no tt.reduce in the TTIR"
        assert all(len(o.split(",")) == 1 for o in operands), (name, operands)


def _ascend_tool(name: str) -> Path:
    from dlc_ascend import toolchain

    found = toolchain.find(name)
    if found is None:
        pytest.skip(f"{name} not found: {toolchain.TOOLS[name].how_to_get}")
    return found.path


ADAPTER_PASSES = (
    "--discrete-mask-access-conversion=compile-on-910-95=False force-simt-template=False", "--triton-to-annotation",
    "--triton-to-unstructure=compile-on-910-95=False force-simt-template=False", "--triton-to-hivm",
    "--triton-to-hfusion", "--triton-to-llvm", "--bubble-up-operation",
    "--triton-to-linalg=global-kernel=false named-ops=True enable-nd2nz-on-vector=False "
    "enable-select-analysis=False compile-on-910-95=False",
)
BISHENGIR_OPTIONS = (
    "--target=Ascend910B2", "--enable-auto-multi-buffer=True", "--enable-auto-bind-sub-block=True",
    "--enable-hfusion-compile=true", "--enable-hivm-compile=true", "--enable-triton-kernel-compile=true",
)


@pytest.mark.ascend_tools
def test_backward_lowers_to_hivm_ir(backward_ttir, tmp_path):
    """triton-ascend's pipeline on the backward's TTIR: no tt. operation left after the adapter,
    and bishengir-compile's HIVM IR (``module.hivm.opt.mlir``) holds hivm.hir operations (it then
    stops for want of CANN's hivmc, whatever its exit status says)."""
    adapter, bishengir = _ascend_tool("triton-adapter-opt"), _ascend_tool("bishengir-compile")
    for name, ttir in backward_ttir.items():
        work = tmp_path / name.replace("+", "_")
        (work / "temps").mkdir(parents=True)
        (work / "kernel.ttir").write_text(ttir)
        subprocess.run([adapter, work / "kernel.ttir", *ADAPTER_PASSES, "-o", work / "linalg.mlir"], check=True,
                       capture_output=True, timeout=300)
        linalg = (work / "linalg.mlir").read_text()
        assert not re.findall(r'(?:= |^\s*|")tt\.[a-z_]+', linalg, re.MULTILINE), name
        (work / "in.mlir").write_text(re.sub(r',\s*mix_mode\s*=\s*"[^"]*"', "", linalg))
        subprocess.run([bishengir, work / "in.mlir", *BISHENGIR_OPTIONS, f"--save-temps={work / 'temps'}",
                        "-o", work / "temps" / "kernel"], capture_output=True, timeout=600)
        hivm = work / "temps" / "module.hivm.opt.mlir"
        assert hivm.is_file() and "hivm.hir." in hivm.read_text(), name
