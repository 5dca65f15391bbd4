"""The end-to-end benchmark's code path on a CPU: a tiny LLaMA, one layer, a few tokens, float32, the
kernels in Triton's interpreter; the JSON it writes and the section of docs/performance.md rendered
from it. Times are not checked: on a CPU they say nothing."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from dlblas_kernels.integrations.transformers import bench, bench_phases  # noqa: E402

from dlcore.cli import main as dlcore_main  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--preset", "tiny-llama", "--device", "cpu", "--dtype", "fp32", "--layers", "1", "--tokens", "8",
        "--decode-batches", "1,2", "--warmup", "1", "--iters", "1"]
PHASES = {"train", "prefill", "decode_b1", "decode_b2"}


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    """``dlcore bench-model`` (through its entry point) on the tiny LLaMA: eager, dlcore, and two
    columns that do not apply to it."""
    out = tmp_path_factory.mktemp("e2e")
    assert dlcore_main(["bench-model", *TINY, "--columns", "eager,grouped_mm,dlcore", "--out", str(out)]) == 0
    return json.loads((out / "tiny-llama.json").read_text())


def test_every_column_and_phase_is_in_the_json(report):
    assert report["benchmark"] == "transformers" and report["preset"] == "tiny-llama"
    assert report["gpu"] == "cpu" and report["dtype"] == "float32" and report["layers"] == 1
    assert {"torch", "triton", "transformers", "python"} <= set(report["versions"])
    assert report["date"][:2] == "20" and report["command"].startswith("dlcore bench-model --preset tiny-llama ")
    assert [c["name"] for c in report["columns"]] == ["eager", "grouped_mm", "dlcore"]
    columns = {c["name"]: c for c in report["columns"]}
    assert columns["grouped_mm"]["status"] == "skipped" and "no experts" in columns["grouped_mm"]["reason"]
    for name in ("eager", "dlcore"):
        column = columns[name]
        assert column["status"] == "ok", column
        assert set(column["phases"]) == PHASES
        for phase, result in column["phases"].items():
            assert result["status"] == "ok" and len(result["runs_ms"]) == 1, (name, phase)
            assert result["ms"] == result["runs_ms"][0] > 0 and result["tokens_per_s"] > 0
        assert column["phases"]["decode_b2"]["ms_per_token"] == column["phases"]["decode_b2"]["ms"]
        assert column["parameters"] == columns["eager"]["parameters"]


def test_a_failing_phase_is_recorded_and_the_run_goes_on(monkeypatch, tmp_path):
    def broken(model, settings):
        raise RuntimeError("prefill broke\nsecond line")

    monkeypatch.setattr(bench_phases, "prefill_phase", broken)
    assert bench.main([*TINY, "--columns", "eager", "--out", str(tmp_path)]) == 0
    (column,) = json.loads((tmp_path / "tiny-llama.json").read_text())["columns"]
    assert column["status"] == "partial"
    assert column["phases"]["prefill"]["status"] == "failed"
    assert column["phases"]["prefill"]["error"] == "RuntimeError: prefill broke"
    assert any("prefill broke" in line for line in column["phases"]["prefill"]["traceback"])
    assert all(column["phases"][p]["status"] == "ok" for p in PHASES - {"prefill"})


def test_the_modeling_module_is_restored_after_a_column():
    """Liger-Kernel rebinds the modeling module's names; the next column must build transformers' own."""
    from transformers.models.llama import modeling_llama

    norm, forward = modeling_llama.LlamaRMSNorm, modeling_llama.LlamaForCausalLM.forward
    with bench.restored_names(modeling_llama.__name__):
        modeling_llama.LlamaRMSNorm = object
        modeling_llama.LlamaForCausalLM.forward = lambda self: None
        modeling_llama.added_by_a_patch = 1
    assert modeling_llama.LlamaRMSNorm is norm and modeling_llama.LlamaForCausalLM.forward is forward
    assert not hasattr(modeling_llama, "added_by_a_patch")


def test_the_performance_page_renders_the_tables_and_the_targets(report, tmp_path):
    """The rendered section: one row per column, the speedups over eager, and issue #41's targets read
    from a LLaMA-3-8B report (the tiny report, renamed, with its times set)."""
    llama = copy.deepcopy(report)
    llama["preset"] = "llama3-8b"
    times = {"eager": 100.0, "dlcore": 80.0}
    for column in llama["columns"]:
        for result in column.get("phases", {}).values():
            result["ms"] = times[column["name"]]
            result["ms_per_token"] = times[column["name"]]
    llama["columns"][1]["phases"] = {}
    (tmp_path / "e2e").mkdir()
    for data in (report, llama):
        (tmp_path / "e2e" / f"{data['preset']}.json").write_text(json.dumps(data))
    page = tmp_path / "performance.md"
    done = subprocess.run([sys.executable, str(ROOT / "docs" / "results" / "render.py"), "--results", str(tmp_path),
                           "--out", str(page)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    text = page.read_text()
    assert "### tiny-llama" in text and "### llama3-8b" in text
    rows = [line for line in text.splitlines() if line.startswith("| **dlcore** |")]
    assert len(rows) == 2 and rows[0].split(" | ")[1:3] == ["80.0", "1.25x"], rows  # llama3-8b.json first
    assert "| llama3-8b, train: >= 1.15x eager | 1.25x (dlcore against eager) | yes |" in text
    assert "| llama3-8b, train: >= 1.05x the faster of liger and compile | not measured | - |" in text
    assert "| llama3-8b, decode at batch 2" not in text
    assert "`grouped_mm`: transformers' grouped_mm experts" in text and "skipped: tiny-llama has no experts" in text


def test_a_decode_that_does_not_use_the_cache_is_a_failure(monkeypatch, tmp_path):
    """A forward that drops the cache argument (one under another name) would time decoding against
    nothing: the decode phases fail instead of reporting numbers."""
    monkeypatch.setattr(bench_phases, "cache_keyword", lambda model: "kv_cache_under_another_name")
    bench.main([*TINY, "--columns", "eager", "--phases", "decode", "--out", str(tmp_path)])
    (column,) = json.loads((tmp_path / "tiny-llama.json").read_text())["columns"]
    assert column["status"] == "failed"
    assert all("the forward did not use it" in column["phases"][p]["error"] for p in ("decode_b1", "decode_b2"))
