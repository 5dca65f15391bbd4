"""The reference pages stay what their sources say."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_performance_page_is_rendered_from_the_results():
    done = subprocess.run([sys.executable, str(ROOT / "docs" / "results" / "render.py"), "--check"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_architecture_page_names_every_layer_the_contract_holds():
    contract = (ROOT / "pyproject.toml").read_text()
    page = (ROOT / "docs" / "architecture.md").read_text()
    layers = contract.split("layers = [", 1)[1].split("]", 1)[0]
    for layer in (name.strip(' "') for line in layers.splitlines() for name in line.split("|")):
        if layer.rstrip(","):
            assert f"dlcore.{layer.rstrip(',').strip(chr(34))}" in page, layer


def test_the_performance_page_renders_dlcore_columns_the_choice_and_token_ranges(tmp_path):
    """A bench with --impls: each dlcore[NAME] column with its rate and its ratio to every baseline,
    the implementation get_op chose, vs best, the geometric means per token range and the baselines'
    descriptions."""
    import torch

    from dlcore.bench.harness import OWN, Report, ShapeResult
    from dlcore.bench.presets import Shape

    shapes = [ShapeResult(Shape({"tokens": t, "hidden": 4096, "inter": 14336}, ("llama3-8b",)), nbytes=10**8,
                          flops=10**12, impl="vendor" if t == 16 else "triton", chosen="x",
                          rounds={OWN: [1.0], "dlcore[triton]": [triton], "torch": [2.0], "compile": [4.0]})
              for t, triton in ((16, 2.0), (4096, 1.0))]
    report = Report("matmul", "fwd", torch.bfloat16, {"name": "H200", "backend": "cuda"}, ["torch", "compile"],
                    2**30, impls=["dlcore[triton]"], shapes=shapes, date="2026-12-01T00:00:00+00:00",
                    command="dlcore bench matmul --impls triton", copy_gbps=[4000.0],
                    baseline_docs={"torch": "torch.matmul", "compile": "torch.compile of torch.matmul"})
    (tmp_path / "matmul_fwd.json").write_text(json.dumps(report.to_json()))
    page = tmp_path / "performance.md"
    done = subprocess.run([sys.executable, str(ROOT / "docs" / "results" / "render.py"), "--results", str(tmp_path),
                           "--out", str(page)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    text = page.read_text()
    header = next(line for line in text.splitlines() if line.startswith("| model | shape"))
    assert header == ("| model | shape | MiB | dlcore us | dlcore rate | % of limit | chosen | dlcore[triton] us | "
                      "dlcore[triton] rate | torch us | vs torch | dlcore[triton] vs torch | compile us | vs compile | "
                      "dlcore[triton] vs compile | vs best |")
    rows = [line for line in text.splitlines() if line.startswith("| llama3-8b")]
    assert rows[0].split(" | ")[6:9] == ["vendor", "2000", "500 TFLOP/s"], rows[0]
    assert rows[0].endswith("| 2000 | 2.00x | 1.00x | 4000 | 4.00x | 2.00x | 2.00x |"), rows[0]
    assert "| **geometric mean, tokens >= 1024** |" in text and "| **geometric mean, tokens <= 128** |" in text
    assert "- `compile`: torch.compile of torch.matmul" in text
