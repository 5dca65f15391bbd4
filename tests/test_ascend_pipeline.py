"""The npu pipeline (dlc_ascend.pipeline): each stage driver on hand-written TTIR and linalg with the
real tools (skipped, with the reason, where they are absent), and with fake tools that fail or lie;
the coalescing pass on a kernel with a scattered mask; a missing tool; ``--stage hivm``'s exit status.

The drivers take IR text, so they run here; what needs Triton's compiler (ttir of a real kernel)
runs in a fresh process without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from dlc_ascend import invoke, passes, pipeline
from dlc_ascend.chips import chip
from dlc_ascend.toolchain import find

from dlcore.compiler.passes import Pipeline
from dlcore.errors import LoweringError

ADD_ONE_TTIR = """\
module {
  tt.func public @add_one(%x: !tt.ptr<f32> {tt.divisibility = 16 : i32}, %y: !tt.ptr<f32> {tt.divisibility = 16 : i32},
                          %n: i32) attributes {noinline = false} {
    %c64 = arith.constant 64 : i32
    %one = arith.constant dense<1.000000e+00> : tensor<64xf32>
    %zero = arith.constant dense<0.000000e+00> : tensor<64xf32>
    %pid = tt.get_program_id x : i32
    %start = arith.muli %pid, %c64 : i32
    %range = tt.make_range {end = 64 : i32, start = 0 : i32} : tensor<64xi32>
    %base = tt.splat %start : i32 -> tensor<64xi32>
    %offs = arith.addi %base, %range : tensor<64xi32>
    MASK
    %xs = tt.splat %x : !tt.ptr<f32> -> tensor<64x!tt.ptr<f32>>
    %xp = tt.addptr %xs, %offs : tensor<64x!tt.ptr<f32>>, tensor<64xi32>
    %v = tt.load %xp, %mask, %zero : tensor<64x!tt.ptr<f32>>
    %w = arith.addf %v, %one : tensor<64xf32>
    %ys = tt.splat %y : !tt.ptr<f32> -> tensor<64x!tt.ptr<f32>>
    %yp = tt.addptr %ys, %offs : tensor<64x!tt.ptr<f32>>, tensor<64xi32>
    tt.store %yp, %w, %mask : tensor<64x!tt.ptr<f32>>
    tt.return
  }
}
"""
#: a contiguous mask (the first n elements)
BOUNDED = ADD_ONE_TTIR.replace("MASK", "%bound = tt.splat %n : i32 -> tensor<64xi32>\n"
                               "    %mask = arith.cmpi slt, %offs, %bound : tensor<64xi32>")
#: a scattered mask (every other element): what discrete_mask_access_conversion coalesces
EVEN = ADD_ONE_TTIR.replace("MASK", "%two = arith.constant dense<2> : tensor<64xi32>\n"
                            "    %izero = arith.constant dense<0> : tensor<64xi32>\n"
                            "    %odd = arith.remsi %range, %two : tensor<64xi32>\n"
                            "    %mask = arith.cmpi eq, %odd, %izero : tensor<64xi32>")

#: what triton-adapter-opt (triton-ascend 3.2) makes of BOUNDED
ADD_ONE_LINALG = """\
module {
  func.func @add_one(%arg0: memref<?xi8>, %arg1: memref<?xi8>, %arg2: memref<?xf32> {tt.divisibility = 16 : i32, \
tt.tensor_kind = 0 : i32}, %arg3: memref<?xf32> {tt.divisibility = 16 : i32, tt.tensor_kind = 1 : i32}, %arg4: i32, \
%arg5: i32, %arg6: i32, %arg7: i32, %arg8: i32, %arg9: i32, %arg10: i32) attributes {SyncBlockLockArgIdx = 0 : i64, \
WorkspaceArgIdx = 1 : i64, global_kernel = "local", mix_mode = "aiv", parallel_mode = "simd"} {
    %c64 = arith.constant 64 : index
    %c64_i32 = arith.constant 64 : i32
    %cst = arith.constant 1.000000e+00 : f32
    %0 = tensor.empty() : tensor<64xf32>
    %1 = linalg.fill ins(%cst : f32) outs(%0 : tensor<64xf32>) -> tensor<64xf32>
    %2 = arith.muli %arg8, %c64_i32 : i32
    %3 = arith.index_cast %2 : i32 to index
    %reinterpret_cast = memref.reinterpret_cast %arg2 to offset: [%3], sizes: [64], strides: [1] : memref<?xf32> to \
memref<64xf32, strided<[1], offset: ?>>
    %alloc = memref.alloc() : memref<64xf32>
    %4 = arith.addi %3, %c64 : index
    %5 = arith.index_cast %arg4 : i32 to index
    %6 = arith.maxsi %3, %5 : index
    %7 = arith.minsi %4, %6 : index
    %8 = arith.subi %7, %3 : index
    %subview = memref.subview %reinterpret_cast[0] [%8] [1] : memref<64xf32, strided<[1], offset: ?>> to \
memref<?xf32, strided<[1], offset: ?>>
    %subview_0 = memref.subview %alloc[0] [%8] [1] : memref<64xf32> to memref<?xf32, strided<[1]>>
    memref.copy %subview, %subview_0 : memref<?xf32, strided<[1], offset: ?>> to memref<?xf32, strided<[1]>>
    %9 = bufferization.to_tensor %alloc restrict writable : memref<64xf32>
    %10 = arith.addf %9, %1 : tensor<64xf32>
    %reinterpret_cast_1 = memref.reinterpret_cast %arg3 to offset: [%3], sizes: [64], strides: [1] : memref<?xf32> \
to memref<64xf32, strided<[1], offset: ?>>
    %extracted_slice = tensor.extract_slice %10[0] [%8] [1] : tensor<64xf32> to tensor<?xf32>
    %subview_2 = memref.subview %reinterpret_cast_1[0] [%8] [1] : memref<64xf32, strided<[1], offset: ?>> to \
memref<?xf32, strided<[1], offset: ?>>
    bufferization.materialize_in_destination %extracted_slice in writable %subview_2 : (tensor<?xf32>, \
memref<?xf32, strided<[1], offset: ?>>) -> ()
    return
  }
}
"""
HIVM_OUT = 'module {\n  func.func @add_one() {\n    hivm.hir.vadd ins() outs()\n    return\n  }\n}\n'

# ascend_tools skips, with the reason, where the tools are absent (tests/conftest.py); nox -s ascend runs them
needs_adapter = pytest.mark.ascend_tools("triton-adapter-opt")
needs_bishengir = pytest.mark.ascend_tools("bishengir-compile")
PART = chip("Ascend910B2")


def _context(stage: str = "linalg"):
    return pipeline.NpuCompile.after(None, "add_one", PART).context(stage)


def _adapter_pipeline(disable: tuple[str, ...] = ()) -> Pipeline:
    return Pipeline("npu", tuple(p for p in passes.adapter_passes() if p.name not in disable))


#: what the real tools print for --version, which dlcore's discovery checks before using one
VERSION = 'if [ "$1" = "--version" ]; then echo "LLVM version 20.0.0git"; echo "bishengir-compile 1.2.0"; exit 0; fi\n'


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + VERSION + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


# -- the real tools ---------------------------------------------------------------------------------

@needs_adapter
def test_linalg_driver_runs_each_adapter_pass_and_checks_the_result():
    outputs = pipeline.linalg(BOUNDED, _adapter_pipeline(), _context())
    assert [o.after_pass for o in outputs] == [name for name, *_ in passes.ADAPTER_PASSES] + [""]
    final = str(outputs[-1].ir)
    ops = pipeline.operations(final)
    assert "func.func" in ops and not [op for op in ops if op.startswith("tt.")]
    assert "tt.divisibility" in final  # attributes named tt. stay: only operations are checked
    assert "tt.load" in str(outputs[0].ir) and "memref.copy" in ops


@needs_adapter
def test_the_coalescing_pass_turns_a_scattered_mask_into_a_contiguous_load(monkeypatch):
    import triton

    # the expected failure is the adapter's own, not the one-line version message (Triton 3.9 in CI)
    monkeypatch.setattr(triton, "__version__", pipeline.TTIR_TRITON)
    on = pipeline.linalg(EVEN, _adapter_pipeline(), _context())
    coalesced = str(on[0].ir)  # after discrete_mask_access_conversion
    loads = [line for line in coalesced.splitlines() if "tt.load" in line]
    assert loads and all(re.search(r"tt\.load %\w+ :", line) for line in loads)  # no mask operand left
    assert "arith.select" in coalesced and "DiscreteMask" in coalesced
    with pytest.raises(LoweringError, match=r"triton-adapter-opt failed in the linalg stage \(--triton-to-linalg"):
        pipeline.linalg(EVEN, _adapter_pipeline(disable=("discrete_mask_access_conversion",)), _context())


def test_the_lowering_pass_cannot_be_switched_off():
    with pytest.raises(LoweringError, match="triton_to_linalg is switched off"):
        pipeline.linalg(BOUNDED, _adapter_pipeline(disable=(passes.LOWERING,)), _context())


@needs_bishengir
def test_hivm_driver_makes_hivm_ir_from_hand_written_linalg():
    made = pipeline.hivm(ADD_ONE_LINALG, PART, None)
    assert made.mix_mode == "aiv" and made.binary is None and not made.retried
    assert sum(op.startswith("hivm.hir.") for op in pipeline.operations(made.hivm)) > 5
    assert made.hivm_seconds > 0


# -- fake tools ---------------------------------------------------------------------------------------

def test_an_adapter_that_exits_0_with_garbage_is_caught(tmp_path, monkeypatch):
    import triton

    fake = _script(tmp_path / "adapter", 'echo "warning: all fine" >&2\necho garbage > "$4"\n')
    monkeypatch.setenv("DLC_ASCEND_ADAPTER_OPT", str(fake))
    # on the Triton the adapter reads: its own failure, not the version's one line (Triton 3.9 in CI)
    monkeypatch.setattr(triton, "__version__", pipeline.TTIR_TRITON)
    with pytest.raises(LoweringError) as caught:
        pipeline.linalg(BOUNDED, _adapter_pipeline(), _context())
    message = str(caught.value)
    assert "triton-adapter-opt exited 0 in the linalg stage" in message and "no MLIR module" in message
    assert "warning: all fine" in message


def test_an_adapter_that_leaves_triton_operations_is_caught(tmp_path, monkeypatch):
    fake = _script(tmp_path / "adapter", 'cp "$1" "$4"\n')  # every pass a no-op: ttir stays ttir
    monkeypatch.setenv("DLC_ASCEND_ADAPTER_OPT", str(fake))
    with pytest.raises(LoweringError, match=r"left Triton operations .*tt\.load, .*tt\.store"):
        pipeline.linalg(BOUNDED, _adapter_pipeline(), _context())


def test_an_adapter_failing_on_a_newer_triton_s_ttir_says_in_one_line_which_triton_it_reads(tmp_path, monkeypatch):
    """Triton 3.9's ttir holds ``ttg.barrier``, which the adapter has no dialect for."""
    import triton

    fake = _script(tmp_path / "adapter", "echo \"error: Dialect \\`ttg' not found for custom op 'ttg.barrier'\" >&2\n"
                                         "exit 1\n")
    monkeypatch.setenv("DLC_ASCEND_ADAPTER_OPT", str(fake))
    monkeypatch.setattr(triton, "__version__", "3.9.0")
    with pytest.raises(LoweringError) as caught:
        pipeline.linalg(BOUNDED, _adapter_pipeline(), _context())
    message = str(caught.value)
    assert "\n" not in message and "Triton 3.9.0" in message, message
    assert f"pip install triton=={pipeline.TTIR_TRITON}" in message and "nox -s ascend" in message
    monkeypatch.setattr(triton, "__version__", pipeline.TTIR_TRITON)  # on the Triton it reads: its own error
    with pytest.raises(LoweringError, match="ttg.barrier") as caught:
        pipeline.linalg(BOUNDED, _adapter_pipeline(), _context())
    assert "pip install triton" not in str(caught.value)
    assert pipeline.triton_mismatch("3.6.1") == "" and pipeline.triton_mismatch("3.7.0")


def _crashing_adapter(tmp_path: Path, crashes: int) -> Path:
    """A fake triton-adapter-opt: its first ``crashes`` runs die of SIGSEGV, later ones copy IN to OUT."""
    body = f"""count=$(cat {tmp_path}/runs 2>/dev/null || echo 0); echo $((count + 1)) > {tmp_path}/runs
if [ "$count" -lt {crashes} ]; then echo "PLEASE submit a bug report" >&2; kill -SEGV $$; fi
cp "$1" "$4"
"""
    return _script(tmp_path / "adapter", body)


def test_an_adapter_pass_that_crashes_is_run_again_and_the_retry_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("DLC_ASCEND_ADAPTER_OPT", str(_crashing_adapter(tmp_path, crashes=2)))
    context = _context()
    module = "module {\n}\n"
    assert passes.AdapterPass("triton-to-annotation")(module, context) == module
    assert _runs(tmp_path) == 3
    assert context.compile.scratch[passes.RETRIED] == ["--triton-to-annotation, exit status -11"] * 2


def test_an_adapter_that_always_crashes_stops_after_bounded_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("DLC_ASCEND_ADAPTER_OPT", str(_crashing_adapter(tmp_path, crashes=99)))
    with pytest.raises(LoweringError, match=rf"triton-adapter-opt failed .*{invoke.ATTEMPTS} runs failed, each by a "
                                            r"crash \(exit status -11\)(.|\n)*PLEASE submit"):
        passes.AdapterPass("triton-to-annotation")("module {\n}\n", _context())
    assert _runs(tmp_path) == invoke.ATTEMPTS


@pytest.mark.parametrize("code, crashed", [(-11, True), (-6, True), (-7, True), (139, True), (134, True),
                                           (1, False), (0, False), (-15, False), (2, False)])
def test_a_crash_is_told_from_an_error_exit(code, crashed):
    run = invoke.ToolRun("triton-adapter-opt", "linalg", code, "", "error: something", 0.1)
    assert run.crashed is crashed
    assert invoke.comes_and_goes(run) is crashed
    assert invoke.comes_and_goes(run, ["something"]) is (code != 0)


def _bishengir(tmp_path: Path, first: str, then: str = "") -> Path:
    """A fake bishengir-compile: the first run does ``first``, later runs ``then``; counts its runs."""
    hivm = tmp_path / "hivm.mlir"
    hivm.write_text(HIVM_OUT)
    body = f"""count=$(cat {tmp_path}/runs 2>/dev/null || echo 0); echo $((count + 1)) > {tmp_path}/runs
for a in "$@"; do case "$a" in --save-temps=*) dir="${{a#--save-temps=}}";; esac; done
write() {{ cp {hivm} "$dir/module.hivm.opt.mlir"; echo "[ERROR] Cannot find hivmc under \\$PATH" >&2; exit 1; }}
transient() {{ echo "error: hivm.hir.store only support store ub to gm" >&2; exit 1; }}
crash() {{ echo "Stack dump:" >&2; kill -SEGV $$; }}
broken() {{ echo "error: failed to legalize operation 'linalg.generic'" >&2; exit 1; }}
silent() {{ exit 0; }}
if [ "$count" = 0 ]; then {first}; else {then or first}; fi
"""
    return _script(tmp_path / "bishengir-compile", body)


def _runs(tmp_path: Path) -> int:
    return int((tmp_path / "runs").read_text())


def test_a_transient_bishengir_failure_is_retried_and_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("DLC_ASCEND_BISHENGIR", str(_bishengir(tmp_path, "transient", "write")))
    made = pipeline.hivm(ADD_ONE_LINALG, PART, None)
    assert _runs(tmp_path) == 2 and len(made.retried) == 1 and "store ub to gm" in made.retried[0]
    assert made.hivm == HIVM_OUT


def test_a_bishengir_crash_is_retried_and_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("DLC_ASCEND_BISHENGIR", str(_bishengir(tmp_path, "crash", "write")))
    made = pipeline.hivm(ADD_ONE_LINALG, PART, None)
    assert _runs(tmp_path) == 2 and len(made.retried) == 1 and "Stack dump" in made.retried[0]
    assert made.hivm == HIVM_OUT


def test_a_transient_failure_is_retried_a_bounded_number_of_times(tmp_path, monkeypatch):
    monkeypatch.setenv("DLC_ASCEND_BISHENGIR", str(_bishengir(tmp_path, "transient")))
    with pytest.raises(LoweringError, match=f"{pipeline.ATTEMPTS} runs failed"):
        pipeline.hivm(ADD_ONE_LINALG, PART, None)
    assert _runs(tmp_path) == pipeline.ATTEMPTS


def test_a_tool_that_does_not_finish_is_stopped_and_named(tmp_path, monkeypatch):
    """A bishengir-compile that hangs (1.2 has run for over ten minutes on a tile at the edge of the
    unified buffer) is stopped after DLC_ASCEND_TOOL_TIMEOUT seconds, and the lowering fails saying
    so, once: a run that timed out is not run again."""
    monkeypatch.setenv("DLC_ASCEND_BISHENGIR", str(_bishengir(tmp_path, "echo 'still tiling' >&2; sleep 30")))
    monkeypatch.setenv(invoke.TIMEOUT_VARIABLE, "0.5")
    with pytest.raises(LoweringError, match=r"bishengir-compile did not finish the hivm stage within 0\.5 s(.|\n)*"
                                            r"DLC_ASCEND_TOOL_TIMEOUT(.|\n)*still tiling"):
        pipeline.hivm(ADD_ONE_LINALG, PART, None)
    assert _runs(tmp_path) == 1
    monkeypatch.setenv(invoke.TIMEOUT_VARIABLE, "soon")
    with pytest.raises(LoweringError, match="DLC_ASCEND_TOOL_TIMEOUT='soon' is not a positive number"):
        invoke.timeout()
    monkeypatch.delenv(invoke.TIMEOUT_VARIABLE)
    assert invoke.timeout() == invoke.DEFAULT_TIMEOUT


def test_a_deterministic_bishengir_failure_is_not_retried(tmp_path, monkeypatch):
    monkeypatch.setenv("DLC_ASCEND_BISHENGIR", str(_bishengir(tmp_path, "broken", "write")))
    with pytest.raises(LoweringError, match=r"bishengir-compile failed in the hivm stage(.|\n)*linalg\.generic"):
        pipeline.hivm(ADD_ONE_LINALG, PART, None)
    assert _runs(tmp_path) == 1


def test_bishengir_exiting_0_without_hivm_ir_is_caught(tmp_path, monkeypatch):
    monkeypatch.setenv("DLC_ASCEND_BISHENGIR", str(_bishengir(tmp_path, "silent")))
    with pytest.raises(LoweringError, match="bishengir-compile exited 0 in the hivm stage but wrote no"):
        pipeline.hivm(ADD_ONE_LINALG, PART, None)


def test_hivm_ir_without_hivm_operations_is_caught(tmp_path, monkeypatch):
    monkeypatch.setenv("DLC_ASCEND_BISHENGIR", str(_bishengir(tmp_path, "write")))
    (tmp_path / "hivm.mlir").write_text("module {\n}\n")
    with pytest.raises(LoweringError, match="without hivm.hir operations"):
        pipeline.hivm(ADD_ONE_LINALG, PART, None)


def test_with_hivmc_the_same_run_makes_the_binary(tmp_path, monkeypatch):
    """bishengir-compile runs hivmc from PATH: a hivmc found elsewhere is put first on it."""
    (tmp_path / "cann").mkdir()
    monkeypatch.setenv("DLC_ASCEND_HIVMC", str(_script(tmp_path / "cann" / "hivmc", "exit 0\n")))
    compiles = (f'command -v hivmc > /dev/null || exit 3; cp {tmp_path / "hivm.mlir"} "$dir/module.hivm.opt.mlir"; '
                'printf BIN > "$dir/kernel.o"')
    monkeypatch.setenv("DLC_ASCEND_BISHENGIR", str(_bishengir(tmp_path, compiles)))
    made = pipeline.hivm(ADD_ONE_LINALG, PART, find("hivmc"))
    assert made.binary == b"BIN" and made.hivm == HIVM_OUT and made.bin_seconds >= 0


def test_dlcore_ops_says_which_kernels_cannot_lower(capsys):
    from dlcore.cli import main

    assert main(["ops"]) == 0
    out = capsys.readouterr().out
    assert "fused_rotary_and_fa.triton: npu: attention_forward_kernel stops before hivm" in out


def test_operations_are_told_from_attributes():
    ir = ('%0:2 = "tt.reduce"(%a, %b) <{axis = 0 : i32}> ({\n  tt.reduce.return %x : f32\n'
          '%1 = arith.addf %a, %b {tt.divisibility = 16 : i32} : f32\n  func.func @f(%p: !tt.ptr<f32>)\n')
    assert pipeline.operations(ir) == ["tt.reduce", "tt.reduce.return", "arith.addf", "func.func"]


def test_targets_name_a_known_part(capsys):
    from dlcore.cli import main

    assert pipeline.part_of("npu:Ascend910B").name == "Ascend910B2"
    with pytest.raises(LoweringError, match="unknown Ascend part 'Ascend999'; known: Ascend910B1"):
        pipeline.part_of("npu:Ascend999")
    assert main(["lower", "silu_and_mul", "--target", "npu:Ascend999"]) == 2
    assert "unknown Ascend part 'Ascend999'; known: Ascend910B1" in capsys.readouterr().err


def test_the_npu_target_profile_counts_vector_cores():
    from dlcore.compiler.lowering import target_profile

    profile = target_profile("npu:Ascend910B")
    assert (profile.name, profile.cores) == ("Ascend910B2", 48)
    assert target_profile("npu:Ascend910B4").cores == 40


# -- whole lowerings, in a fresh process ---------------------------------------------------------------

LOWER_SILU = """
import json, torch
from dlcore.compiler.lowering import launches, target_profile
from dlcore.compiler.passes import pipeline
from dlcore.errors import LoweringError, ToolchainMissingError
from dlcore.plugins.registry import registry

reg = registry()
passes = pipeline("npu")
todo, _ = launches(reg, "silu_and_mul_kernel", torch.float16, {}, target_profile("npu:Ascend910B2"), passes)
try:
    lowering = reg.backends["npu"].lower(todo[0].call, "npu:Ascend910B2", passes)
    found = {"error": None, "missing": []}
except LoweringError as exc:
    lowering = exc.partial
    found = {"error": str(exc), "missing": list(getattr(exc, "missing", ()))}
found.update(reached=lowering.reached, stages=[[s.stage, s.after_pass, s.seconds] for s in lowering.stages],
             notes=lowering.notes)
print(json.dumps(found))
"""


def _fresh_env(tmp_path: Path, **env: str) -> dict[str, str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("DLCORE_", "DLC_ASCEND_"))}
    full.update(TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1", DLCORE_TOOL_CACHE=str(tmp_path / "tools"),
                TRITON_CACHE_DIR=str(tmp_path / "triton"), DLCORE_CACHE_DIR=str(tmp_path / "cache"), **env)
    return full


def _lower_silu(tmp_path: Path, **env: str) -> dict:
    done = subprocess.run([sys.executable, "-c", LOWER_SILU], capture_output=True, text=True, timeout=600,
                          env=_fresh_env(tmp_path, **env))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _fake_tools(tmp_path: Path, bishengir: str = "write") -> dict[str, str]:
    linalg = tmp_path / "linalg.mlir"
    linalg.write_text(ADD_ONE_LINALG)
    adapter = _script(tmp_path / "adapter", f'case "$2" in --triton-to-linalg*) cp {linalg} "$4";; '
                                            '*) cp "$1" "$4";; esac\n')
    return {"DLC_ASCEND_ADAPTER_OPT": str(adapter), "DLC_ASCEND_BISHENGIR": str(_bishengir(tmp_path, bishengir))}


@pytest.mark.slow
def test_a_missing_adapter_stops_after_ttir_saying_how_to_get_it(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    found = _lower_silu(tmp_path, PATH=f"{empty}{os.pathsep}{Path(sys.executable).parent}")
    assert found["missing"] == ["triton-adapter-opt"] and found["reached"] == ["ttir"]
    assert "lowered as far as ttir" in found["error"] and "dlcore toolchain fetch ascend" in found["error"]


@pytest.mark.slow
def test_every_stage_is_recorded_and_timed_up_to_the_missing_hivmc(tmp_path):
    found = _lower_silu(tmp_path, **_fake_tools(tmp_path))
    assert found["missing"] == ["hivmc"] and found["reached"] == ["ttir", "linalg", "hivm"]
    assert "lowered as far as hivm" in found["error"] and "install Huawei CANN" in found["error"]
    steps = [after for stage, after, _ in found["stages"] if stage == "linalg"]
    assert steps == [name for name, *_ in passes.ADAPTER_PASSES] + [""]
    assert all(seconds > 0 for stage, after, seconds in found["stages"] if stage in ("linalg", "hivm") and not after)
    assert "mix_mode aiv" in found["notes"]


def _cli(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dlcore.cli", "lower", *args], capture_output=True, text=True,
                          timeout=600, env=_fresh_env(tmp_path, **env), cwd=tmp_path)


@pytest.mark.slow
def test_stage_hivm_succeeds_when_every_kernel_reached_it_and_names_those_that_did_not(tmp_path):
    reached = _cli(tmp_path, "silu_and_mul", "--target", "npu:Ascend910B2", "--stage", "hivm", "--dump",
                   str(tmp_path / "dump"), **_fake_tools(tmp_path))
    assert reached.returncode == 0, reached.stderr
    assert reached.stderr.count("hivmc (for the bin stage) was not found") == 1  # said once, not per kernel
    folder = tmp_path / "dump" / "silu_and_mul_kernel-npuAscend910B2"
    assert (folder / "03-hivm.mlir").read_text() == HIVM_OUT
    assert not (tmp_path / "dump" / "silu_and_mul_kernel-npuAscend910B2" / "02-linalg.mlir").exists()

    (tmp_path / "runs").unlink()
    failed = _cli(tmp_path, "silu_and_mul", "--target", "npu:Ascend910B2", "--stage", "hivm", "--report",
                  **_fake_tools(tmp_path, bishengir="broken"))
    assert failed.returncode == 1
    assert "2 kernels did not reach hivm: silu_and_mul.triton/silu_and_mul_kernel (npu:Ascend910B2)" in failed.stderr
    assert "2/4 (linalg)" in failed.stdout and "ttir " in failed.stdout and "linalg " in failed.stdout


@pytest.mark.slow
def test_dumps_show_the_ir_after_each_linalg_pass(tmp_path):
    """--dump, and DLC_DUMP_IR's folder per compile (ttir from Triton's hook, the rest from the npu pipeline)."""
    done = _cli(tmp_path, "silu_and_mul_kernel", "--target", "npu:Ascend910B2", "--dump", str(tmp_path / "dump"),
                DLC_DUMP_IR="1", DLC_DUMP_DIR=str(tmp_path / "ir"), **_fake_tools(tmp_path))
    assert done.returncode == 1 and "hivmc" in done.stderr
    assert "1 kernels did not finish their pipeline: 1 for want of hivmc (npu:Ascend910B2)" in done.stderr
    steps = [f"02-linalg.{k}-{name}.mlir" for k, (name, *_) in enumerate(passes.ADAPTER_PASSES, start=1)]
    names = sorted(p.name for p in (tmp_path / "dump" / "silu_and_mul_kernel-npuAscend910B2").iterdir())
    assert names == ["00-python.py", "00-source.mlir", "01-ttir.ttir", *steps, "02-linalg.mlir", "03-hivm.mlir"]
    (folder,) = (tmp_path / "ir").iterdir()
    assert sorted(p.name for p in folder.iterdir()) == ["01-ttir.ttir", *steps, "02-linalg.mlir", "03-hivm.mlir"]
    assert (folder / "02-linalg.mlir").read_text() == ADD_ONE_LINALG


def test_the_portability_page_has_a_cell_per_kernel_and_target_and_says_why_one_stopped():
    from dlcore.compiler.report import portability_page

    rows = [("k", "op.triton", "cuda:90", "float16", "?", "?", "?", "5/5 (cubin)", "ttir 1, cubin 2", "9", ""),
            ("k", "op.triton", "npu:Ascend910B2", "float16", "?", "?", "?", "2/4 (linalg)", "ttir 1, linalg 3", "4",
             "needs hivmc; stopped: bishengir-compile failed")]
    page = portability_page(rows, ["cuda:90", "cuda:100", "npu:Ascend910B2"], "dlcore lower --all --report")
    assert page.splitlines()[5] == "    dlcore lower --all --report"
    assert "| op.triton | k | cubin (ttir 1, cubin 2) | not launched | linalg (ttir 1, linalg 3) |" in page
    assert "- op.triton / k on npu:Ascend910B2: stopped: bishengir-compile failed" in page
    # a path's own form on one target: another target that launches the kernel in one form says so
    rows.append(("k", "op.triton [decode]", "cuda:90", "float16", "?", "?", "?", "5/5 (cubin)", "ttir 2", "9", ""))
    page = portability_page(rows, ["cuda:90", "cuda:100", "npu:Ascend910B2"], "dlcore lower --all --report")
    assert ("| op.triton [decode] | k | cubin (ttir 2) | not launched | in another row |"
            in page), page


@pytest.mark.slow
def test_stage_hivm_names_declared_limits_apart_and_does_not_fail_on_them(tmp_path):
    """attention_forward_kernel is launched by flash_attention_v2's forward (no limit declared) and by
    fused_rotary_and_fa's (declared unable on npu): with a bishengir that fails, only the first fails the run."""
    done = _cli(tmp_path, "attention_forward_kernel", "--target", "npu:Ascend910B2", "--stage", "hivm", "--report",
                **_fake_tools(tmp_path, bishengir="broken"))
    assert done.returncode == 1
    assert "declared unable to reach hivm (see `dlcore ops`): fused_rotary_and_fa.triton/attention_forward_kernel" \
        in done.stderr, done.stderr
    assert "did not reach hivm: flash_attention_v2.triton/attention_forward_kernel" in done.stderr, done.stderr
