"""`dlcore tune` and `dlcore cache` from the command line."""

import json

from dlcore.cli import main


def test_tune_then_list_export_import_and_clear(capsys, tmp_path, monkeypatch):
    plot = tmp_path / "curves.png"
    assert main(["tune", "rms_norm", "--shape", "tokens=4,hidden=64", "--dtype", "fp32",
                 "--strategy", "grid,random", "--budget", "2", "--plot", str(plot)]) == 0
    out = capsys.readouterr()
    assert "rms_norm" in out.out and "-> kept" in out.out and "grid" in out.out and "random" in out.out
    assert "evaluations, best" in out.err  # the progress line
    assert plot.exists() and plot.stat().st_size > 1000

    assert main(["cache", "list"]) == 0
    listing = capsys.readouterr().out
    assert "rms_norm:" in listing and "1 entries" in listing
    key = next(word for word in listing.split() if word.startswith("rms_norm:"))

    assert main(["cache", "show", key]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["selection"]["impl"] == "triton" and shown["selection"]["strategy"] in ("grid", "random")

    exported = tmp_path / "tuned.json"
    assert main(["cache", "export", str(exported)]) == 0
    assert main(["cache", "clear"]) == 0
    assert "deleted 1 entries" in capsys.readouterr().out
    assert main(["cache", "show", key]) == 1
    assert main(["cache", "import", str(exported)]) == 0
    assert "imported 1 entries" in capsys.readouterr().out
    assert main(["cache", "show", key]) == 0


def test_tuned_result_is_used_by_get_op(capsys):
    import torch

    import dlcore
    import dlcore.dispatch.dispatcher

    assert main(["tune", "rms_norm", "--shape", "tokens=4,hidden=64", "--dtype", "fp32", "--strategy", "grid",
                 "--budget", "3"]) == 0
    dlcore.dispatch.dispatcher.default().clear()
    x, w = torch.randn(4, 64), torch.randn(64)
    op = dlcore.get_op("rms_norm", (x, w))
    assert op.selection.describe() == "tuned (full, grid)"


def test_all_tunes_the_preset_model_shapes():
    import argparse

    from dlcore.cli.tune import ALL_TOKENS, _shapes_for
    from dlcore.plugins.registry import registry

    op = registry().op("rms_norm")
    shapes = _shapes_for(op, argparse.Namespace(shape=[], all=True))
    assert {"tokens": 4096, "hidden": 4096} in shapes  # LLaMA-3-8B prefill
    assert {"tokens": 1, "hidden": 8192} in shapes  # LLaMA-3-70B decoding
    assert {s["tokens"] for s in shapes} == set(ALL_TOKENS)


def test_a_tune_replaces_a_time_read_from_elsewhere_and_refuses_empty_inputs(capsys, tmp_path):
    """A stored time came from other inputs of the key, perhaps another machine (an import): a new
    `dlcore tune` is never compared with it, so a tampered or stale entry cannot pin its config."""
    args = ["tune", "rms_norm", "--shape", "tokens=4,hidden=64", "--dtype", "fp32", "--strategy", "grid",
            "--budget", "2"]
    assert main(args) == 0
    assert main(["cache", "export", str(tmp_path / "tuned.json")]) == 0
    capsys.readouterr()
    data = json.loads((tmp_path / "tuned.json").read_text())
    ((key, record),) = data["entries"].items()
    record["selection"]["time_ms"] = 1e-9  # faster than anything this machine measures
    record["selection"]["config"] = {**record["selection"]["config"], "num_warps": 16}
    (tmp_path / "tuned.json").write_text(json.dumps(data))
    assert main(["cache", "import", str(tmp_path / "tuned.json")]) == 0
    assert main(args) == 0
    capsys.readouterr()
    assert main(["cache", "show", key]) == 0
    assert json.loads(capsys.readouterr().out)["selection"]["time_ms"] > 1e-9
    assert main(["tune", "rms_norm", "--shape", "tokens=0,hidden=64", "--dtype", "fp32", "--budget", "2"]) == 2
    assert "nothing to tune: x has no elements" in capsys.readouterr().err
