"""docs/plugins.md stays true to its example distribution and to dlcore.api."""

import re
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
        if block.startswith(WHOLE_OP):  # run by test_the_guide_s_whole_op_runs_forward_and_backward
            continue
        for line in block.splitlines():
            code = "".join(line.split("  #")[0].split())
            if code and not code.startswith("#"):
                assert code in compact, line


WHOLE_OP = "# my_kernels/softcap.py"


def whole_op() -> str:
    """The guide's complete op in one file, as the page shows it."""
    return next(block for block in blocks("python") if block.startswith(WHOLE_OP))


def load_whole_op(tmp_path, namespace: str = "my_kernels", edit=lambda code: code):
    import importlib.util

    code = tmp_path / "guide_softcap.py"  # triton.jit reads its source from the file
    code.write_text(edit(whole_op()).replace('namespace="my_kernels"', f'namespace="{namespace}"'))
    spec = importlib.util.spec_from_file_location(f"guide_softcap_{namespace}", code)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def guide_softcap(tmp_path_factory):
    return load_whole_op(tmp_path_factory.mktemp("guide"))


def test_the_guide_s_whole_op_runs_forward_and_backward(guide_softcap):
    """The page's block, executed: forward and backward in float32 against float64 torch, odd sizes."""
    import torch

    from dlcore.testing import assert_close, randn

    x = randn(5, 37, scale=40.0, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    dy = randn(5, 37, generator=torch.Generator().manual_seed(1))
    y = guide_softcap.softcap(x, 20.0)
    (dx,) = torch.autograd.grad(y, x, dy)
    x64 = x.detach().double().requires_grad_(True)
    y64 = 20.0 * torch.tanh(x64 / 20.0)
    (dx64,) = torch.autograd.grad(y64, x64, dy.double())
    assert_close(y.detach(), y64.detach())
    assert_close(dx, dx64)


def test_the_guide_s_whole_op_checks_its_arguments_and_gradchecks(guide_softcap):
    import torch

    from dlcore.api import InvalidInputError

    with pytest.raises(InvalidInputError) as error:
        guide_softcap.softcap(torch.randn(3, 5), -1.0)
    assert error.value.arg == "cap" and error.value.got == "is -1.0"
    x64 = (torch.randn(3, 7, dtype=torch.float64) * 40).requires_grad_(True)
    assert torch.autograd.gradcheck(guide_softcap.softcap, (x64, 30.0))


def test_the_backward_reference_runs_with_autograd_off(tmp_path):
    """What the guide says: torch.autograd.grad inside a backward reference fails."""
    import torch

    def autograd_inside(code):
        written = "    t = torch.tanh(x.to(torch.promote_types(x.dtype, torch.float32)) / cap)\n" \
                  "    return (dy * (1 - t * t)).to(x.dtype)\n"
        assert written in code
        return code.replace(written, "    xx = x.detach().requires_grad_(True)\n"
                                     "    return torch.autograd.grad(cap * torch.tanh(xx / cap), xx, dy)[0]\n")

    module = load_whole_op(tmp_path, namespace="my_kernels_autograd", edit=autograd_inside)
    x64 = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="does not require grad"):
        module.softcap(x64, 30.0).sum().backward()
