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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` need a CUDA device: without one they are skipped, and ``-m "not gpu"``
    leaves them out altogether. Tests marked ``ascend_tools`` (``@pytest.mark.ascend_tools`` or
    ``@pytest.mark.ascend_tools("bishengir-compile")``) are skipped, with the reason, unless each tool
    is found and answers as itself (``nox -s ascend`` installs them)."""
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
