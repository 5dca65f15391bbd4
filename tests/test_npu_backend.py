"""The npu backend on an Ascend host, with fakes: torch_npu and ``torch.npu`` (availability,
device properties, events), triton-ascend's driver, and the kernels' real search spaces refined for
the chip. Nothing here needs CANN, an NPU or triton-ascend."""

from __future__ import annotations

import sys
import textwrap
import types
import warnings

import pytest
import torch
import triton
from dlblas_kernels.kernels import matmul, rms_norm
from dlc_ascend import chips, refine, runtime
from dlc_ascend.backend import AscendBackend
from fake_devices import FakeAccelerator, installer
from fake_devices import signature as fake_signature
from isolated import run_json

from dlcore.declarations.device import DeviceProfile
from dlcore.declarations.implementation import KernelCall
from dlcore.declarations.signature import Signature
from dlcore.declarations.space import PowerOfTwo, SearchSpace, num_warps
from dlcore.errors import BackendUnavailableError
from dlcore.plugins.registry import registry
from dlcore.runtime import internals, launch

KiB = 2**10


def props(name: str, **numbers) -> types.SimpleNamespace:
    """torch_npu's ``_NPUDeviceProperties`` (name, total_memory, cube_core_num, vector_core_num, L2_cache_size)."""
    return types.SimpleNamespace(name=name, **numbers)


@pytest.fixture
def npu(monkeypatch):
    """Install a fake, importable ``torch_npu`` and a fake ``torch.npu``; returns a setter for the latter."""
    return installer(monkeypatch, "torch_npu", "npu")


@pytest.fixture
def driver(monkeypatch):
    """Make ``triton.runtime.driver.active.utils.get_device_properties`` answer as triton-ascend's does."""

    def install(found: dict) -> list[int]:
        asked: list[int] = []

        def get_device_properties(index):
            asked.append(index)
            return found

        active = types.SimpleNamespace(utils=types.SimpleNamespace(get_device_properties=get_device_properties))
        monkeypatch.setattr(triton.runtime, "driver", types.SimpleNamespace(active=active))
        return asked

    return install


def signature(op: str, dtype: torch.dtype, *shapes: tuple[int, ...]) -> Signature:
    return fake_signature(op, "npu", dtype, *shapes)


def npu_profile(name: str = "Ascend910B2") -> DeviceProfile:
    return runtime.profile(0, props(name))


# --- availability --------------------------------------------------------------------------------

def test_unavailable_when_torch_npu_is_not_installed(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    availability = AscendBackend().available()
    assert not availability
    assert "torch_npu is not installed" in availability.reason and "dlc-ascend[npu]" in availability.reason
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD" not in availability.reason


def test_unavailable_when_torch_npu_fails_to_import_says_what_to_do(tmp_path, monkeypatch):
    (tmp_path / "torch_npu.py").write_text("raise ImportError('libhccl.so: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    availability = AscendBackend().available()
    assert not availability
    assert "failed to import: ImportError: libhccl.so" in availability.reason
    assert "set_env.sh" in availability.reason and "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in availability.reason


def test_unavailable_without_a_visible_npu(npu):
    npu(FakeAccelerator(available=False))
    availability = AscendBackend().available()
    assert not availability and "torch.npu.is_available() is False" in availability.reason


def test_available_with_torch_npu_and_a_device(npu):
    npu(FakeAccelerator(props("Ascend910B2")))
    assert AscendBackend().available()


@pytest.mark.slow
def test_plugin_load_never_imports_torch_npu(tmp_path):
    """A torch_npu that can be found is left alone by ``import dlc_ascend`` and the registry's load;
    the backend's ``available()`` is what imports it."""
    (tmp_path / "torch_npu.py").write_text("")
    result = run_json(textwrap.dedent("""
        import importlib.util, json, sys
        import dlc_ascend
        from dlcore.plugins.registry import registry
        reg = registry()
        loaded = {"findable": importlib.util.find_spec("torch_npu") is not None, "npu": "npu" in reg.backends,
                  "after_load": "torch_npu" in sys.modules}
        reg.backends["npu"].available()
        loaded["after_available"] = "torch_npu" in sys.modules
        print(json.dumps(loaded))
    """), tmp_path)
    assert result == {"findable": True, "npu": True, "after_load": False, "after_available": True}


# --- the profile ---------------------------------------------------------------------------------

def test_profile_takes_the_core_counts_from_triton_ascends_driver(npu, driver):
    npu(FakeAccelerator(props("Ascend910B2", total_memory=62 * 2**30, cube_core_num=24, vector_core_num=48,
                      L2_cache_size=96 * 2**20)))
    asked = driver({"max_shared_mem": 1, "num_aicore": 20, "num_vectorcore": 40})
    profile = AscendBackend().profile(torch.device("meta"))  # a device with no index: the current one
    assert asked == [0]
    assert (profile.backend, profile.vendor, profile.name, profile.arch) == ("npu", "huawei", "Ascend910B2",
                                                                            "Ascend910B2")
    # AI cores (cube), two vector cores each: grid folding launches 40 programs
    assert (profile.cores, profile.programs_per_core) == (20, 2)
    assert profile.memory_bytes == 62 * 2**30 and profile.l2_bytes == 96 * 2**20
    assert profile.shared_memory_per_program == 192 * KiB  # the unified buffer, from the parts table


def test_profile_falls_back_to_torch_npus_counts_without_the_driver(npu):
    # upstream Triton here: it has no NPU driver (driver.active raises)
    npu(FakeAccelerator(props("Ascend910B4", total_memory=32 * 2**30, cube_core_num=18, vector_core_num=36)))
    profile = AscendBackend().profile(0)
    assert (profile.cores, profile.programs_per_core) == (18, 2)
    assert profile.l2_bytes == chips.chip("Ascend910B4").l2_bytes  # torch_npu gave none


def test_profile_falls_back_to_the_parts_table_by_name(npu, driver):
    npu(FakeAccelerator(props("Ascend910B3", cube_core_num=0)))
    driver({"max_shared_mem": 1})  # a driver without the counts
    profile = AscendBackend().profile(0)
    part = chips.chip("Ascend910B3")
    assert (profile.cores, profile.programs_per_core) == (part.cube_cores, part.vector_cores // part.cube_cores)
    assert (profile.memory_bytes, profile.l2_bytes, profile.shared_memory_per_program) == (
        part.memory_bytes, part.l2_bytes, part.ub_bytes)


def test_an_unknown_part_without_counts_warns_and_sizes_for_one_core(npu):
    npu(FakeAccelerator(props("Ascend999X")))
    with pytest.warns(UserWarning, match="no core count for 'Ascend999X'.*dlc_ascend/chips.py"):
        profile = AscendBackend().profile(0)
    assert (profile.cores, profile.programs_per_core, profile.shared_memory_per_program) == (1, 1, 0)


def test_profile_of_an_unavailable_backend_says_why(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    with pytest.raises(BackendUnavailableError, match="backend 'npu' is not available: torch_npu is not installed"):
        AscendBackend().profile(0)


# --- timing --------------------------------------------------------------------------------------

def test_timer_is_the_median_between_npu_events_warm_up_excluded(npu):
    fake = npu(FakeAccelerator(props("Ascend910B2")))
    runs = iter([100.0, 100.0, 3.0, 1.0, 2.0, 50.0, 4.0])  # two warm-up runs, then five timed
    result = AscendBackend().timer(lambda: fake.advance(next(runs)), 0, warmup=2, reps=5)
    assert result == 3.0
    assert len(fake.events) == 10 and all(e.enable_timing and e.stream is fake.stream for e in fake.events)
    assert fake.synchronized == [0, 0]  # after the warm-up and after the timed runs


# --- search spaces -------------------------------------------------------------------------------

def test_matmul_space_refined_for_the_cube_unit():
    profile = npu_profile()
    declared = matmul.space(profile)
    refined = registry().refine_space(declared, signature("matmul", torch.float16, (64, 4096), (4096, 4096)),
                                      profile)
    before, after = list(declared.configs()), list(refined.configs())
    assert 0 < len(after) < len(before)
    # the float32 accumulator fits L0C (128 KiB); cube fractals: M and N in 16s, K in 32 bytes
    assert all(c["BLOCK_M"] * c["BLOCK_N"] * 4 <= chips.chip("Ascend910B2").l0c_bytes for c in after)
    assert all(c["BLOCK_M"] % 16 == 0 and c["BLOCK_N"] % 16 == 0 and c["BLOCK_K"] * 2 % 32 == 0 for c in after)
    # one num_warps and num_stages per tile (the declared space times each tile up to six times), and
    # every tile is still there
    tile = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "TMA")
    tiles = [tuple(c[n] for n in tile) for c in after]
    assert len(tiles) == len(set(tiles))
    assert set(tiles) == {tuple(c[n] for n in tile) for c in before}
    assert all(refined.is_valid(c) is None for c in after)


def test_gemm_tiles_keep_the_accumulator_in_l0c_and_k_in_fractals():
    space = SearchSpace([PowerOfTwo("BLOCK_M", 8, 512), PowerOfTwo("BLOCK_N", 16, 512), PowerOfTwo("BLOCK_K", 4, 64)])
    profile = npu_profile()
    fp16 = list(refine.refine(space, signature("gemm", torch.float16, (64, 64)), profile).configs())
    assert {c["BLOCK_M"] for c in fp16} == {16, 32, 64, 128, 256, 512}
    assert {c["BLOCK_K"] for c in fp16} == {16, 32, 64}
    assert max(c["BLOCK_M"] * c["BLOCK_N"] for c in fp16) == 128 * KiB // 4
    fp32 = refine.refine(space, signature("gemm", torch.float32, (64, 64)), profile)
    assert {c["BLOCK_K"] for c in fp32.configs()} == {8, 16, 32, 64}
    # an unknown part: no L0C size, no bound by it
    unknown = DeviceProfile(backend="npu", vendor="huawei", name="Ascend999X", arch="Ascend999X", cores=1)
    assert max(c["BLOCK_M"] * c["BLOCK_N"] for c in refine.refine(
        space, signature("gemm", torch.float16, (64, 64)), unknown).configs()) == 512 * 512


def test_rms_norm_space_refined_for_the_vector_unit_and_the_unified_buffer():
    profile = npu_profile()
    declared = rms_norm.space(profile)
    refined = refine.refine(declared, signature("rms_norm", torch.bfloat16, (64, 4096), (4096,)), profile)
    before, after = list(declared.configs()), list(refined.configs())
    half_ub = profile.shared_memory_per_program // 2
    assert any(c["BLOCK_M"] * c["BLOCK_N"] * 4 > half_ub for c in before)
    assert after and all(c["BLOCK_M"] * c["BLOCK_N"] * 4 <= half_ub for c in after)
    assert all(c["BLOCK_N"] * 2 % 32 == 0 for c in after)
    tiles = [(c["BLOCK_M"], c["BLOCK_N"]) for c in after]
    assert len(tiles) == len(set(tiles))  # one num_warps per tile
    # the largest tile that fits stays, with the first num_warps the kernel's constraints admit it with
    # (16: at most 32 elements a thread); fixing one num_warps for the whole space would have lost it or
    # the small tiles
    assert (1, 16384) in tiles and next(c for c in after if c["BLOCK_N"] == 16384)["num_warps"] == 16
    assert (1, 64) in tiles and next(c for c in after if c["BLOCK_N"] == 64)["num_warps"] == 1


def test_vector_rows_are_whole_32_byte_blocks():
    space = SearchSpace([PowerOfTwo("BLOCK_N", 1, 64), num_warps(4)])
    profile = npu_profile()
    assert [c["BLOCK_N"] for c in refine.refine(space, signature("x", torch.float16, (8, 64)), profile).configs()] \
        == [16, 32, 64]
    assert [c["BLOCK_N"] for c in refine.refine(space, signature("x", torch.float32, (8, 64)), profile).configs()] \
        == [8, 16, 32, 64]
    # a rule that would leave nothing is not applied: the compiler takes any tile, only slower
    narrow = SearchSpace([PowerOfTwo("BLOCK_N", 1, 4)])
    assert refine.refine(narrow, signature("x", torch.float16, (8, 4)), profile).size() == 3


def test_other_backends_spaces_are_left_alone():
    declared = rms_norm.space(npu_profile())
    cuda = DeviceProfile(backend="cuda", vendor="nvidia", name="H100", arch="sm_90", cores=132)
    assert registry().refine_space(declared, signature("rms_norm", torch.float16, (64, 4096), (4096,)), cuda) \
        is declared


def test_grids_are_folded_to_the_cores_on_npu_by_default():
    from dlcore.compiler.folding import programs_for
    from dlcore.compiler.passes import default_pipeline

    assert "grid_folding" in default_pipeline("npu").names
    profile = npu_profile()
    assert programs_for(KernelCall(kernel=None, grid=(10**6,), args=()), profile) == \
        chips.chip("Ascend910B2").vector_cores


# --- the launch path on triton-ascend --------------------------------------------------------------

class JITFunction:
    """Named as Triton's is; records each ``kernel[grid](...)`` launch."""

    def __init__(self):
        self.launched = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launched.append((grid, args, kwargs))


def test_launches_go_through_kernel_grid_once_the_capability_check_fails(monkeypatch):
    """triton-ascend's launcher takes ``(*args, **kwargs)``: the warm path's check finds it, warns
    once, and every launch goes through ``kernel[grid](...)``."""

    class NPULauncher:
        def __call__(self, *args, **kwargs):
            raise AssertionError("the warm path must not call the launcher itself")

    active = types.SimpleNamespace(launcher_cls=NPULauncher, get_current_device=lambda: 0,
                                   get_current_stream=lambda device: 0, get_current_target=lambda: None)
    monkeypatch.setattr(triton.runtime, "driver", types.SimpleNamespace(active=active))
    monkeypatch.setattr(internals, "found", None)
    monkeypatch.setattr(launch, "_entries", {})
    assert "launcher_cls.__call__(self, gridX, gridY, gridZ, stream, function, ...)" in internals.check().missing
    kernel = JITFunction()
    call = KernelCall(kernel, (4,), (1, 2), {"BLOCK": 8})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        launch.launch(call)
        launch.launch(call)
    assert kernel.launched == [((4,), (1, 2), {"BLOCK": 8})] * 2
    said = [str(w.message) for w in caught if "kernel[grid]" in str(w.message)]
    assert len(said) == 1 and "launcher_cls.__call__" in said[0]

