"""The mlu backend with fakes: torch_mlu and ``torch.mlu``, Cambricon's Triton driver, Cambricon's
tools as scripts, a toolchain plugin's stage driver. Lowering to TTIR itself runs in a fresh
interpreter (Triton's compiler, not its interpreter)."""

from __future__ import annotations

import stat
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
import triton
from dlblas_kernels.kernels import matmul, rms_norm
from dlc_mlu import refine, stages, toolchain
from dlc_mlu.backend import MluBackend
from fake_devices import FakeAccelerator, installer
from fake_devices import signature as fake_signature
from isolated import run_json

from dlcore.compiler.lowering import Lowering
from dlcore.compiler.passes import Pipeline
from dlcore.compiler.stages import StageOutput
from dlcore.compiler.toolchain import Tool
from dlcore.declarations.device import DeviceProfile
from dlcore.declarations.signature import Signature
from dlcore.errors import LoweringError, ToolchainMissingError
from dlcore.plugins.registry import registry

KiB = 2**10


def mlu_props(name: str = "MLU370-X8", **numbers) -> types.SimpleNamespace:
    """torch_mlu's ``_MLUDeviceProperties``: name, cluster_count, core_num_per_cluster, total_memory, ..."""
    return types.SimpleNamespace(name=name, **numbers)


@pytest.fixture
def mlu(monkeypatch):
    return installer(monkeypatch, "torch_mlu", "mlu")


@pytest.fixture
def bang_driver(monkeypatch):
    """Make ``triton.runtime.driver.active.utils.get_device_properties`` answer as Cambricon's Triton does."""

    def install(found: dict) -> None:
        active = types.SimpleNamespace(utils=types.SimpleNamespace(get_device_properties=lambda index: found))
        monkeypatch.setattr(triton.runtime, "driver", types.SimpleNamespace(active=active))

    return install


def signature(op: str, dtype: torch.dtype, *shapes: tuple[int, ...]) -> Signature:
    return fake_signature(op, "mlu", dtype, *shapes)


MLU370 = DeviceProfile(backend="mlu", vendor="cambricon", name="MLU370-X8", arch="mtp_372", cores=8,
                       programs_per_core=4, shared_memory_per_program=768 * KiB)


# --- availability and the profile ----------------------------------------------------------------

def test_unavailable_when_torch_mlu_is_not_installed(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch_mlu", raising=False)
    assert "torch_mlu is not installed" in MluBackend().available().reason


def test_unavailable_when_torch_mlu_fails_to_import(monkeypatch, tmp_path):
    (tmp_path / "torch_mlu.py").write_text("raise OSError('libcnrt.so: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_mlu", raising=False)
    assert "failed to import: OSError: libcnrt.so" in MluBackend().available().reason


def test_unavailable_without_a_visible_mlu(mlu):
    mlu(FakeAccelerator(available=False))
    assert "torch.mlu.is_available() is False" in MluBackend().available().reason


def test_profile_from_torch_mlu(mlu):
    mlu(FakeAccelerator(mlu_props(cluster_count=8, core_num_per_cluster=4, total_memory=48 * 2**30, major=3, minor=7)))
    profile = MluBackend().profile(0)
    assert (profile.backend, profile.vendor, profile.name, profile.arch) == ("mlu", "cambricon", "MLU370-X8",
                                                                            "MLU370-X8")
    # clusters x cores per cluster: grid folding launches one program per core
    assert (profile.cores, profile.programs_per_core, profile.memory_bytes) == (8, 4, 48 * 2**30)
    assert profile.shared_memory_per_program == 0  # torch_mlu does not report the NRAM


def test_profile_from_cambricons_triton_driver(mlu, bang_driver):
    mlu(FakeAccelerator(mlu_props("MLU590-H8", cluster_count=12, core_num_per_cluster=4, total_memory=80 * 2**30)))
    bang_driver({"cluster_num": 10, "core_num_per_cluster": 4, "max_nram_size": 512 * KiB, "max_shared_mem": 2**21,
                 "max_l2_cache_size": 48 * 2**20, "isa_version": 592})
    profile = MluBackend().profile(torch.device("meta"))
    # the clusters visible to this context win over the device's
    assert (profile.cores, profile.programs_per_core, profile.arch) == (10, 4, "mtp_592")
    assert (profile.shared_memory_per_program, profile.l2_bytes) == (512 * KiB, 48 * 2**20)


def test_profile_without_counts_warns(mlu):
    mlu(FakeAccelerator(mlu_props(cluster_count=-1, core_num_per_cluster=-1)))
    with pytest.warns(UserWarning, match="no cluster or core count for 'MLU370-X8'"):
        profile = MluBackend().profile(0)
    assert (profile.cores, profile.programs_per_core) == (1, 1)


def test_timer_is_the_median_between_mlu_events(mlu):
    fake = mlu(FakeAccelerator(mlu_props(cluster_count=8, core_num_per_cluster=4)))
    runs = iter([40.0, 2.0, 9.0, 1.0])
    assert MluBackend().timer(lambda: fake.advance(next(runs)), 0, warmup=1, reps=3) == 2.0
    assert len(fake.events) == 6 and all(e.enable_timing and e.stream is fake.stream for e in fake.events)


# --- search spaces -------------------------------------------------------------------------------

def tile(c: dict) -> int:
    return c["BLOCK_M"] * c["BLOCK_N"]


def test_rms_norm_on_a_large_input_takes_the_largest_blocks():
    declared = rms_norm.space(MLU370)
    refined = registry().refine_space(declared, signature("rms_norm", torch.float16, (4096, 4096), (4096,)), MLU370)
    before, after = list(declared.configs()), list(refined.configs())
    assert {c["num_warps"] for c in before} == {1, 2, 4, 8, 16, 32}
    assert {c["num_warps"] for c in after} == {1, 4}  # a Block task or a Union1 task
    # 16M elements over 32 cores is more than any tile holds: only the largest tile of each task type
    largest = {w: max(tile(c) for c in before if c["num_warps"] == w) for w in (1, 4)}
    assert after and all(tile(c) == largest[c["num_warps"]] for c in after)
    assert all(2 * 4 * tile(c) <= MLU370.shared_memory_per_program * c["num_warps"] for c in after)


def test_rms_norm_on_a_small_input_gives_each_core_its_share():
    declared = rms_norm.space(MLU370)
    after = list(refine.refine(declared, signature("rms_norm", torch.float16, (64, 128), (128,)), MLU370).configs())
    # 8192 elements over 32 cores: at least 256 a Block task, 1024 a Union1 task (a cluster's four cores)
    assert after and all(tile(c) >= 256 * c["num_warps"] for c in after)
    assert {tile(c) for c in after if c["num_warps"] == 1} == {256, 512, 1024}
    assert min(tile(c) for c in declared.configs()) < 256


def test_a_gemm_space_keeps_its_tiles_and_only_loses_meaningless_warps():
    declared = matmul.space(MLU370)
    refined = refine.refine(declared, signature("matmul", torch.float16, (64, 4096), (4096, 4096)), MLU370)
    assert {c["num_warps"] for c in refined.configs()} == {4}
    assert {(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]) for c in refined.configs()} == \
        {(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]) for c in declared.configs() if c["num_warps"] == 4}


def test_other_backends_spaces_are_left_alone():
    declared = rms_norm.space(MLU370)
    cuda = DeviceProfile(backend="cuda", vendor="nvidia", name="H100", arch="sm_90", cores=132)
    sig = signature("rms_norm", torch.float16, (64, 4096), (4096,))
    assert registry().refine_space(declared, sig, cuda) is declared


# --- lowering: the stage drivers -------------------------------------------------------------------

TTIR = """module {
  tt.func public @k(%arg0: !tt.ptr<f32> {tt.divisibility = 16 : i32}) {
    %0 = tt.get_program_id x : i32
    tt.return
  }
}
"""
LINALG = """module {
  func.func @k(%arg0: i64 {tt.divisibility = 16 : i32}) {
    %0 = tt.get_program_id x : i32
    return
  }
}
"""


def script(folder: Path, name: str, body: str) -> Path:
    path = folder / name
    path.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def ttir_only(monkeypatch, tmp_path):
    """Lowering reaches ttir without compiling (a hand-written TTIR); no Cambricon tool is found."""

    def ttir(call, gpu_target, target, passes, stop_after=None, specialize=True):
        return Lowering("k", target, [StageOutput("python", "", 0.0), StageOutput("ttir", TTIR, 0.01)], ("ttir",),
                        0.01)

    monkeypatch.setattr(stages, "lower_with_triton", ttir)
    for tool in toolchain.TOOLCHAIN.tools:
        monkeypatch.delenv(tool.variable, raising=False)
    monkeypatch.setenv("DLCORE_TOOL_CACHE", str(tmp_path / "tools"))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")


def lower(target: str = "mlu:MLU590") -> Lowering:
    return MluBackend().lower(None, target, Pipeline("mlu"))


def fake_linalg_opt(monkeypatch, folder: Path, output: str, code: int = 0) -> None:
    (folder / "out.mlir").write_text(output)
    tool = script(folder, "triton-linalg-opt", f"""\
        [ "$1" = "--triton-to-linalg" ] && grep -q "tt.func public @k" "$2" || exit 3
        cat {folder / "out.mlir"}
        echo "linalg-opt: failed on purpose" >&2
        exit {code}
    """)
    monkeypatch.setenv("DLC_MLU_TRITON_LINALG_OPT", str(tool))


def test_lowering_stops_at_ttir_without_triton_linalg_opt(ttir_only):
    with pytest.raises(ToolchainMissingError) as stopped:
        lower()
    message = str(stopped.value)
    assert "lowered as far as ttir" in message and "Cambricon's Triton toolchain is not published" in message
    assert "triton-shared" in message and "github.com/Cambricon/triton-linalg" in message
    assert "DLC_MLU_TRITON_LINALG_OPT" in message
    assert stopped.value.missing == ("triton-linalg-opt",)
    assert stopped.value.partial.reached == ["ttir"] and stopped.value.partial.planned == stages.PLANNED


def test_lowering_reaches_linalg_then_stops_at_the_unpublished_stage(ttir_only, monkeypatch, tmp_path):
    fake_linalg_opt(monkeypatch, tmp_path, LINALG)
    with pytest.raises(ToolchainMissingError) as stopped:
        lower()
    message = str(stopped.value)
    assert "lowered as far as linalg; no published tool lowers linalg to mlisa" in message
    assert "inside its own libtriton" in message and stages.GROUP in message
    partial = stopped.value.partial
    assert partial.reached == ["ttir", "linalg"] and partial.stage("linalg").ir == LINALG


def test_a_tool_that_exits_0_with_triton_ops_left_is_caught(ttir_only, monkeypatch, tmp_path):
    fake_linalg_opt(monkeypatch, tmp_path, LINALG.replace("return", "tt.store %0, %0 : i32\n    return"))
    with pytest.raises(LoweringError, match="exited 0 but its output is wrong: Triton ops left unlowered: tt.store"):
        lower()


def test_a_tool_that_fails_is_reported_with_its_error_output(ttir_only, monkeypatch, tmp_path):
    fake_linalg_opt(monkeypatch, tmp_path, LINALG, code=2)
    with pytest.raises(LoweringError, match=r"(?s)linalg: triton-linalg-opt failed \(exit 2\).*failed on purpose"):
        lower()


class EntryPoint:
    def __init__(self, name: str, loaded):
        self.name, self.value, self.loaded = name, f"cambricon_plugin:{name}", loaded

    def load(self):
        if isinstance(self.loaded, Exception):
            raise self.loaded
        return self.loaded


def test_a_toolchain_plugin_fills_the_missing_stage(ttir_only, monkeypatch, tmp_path):
    fake_linalg_opt(monkeypatch, tmp_path, LINALG)
    mlisa_tool = script(tmp_path, "cambricon-mlisa", "echo '.mlisa kernel k'\n")
    plugin_tool = Tool("cambricon-mlisa", "DLC_TEST_CAMBRICON_MLISA", "mlisa", "from the plugin")
    monkeypatch.setenv("DLC_TEST_CAMBRICON_MLISA", str(mlisa_tool))

    def to_mlisa(given: stages.StageInput) -> str:
        assert "func.func @k" in given.source and given.arch == "mtp_592"
        return stages.run_tool(given.tools["cambricon-mlisa"], [], given.workdir)

    driver = stages.StageDriver("mlisa", (plugin_tool,), to_mlisa, lambda out: None if ".mlisa" in out else "empty")
    points = [EntryPoint("mlisa", [driver]), EntryPoint("broken", ImportError("no module cambricon_plugin"))]
    monkeypatch.setattr(stages.importlib.metadata, "entry_points",
                        lambda group: points if group == stages.GROUP else [])
    args = tmp_path / "cnas.args"
    script(tmp_path, "cnas", f"""\
        echo "$@" > {args}
        while [ $# -gt 0 ]; do [ "$1" = "-o" ] && out=$2; shift; done
        printf cnbin > "$out"
    """)
    script(tmp_path, "cnlink", """\
        while [ $# -gt 0 ]; do [ "$1" = "-o" ] && out=$2; shift; done
        printf 'cnfatbin' > "$out"
    """)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    with pytest.warns(UserWarning, match="entry point 'broken'.*failed to load: ImportError"):
        lowered = lower("mlu:MLU590")
    assert lowered.reached == ["ttir", "linalg", "mlisa", "cnbin"]
    assert lowered.stage("mlisa").ir.strip() == ".mlisa kernel k" and lowered.stage("cnbin").ir == b"cnfatbin"
    assert args.read_text().split() == ["-O3", "-a", "mtp_592", "-i", "k.mlisa", "-o", "k.cnbin"]


def test_targets_name_an_mlu():
    assert (stages.isa("mlu:MLU370"), stages.isa("mlu:mtp_592")) == ("mtp_372", "mtp_592")
    with pytest.raises(LoweringError, match="unknown MLU 'MLU999'.*MLU370, MLU590"):
        stages.isa("mlu:MLU999")
    with pytest.raises(LoweringError, match="not an mlu target"):
        stages.isa("npu:Ascend910B2")


def test_the_toolchain_declares_cambricons_tools_found_like_every_backends(monkeypatch, tmp_path):
    assert (toolchain.TOOLCHAIN.name, toolchain.TOOLCHAIN.backend) == ("mlu", "mlu")
    assert [t.name for t in toolchain.TOOLCHAIN.tools] == ["triton-linalg-opt", "cnas", "cnlink"]
    monkeypatch.setenv("DLCORE_TOOL_CACHE", str(tmp_path))
    (tmp_path / "mlu").mkdir()
    cached = script(tmp_path / "mlu", "cnas", "exit 0\n")
    monkeypatch.delenv("DLC_MLU_CNAS", raising=False)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert toolchain.find("cnas").path == cached


LOWER_TO_TTIR = """
import json, torch
from dlcore.compiler.lowering import launches, target_profile
from dlcore.compiler.passes import pipeline
from dlcore.errors import ToolchainMissingError
from dlcore.plugins.registry import registry

reg = registry()
passes = pipeline("mlu")
todo, _ = launches(reg, "rms_norm", torch.float16, {}, target_profile("mlu:MLU370"), passes)
try:
    reg.backends["mlu"].lower(todo[0].call, "mlu:MLU370", passes)
except ToolchainMissingError as exc:
    found = {"message": str(exc), "stages": [s.stage for s in exc.partial.stages],
             "ttir": exc.partial.stage("ttir").ir[:2000], "missing": list(exc.missing)}
print(json.dumps(found))
"""


@pytest.mark.slow
def test_a_kernel_lowers_to_ttir_and_stops_with_the_reason(tmp_path):
    env = {"TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1", "DLC_MLU_TRITON_LINALG_OPT": "",
           "DLCORE_TOOL_CACHE": str(tmp_path), "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    found = run_json(LOWER_TO_TTIR, None, **env)
    assert found["stages"] == ["python", "source", "ttir"] and "tt.func public @" in found["ttir"]
    assert "lowered as far as ttir" in found["message"] and "not published" in found["message"]
    assert found["missing"] == ["triton-linalg-opt"]
