"""The reference pages stay what their sources say."""

from __future__ import annotations

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
