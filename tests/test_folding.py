"""Grid folding (inter-core scheduling): identical results in the interpreter for grids smaller
than, equal to and larger than the programs folded onto, and a clear refusal where it is unsafe."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from dlcore.compiler import folding, source
from dlcore.compiler.folding import fold_call
from dlcore.compiler.passes import default_pipeline
from dlcore.compiler.rewrite import apply_launch_passes
from dlcore.declarations.device import DeviceProfile
from dlcore.declarations.implementation import KernelCall, LaunchPlan
from dlcore.declarations.signature import make_signature
from dlcore.errors import FoldingRefused
from dlcore.plugins.registry import registry
from dlcore.runtime.profile import device_profile


def profile(backend: str, cores: int = 3) -> DeviceProfile:
    return DeviceProfile(backend=backend, vendor="test", name=f"test {backend}", arch="test", cores=cores)


def run_poisoned(plan: LaunchPlan) -> torch.Tensor:
    """Run ``plan`` with its output poisoned first, so an element no program wrote shows."""
    plan.result.fill_(float("nan"))
    return plan.run().clone()


def fold_plan(plan: LaunchPlan, programs: int) -> LaunchPlan:
    return LaunchPlan([fold_call(c, programs) for c in plan.calls], plan.result)


# -- the registered kernels, bit for bit ------------------------------------------------------------


@pytest.mark.parametrize("op_name,sizes", [
    ("silu_and_mul", {"tokens": 37, "inter": 96}),
    ("rms_norm", {"tokens": 37, "hidden": 200}),
    ("ffn", {"tokens": 130, "hidden": 64, "inter": 96}),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_registered_kernels_fold_bit_exactly(op_name, sizes, dtype):
    op = registry().op(op_name)
    impl = next(i for i in registry().implementations_of(op_name) if i.kind == "triton")
    args = op.example(sizes, dtype, torch.device("cpu"), torch.Generator().manual_seed(1))
    cpu = torch.device("cpu")
    plan = impl.plan(args, impl.default_config(make_signature(op, args, cpu), None), device_profile(cpu))
    expected = run_poisoned(plan)
    total = math.prod(plan.calls[0].grid)
    assert total > 2, "the example must launch a few programs"
    for p in (1, total - 1, total, total + 5):  # one program; fewer than, as many as, more than the grid
        folded = fold_plan(plan, p)
        assert folded.calls[0].grid == (min(p, total),)
        assert torch.equal(run_poisoned(folded), expected), f"{op_name} folded onto {p} programs"


# -- grids of one, two and three axes; a reassigned parameter; defaults -------------------------------


@triton.jit
def where_am_i_kernel(out_ptr, stride_0, stride_1):
    # Each logical program writes its own (axis 0, 1, 2) ids at its own place.
    pid_0 = tl.program_id(0)
    pid_1 = tl.program_id(axis=1)
    pid_2 = tl.program_id(2)
    base = out_ptr + (pid_0 * stride_0 + pid_1 * stride_1 + pid_2) * 3
    tl.store(base, pid_0)
    tl.store(base + 1, pid_1)
    tl.store(base + 2, pid_2)


@pytest.mark.parametrize("grid", [(7,), (3, 4), (3, 4, 5), (2, 1, 3)])
@pytest.mark.parametrize("programs", [1, 5, 60, 1000])
def test_every_logical_program_runs_once_with_its_ids(grid, programs):
    dims = (*grid, *(1,) * (3 - len(grid)))
    out = torch.full((*dims, 3), -1, dtype=torch.int32)
    call = KernelCall(where_am_i_kernel, grid, (out, dims[1] * dims[2], dims[2]))
    folded = fold_call(call, programs)
    assert folded.grid == (min(programs, dims[0] * dims[1] * dims[2]),)
    folded.launch()
    ids = torch.stack(torch.meshgrid(*(torch.arange(d, dtype=torch.int32) for d in dims), indexing="ij"), dim=-1)
    assert torch.equal(out, ids)


@triton.jit
def shifted_copy_kernel(x_ptr, out_ptr, n, shift, BLOCK: tl.constexpr = 16):
    # Reassigns two parameters: every logical program must still start from the launched values.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x_ptr += shift
    n -= shift
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n, other=-1.0), mask=offs < n + shift)


def test_reassigned_parameters_restart_in_every_logical_program():
    x = torch.randn(100)
    expected, out = torch.full((100,), float("nan")), torch.full((100,), float("nan"))
    shifted_copy_kernel[(7,)](x, expected, 100, 3)
    fold_call(KernelCall(shifted_copy_kernel, (7,), (x, out, 100, 3)), 2).launch()
    assert torch.equal(out, expected)
    text = source.source_of(folding.folded_kernel(shifted_copy_kernel, 1)[0])
    assert "dlc_local_x_ptr = x_ptr" in text and "dlc_local_n = n" in text
    assert "dlc_programs=1" in text.replace(" ", "")  # new parameters after defaults get defaults too


def test_the_folded_loop_can_be_kept_from_pipelining():
    x = torch.randn(100)
    expected, out = torch.full((100,), float("nan")), torch.full((100,), float("nan"))
    shifted_copy_kernel[(7,)](x, expected, 100, 3)
    call = fold_call(KernelCall(shifted_copy_kernel, (7,), (x, out, 100, 3)), 3, loop_stages=1)
    assert "tl.range(tl.program_id(0), dlc_grid_0, dlc_programs, num_stages=1)" in source.source_of(call.kernel)
    call.launch()
    assert torch.equal(out, expected)


def test_folded_source_is_a_syntax_tree_rewrite():
    kernel, axes = folding.folded_kernel(where_am_i_kernel, 3)
    text = source.source_of(kernel)
    assert axes == 3 and source.kernel_name(kernel) == "where_am_i_kernel_folded"
    assert "for dlc_index in range(tl.program_id(0), dlc_grid_0 * dlc_grid_1 * dlc_grid_2, dlc_programs):" in text
    assert text.count("tl.program_id") == 1  # only the loop's start reads the physical id
    assert folding.folded_kernel(where_am_i_kernel, 3)[0] is kernel  # built once


# -- refusals ---------------------------------------------------------------------------------------


@triton.jit
def persistent_kernel(x_ptr, n):
    for i in range(tl.program_id(0), n, tl.num_programs(0)):
        tl.store(x_ptr + i, i)


@triton.jit
def counter_kernel(counter_ptr):
    tl.atomic_add(counter_ptr, tl.program_id(0))


@triton.jit
def lock_kernel(lock_ptr, x_ptr):
    while tl.atomic_cas(lock_ptr, 0, 1) == 1:
        pass
    tl.store(x_ptr + tl.program_id(0), 1)
    tl.atomic_xchg(lock_ptr, 0)


@triton.jit
def early_return_kernel(x_ptr, n):
    pid = tl.program_id(0)
    if pid >= n:
        return
    tl.store(x_ptr + pid, 1)


@triton.jit
def pid_helper():
    return tl.program_id(0)


@triton.jit
def helper_kernel(x_ptr):
    tl.store(x_ptr + pid_helper(), 1)


@triton.jit
def variable_axis_kernel(x_ptr, AXIS: tl.constexpr):
    tl.store(x_ptr + tl.program_id(AXIS), 1)


@triton.jit
def aliased_pid_kernel(x_ptr):
    get = tl.program_id
    tl.store(x_ptr + get(0), 1)


@triton.jit
def constexpr_reassigned_kernel(x_ptr, BLOCK: tl.constexpr):
    BLOCK = BLOCK * 2
    tl.store(x_ptr + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), 1)


@triton.jit
def same_everywhere_kernel(x_ptr):
    tl.store(x_ptr, 1)


@triton.jit
def block_id_asm_kernel(x_ptr):
    ids = tl.inline_asm_elementwise("mov.u32 $0, %ctaid.x;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)
    tl.store(x_ptr + tl.program_id(0), ids)


@pytest.mark.parametrize("kernel,reason", [
    (persistent_kernel, "uses tl.num_programs: the kernel already schedules its own programs"),
    (counter_kernel, "uses tl.atomic_add: programs may synchronise through memory"),
    (lock_kernel, "uses tl.atomic_cas"),
    (early_return_kernel, "has a `return`"),
    (helper_kernel, "helper pid_helper, called by helper_kernel .*reads tl.program_id inside a helper"),
    (variable_axis_kernel, "axis that is not a literal 0, 1 or 2"),
    (aliased_pid_kernel, "uses tl.program_id other than by calling it"),
    (constexpr_reassigned_kernel, "reassigns its constexpr parameter BLOCK"),
    (same_everywhere_kernel, "never reads tl.program_id"),
    (block_id_asm_kernel, "reads the hardware block id in inline assembly"),
])
def test_unsafe_kernels_are_refused_with_the_reason(kernel, reason):
    assert folding.check(kernel) is not None
    with pytest.raises(FoldingRefused, match=reason):
        fold_call(KernelCall(kernel, (8,), (torch.zeros(8),)), 2)


def test_kernels_closing_over_locals_are_refused():
    scale = 2.0

    def body(x_ptr):
        tl.store(x_ptr + tl.program_id(0), scale)

    with pytest.raises(FoldingRefused, match="closes over local variables"):
        folding.analyse(triton.jit(body))


def test_grids_that_cannot_fold_are_refused():
    call = KernelCall(where_am_i_kernel, (2**16, 2**16), (torch.zeros(1), 1, 1))
    with pytest.raises(FoldingRefused, match="folded indices must stay below 2\\*\\*31"):
        fold_call(call, 4)
    with pytest.raises(FoldingRefused, match="not a tuple of non-negative ints"):
        fold_call(KernelCall(where_am_i_kernel, lambda meta: (4,), ()), 4)


# -- the pass -----------------------------------------------------------------------------------------


def _silu_plan(tokens=37):
    op = registry().op("silu_and_mul")
    impl = next(i for i in registry().implementations_of("silu_and_mul") if i.kind == "triton")
    args = op.example({"tokens": tokens, "inter": 64}, torch.float32, torch.device("cpu"),
                      torch.Generator().manual_seed(2))
    cpu = torch.device("cpu")
    return impl.plan(args, impl.default_config(make_signature(op, args, cpu), None), device_profile(cpu))


def test_the_pass_is_on_by_default_for_npu_and_mlu_and_for_small_programs_on_cuda(monkeypatch):
    assert "grid_folding" in default_pipeline("npu").names
    assert "grid_folding" in default_pipeline("mlu").names
    assert "grid_folding" not in default_pipeline("cuda").names
    assert "grid_folding_small_programs" in default_pipeline("cuda").names
    assert "grid_folding_small_programs" not in default_pipeline("npu").names
    monkeypatch.setenv("DLCORE_ENABLE_PASSES", "grid_folding")
    assert "grid_folding" in default_pipeline("cuda").names


def test_on_cuda_only_one_warp_launches_fold_by_default():
    """The rule the H200 measurements support: one-warp programs win, bigger ones lose."""
    import dataclasses

    from dlcore.compiler.folding import fold_launch, fold_small_programs
    from dlcore.declarations.device import DeviceProfile

    h200 = DeviceProfile("cuda", "nvidia", "NVIDIA H200", "sm_90", 132)
    (call,) = _silu_plan().calls
    grid = (100_000, 1)
    one_warp = dataclasses.replace(call, grid=grid, kwargs={**call.kwargs, "num_warps": 1})
    four_warps = dataclasses.replace(call, grid=grid, kwargs={**call.kwargs, "num_warps": 4})
    assert fold_small_programs(one_warp, h200).grid == (132 * 32,)
    assert fold_small_programs(four_warps, h200) is None
    assert fold_launch(four_warps, h200).grid == (132 * 16,)  # grid_folding itself, when asked for


def test_the_pass_folds_a_large_grid_and_keeps_results():
    plan = _silu_plan()
    expected = run_poisoned(plan)
    folded = apply_launch_passes(plan, profile("npu", cores=3))
    assert folded.calls[0].grid == (3,) and source.kernel_name(folded.calls[0].kernel).endswith("_folded")
    assert torch.equal(run_poisoned(folded), expected)


def test_the_pass_leaves_a_grid_that_fits():
    plan = _silu_plan(tokens=3)
    assert apply_launch_passes(plan, profile("npu", cores=8)).calls[0].kernel is plan.calls[0].kernel


def test_the_pass_declines_unsafe_kernels_and_records_why():
    x = torch.zeros(64)
    plan = LaunchPlan([KernelCall(persistent_kernel, (16,), (x, 64))], x)
    assert apply_launch_passes(plan, profile("mlu", cores=2)).calls[0].kernel is persistent_kernel
    assert "tl.num_programs" in folding.refusals["persistent_kernel"]


def test_programs_per_sm_follow_num_warps_on_cuda():
    call = KernelCall(where_am_i_kernel, (10**6,), (), {"num_warps": 4})
    assert folding.programs_for(call, profile("cuda", cores=132)) == 132 * 16
    call.kwargs["num_warps"] = 1
    assert folding.programs_for(call, profile("cuda", cores=132)) == 132 * 32
    assert folding.programs_for(call, profile("npu", cores=24)) == 24
