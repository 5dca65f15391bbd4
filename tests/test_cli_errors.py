"""Plain mistakes on the command line end in one line, ``dlcore: error: ...`` with the fix, and exit 2."""

import dataclasses
import sys

import pytest
import torch

from dlcore.cli import main
from dlcore.plugins.registry import registry


def error_line(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("dlcore: error: ") and captured.err.count("\n") == 1, captured.err
    return captured.err


@pytest.mark.parametrize("argv", [["check", "rms_nrom"], ["tune", "rms_nrom", "--budget", "1"],
                                  ["ops", "rms_nrom"]])
def test_a_misspelled_op_names_the_closest(capsys, argv):
    assert "rms_norm" in error_line(capsys, argv)


def test_an_unknown_op_to_lower(capsys):
    assert "rms_norm" in error_line(capsys, ["lower", "nothing", "--target", "cuda:90"])


def test_an_unknown_implementation_lists_the_op_s(capsys):
    err = error_line(capsys, ["check", "rms_norm", "--impl", "foo", "--shape", "tokens=2,hidden=16"])
    assert "foo" in err and "triton" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a CPU-only torch")
def test_a_device_this_build_lacks(capsys):
    err = error_line(capsys, ["check", "rms_norm", "--device", "cuda", "--shape", "tokens=2,hidden=16"])
    assert "--device cuda" in err and "--device cpu" in err


@pytest.mark.parametrize("command", ["check", "tune"])
def test_a_device_that_is_no_device(capsys, command):
    err = error_line(capsys, [command, "rms_norm", "--device", "gpu"])
    assert "--device gpu" in err and "cuda" in err


def test_check_of_an_op_without_example_sizes(capsys, monkeypatch):
    reg = registry()
    monkeypatch.setitem(reg.ops, "rms_norm", dataclasses.replace(reg.ops["rms_norm"], example=None))
    err = error_line(capsys, ["check", "rms_norm"])
    assert "declares no example inputs" in err and "example=" in err


def test_tune_plot_without_matplotlib_fails_before_the_search(capsys, monkeypatch, tmp_path):
    from dlcore.dispatch import dispatcher

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    monkeypatch.setattr(dispatcher.Dispatcher, "tune_op", lambda *a, **k: pytest.fail("the search ran"))
    err = error_line(capsys, ["tune", "rms_norm", "--shape", "tokens=2,hidden=16", "--plot", str(tmp_path / "p.png")])
    assert "pip install 'dlc-core[plot]'" in err


@pytest.mark.parametrize("command", ["tune", "bench"])
def test_a_plot_path_that_cannot_be_written_fails_before_the_work(capsys, monkeypatch, tmp_path, command):
    pytest.importorskip("matplotlib")
    from dlcore.dispatch import dispatcher

    monkeypatch.setattr(dispatcher.Dispatcher, "tune_op", lambda *a, **k: pytest.fail("the search ran"))
    path = tmp_path / "missing" / "p.png"
    err = error_line(capsys, [command, "rms_norm", "--shape", "tokens=2,hidden=16", "--plot", str(path)])
    assert f"--plot {path}: the folder {path.parent} does not exist or cannot be written" in err


@pytest.mark.parametrize("argv", [["check", "silu_and_mul", "--shape", "tokens=2,hidden=8"],
                                  ["tune", "silu_and_mul", "--shape", "foo=3", "--budget", "1"]])
def test_an_unknown_size_name_lists_the_op_s(capsys, argv):
    err = error_line(capsys, argv)
    assert "silu_and_mul has no size named" in err and "tokens, inter" in err


def test_tune_defaults_to_float32_on_a_cpu(capsys, monkeypatch):
    from dlcore.dispatch import dispatcher

    seen = []

    def tune_op(self, name, inputs, **kwargs):
        seen.append(inputs[0].dtype)
        raise dispatcher.InvalidOptionError("stop here")

    monkeypatch.setattr(dispatcher.Dispatcher, "tune_op", tune_op)
    error_line(capsys, ["tune", "rms_norm", "--shape", "tokens=2,hidden=16", "--device", "cpu"])
    assert seen == [torch.float32]


def test_bench_on_a_cpu_warns_and_times_the_example_sizes_only(capsys, monkeypatch):
    from dlcore.bench import harness
    from dlcore.errors import InvalidOptionError

    seen = []

    def run_bench(op, shapes, **kwargs):
        seen.extend(s.sizes for s in shapes)
        raise InvalidOptionError("stop here")

    monkeypatch.setattr(harness, "run_bench", run_bench)
    assert main(["bench", "rms_norm", "--device", "cpu"]) == 2
    assert seen == [registry().op("rms_norm").example_sizes]
    assert "warning: on a CPU the kernels run in Triton's interpreter" in capsys.readouterr().err


def test_a_tune_with_nothing_but_the_reference_to_run_says_why_and_stores_nothing(capsys, monkeypatch):
    from dlcore.dispatch import dispatcher

    monkeypatch.setattr(dispatcher.Dispatcher, "tune_op", lambda *a, **k: pytest.fail("the search ran"))
    line = error_line(capsys, ["tune", "rms_norm", "--shape", "tokens=2,hidden=16", "--dtype", "bf16",
                               "--budget", "1", "--device", "cpu"])
    assert "nothing to tune, only the torch reference runs these inputs" in line and "bfloat16" in line, line


def test_tune_without_an_op_is_a_usage_error(capsys):
    assert "name an op" in error_line(capsys, ["tune"])


def test_an_op_in_the_wrong_case_names_it(capsys):
    assert "Did you mean 'rms_norm'" in error_line(capsys, ["ops", "RMS_NORM"])


def test_a_device_whose_backend_is_installed_but_unavailable_names_what_is_missing(capsys):
    line = error_line(capsys, ["check", "rms_norm", "--device", "npu"])
    assert "npu backend (dlc-ascend" in line and "torch_npu is not installed" in line, line


def test_version_names_each_installed_distribution(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("dlc-core 0.") and lines[-1].startswith("triton ")
    names = {line.split()[0] for line in lines}
    assert {"dlc-core", "dlc-cuda", "dlc-ascend", "dlc-mlu", "dlblas-kernels", "torch"} <= names


def test_tune_into_a_cache_it_cannot_write_fails_before_the_search(capsys, monkeypatch, tmp_path):
    from dlcore.dispatch import dispatcher

    monkeypatch.setattr(dispatcher.Dispatcher, "tune_op", lambda *a, **k: pytest.fail("the search ran"))
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("DLCORE_CACHE_DIR", str(blocker))
    dispatcher.default().clear()
    with pytest.warns(UserWarning, match="not a directory"):
        err = error_line(capsys, ["tune", "rms_norm", "--shape", "tokens=2,hidden=16", "--budget", "1"])
    assert "cannot keep tuned configs" in err and "absent" in err
    monkeypatch.setenv("DLCORE_CACHE_DIR", str(tmp_path / "writable"))
    dispatcher.default().clear()
    assert "names no strategy" in error_line(capsys, ["tune", "rms_norm", "--strategy", ",", "--budget", "1"])


def test_ctrl_c_ends_a_command_with_one_line(capsys, monkeypatch):
    from dlcore.cli import inventory

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(inventory, "run_ops", interrupted)  # the parser is built by each main()
    assert main(["ops"]) == 130
    assert capsys.readouterr().err == "dlcore: interrupted\n"


def test_bench_on_a_cpu_defaults_to_float32(capsys, monkeypatch):
    """bfloat16, the accelerators' default, is declined by the interpreter: the reference alone would be timed."""
    from dlcore.bench import harness
    from dlcore.errors import InvalidOptionError

    seen = []

    def run_bench(op, shapes, **kwargs):
        seen.append(kwargs["dtype"])
        raise InvalidOptionError("stop here")

    monkeypatch.setattr(harness, "run_bench", run_bench)
    assert main(["bench", "rms_norm", "--device", "cpu"]) == 2
    assert seen == [torch.float32]
