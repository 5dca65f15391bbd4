"""The five distributions' names: free on the package index (recorded offline), and pinned to each other."""

import json
import warnings
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
PROJECTS = [REPO / "pyproject.toml", *sorted((REPO / "plugins").glob("*/pyproject.toml"))]
#: which names exist on the index and whose (`pip index versions NAME`), recorded on the date it says
INDEX = json.loads((Path(__file__).parent / "data" / "pypi_names.json").read_text())


def project(path: Path) -> dict:
    return tomllib.loads(path.read_text())["project"]


def names() -> list[str]:
    return [canonicalize_name(project(p)["name"]) for p in PROJECTS]


def test_five_distributions():
    assert names() == ["dlc-core", "dlblas-kernels", "dlc-ascend", "dlc-cuda", "dlc-mlu"]


def test_no_name_is_taken_on_the_index_by_someone_else():
    taken = {canonicalize_name(n): entry for n, entry in INDEX["taken"].items()}
    assert "dlcore" in taken and not taken["dlcore"]["ours"], "the record must show the foreign dlcore"
    for name in names():
        assert name not in taken or taken[name]["ours"], f"{name} is someone else's on the index: {taken[name]}"
        assert name in INDEX["free"] or taken[name]["ours"], f"{name} was never checked against the index"


@pytest.mark.parametrize("path", PROJECTS[1:], ids=lambda p: p.parent.name)
def test_siblings_pin_the_core_to_this_minor_version(path):
    core = project(PROJECTS[0])
    requirements = {canonicalize_name(r.name): r for r in map(Requirement, project(path)["dependencies"])}
    assert "dlcore" not in requirements, "dlcore on the index is an unrelated project"
    pin = requirements["dlc-core"]
    assert pin.specifier.contains(core["version"]) and not pin.specifier.contains("0.2.0"), pin


@pytest.mark.parametrize("path", PROJECTS, ids=lambda p: p.parent.name)
def test_license_is_an_spdx_expression_setuptools_reads_without_deprecation(path, monkeypatch):
    """PEP 639's string form: the `{text = ...}` table makes setuptools print a deprecation block per build."""
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution
    from setuptools.warnings import SetuptoolsDeprecationWarning

    assert project(path)["license"] == "Apache-2.0"
    monkeypatch.chdir(path.parent)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), "pyproject.toml")
    assert dist.metadata.license_expression == "Apache-2.0"
    deprecations = [str(w.message) for w in caught if issubclass(w.category, SetuptoolsDeprecationWarning)]
    assert not deprecations, deprecations


@pytest.mark.parametrize("path", PROJECTS, ids=lambda p: p.parent.name)
def test_build_requires_a_setuptools_that_reads_a_license_expression(path):
    """setuptools reads `license = "SPDX"` from 77.0.0 on; an older one rejects the string."""
    requires = tomllib.loads(path.read_text())["build-system"]["requires"]
    (setuptools,) = [r for r in map(Requirement, requires) if r.name == "setuptools"]
    assert not setuptools.specifier.contains("76.1") and setuptools.specifier.contains("77.0.0"), setuptools
