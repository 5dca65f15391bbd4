"""Under `nox -s test` the distributions are real installs, not the source tree."""

import importlib
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(os.environ.get("DLCORE_EXPECT_INSTALLED") != "1", reason="only under nox -s test")
@pytest.mark.parametrize("module", ["dlcore", "dlc_cuda", "dlc_ascend", "dlc_mlu", "dlblas_kernels"])
def test_distribution_is_installed_not_the_source_tree(module):
    path = Path(importlib.import_module(module).__file__).resolve()
    assert "site-packages" in path.parts, path
    assert not {REPO / "dlcore", REPO / "plugins"} & set(path.parents), path


@pytest.mark.skipif(os.environ.get("DLCORE_EXPECT_INSTALLED") != "1", reason="only under nox -s test")
def test_the_core_is_dlc_core_and_the_foreign_dlcore_is_absent():
    from importlib import metadata

    assert metadata.packages_distributions()["dlcore"] == ["dlc-core"]
    for sibling in ("dlc-cuda", "dlc-ascend", "dlc-mlu", "dlblas-kernels"):
        assert any(r.startswith("dlc-core") for r in metadata.requires(sibling)), sibling
    with pytest.raises(metadata.PackageNotFoundError):
        metadata.distribution("dlcore")  # an unrelated project on the index has that name
