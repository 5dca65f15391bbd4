"""`nox -s demo` shows pip's progress while it installs and ends with the commands to try next."""

import importlib.util
import shlex
import sys
import types
from pathlib import Path

import pytest

from dlcore.cli import build_parser

NOXFILE = Path(__file__).resolve().parent.parent / "noxfile.py"


class FakeSession:
    bin = "/venv/bin"
    posargs: list[str] = []

    def __init__(self):
        self.installs, self.runs, self.logs = [], [], []

    def install(self, *args, silent=True):
        self.installs.append((args, silent))

    def run(self, *args, **kwargs):
        self.runs.append(args)

    def log(self, message, *args):
        self.logs.append(message % args)


@pytest.fixture
def noxfile(monkeypatch):
    fake = types.ModuleType("nox")
    fake.options = types.SimpleNamespace()
    fake.Session = FakeSession
    fake.session = lambda f=None, **kw: f if f is not None else (lambda g: g)
    fake.parametrize = lambda *a, **kw: (lambda g: g)
    monkeypatch.setitem(sys.modules, "nox", fake)
    spec = importlib.util.spec_from_file_location("noxfile_under_test", NOXFILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_shows_pip_s_progress_and_ends_with_next_steps(noxfile):
    session = FakeSession()
    noxfile.demo(session)
    assert session.installs and all(silent is False for _, silent in session.installs)
    assert session.logs[0].startswith("next steps")
    assert any("docs/plugins.md" in line for line in session.logs)


def test_the_next_steps_are_real_commands(noxfile):
    parser = build_parser()
    for line in noxfile.NEXT_STEPS:
        words = shlex.split(line.split("  ")[0])
        if words[0] == "dlcore":
            parser.parse_args(words[1:])  # a usage error exits


def test_the_ascend_session_installs_the_triton_whose_ttir_the_adapter_reads(noxfile):
    from dlc_ascend.pipeline import TTIR_TRITON

    session = FakeSession()
    noxfile.ascend(session)
    assert f"triton=={TTIR_TRITON}" in session.installs[0][0]


def test_the_test_session_installs_transformers_for_the_integrations(noxfile):
    """tests/integrations leaves itself out where transformers is missing: the session CI runs has it."""
    session = FakeSession()
    noxfile.test(session, noxfile.TRITON_VERSIONS[0])
    assert any("./plugins/dlblas_kernels[transformers]" in args for args, _ in session.installs)
