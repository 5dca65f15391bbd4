"""`Backend.lower` and `dlcore lower`: every stage of every kernel for cuda:80 and cuda:90 on this
CPU-only machine, folded kernels included, npu's ttir, the report and the dump.

Lowering needs Triton's real compiler: those cases run in fresh processes without
``TRITON_INTERPRET``; the rest run here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from isolated import run_json

from dlcore.compiler.lowering import (
    LoweringError,
    cuda_capability,
    launches,
    lower_with_triton,
    parse_target,
    specialization,
    target_profile,
)
from dlcore.compiler.passes import Pipeline, pipeline
from dlcore.plugins.registry import registry

LOWER_ALL = """
import json
import torch
from dlcore.compiler import source
from dlcore.compiler.lowering import launches, parse_target, target_profile
from dlcore.compiler.passes import pipeline
from dlcore.errors import LoweringError
from dlcore.plugins.registry import registry

reg = registry()
found = {}
for target, enable in (("cuda:80", []), ("cuda:90", []), ("cuda:90", ["grid_folding"])):
    passes = pipeline("cuda", enable=enable, disable=[] if enable else ["grid_folding_small_programs"])
    todo, _ = launches(reg, None, torch.float16, {"tokens": 20000}, target_profile(target), passes)
    for launch in todo:
        direction = "/backward" if launch.backward else ""
        try:
            lowered = reg.backends["cuda"].lower(launch.call, target, passes)
        except LoweringError as error:  # only where the implementation declares it (test_only_declared_...)
            kernel = source.kernel_name(launch.original)
            impl = next(i for i in reg.implementations_of(launch.op) if i.name == launch.impl)
            found[f"{launch.op}/{kernel}{direction}/{target}"] = {
                "error": str(error), "declared": impl.limit("cuda", kernel, parse_target(target)[1]) is not None}
            continue
        found[f"{launch.op}/{lowered.kernel}{direction}/{target}"] = {
            "stages": [s.stage for s in lowered.stages], "planned": list(lowered.planned),
            "kinds": [type(s.ir).__name__ for s in lowered.stages],
            "registers": lowered.resources.registers, "spills": lowered.resources.spill_stores,
            "shared": lowered.resources.shared, "seconds": lowered.seconds, "notes": launch.notes,
            "grid": list(launch.call.grid),
        }
print(json.dumps(found))
"""

PIPELINE = ["python", "source", "ttir", "ttgir", "llir", "ptx", "cubin"]


def lower_cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DLCORE_")}
    env.update(TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    return subprocess.run([sys.executable, "-m", "dlcore.cli", "lower", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=600)


@pytest.fixture(scope="module")
def lowered(tmp_path_factory):
    return run_json(LOWER_ALL, None, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1",
                    TRITON_CACHE_DIR=str(tmp_path_factory.mktemp("triton-cache")))


@pytest.mark.slow
def test_only_declared_kernels_fail_to_lower(lowered):
    failed = {key: found for key, found in lowered.items() if "error" in found}
    assert all(found["declared"] for found in failed.values()), failed
    # fp8 stores need sm_89: quantize_fp8's on cuda:80 is declared, and it is the only failure
    assert sorted(failed) == ["quantize_fp8/block_quantize_kernel/cuda:80"], sorted(failed)


@pytest.mark.slow
@pytest.mark.parametrize("op", ["softmax", "silu_and_mul", "rms_norm", "ffn"])
@pytest.mark.parametrize("target", ["cuda:80", "cuda:90"])
def test_every_stage_of_each_kernel(lowered, op, target):
    keys = [k for k in lowered if k.startswith(f"{op}/") and k.endswith(f"/{target}") and "_folded" not in k]
    assert keys, sorted(lowered)
    for key in keys:
        found = lowered[key]
        assert found["stages"] == PIPELINE, key
        assert found["planned"] == PIPELINE[2:]
        assert found["kinds"] == ["str"] * 6 + ["bytes"]
        assert 0 < found["registers"] <= 255 and found["spills"] is not None and found["shared"] is not None
        assert found["seconds"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("op,kernel", [("silu_and_mul", "silu_and_mul_kernel"), ("rms_norm", "rms_norm_kernel")])
def test_folded_kernels_lower_to_cubin(lowered, op, kernel):
    found = lowered[f"{op}/{kernel}_folded/cuda:90"]
    assert found["stages"] == PIPELINE
    assert len(found["grid"]) == 1 and found["grid"][0] <= 132 * 32
    assert any(f"-> {kernel}_folded grid" in note for note in found["notes"])


@pytest.mark.slow
def test_cli_report_for_every_kernel():
    done = lower_cli("--all", "--report", "--target", "cuda:80", "--target", "cuda:90")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split()[:5] == ["kernel", "op", "target", "dtype", "regs"]
    for op in ("softmax", "silu_and_mul", "rms_norm", "ffn"):
        for target in ("cuda:80", "cuda:90"):
            rows = [line for line in lines if f" {op}.triton " in line and f" {target} " in line]
            assert rows and all("5/5 (cubin)" in row for row in rows), (op, target, done.stdout)


@pytest.mark.slow
def test_cli_prints_one_stage_and_dumps_files(tmp_path):
    done = lower_cli("rms_norm", "--target", "cuda:90", "--stage", "ttgir", "--pass", "grid_folding",
                     "--shape", "tokens=20000")
    assert done.returncode == 0, done.stderr
    assert "rms_norm_kernel_folded for cuda:90 (float16), stage ttgir; passes: grid_folding" in done.stdout
    assert "tt.func public @rms_norm_kernel_folded" in done.stdout and "ttg.num-warps" in done.stdout
    assert "stage ttir" not in done.stdout

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("kept")
    done = lower_cli("silu_and_mul_kernel", "--target", "cuda:80", "--dump", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    folder = tmp_path / "out" / "silu_and_mul_kernel-cuda80"
    assert sorted(p.name for p in folder.iterdir()) == ["00-python.py", "00-source.mlir", "01-ttir.ttir",
                                                        "02-ttgir.ttgir", "03-llir.ll", "04-ptx.ptx", "05-cubin.cubin"]
    assert (tmp_path / "out" / "mine.txt").read_text() == "kept"


@pytest.mark.slow
@pytest.mark.parametrize("selector, kernel, suffix", [
    ("apply_rotary_pos_emb", "rotary_kernel", "-backward"),  # one kernel rotates forward and, transposed, back
    ("softmax_kernel", "softmax_kernel", "-looped-rows"),  # a path's own form, named after the path
])
def test_cli_dumps_each_form_of_a_kernel_into_a_folder_of_its_own(selector, kernel, suffix, tmp_path):
    done = lower_cli(selector, "--target", "cuda:90", "--stage", "ttir", "--dump", str(tmp_path))
    assert done.returncode == 0, done.stderr
    first, other = (tmp_path / f"{kernel}{s}-cuda90" / "01-ttir.ttir" for s in ("", suffix))
    assert first.read_text() != other.read_text()


@pytest.mark.slow
def test_cli_prints_the_stage_asked_for_whatever_stops_the_pipeline_after_it():
    """npu's later stages need tools (tests/test_ascend_pipeline.py); ttir needs upstream Triton alone."""
    done = lower_cli("silu_and_mul", "--target", "npu:Ascend910B", "--stage", "ttir", "--shape", "tokens=20000")
    assert done.returncode == 0, done.stderr
    assert "tt.func public @silu_and_mul_kernel_folded" in done.stdout  # folded by default on npu


@pytest.mark.slow
def test_cli_refuses_unknown_names():
    done = lower_cli("no_such_op", "--target", "cuda:90")
    assert done.returncode != 0 and "'no_such_op' is no op, op.implementation or Triton kernel name" in done.stderr
    done = lower_cli("rms_norm", "--no-pass", "nope")
    assert done.returncode != 0 and "no pass named nope" in done.stderr


# -- specialized like a launch ---------------------------------------------------------------------------

SCALE_KERNEL = """
import triton
import triton.language as tl


@triton.jit
def scale_kernel(x_ptr, out_ptr, n, stride, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs * stride, mask=mask) * 2, mask=mask)
"""

SPECIALIZE = """
import importlib, json, torch
import triton.runtime.jit
from triton.backends.compiler import GPUTarget
from dlcore.compiler.signatures import compile_call, launch_signature
from dlcore.declarations.implementation import KernelCall
from scale import scale_kernel

target = GPUTarget("cuda", 90, 32)
x = torch.empty(8192, device="meta", dtype=torch.bfloat16)
aligned = KernelCall(scale_kernel, (4,), (x[:4096], x[4096:], 4096, 1), {"BLOCK": 1024, "num_warps": 4})
unaligned = KernelCall(scale_kernel, (4,), (x[1:4096], x[4096:], 4095, 2), {"BLOCK": 1024, "num_warps": 4})
found = {}
for name, call, how in (("aligned", aligned, {}), ("plain", aligned, {"specialize": False}),
                        ("unaligned", unaligned, {})):
    kernel = compile_call(call, target, **how)
    found[name] = {"ttir": kernel.asm["ttir"], "ttgir": kernel.asm["ttgir"], "ptx": kernel.asm["ptx"]}
    sig = launch_signature(call, target)
    found[name]["types"] = sig.types
    found[name]["divisible"] = sorted(scale_kernel.arg_names[path[0]] for path, attr in sig.attrs.items() if attr)

def described(sig):
    return [sig.types, sorted((str(k), repr(v)) for k, v in sig.constexprs.items()),
            sorted((str(k), v) for k, v in sig.attrs.items() if v)]

from dlcore.runtime.template import UNKNOWN_DEVICE as profile
rms, rope = (importlib.import_module("dlblas_kernels.kernels." + n) for n in ("rms_norm", "apply_rotary_pos_emb"))
def calls(device):
    x, w = torch.empty(37, 300, device=device), torch.empty(300, device=device)
    q, k, cos = (torch.empty(*s, device=device, dtype=torch.bfloat16) for s in ((2, 7, 8, 64), (2, 7, 2, 64), (7, 64)))
    plans = [rms.plan((x, w, 1e-6), {"BLOCK_M": 2, "BLOCK_N": 512, "num_warps": 4}, profile),
             rms.backward_plan((x, x, w, x, 1e-6), {"BLOCK_M": 1, "BLOCK_N": 128, "num_warps": 2}, profile),
             rope.plan((q, k, cos, cos, True, False), {"BLOCK_H": 4, "num_warps": 4}, profile)]
    return [call for plan in plans for call in plan.calls] + [aligned, unaligned]

by_triton = [described(launch_signature(call, target)) for call in calls("meta")]
found["real_tensors_agree"] = by_triton[:-2] == [described(launch_signature(c, target)) for c in calls("cpu")][:-2]
del triton.runtime.jit.create_function_from_signature  # what the rule-based fallback sees
by_rule = [described(launch_signature(call, target)) for call in calls("meta")]
found["rule_agrees"] = by_triton == by_rule
found["rule_differs_at"] = [i for i, (a, b) in enumerate(zip(by_triton, by_rule)) if a != b]
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def specialized(tmp_path_factory):
    site = tmp_path_factory.mktemp("scale")
    (site / "scale.py").write_text(SCALE_KERNEL)
    return run_json(SPECIALIZE, site, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1",
                    TRITON_CACHE_DIR=str(tmp_path_factory.mktemp("triton-cache")))


def _divisible_args(ir: str) -> set[str]:
    """The kernel parameters that carry ``tt.divisibility = 16`` in a ttir or ttgir function header."""
    header = next(line for line in ir.splitlines() if "tt.func public @scale_kernel" in line)
    return {part.split(":")[0].strip().lstrip("%") for part in header.split("%")[1:] if "tt.divisibility = 16" in part}


@pytest.mark.slow
def test_aligned_pointers_and_sizes_carry_divisibility(specialized):
    found = specialized["aligned"]
    assert found["divisible"] == ["n", "out_ptr", "x_ptr"]
    assert found["types"]["stride"] == "constexpr"  # an integer equal to 1 is a constant, as at a launch
    for stage in ("ttir", "ttgir"):
        assert {"x_ptr", "out_ptr", "n"} <= _divisible_args(found[stage]), found[stage]
    # 1024 bf16 over 128 threads: 8 contiguous elements each, one 128-bit load when x_ptr is known aligned
    assert "ld.global.v4.b32" in found["ptx"], found["ptx"]


@pytest.mark.slow
def test_unspecialized_compile_has_no_hints(specialized):
    found = specialized["plain"]
    assert "tt.divisibility" not in found["ttir"]
    assert "ld.global.v2" not in found["ptx"] and "ld.global.v4" not in found["ptx"]


@pytest.mark.slow
def test_a_meta_view_off_a_16_byte_boundary_is_not_aligned(specialized):
    found = specialized["unaligned"]
    assert found["divisible"] == ["out_ptr"]  # x_ptr is one bf16 into its storage, n = 4095
    assert _divisible_args(found["ttir"]) == {"out_ptr"}
    assert found["types"]["stride"] == "i32"


@pytest.mark.slow
def test_meta_tensors_specialize_like_allocated_ones(specialized):
    assert specialized["real_tensors_agree"]


@pytest.mark.slow
def test_the_rule_based_fallback_agrees_with_triton(specialized):
    assert specialized["rule_agrees"], specialized["rule_differs_at"]


@pytest.mark.slow
def test_cli_specializes_unless_told_not_to():
    done = lower_cli("silu_and_mul", "--target", "cuda:90", "--stage", "ttir")
    assert done.returncode == 0, done.stderr
    assert "tt.divisibility = 16" in done.stdout
    done = lower_cli("silu_and_mul", "--target", "cuda:90", "--stage", "ttir", "--no-specialize")
    assert done.returncode == 0, done.stderr
    assert "tt.divisibility" not in done.stdout and "// not specialized (--no-specialize)" in done.stdout


# -- here, in the interpreter's process -----------------------------------------------------------------


def test_targets_parse():
    assert parse_target("cuda:90") == ("cuda", "90")
    assert cuda_capability("cuda:sm_90a") == 90
    with pytest.raises(LoweringError, match="is not BACKEND:ARCH"):
        parse_target("cuda")
    with pytest.raises(LoweringError, match="is not a CUDA target"):
        cuda_capability("npu:Ascend910B")
    assert target_profile("cuda:90").cores == 132 and target_profile("cuda:90").arch == "sm_90"
    assert target_profile("npu:Ascend910B").backend == "npu"


def test_interpreted_kernels_are_not_lowered_here():
    todo, _ = launches(registry(), "rms_norm", torch.float32, {}, target_profile("cuda:90"), Pipeline("cuda"))
    with pytest.raises(LoweringError, match="created under TRITON_INTERPRET=1"):
        lower_with_triton(todo[0].call, None, "cuda:90", Pipeline("cuda"))


def test_backward_plans_are_lowered_too():
    todo, skipped = launches(registry(), "rms_norm", torch.float32, {}, target_profile("cuda:90"), pipeline("cuda"))
    assert [(t.name, t.call.kernel.__name__) for t in todo] == [
        ("rms_norm.triton", "rms_norm_kernel"), ("rms_norm.triton backward", "rms_norm_backward_kernel"),
        ("rms_norm.triton backward", "column_sum_kernel"),
        ("rms_norm.triton [wide rows]", "rms_norm_kernel"),
        ("rms_norm.triton [wide rows] backward", "rms_norm_backward_kernel"),
        ("rms_norm.triton [wide rows] backward", "column_sum_kernel")] and not skipped
    todo, _ = launches(registry(), "add_rms_norm", torch.float32, {}, target_profile("cuda:90"), pipeline("cuda"))
    backward = [t for t in todo if t.backward]
    assert backward and backward[0].call.kwargs["HAS_DRES"], "add_rms_norm's backward adds the residual gradient"


def test_example_paths_reach_every_path_of_an_op():
    """Without sizes, the plans of the op's example and of each of its example_paths are lowered,
    each form of a kernel once: ffn's decode kernels (one token) beside its sm_90 prefill pair."""
    todo, skipped = launches(registry(), "ffn", torch.float16, {}, target_profile("cuda:90"), pipeline("cuda"))
    forms = [(t.backward, t.call.kernel.__name__, specialization(t.call)) for t in todo]
    assert len(forms) == len(set(forms))
    forward = {k for backward, k, _ in forms if not backward}
    assert {"ffn_decode_kernel", "swiglu_pair_tma_kernel"} <= forward
    # given sizes, those alone: one token plans the decode kernels only
    todo, _ = launches(registry(), "ffn", torch.float16, {"tokens": 1}, target_profile("cuda:90"), pipeline("cuda"))
    assert "swiglu_pair_tma_kernel" not in {t.call.kernel.__name__ for t in todo if not t.backward}


def test_a_path_that_compiles_a_kernel_differently_is_lowered_apart_and_named():
    """softmax's looped rows launch softmax_kernel with other constexprs than its one-block example:
    both forms are lowered (a unified-buffer overflow on npu hid in the looped one while a kernel was
    lowered once), the second labelled with its path; a path that launches a kernel alike adds none."""
    todo, _ = launches(registry(), "softmax", torch.float16, {}, target_profile("cuda:90"), pipeline("cuda"))
    forward = [t for t in todo if not t.backward and t.call.kernel.__name__ == "softmax_kernel"]
    assert [t.name for t in forward] == ["softmax.triton", "softmax.triton [looped rows]"]
    assert specialization(forward[0].call) != specialization(forward[1].call)
    backward = [t.name for t in todo if t.backward]
    assert backward == ["softmax.triton backward", "softmax.triton [looped rows] backward"]
    # the same sizes as a path plan one form, lowered once and unlabelled
    todo, _ = launches(registry(), "softmax", torch.float16, {"tokens": 300}, target_profile("cuda:90"),
                       pipeline("cuda"))
    assert [t.name for t in todo] == ["softmax.triton", "softmax.triton backward"]


def test_a_plan_that_launches_a_kernel_in_two_forms_gives_each_its_row():
    """fused_moe's gate/up and down GEMMs are one kernel with other constexprs: both are lowered, the
    second named ``form 2`` (a row of its own on the portability page, a folder of its own)."""
    todo, _ = launches(registry(), "fused_moe", torch.float16, {"tokens": 300}, target_profile("cuda:90"),
                       pipeline("cuda"))
    gemms = [t for t in todo if not t.backward and t.call.kernel.__name__ == "grouped_gemm_kernel"]
    assert [t.name for t in gemms] == ["fused_moe.triton", "fused_moe.triton [form 2]"]
    assert [t.call.kwargs["SWIGLU"] for t in gemms] == [True, False]


def test_the_form_of_a_launch_is_its_constexprs_options_and_dtypes_not_its_sizes():
    import triton.language as tl

    from dlcore.declarations.implementation import KernelCall

    a16, a32 = torch.empty(4, dtype=torch.float16, device="meta"), torch.empty(4, dtype=torch.float32, device="meta")
    call = KernelCall(None, (8,), (a16, 300), {"BLOCK": 64, "num_warps": 4})
    assert specialization(call) == specialization(KernelCall(None, (1,), (a16, 7), {"num_warps": 4, "BLOCK": 64}))
    assert specialization(call) != specialization(KernelCall(None, (8,), (a16, 300), {"BLOCK": 128, "num_warps": 4}))
    assert specialization(call) != specialization(KernelCall(None, (8,), (a32, 300), {"BLOCK": 64, "num_warps": 4}))
    assert specialization(call) != specialization(KernelCall(None, (8,), (a16, 300), {"BLOCK": 64, "num_warps": 8}))
    # which pointer is None, and wrapped constexprs by their values
    assert specialization(KernelCall(None, (1,), (a16, None, a16))) != specialization(
        KernelCall(None, (1,), (None, a16, a16)))
    assert specialization(KernelCall(None, (1,), (), {"S": tl.constexpr(64)})) != specialization(
        KernelCall(None, (1,), (), {"S": tl.constexpr(128)}))


def test_without_a_dtype_each_implementation_takes_its_own():
    """float16 where an implementation takes it, else its first dtype (fp8_gemm: float8_e4m3fn); a
    dtype asked for skips what does not take it, with the reason."""
    todo, skipped = launches(registry(), "fp8_gemm", None, {}, target_profile("cuda:90"), pipeline("cuda"))
    assert todo and {t.dtype for t in todo} == {torch.float8_e4m3fn} and not any("support" in s for s in skipped)
    todo, _ = launches(registry(), "rms_norm", None, {}, target_profile("cuda:90"), pipeline("cuda"))
    assert {t.dtype for t in todo} == {torch.float16}
    todo, skipped = launches(registry(), "fp8_gemm", torch.float16, {}, target_profile("cuda:90"), pipeline("cuda"))
    assert not todo and skipped == ["fp8_gemm.triton: no float16 support"]


def test_kernels_outside_the_plan_are_named():
    # one row: the backward's single program writes dweight itself, no column sum
    _, skipped = launches(registry(), "rms_norm", torch.float32, {"tokens": 1}, target_profile("cuda:90"),
                          pipeline("cuda"))
    assert skipped == ["rms_norm.triton/column_sum_kernel: not launched by the plan for these inputs"]


def test_backends_without_a_pipeline_refuse_to_lower():
    todo, _ = launches(registry(), "rms_norm", torch.float32, {}, target_profile("cuda:90"), Pipeline("cuda"))
    with pytest.raises(LoweringError, match="the cpu backend has no compiler pipeline"):
        registry().backends["cpu"].lower(todo[0].call, "cpu:x86_64")


def test_plans_lowered_for_a_target_are_sized_by_its_profile():
    """rms_norm's persistent backward grid comes from the target's cores and registers, not meta's."""
    sizes = {"tokens": 65536, "hidden": 4096}
    grids = {}
    for target in ("cuda:90", "cuda:80"):
        todo, _ = launches(registry(), "rms_norm", torch.float16, sizes, target_profile(target), pipeline("cuda"))
        backward = [t for t in todo if t.backward and t.call.grid[0] < sizes["tokens"]]
        assert backward, [(t.name, t.call.grid) for t in todo]
        grids[target] = backward[0].call.grid[0]
    cores = {t: target_profile(t).cores for t in grids}
    assert grids["cuda:90"] // cores["cuda:90"] == grids["cuda:80"] // cores["cuda:80"] >= 1
    assert grids["cuda:90"] % cores["cuda:90"] == grids["cuda:80"] % cores["cuda:80"] == 0


def test_a_forward_only_form_lowers_its_forward_and_says_why_not_its_backward():
    """fused_moe with fp8 weights has no backward (its backward plan refuses them): the forward's
    launches are lowered, the backward is skipped with the reason."""
    found, skipped = launches(registry(), "fused_moe", torch.float16, {"tokens": 300, "fp8": 1},
                              target_profile("cuda:90"), pipeline("cuda"))
    assert found and not any(launch.backward for launch in found)
    assert "grouped_fp8_gemm_kernel" in {launch.call.kernel.__name__ for launch in found}
    assert any(note.startswith("fused_moe.triton backward:") and "forward only" in note for note in skipped)


class _Terminal:
    def __init__(self, tty: bool):
        self.tty, self.text = tty, ""

    def isatty(self) -> bool:
        return self.tty

    def write(self, text: str) -> None:
        self.text += text

    def flush(self) -> None:
        pass


def test_progress_rewrites_one_status_line_on_a_terminal_and_says_nothing_elsewhere():
    from dlcore.cli.lower import Progress

    terminal = _Terminal(True)
    progress = Progress("npu:Ascend910B2", 2, stream=terminal)
    progress.show("softmax.triton/softmax_kernel")
    progress.show("softmax.triton [looped rows]/softmax_kernel")
    progress.clear()
    progress.clear()  # twice: wiped once
    assert terminal.text == ("\r\033[K  lowering 1/2 for npu:Ascend910B2: softmax.triton/softmax_kernel"
                             "\r\033[K  lowering 2/2 for npu:Ascend910B2: softmax.triton [looped rows]/softmax_kernel"
                             "\r\033[K")
    for progress in (Progress("cuda:90", 2, stream=_Terminal(False)), Progress("cuda:90", 2, quiet=True,
                                                                               stream=_Terminal(True))):
        progress.show("k")
        progress.clear()
        assert progress.stream.text == ""


#: Triton 3.9's nvidia backend, emulated on any Triton: a compile that leaves FP fusion to an unset
#: TRITON_DEFAULT_FP_FUSION warns (its default is to change in 3.10)
UNSET_FUSION = """
import json, os, warnings
from triton.backends.nvidia.compiler import CUDABackend
from dlcore.cli import main

parse, asked = CUDABackend.parse_options, []
def parse_options(self, opts):
    asked.append(opts.get("enable_fp_fusion"))
    if opts.get("enable_fp_fusion") is None and os.environ.get("TRITON_DEFAULT_FP_FUSION") is None:
        warnings.warn("TRITON_DEFAULT_FP_FUSION is unset: defaulting to FP fusion ENABLED")
    return parse(self, opts)
CUDABackend.parse_options = parse_options
warnings.simplefilter("error")
status = main(["lower", "silu_and_mul", "--target", "cuda:90", "--stage", "ttir"])
print(json.dumps({"status": status, "asked": asked}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("setting, fused", [(None, True), ("0", False), ("1", True)])
def test_lowering_chooses_fp_fusion_as_a_launch_would_without_triton_s_unset_warning(setting, fused, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DLCORE_") and k != "TRITON_DEFAULT_FP_FUSION"}
    env.update(TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path), **({} if setting is None else
                                                                        {"TRITON_DEFAULT_FP_FUSION": setting}))
    done = subprocess.run([sys.executable, "-c", UNSET_FUSION], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["status"] == 0 and found["asked"] and set(found["asked"]) == {fused}, found


@pytest.mark.slow
def test_without_a_stage_or_a_folder_the_report_shows_and_says_how_to_get_the_ir():
    done = lower_cli("silu_and_mul", "--target", "cuda:90")
    assert done.returncode == 0, done.stderr
    assert "// =====" not in done.stdout and len(done.stdout.splitlines()) < 20, done.stdout[:2000]
    assert "silu_and_mul" in done.stdout and "--stage ttir|ttgir|llir|ptx|cubin" in done.stderr, done.stderr
