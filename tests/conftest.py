"""Fixtures shared by all tests.

Triton kernels run in the interpreter on CPU tensors unless a CUDA device is present; the variable
must be set before triton is first imported, hence here, at the top of the first conftest.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The whole session, collection and the interpreters tests start included, keeps its selections and
# plugin index in a folder of its own, never in the user's ~/.cache/dlcore (each test then gets a
# fresh one of its own from ``fresh_dlcore``). The tool cache (DLCORE_TOOL_CACHE) stays shared: the
# Ascend tests use the adapter `dlcore toolchain fetch ascend` put there.
SESSION_CACHE = Path(tempfile.mkdtemp(prefix="dlcore-tests-"))
os.environ["DLCORE_CACHE_DIR"] = str(SESSION_CACHE / "dlcore-cache")

import pytest  # noqa: E402

import dlcore.dispatch.dispatcher  # noqa: E402

TESTS = Path(__file__).parent
PLUGIN_SOURCES = TESTS / "plugins"


#: the tools a test marked ``ascend_tools`` needs when the marker names none
ASCEND_TOOLS = ("triton-adapter-opt", "bishengir-compile")


#: parametrized tests whose first cases (in collection order) are the fast lane's sample; the rest
#: are marked ``slow``, so the whole matrix runs in the slow lane (each of these took 4 to 35 s of
#: the fast lane on a 2-core machine; the lane's budget is 6 minutes)
FAST_SAMPLE = {
    "tests/kernels/test_ffn.py::test_pair_tile_kernel": 2,
    "tests/kernels/test_ffn.py::test_backward_matches_autograd": 2,
    "tests/kernels/test_ffn.py::test_configs": 2,
    "tests/kernels/test_ffn.py::test_pair_tile_split_last_wave": 1,
    "tests/kernels/test_ffn.py::test_decode_split_over_k": 2,
    "tests/kernels/test_fused_rotary_and_fa.py::test_backward_matches_reference": 3,
    "tests/kernels/test_fused_rotary_and_fa.py::test_non_contiguous_inputs": 2,
    "tests/kernels/test_fused_rotary_and_fa.py::test_matches_reference": 4,
    "tests/kernels/test_attention_grad.py::test_rotary_gradients_match_autograd": 3,
    "tests/kernels/test_attention_grad.py::test_tiles": 3,
    "tests/kernels/test_flash_attention_v2.py::test_rotary_tiles": 3,
    "tests/kernels/test_flash_attention_v2.py::test_warp_specialised_loop": 2,
    "tests/kernels/test_attention_decode.py::test_matches_reference": 4,
    "tests/kernels/test_gemm.py::test_epilogue": 10,
    "tests/kernels/test_matmul.py::test_launch_paths": 6,
    "tests/kernels/test_softmax.py::test_backward_plan_writes_every_output": 4,
    "tests/kernels/test_softmax.py::test_any_dim": 6,
    "tests/kernels/test_apply_rotary_pos_emb.py::test_configs": 4,
    "tests/test_folding.py::test_registered_kernels_fold_bit_exactly": 2,
    "tests/test_moe_ep.py::test_in_processes": 13,  # two ranks; three in the slow lane
    "tests/kernels/test_fused_rotary_and_fa.py::test_learnt_tables_get_their_gradients": 3,
    "tests/kernels/test_fused_rotary_and_fa.py::test_descriptor_path_matches_reference": 4,
    "tests/kernels/test_torch_ops.py::test_opcheck_forward": 3,
    "tests/kernels/test_torch_ops.py::test_opcheck_backward": 2,
    "tests/kernels/test_flash_attention_v2.py::test_key_padding": 4,
    "tests/kernels/test_flash_attention_v2.py::test_both_load_paths": 8,
    "tests/kernels/test_attention_grad.py::test_gradients_match_autograd": 6,
    "tests/kernels/test_gemm.py::test_activation_gradient": 12,
    "tests/kernels/test_partial_rotary_emb.py::test_configs": 4,
    "tests/kernels/test_silu_and_mul.py::test_backward_plan_writes_every_output": 4,
    "tests/kernels/test_fp8_gemm.py::test_granularity_on_every_path": 10,
}


def _sampled(items: list[pytest.Item]) -> None:
    """Mark ``slow`` the cases of :data:`FAST_SAMPLE`'s tests past each one's sample."""
    seen: dict[str, int] = {}
    for item in items:
        function = item.nodeid.split("[")[0]
        keep = FAST_SAMPLE.get(function)
        if keep is None:
            continue
        seen[function] = seen.get(function, 0) + 1
        if seen[function] > keep:
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(tryfirst=True)  # before -m selects: the marks added here count
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` need a CUDA device: without one they are skipped, and ``-m "not gpu"``
    leaves them out altogether. Tests marked ``ascend_tools`` (``@pytest.mark.ascend_tools`` or
    ``@pytest.mark.ascend_tools("bishengir-compile")``) are skipped, with the reason, unless each tool
    is found and answers as itself (``nox -s ascend`` installs them). :data:`FAST_SAMPLE`'s tests
    keep a sample of their cases in the fast lane."""
    _sampled(items)
    no_gpu = pytest.mark.skip(reason="needs a CUDA device")
    missing: dict[tuple[str, ...], str | None] = {}
    for item in items:
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        marker = item.get_closest_marker("ascend_tools")
        if marker is not None:
            names = tuple(marker.args) or ASCEND_TOOLS
            if names not in missing:
                missing[names] = ascend_tools_missing(names)
            if missing[names]:
                item.add_marker(pytest.mark.skip(reason=f"needs the Ascend tools: {missing[names]}"))


def ascend_tools_missing(names: tuple[str, ...]) -> str | None:
    """Why one of the Ascend tools ``names`` cannot be used here, or ``None`` when all can."""
    from dlcore.errors import DlcoreError

    try:
        from dlc_ascend import toolchain
    except ImportError as exc:
        return f"dlc-ascend is not installed ({exc})"
    for name in names:
        try:
            toolchain.locate(name)
        except DlcoreError as exc:
            return str(exc)
    return None


@pytest.fixture(autouse=True)
def fresh_dlcore(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Each test discovers plugins anew and starts with no cached selection, on disk or in memory."""
    monkeypatch.delenv("DLCORE_PLUGINS", raising=False)
    monkeypatch.delenv("DLCORE_DISABLE_PLUGINS", raising=False)
    monkeypatch.delenv("DLCORE_DISABLE_IMPLS", raising=False)
    monkeypatch.delenv("DLCORE_TUNE", raising=False)
    monkeypatch.setenv("DLCORE_CACHE_DIR", str(tmp_path / "dlcore-cache"))
    dlcore.dispatch.dispatcher.reset()
    yield
    dlcore.dispatch.dispatcher.reset()


@pytest.fixture
def kernel_device() -> str:
    """Where Triton kernels run in this session: the GPU, or the CPU under the interpreter."""
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available() else "cuda"


def install_plugins(target: Path, *names: str) -> Path:
    """pip-install the test plugin distributions ``names`` (folders of tests/plugins) into ``target``."""
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), *(str(PLUGIN_SOURCES / name) for name in names)],
        check=True,
    )
    return target


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the test plugin distributions pip-installed into it (real builds, real entry points)."""
    return install_plugins(tmp_path_factory.mktemp("site"), "thirdparty", "broken")


@pytest.fixture(scope="session")
def clash_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with a plugin whose entry-point name (``rms_norm``) clashes with dlblas-kernels'."""
    return install_plugins(tmp_path_factory.mktemp("clash-site"), "clash")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(SESSION_CACHE, ignore_errors=True)
