"""The reference pages stay what their sources say."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_readme_is_short_and_its_links_resolve():
    """A newcomer's five minutes: at most 200 lines; every relative link names a file that exists."""
    import re

    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200, len(readme.splitlines())
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        prose = re.sub(r"```.*?```|`[^`]*`", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", prose):
            assert target == "..." or (page.parent / target).exists(), f"{page.name} links to {target}"


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
    the implementation get_op chose, vs best, the geometric means per token range, the baselines'
    descriptions and the host probe's times."""
    import torch

    from dlcore.bench.presets import Shape
    from dlcore.bench.report import OWN, Report, ShapeResult

    shapes = [ShapeResult(Shape({"tokens": t, "hidden": 4096, "inter": 14336}, ("llama3-8b",)), nbytes=10**8,
                          flops=10**12, impl="vendor" if t == 16 else "triton", chosen="x",
                          rounds={OWN: [1.0], "dlcore[triton]": [triton], "torch": [2.0], "compile": [4.0]})
              for t, triton in ((16, 2.0), (4096, 1.0))]
    report = Report("matmul", "fwd", torch.bfloat16, {"name": "H200", "backend": "cuda"}, ["torch", "compile"],
                    2**30, impls=["dlcore[triton]"], shapes=shapes, date="2026-12-01T00:00:00+00:00",
                    command="dlcore bench matmul --impls triton", copy_gbps=[4000.0], host_us=[5.04, 6.1],
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
    assert "Host: 5.0 and 6.1 us a small torch op at the run's start and end" in text


def test_the_performance_page_reads_issue_14s_targets_from_the_results(tmp_path):
    """The attention and softmax targets: the Triton rate at B2 H16 S8192 D128 from its dlcore[triton]
    column, get_op against the best column, decode against SDPA and the copy, fused rotary against
    its composite, softmax against a copy of the same bytes; a target without results says so."""
    import torch

    from dlcore.bench.presets import Shape
    from dlcore.bench.report import OWN, Report, ShapeResult

    anchor = {"batch": 2, "seq": 8192, "kv_seq": 0, "heads": 16, "kv_heads": 16, "head_dim": 128}
    flops = 4 * 2 * 16 * 8192 * 8192 * 128

    def attention(causal, triton_ms):
        return ShapeResult(Shape({**anchor, "causal": causal}), nbytes=2**28, flops=flops // (1 + causal),
                           rounds={OWN: [triton_ms], "dlcore[triton]": [triton_ms], "sdpa_flash": [2.0],
                                   "sdpa_cudnn": [1.0]})

    decode = [ShapeResult(Shape({**anchor, "batch": 1, "seq": 1, "kv_seq": sk, "heads": 32, "kv_heads": 8,
                                 "causal": 0}), nbytes=sk * 8 * 128 * 4, flops=4 * 32 * sk * 128,
                          rounds={OWN: [ms], "dlcore[triton]": [ms], "sdpa_flash": [0.1], "sdpa_cudnn": [cudnn]})
              for sk, ms, cudnn in ((4096, 0.02, 0.019), (65536, 0.08, 0.079))]  # 65536: 3355 GB/s

    def report(op, mode, baselines, shapes, impls=()):
        data = Report(op, mode, torch.bfloat16, {"name": "H200", "backend": "cuda"}, baselines, 2**30,
                      impls=list(impls), shapes=shapes, date="2026-12-01T00:00:00+00:00", command=f"dlcore bench {op}",
                      copy_gbps=[4000.0]).to_json()
        (tmp_path / f"{op}_{mode}.json").write_text(json.dumps(data))

    report("flash_attention_v2", "fwd", ["sdpa_flash", "sdpa_cudnn"],
           [attention(0, 1.1), attention(1, 0.9), *decode], ["dlcore[triton]"])
    softmax = [ShapeResult(Shape({"tokens": t, "vocab": v}), nbytes=4 * t * v, flops=5 * t * v,
                           rounds={OWN: [0.02], "torch": [0.05]}, copy_ms=copy)
               for t, v, copy in ((4096, 4096, 0.0195), (256, 131072, 0.016))]
    report("softmax", "fwd", ["torch"], softmax)
    page = tmp_path / "performance.md"
    done = subprocess.run([sys.executable, str(ROOT / "docs" / "results" / "render.py"), "--results", str(tmp_path),
                           "--out", str(page)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {line.split(" | ")[0].removeprefix("| "): line.split(" | ")[1:]
            for line in page.read_text().split("## Attention and softmax targets", 1)[1].splitlines()
            if line.startswith("| ") and " | " in line}
    forward = rows["Triton forward, B 2, H 16, S 8192, D 128: >= 450 TFLOP/s"]
    assert forward[0].startswith(f"{flops / 1.1e9:.0f} TFLOP/s (sdpa_flash {flops / 2e9:.0f}, sdpa_cudnn ")
    assert forward[1] == "yes |"
    assert rows["Triton forward, causal, B 2, H 16, S 8192, D 128: >= 400 TFLOP/s"][1] == "yes |"
    assert rows["Triton backward, B 2, H 16, S 8192, D 128: >= 330 TFLOP/s"] == ["not measured", "- |"]
    best = rows["`get_op('flash_attention_v2')` >= 0.98x the best of Triton and SDPA, every shape"]
    assert best[0].startswith("lowest 0.91x (batch=2, seq=8192") and best[1] == "no |"
    assert rows["Decode (Sq 1, Sk 1024 to 65536, GQA 32/8): >= 1.0x SDPA every Sk"][0].startswith("lowest 0.95x")
    assert rows["Decode at Sk 65536: >= 85% of the copy bandwidth"] == ["84%", "no |"]
    softmax_row = rows["softmax forward >= 90% of a copy of the same bytes, rows 4096 to 131072"]
    assert softmax_row == ["lowest 80% (tokens=256, vocab=131072)", "no |"]
