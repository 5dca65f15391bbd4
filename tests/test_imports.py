"""Imports among the first-party modules: none runs upward, none comes back to where it started.

``lint-imports`` (the contracts in pyproject.toml, run by ``nox -s test``) holds dlcore's layers and
the cycles between sibling packages. What it cannot say for dlblas_kernels, whose kernels and the
building blocks beside them use each other package-wise, is checked here module by module: no
module imports itself through others, imports inside functions and under ``TYPE_CHECKING``
included. Below the compiler and tuning layers their objects are known through
:mod:`dlcore.declarations.protocols`; the classes that satisfy those protocols are checked too.
"""

from pathlib import Path

import pytest
import tomllib

from dlcore.compiler.lowering import Lowering
from dlcore.compiler.passes import Pass, Pipeline
from dlcore.compiler.toolchain import Tool, Toolchain
from dlcore.declarations.protocols import CompilerPass, LoweringResult, PassPipeline, SearchStrategy, ToolchainSpec
from dlcore.plugins.registry import registry
from dlcore.tuning.strategies import GridStrategy

grimp = pytest.importorskip("grimp")

PACKAGES = ("dlcore", "dlblas_kernels", "dlc_cuda", "dlc_ascend", "dlc_mlu")
PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def cycles(graph) -> list[list[str]]:
    """Each import of one module by another that a chain of imports leads back from."""
    found = []
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back:
                found.append([importer, *back])
    return found


def test_no_module_imports_itself_through_others():
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=False, cache_dir=None)
    assert not cycles(graph), "\n".join(" -> ".join(c) for c in cycles(graph))


def test_a_cycle_inside_a_function_is_found():
    graph = grimp.ImportGraph()
    for module in ("pkg", "pkg.vendor", "pkg.kernels", "pkg.kernels.moe", "pkg.gemm"):
        graph.add_module(module)
    graph.add_import(importer="pkg.vendor", imported="pkg.gemm")
    graph.add_import(importer="pkg.vendor", imported="pkg.kernels.moe")
    assert cycles(graph) == []
    graph.add_import(importer="pkg.kernels.moe", imported="pkg.vendor")
    assert cycles(graph) == [["pkg.kernels.moe", "pkg.vendor", "pkg.kernels.moe"],
                             ["pkg.vendor", "pkg.kernels.moe", "pkg.vendor"]]


def test_lint_imports_checks_annotations_and_the_kernels():
    settings = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]
    assert settings["exclude_type_checking_imports"] is False
    assert set(settings["root_packages"]) >= set(PACKAGES)


def test_the_plugins_see_only_the_public_modules_of_dlcore():
    """The contract names every module of dlcore but api and language: a new one is internal until
    someone decides otherwise."""
    contracts = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]
    public = next(c for c in contracts if c["type"] == "forbidden" and "dlcore.errors" in c["forbidden_modules"])
    assert set(public["source_modules"]) == set(PACKAGES) - {"dlcore"}
    dlcore = PYPROJECT.parent / "dlcore"
    modules = {f"dlcore.{p.stem}" for p in dlcore.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert set(public["forbidden_modules"]) == modules - {"dlcore.__init__", "dlcore.api", "dlcore.language"}


def test_the_compiler_and_tuning_objects_satisfy_the_protocols_below_them():
    tool = Tool("opt", "DLC_TEST_OPT", "linalg", "nowhere")
    assert isinstance(Toolchain("test", "npu", (tool,)), ToolchainSpec)
    p = Pass("noop", "ttir", lambda module, stage: None)
    assert isinstance(p, CompilerPass)
    assert isinstance(Pipeline("cuda", (p,)), PassPipeline)
    assert isinstance(Lowering("k", "cuda:90", [], ("ttir",), 0.0), LoweringResult)
    assert isinstance(GridStrategy(), SearchStrategy)
    reg = registry()
    assert reg.passes and all(isinstance(q, CompilerPass) for q in reg.passes)
    assert reg.strategies and all(isinstance(s, SearchStrategy) for s in reg.strategies.values())
    chains = [t for backend in reg.backends.values() for t in backend.toolchains]
    assert all(isinstance(t, ToolchainSpec) for t in chains)


def test_an_object_without_what_a_protocol_names_does_not_satisfy_it():
    assert not isinstance(Pass("noop", "ttir", print), PassPipeline)
    assert not isinstance(object(), LoweringResult)
