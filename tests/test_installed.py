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
