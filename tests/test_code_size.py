"""Size limits of issue 44: no module over 500 lines and no function over 80 lines, ``@triton.jit``
kernels apart (a kernel's body is one program), across dlcore and the plugins (``build/`` folders,
stale build output, left out)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = [REPO / "dlcore", *sorted(p for p in (REPO / "plugins").iterdir() if p.is_dir())]
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80

# What may still be over the limits: nothing. An entry would leave the list as soon as it fits
# (test_the_allow_list_holds_only_what_is_over).
ALLOWED: set[str] = set()


def _is_jit(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Whether ``fn`` is a Triton kernel: decorated by ``triton.jit`` (or ``jit``, called or not)."""
    for decorator in fn.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if (isinstance(target, ast.Attribute) and target.attr == "jit") or (
                isinstance(target, ast.Name) and target.id == "jit"):
            return True
    return False


def oversized(roots: list[Path], base: Path) -> dict[str, int]:
    """Every module over MAX_MODULE_LINES (``path``) and every function, nested ones included, over
    MAX_FUNCTION_LINES from its ``def`` to its last line (``path:name``), outside ``@triton.jit``
    kernels, under ``roots``; each with its line count."""
    found: dict[str, int] = {}
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if "build" in path.relative_to(root).parts:
                continue
            name = path.relative_to(base).as_posix()
            text = path.read_text()
            if len(text.splitlines()) > MAX_MODULE_LINES:
                found[name] = len(text.splitlines())
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_jit(node):
                    length = node.end_lineno - node.lineno + 1
                    if length > MAX_FUNCTION_LINES:
                        found[f"{name}:{node.name}"] = length
    return found


@pytest.fixture(scope="module")
def repository() -> dict[str, int]:
    return oversized(ROOTS, REPO)


def test_no_module_or_function_is_over_the_limits(repository):
    over = {k: v for k, v in repository.items() if k not in ALLOWED}
    assert not over, (f"over {MAX_MODULE_LINES} lines a module or {MAX_FUNCTION_LINES} a function (split it by "
                      f"job): {over}")


def test_the_allow_list_holds_only_what_is_over(repository):
    fits = ALLOWED - set(repository)
    assert not fits, f"now within the limits, to be taken off ALLOWED: {sorted(fits)}"


def _function(name: str, lines: int, decorator: str = "") -> str:
    body = "".join(f"    x{i} = {i}\n" for i in range(lines - 2))
    return f"{decorator}def {name}():\n{body}    return 0\n\n\n"


def test_the_check_finds_a_long_function_and_module_and_spares_kernels(tmp_path):
    """A function of 81 lines, a nested one, and a module of 501 lines are found; a function of 80
    lines, ``@triton.jit`` kernels of any length and a build folder are not."""
    package = tmp_path / "plugins" / "demo"
    (package / "build").mkdir(parents=True)
    (package / "long.py").write_text(_function("fits", 80) + _function("too_long", 81) + "def outer():\n" + "".join(
        "    " + line + "\n" for line in _function("inner", 81).splitlines()))
    (package / "kernels.py").write_text("import triton\n\n\n" + _function("kernel", 200, "@triton.jit\n")
                                        + _function("called", 200, "@triton.jit(do_not_specialize=['x'])\n"))
    (package / "big.py").write_text("x = 0\n" * 501)
    (package / "fits.py").write_text("x = 0\n" * 500)
    (package / "build" / "old.py").write_text(_function("stale", 200) + "x = 0\n" * 501)
    found = oversized([package], tmp_path)
    assert found == {"plugins/demo/long.py:too_long": 81, "plugins/demo/long.py:inner": 81,
                     "plugins/demo/long.py:outer": 82, "plugins/demo/big.py": 501}
