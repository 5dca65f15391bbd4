"""Finding a backend's tools (dlcore.compiler.toolchain), fetching the Ascend adapter, `dlcore toolchain`.

The tools are fake executable scripts that answer ``--version`` as the real ones do; the wheels are
small zip files built here, their sha256 pinned in place of the real ones. Nothing reaches the network.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import stat
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
from dlc_ascend import toolchain as ascend
from dlc_ascend.backend import AscendBackend

from dlcore.cli import main
from dlcore.cli import toolchain as cli_toolchain
from dlcore.compiler import toolchain as tc
from dlcore.compiler import wheels
from dlcore.compiler.toolchain import SEARCH_ORDER, Probe, Source, State, Tool, Toolchain
from dlcore.compiler.wheels import PinnedWheel
from dlcore.declarations.backend import Backend
from dlcore.errors import ToolchainBrokenError, ToolchainMissingError

ADAPTER_SAYS = "LLVM (http://llvm.org/):\n  LLVM version 20.0.0git\n  Optimized build with assertions."
BISHENGIR_SAYS = "bishengir-compile 1.2.0 (/usr1/BiSheng/npuir-a3/bishengir 8796a8ac1508 2026-07-29)\nllvm 19.1.7"
#: the package lookup itself, before a test replaces it
REAL_PACKAGE_DIR = tc.package_dir


def script(path: Path, says: str, code: int = 0, executable: bool = True) -> Path:
    """A fake tool: prints ``says`` and exits ``code``, whatever its arguments."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\ncat <<'EOF'\n{says}\nEOF\nexit {code}\n")
    path.chmod(0o755 if executable else 0o644)
    return path


@pytest.fixture
def isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    """No Ascend tool anywhere: variables unset, PATH an empty folder and the system's, the tool cache empty, and the
    package lookup finding neither ascendnpuir nor triton-ascend's triton (the real ones are installed
    here; ``packages`` maps an import name to a fake package folder)."""
    for tool in ascend.TOOLCHAIN.tools:
        monkeypatch.delenv(tool.variable, raising=False)
    (tmp_path / "path").mkdir()
    monkeypatch.setenv("PATH", os.pathsep.join((str(tmp_path / "path"), "/usr/bin", "/bin")))
    monkeypatch.setenv("DLCORE_TOOL_CACHE", str(tmp_path / "toolcache"))
    packages: dict[str, Path] = {}
    monkeypatch.setattr(tc, "package_dir", lambda name: packages.get(name))
    return {"root": tmp_path, "path": tmp_path / "path", "cache": tmp_path / "toolcache" / "ascend",
            "packages": packages}


def test_the_search_order_is_the_issues():
    assert SEARCH_ORDER == (Source.VARIABLE, Source.PACKAGE, Source.PATH, Source.CACHE)
    # ascendnpu-ir ships bishengir-compile, an installed triton-ascend the adapter: one package each
    assert ascend.BISHENGIR.packages == (("ascendnpuir", "bin/bishengir-compile"),)
    assert ascend.ADAPTER.packages == (("triton", "backends/ascend/triton-adapter-opt"),)
    assert ascend.TOOLS == {"triton-adapter-opt": ascend.ADAPTER, "bishengir-compile": ascend.BISHENGIR,
                            "hivmc": ascend.HIVMC}


@pytest.mark.parametrize("tool, package, inside, says", [
    (ascend.ADAPTER, "triton", "backends/ascend/triton-adapter-opt", ADAPTER_SAYS),
    (ascend.BISHENGIR, "ascendnpuir", "bin/bishengir-compile", BISHENGIR_SAYS),
])
def test_each_source_in_order(isolated, monkeypatch, tool, package, inside, says):
    """The tool in every source at once: the variable wins, then the package, PATH, the cache; each
    taken away in turn hands over to the next."""
    root = isolated["root"]
    variable = script(root / "var" / tool.name, says)
    isolated["packages"][package] = root / package
    in_package = script(root / package / inside, says)
    on_path = script(isolated["path"] / tool.name, says)
    cached = script(isolated["cache"] / tool.name, says)
    monkeypatch.setenv(tool.variable, str(variable))

    seen = []
    for take_away in (lambda: monkeypatch.delenv(tool.variable), lambda: in_package.unlink(),
                      on_path.unlink, cached.unlink):
        found = ascend.find(tool.name)
        seen.append((found.source, found.path, found.package))
        assert ascend.locate(tool.name) == found
        take_away()
    assert seen == [(Source.VARIABLE, variable, ""), (Source.PACKAGE, in_package, package),
                    (Source.PATH, on_path, ""), (Source.CACHE, cached, "")]
    assert ascend.find(tool.name) is None
    with pytest.raises(ToolchainMissingError, match=f"{tool.name} .*was not found: .*{tool.variable}"):
        ascend.locate(tool.name)


def test_candidates_lists_every_place_in_order(isolated, monkeypatch):
    root = isolated["root"]
    isolated["packages"]["ascendnpuir"] = root / "ascendnpuir"
    script(root / "ascendnpuir" / "bin" / "bishengir-compile", BISHENGIR_SAYS)
    script(isolated["cache"] / "bishengir-compile", BISHENGIR_SAYS)
    sources = [f.source for f in tc.candidates(ascend.TOOLCHAIN, "bishengir-compile")]
    assert sources == [Source.PACKAGE, Source.CACHE]


def test_packages_are_searched_in_the_order_given(isolated):
    """A tool shipped by two packages (a generic toolchain's declaration): the first listed wins."""
    root = isolated["root"]
    tool = Tool("demo-opt", "DEMO_OPT", "demo", "get it somewhere",
                packages=(("first_pkg", "bin/demo-opt"), ("second_pkg", "demo-opt")))
    chain = Toolchain("demo", "demo", (tool,))
    for name in ("first_pkg", "second_pkg"):
        isolated["packages"][name] = root / name
    script(root / "second_pkg" / "demo-opt", "demo-opt 2")
    assert tc.find(chain, "demo-opt").package == "second_pkg"
    script(root / "first_pkg" / "bin" / "demo-opt", "demo-opt 1")
    found = tc.find(chain, "demo-opt")
    assert (found.package, found.path) == ("first_pkg", root / "first_pkg" / "bin" / "demo-opt")


def test_a_package_on_sys_path_is_found_without_importing_it(isolated, monkeypatch):
    """The real package lookup: a fake ``ascendnpuir`` folder first on sys.path."""
    monkeypatch.setattr(tc, "package_dir", REAL_PACKAGE_DIR)
    site = isolated["root"] / "site"
    (site / "ascendnpuir").mkdir(parents=True)
    (site / "ascendnpuir" / "__init__.py").write_text("raise RuntimeError('imported')\n")
    fake = script(site / "ascendnpuir" / "bin" / "bishengir-compile", BISHENGIR_SAYS)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "ascendnpuir", raising=False)
    found = ascend.find("bishengir-compile")
    assert (found.source, found.path, found.package) == (Source.PACKAGE, fake, "ascendnpuir")
    assert "ascendnpuir" not in sys.modules


def test_upstream_triton_has_no_adapter(isolated, monkeypatch):
    """Upstream Triton (installed here) is a ``triton`` package without the adapter inside: not a source."""
    monkeypatch.setattr(tc, "package_dir", REAL_PACKAGE_DIR)
    assert (REAL_PACKAGE_DIR("triton") / "language").is_dir()
    assert ascend.find("triton-adapter-opt") is None


def test_a_variable_naming_a_non_executable_is_an_error(isolated, monkeypatch):
    plain = script(isolated["root"] / "adapter", ADAPTER_SAYS, executable=False)
    script(isolated["path"] / "triton-adapter-opt", ADAPTER_SAYS)  # found later, but the variable is wrong
    for named in (plain, isolated["root"], isolated["root"] / "nothing-here"):
        monkeypatch.setenv("DLC_ASCEND_ADAPTER_OPT", str(named))
        with pytest.raises(ToolchainMissingError, match="DLC_ASCEND_ADAPTER_OPT=.* is not an executable file"):
            ascend.find("triton-adapter-opt")
        with pytest.raises(ToolchainMissingError, match="is not an executable file"):
            ascend.locate("triton-adapter-opt")


@pytest.mark.parametrize("says, code, why", [
    ("hello, I am some other program", 0, "not what bishengir-compile prints"),
    ("mlir-opt: LLVM version 20.0.0git", 0, "not what bishengir-compile prints"),
    ("error while loading shared libraries: libbishengir.so", 127, "exited 127: error while loading"),
])
def test_a_tool_that_answers_wrongly_is_broken(isolated, monkeypatch, says, code, why):
    fake = script(isolated["path"] / "bishengir-compile", says, code)
    found = ascend.find("bishengir-compile")
    assert found.path == fake
    health = tc.check(found)
    assert health.state is State.BROKEN and why in health.reason, health
    with pytest.raises(ToolchainBrokenError, match=f"bishengir-compile at {fake} .*PATH.* is broken: .*{why}"):
        ascend.locate("bishengir-compile")


def test_a_file_that_does_not_run_is_broken(isolated):
    garbage = isolated["path"] / "triton-adapter-opt"
    garbage.write_bytes(b"\x7fELF not really")
    garbage.chmod(0o755)
    health = tc.check(ascend.find("triton-adapter-opt"))
    assert health.state is State.BROKEN and health.reason.startswith("does not run"), health


def test_a_tool_that_hangs_is_broken(isolated, monkeypatch):
    slow = isolated["path"] / "demo-opt"
    slow.write_text("#!/bin/sh\nexec sleep 30\n")
    slow.chmod(0o755)
    tool = Tool("demo-opt", "DEMO_OPT", "demo", "", probe=Probe(r"demo", timeout=0.3))
    health = tc.check(tc.find(Toolchain("demo", "demo", (tool,)), "demo-opt"))
    assert health.state is State.BROKEN and "did not answer within 0.3 s" in health.reason


def test_versions_are_read_once_per_file(isolated):
    runs = isolated["root"] / "runs"
    adapter = isolated["path"] / "triton-adapter-opt"
    adapter.write_text(f"#!/bin/sh\necho run >> {runs}\necho '  LLVM version 20.0.0git'\n")
    adapter.chmod(0o755)
    found = ascend.find("triton-adapter-opt")
    assert tc.check(found) == tc.Health(State.OK, "20.0.0git")
    assert tc.check(found).version == "20.0.0git"
    assert runs.read_text().count("run") == 1
    script(isolated["cache"] / "bishengir-compile", BISHENGIR_SAYS)
    assert tc.check(ascend.locate("bishengir-compile")) == tc.Health(State.OK, "1.2.0")
    adapter.write_text(adapter.read_text().replace("20.0.0git", "21.0.0git-changed"))  # a new file: read again
    assert tc.check(found).version == "21.0.0git-changed"


def test_a_tool_without_a_probe_is_not_run(isolated):
    hivmc = isolated["path"] / "hivmc"
    hivmc.write_text("#!/bin/sh\nexit 3\n")
    hivmc.chmod(0o755)
    assert tc.check(ascend.locate("hivmc")).state is State.UNCHECKED


def test_backends_declare_their_toolchains():
    assert Backend.toolchains == ()
    assert AscendBackend.toolchains == (ascend.TOOLCHAIN,)
    assert ascend.TOOLCHAIN.fetch is ascend.fetch


# ----- fetching the adapter -----------------------------------------------------------------------

def fake_wheel(path: Path, adapter: bytes | None) -> Path:
    """A small triton-ascend-like wheel: a triton package, its dist-info, and (unless None) the adapter."""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("triton/__init__.py", "raise RuntimeError('never installed, never imported')\n")
        z.writestr("triton/backends/ascend/compiler.py", "")
        if adapter is not None:
            z.writestr(ascend.ADAPTER_MEMBER, adapter)
        z.writestr("triton_ascend-3.2.0.dist-info/METADATA",
                   "Metadata-Version: 2.1\nName: triton-ascend\nVersion: 3.2.0\n")
        z.writestr("triton_ascend-3.2.0.dist-info/WHEEL",
                   "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\n"
                   "Tag: cp311-cp311-manylinux_2_28_x86_64\n")
        z.writestr("triton_ascend-3.2.0.dist-info/RECORD", "")
    return path


ADAPTER_SCRIPT = f"#!/bin/sh\ncat <<'EOF'\n{ADAPTER_SAYS}\nEOF\n".encode()


@pytest.fixture
def pinned(monkeypatch, isolated):
    """Pin this host's adapter wheel to a file built here: ``pin(path)`` pins its sha256."""
    machine = {"arm64": "aarch64"}.get(platform.machine(), platform.machine())
    real = ascend.ADAPTER_WHEELS.get(machine) or ascend.ADAPTER_WHEELS["x86_64"]

    def pin(path: Path, sha256: str | None = None) -> PinnedWheel:
        wheel = PinnedWheel(real.package, real.version, real.filename,
                            sha256 or hashlib.sha256(path.read_bytes()).hexdigest(), real.member, real.platform,
                            real.python)
        monkeypatch.setitem(ascend.ADAPTER_WHEELS, machine, wheel)
        monkeypatch.setattr(platform, "system", lambda: "Linux")
        return wheel
    return pin


def fetch(*args: str) -> int:
    return main(["toolchain", "fetch", "ascend", *args])


def test_fetch_from_a_local_wheel_extracts_only_the_adapter(isolated, pinned, capsys):
    local = fake_wheel(isolated["root"] / "triton_ascend-3.2.0-local.whl", ADAPTER_SCRIPT)
    wheel = pinned(local)
    assert fetch("--wheel", str(local)) == 0
    out = capsys.readouterr().out
    cache = isolated["cache"]
    assert sorted(p.name for p in cache.iterdir()) == ["triton-adapter-opt", "triton-adapter-opt.json"]
    adapter = cache / "triton-adapter-opt"
    assert adapter.read_bytes() == ADAPTER_SCRIPT and os.access(adapter, os.X_OK)
    assert stat.S_IMODE(adapter.stat().st_mode) == 0o755
    record = json.loads((cache / "triton-adapter-opt.json").read_text())
    assert record == {"tool": "triton-adapter-opt", "package": "triton-ascend", "version": "3.2.0",
                      "wheel": wheel.filename, "sha256": wheel.sha256, "url": str(local.resolve()),
                      "member": "triton/backends/ascend/triton-adapter-opt",
                      "binary_sha256": hashlib.sha256(ADAPTER_SCRIPT).hexdigest()}
    found = ascend.locate("triton-adapter-opt")
    assert (found.source, found.path) == (Source.CACHE, adapter)
    assert tc.origin(found) == "triton-ascend 3.2.0"
    # the listing that follows: the adapter from the cache; bishengir missing, with the way to get it
    assert "triton-adapter-opt  linalg  ok       20.0.0git  triton-ascend 3.2.0  tool cache" in out, out
    assert "bishengir-compile: get it: `pip install 'dlc-ascend[tools]'`" in out, out
    assert "pip install 'dlc-ascend[tools]'" in out.splitlines()[0]


def test_fetch_says_when_an_earlier_source_is_the_one_used(isolated, pinned, monkeypatch, capsys):
    monkeypatch.setenv("DLC_ASCEND_ADAPTER_OPT", str(script(isolated["root"] / "mine", ADAPTER_SAYS)))
    local = fake_wheel(isolated["root"] / "w.whl", ADAPTER_SCRIPT)
    pinned(local)
    assert fetch("--wheel", str(local)) == 0
    assert (f"note: triton-adapter-opt from the variable ({isolated['root'] / 'mine'}) comes first and is the one "
            f"used; {isolated['cache'] / 'triton-adapter-opt'} serves when it is gone") in capsys.readouterr().out


def test_a_fetched_adapter_that_does_not_run_here_is_an_error(isolated, pinned, capsys):
    """As an aarch64 binary on an x86_64 host would be: the fetch fails, saying why."""
    local = fake_wheel(isolated["root"] / "w.whl", b"\x7fELF for another machine")
    pinned(local)
    assert fetch("--wheel", str(local)) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"dlcore: error: triton-adapter-opt fetched to {isolated['cache']}/triton-adapter-opt "
                          "does not work here: does not run: ") and err.count("\n") == 1, err


def test_fetch_replaces_atomically_and_leaves_the_old_tool_on_failure(isolated, pinned, monkeypatch, capsys):
    cache = isolated["cache"]
    old = script(cache / "triton-adapter-opt", "  LLVM version 19.0.0old")
    local = fake_wheel(isolated["root"] / "w.whl", ADAPTER_SCRIPT)
    pinned(local)
    replaced = []
    real_replace = os.replace

    def failing_replace(src, dst):
        if Path(dst).parent != cache:  # os is one module: the plugin index is written by os.replace too
            return real_replace(src, dst)
        replaced.append((Path(src), Path(dst)))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", failing_replace)
    assert fetch("--wheel", str(local)) == 1
    err = capsys.readouterr().err
    assert err.startswith("dlcore: error: could not write") and err.count("\n") == 1, err
    # the new file was written beside the old one, under a temporary name, and renamed over it
    [(src, dst)] = replaced
    assert dst == old and src.parent == cache and src.name.startswith(".triton-adapter-opt-")
    assert old.read_text().count("19.0.0old") == 1 and sorted(p.name for p in cache.iterdir()) == [old.name]

    monkeypatch.setattr(os, "replace", real_replace)
    inode = old.stat().st_ino
    assert fetch("--wheel", str(local)) == 0
    assert old.read_bytes() == ADAPTER_SCRIPT and old.stat().st_ino != inode  # a new file, not rewritten in place


def test_a_wheel_with_the_wrong_hash_is_refused(isolated, pinned, capsys):
    local = fake_wheel(isolated["root"] / "triton_ascend-3.2.0-tampered.whl", ADAPTER_SCRIPT)
    wheel = pinned(local, sha256="0" * 64)
    assert fetch("--wheel", str(local)) == 1
    err = capsys.readouterr().err
    digest = hashlib.sha256(local.read_bytes()).hexdigest()
    assert err == (f"dlcore: error: {local.name} has sha256 {digest}; {wheel.filename} (pinned) has {'0' * 64}: "
                   "refusing it (a different or damaged file)\n")
    assert not isolated["cache"].exists()


def test_a_wheel_without_the_adapter_is_refused(isolated, pinned, capsys):
    local = fake_wheel(isolated["root"] / "no-adapter.whl", None)
    pinned(local)
    assert fetch("--wheel", str(local)) == 1
    err = capsys.readouterr().err
    assert err == f"dlcore: error: {local.name} has no triton/backends/ascend/triton-adapter-opt; " \
                  "expected a wheel that ships it\n"
    assert not isolated["cache"].exists()


def test_a_missing_or_broken_local_file_is_refused(isolated, pinned, capsys):
    not_zip = isolated["root"] / "not-a-wheel.whl"
    not_zip.write_bytes(b"not a zip")
    pinned(not_zip)
    assert fetch("--wheel", str(not_zip)) == 1
    assert capsys.readouterr().err.startswith("dlcore: error: not-a-wheel.whl is not a wheel (zip archive)")
    assert fetch("--wheel", str(isolated["root"] / "absent.whl")) == 1
    assert "absent.whl is not a file; expected a copy of triton_ascend-3.2.0" in capsys.readouterr().err
    assert not isolated["cache"].exists()


def test_fetch_downloads_with_pip_and_keeps_what_it_holds(isolated, pinned, monkeypatch, capsys):
    """pip download from a local folder of wheels (PIP_NO_INDEX: no network); then a second fetch finds
    the cache already holds that very file and downloads nothing."""
    links = isolated["root"] / "links"
    links.mkdir()
    wheel = pinned(fake_wheel(links / ascend.adapter_wheel().filename, ADAPTER_SCRIPT))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    assert fetch() == 0
    out = capsys.readouterr().out
    assert f"downloading {wheel.filename} with pip" in out
    record = tc.manifest(ascend.TOOLCHAIN, "triton-adapter-opt")
    assert record.sha256 == wheel.sha256 and record.url.endswith(wheel.filename), record
    assert (isolated["cache"] / "triton-adapter-opt").read_bytes() == ADAPTER_SCRIPT

    def no_download(*args, **kwargs):
        raise AssertionError(f"ran {args}")

    monkeypatch.setattr(wheels.subprocess, "run", no_download)
    assert fetch() == 0
    assert "is already the one of" in capsys.readouterr().out
    (isolated["cache"] / "triton-adapter-opt").write_bytes(b"#!/bin/sh\necho changed\n")
    assert tc.origin(ascend.find("triton-adapter-opt")).startswith("not the file fetched from triton-ascend 3.2.0")
    with pytest.raises(AssertionError, match="pip"):  # a changed file is fetched again
        fetch()


def test_a_failed_download_is_one_line(isolated, pinned, monkeypatch, capsys):
    empty = isolated["root"] / "links"
    empty.mkdir()
    pinned(fake_wheel(isolated["root"] / "w.whl", ADAPTER_SCRIPT))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    assert fetch() == 1
    err = capsys.readouterr().err
    assert err.startswith("dlcore: error: `pip download triton-ascend==3.2.0` for manylinux_2_28_")
    assert "pass it with --wheel" in err and err.count("\n") == 1, err
    assert not isolated["cache"].exists()


@pytest.mark.parametrize("system, machine, filename", [
    ("Linux", "x86_64", "triton_ascend-3.2.0-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl"),
    ("Linux", "aarch64", "triton_ascend-3.2.0-cp311-cp311-manylinux_2_27_aarch64.manylinux_2_28_aarch64.whl"),
    ("Linux", "arm64", "triton_ascend-3.2.0-cp311-cp311-manylinux_2_27_aarch64.manylinux_2_28_aarch64.whl"),
])
def test_the_wheel_for_each_host(system, machine, filename):
    wheel = ascend.adapter_wheel(system, machine)
    assert wheel.filename == filename and len(wheel.sha256) == 64
    assert wheel.platform in filename and wheel.member == "triton/backends/ascend/triton-adapter-opt"


@pytest.mark.parametrize("system, machine", [("Darwin", "arm64"), ("Windows", "AMD64"), ("Linux", "riscv64")])
def test_no_wheel_for_other_hosts(system, machine):
    with pytest.raises(Exception, match=f"publishes no wheel for {system} .*DLC_ASCEND_ADAPTER_OPT"):
        ascend.adapter_wheel(system, machine)


# ----- dlcore toolchain ---------------------------------------------------------------------------

def test_toolchain_lists_the_three_tools(isolated, monkeypatch, capsys):
    isolated["packages"]["ascendnpuir"] = isolated["root"] / "ascendnpuir"
    script(isolated["root"] / "ascendnpuir" / "bin" / "bishengir-compile", BISHENGIR_SAYS)
    assert main(["toolchain"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[1]: line.split() for line in out.splitlines() if line.startswith("ascend     ")}
    assert set(rows) == {"triton-adapter-opt", "bishengir-compile", "hivmc"}, out
    assert rows["triton-adapter-opt"][2:] == ["linalg", "missing"]
    # a fake package folder: no distribution installed it, so no "from"
    assert rows["bishengir-compile"][2:7] == ["hivm", "ok", "1.2.0", "package", "ascendnpuir"], out
    assert rows["hivmc"][2:] == ["bin", "missing"]
    assert "triton-adapter-opt: get it: `dlcore toolchain fetch ascend`" in out
    assert "hivmc: get it: install Huawei CANN" in out
    assert f"ascend tool cache: {isolated['cache']}; `dlcore toolchain fetch ascend` fills it" in out
    assert main(["toolchain", "list"]) == 0 and capsys.readouterr().out == out


def test_toolchain_reports_broken_tools(isolated, monkeypatch, capsys):
    monkeypatch.setenv("DLC_ASCEND_BISHENGIR", str(isolated["root"] / "nowhere"))
    script(isolated["path"] / "triton-adapter-opt", "something else entirely")
    assert main(["toolchain"]) == 0
    out = capsys.readouterr().out
    assert "bishengir-compile: DLC_ASCEND_BISHENGIR=" in out and "is not an executable file" in out
    assert "triton-adapter-opt: broken (`triton-adapter-opt --version` printed 'something else entirely'" in out
    assert any(line.split()[1:4] == ["triton-adapter-opt", "linalg", "broken"] for line in out.splitlines()
               if line.startswith("ascend     ")), out


def test_fetch_of_an_unknown_toolchain_is_a_usage_error(capsys):
    assert main(["toolchain", "fetch", "nope"]) == 2
    captured = capsys.readouterr()
    assert captured.err == "dlcore: error: no toolchain 'nope'; the installed backends declare: ascend, mlu\n"
    assert captured.out == ""


@pytest.mark.skipif(not os.environ.get("DLC_ASCEND_WHEEL"),
                    reason="set DLC_ASCEND_WHEEL to a triton-ascend 3.2.0 wheel to fetch the real adapter from it")
def test_fetch_the_real_adapter_from_a_real_wheel(isolated, capsys):
    assert fetch("--wheel", os.environ["DLC_ASCEND_WHEEL"]) == 0
    found = ascend.locate("triton-adapter-opt")
    assert found.source is Source.CACHE
    assert tc.check(found) == tc.Health(State.OK, "20.0.0git")
    assert tc.origin(found) == "triton-ascend 3.2.0"


@pytest.mark.ascend_tools
def test_the_installed_tools_answer_as_themselves():
    for name in ("triton-adapter-opt", "bishengir-compile"):
        health = tc.check(ascend.locate(name))
        assert health.state is State.OK and re.match(r"\d+\.\d+\.\d+", health.version), (name, health)


def test_a_toolchain_without_a_fetcher_has_nothing_to_fetch(monkeypatch, capsys):
    demo = Toolchain("demo", "demo", (Tool("demo-opt", "DEMO_OPT", "demo", "install the demo SDK"),))
    monkeypatch.setattr(cli_toolchain, "installed", lambda: [demo])
    assert main(["toolchain", "fetch", "demo"]) == 2
    assert capsys.readouterr().err == ("dlcore: error: toolchain 'demo' has nothing to fetch; `dlcore toolchain` "
                                       "says how to get each of its tools\n")
    monkeypatch.setattr(cli_toolchain, "installed", lambda: [])
    assert main(["toolchain"]) == 0
    assert capsys.readouterr().out.startswith("no installed backend declares a toolchain")
