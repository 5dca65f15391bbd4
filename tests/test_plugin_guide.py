"""docs/plugins.md stays true to its example distribution and to dlcore.api."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

import dlcore.api

ROOT = Path(__file__).resolve().parent.parent
GUIDE = (ROOT / "docs" / "plugins.md").read_text()
EXAMPLE = ROOT / "tests" / "plugins" / "thirdparty"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", GUIDE, flags=re.S)


def test_the_guide_s_pyproject_is_the_example_s():
    shown = tomllib.loads(blocks("toml")[0])
    real = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())
    assert shown["build-system"] == real["build-system"]
    assert shown["project"]["dependencies"] == real["project"]["dependencies"] == ["dlc-core>=0.1,<0.2"]
    assert shown["project"]["entry-points"] == real["project"]["entry-points"]
    assert shown["tool"] == real["tool"]


def test_the_guide_lists_the_whole_api():
    table = GUIDE.split("## What you may import")[1].split("## 1.")[0]
    listed = set(re.findall(r"`(\w+)`", table)) - {"dlcore", "DlcoreError"}
    errors = {n for n in dlcore.api.__all__ if n.endswith("Error")}
    assert set(dlcore.api.__all__) - errors <= listed, set(dlcore.api.__all__) - errors - listed
    assert listed <= set(dlcore.api.__all__), listed - set(dlcore.api.__all__)


def test_the_guide_s_code_is_the_example_s():
    """Each line of the guide's Python blocks, comments aside, is in the example's modules (whitespace
    and line breaks aside)."""
    source = "".join(p.read_text() for p in (EXAMPLE / "dlc_thirdparty_demo").glob("*.py"))
    compact = "".join(line.split("  #")[0] for line in source.splitlines())
    compact = "".join(compact.split())
    for block in blocks("python"):
        for line in block.splitlines():
            code = "".join(line.split("  #")[0].split())
            if code and not code.startswith("#"):
                assert code in compact, line


README_CHECK = """
import importlib.util, json, sys, torch
spec = importlib.util.spec_from_file_location("readme_softcap", sys.argv[1])  # triton.jit reads the file
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
x, cap = module.OP.example_inputs({}, torch.float32, "cpu")
err = (module.softcap(x, cap) - module.OP.reference(x, cap)).abs().max().item()
print(json.dumps({"err": err, "shape": list(x.shape)}))
"""


@pytest.mark.slow
def test_the_readme_s_short_plugin_runs(tmp_path):
    readme = (ROOT / "README.md").read_text().split("## Writing a third-party kernel plugin")[1]
    block = re.search(r"```python\n(.*?)```", readme, flags=re.S).group(1)
    toml = tomllib.loads(re.search(r"```toml\n(.*?)```", readme, flags=re.S).group(1))
    assert toml["build-system"]["build-backend"] and toml["tool"]["setuptools"]["packages"]["find"]["include"]
    assert toml["project"]["dependencies"] == ["dlc-core>=0.1,<0.2"]
    code = tmp_path / "softcap.py"
    code.write_text(block)
    done = subprocess.run([sys.executable, "-c", README_CHECK, str(code)], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["shape"] == [37, 1000] and result["err"] < 1e-4
