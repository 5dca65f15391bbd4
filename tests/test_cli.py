"""The dlcore command line."""

import dataclasses
import subprocess
import sys

import pytest

from dlcore.cli import main
from dlcore.cli.options import parse_sizes
from dlcore.plugins.registry import registry


def test_plugins_lists_every_group(capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    for words in ("backends    cpu", "dlc-cuda", "dlc-ascend", "dlc-mlu", "strategies  tpe", "kernels     ffn",
                  "dlblas-kernels", "torch_npu is not installed"):
        assert words in out, out


def test_ops_lists_implementations_backends_and_dtypes(capsys):
    assert main(["ops"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()]
    assert any(r[:3] == ["rms_norm", "triton", "triton"] for r in rows), out
    # the vendor's library: its kind, the backends that run it (not cpu), what it calls
    for op in ("matmul", "ffn"):
        assert any(r[:4] == [op, "torch", "vendor", "cuda,npu,mlu"] and "cuBLAS" in " ".join(r[6:]) for r in rows), out
    assert "reference (fallback)" in out
    assert "float16,bfloat16,float32" in out


@pytest.mark.parametrize("op, shape", [("silu_and_mul", "tokens=5,inter=40"), ("rms_norm", "tokens=5,hidden=40"),
                                       ("ffn", "tokens=7,hidden=48,inter=24")])
def test_check_runs_the_op_against_its_reference(capsys, op, shape):
    assert main(["check", op, "--shape", shape, "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert f"check {op}" in out and ": OK" in out
    assert "chosen:    triton" in out


def test_check_of_a_training_call(capsys):
    """``--training``: the differentiable inputs require grad, and the choice is keyed as a training call."""
    assert main(["check", "rms_norm", "--shape", "tokens=5,hidden=40", "--training"]) == 0
    out = capsys.readouterr().out
    assert ") training\n" in out and ": OK" in out


def test_check_reports_a_mismatch(capsys, monkeypatch):
    reg = registry()
    wrong = dataclasses.replace(reg.ops["rms_norm"], reference=lambda x, w, eps: x * 2)
    monkeypatch.setitem(reg.ops, "rms_norm", wrong)
    assert main(["check", "rms_norm", "--shape", "tokens=3,hidden=16"]) == 1
    assert "MISMATCH" in capsys.readouterr().out


def test_bad_size_syntax():
    with pytest.raises(Exception, match="expected NAME=INTEGER"):
        parse_sizes("tokens:5")


@pytest.mark.slow
def test_console_script_is_installed():
    done = subprocess.run([sys.executable, "-m", "dlcore.cli", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "plugins" in done.stdout


def test_a_dlcore_error_is_one_line_and_exit_2(capsys, tmp_path):
    assert main(["cache", "import", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dlcore: error: cannot read") and err.count("\n") == 1, err
    from dlcore.errors import CacheFileError

    with pytest.raises(CacheFileError):
        main(["--debug", "cache", "import", str(tmp_path / "missing.json")])


CHATTY = """
import sys
import dlcore.cli.inventory as inventory
from dlcore.cli import main

def run_ops(args):
    for i in range(200_000):  # far more than a pipe holds
        print(f"line {i}")
    return 0

inventory.run_ops = run_ops
sys.exit(main(["ops"]))
"""


@pytest.mark.slow
def test_a_closed_pipe_ends_quietly():
    done = subprocess.run(f"{sys.executable} -c '{CHATTY}' | head -1; exit ${{PIPESTATUS[0]}}", shell=True,
                          executable="/bin/bash", capture_output=True, text=True)
    assert done.stdout == "line 0\n"
    assert done.returncode == 0 and done.stderr == "", done.stderr
