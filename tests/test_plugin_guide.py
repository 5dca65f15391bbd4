"""docs/plugins.md stays true to its example distribution and to dlcore.api."""

import re
import tomllib
from pathlib import Path

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
