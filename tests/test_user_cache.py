"""The test suite never writes into the user's cache directory."""

import os
from pathlib import Path

import pytest
from isolated import run_python

from dlcore.cachedir import default_directory

USER_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dlcore"
#: while the tests are collected (module-level code of test modules runs then), before any fixture
AT_COLLECTION = os.environ.get("DLCORE_CACHE_DIR")


def test_each_test_has_a_cache_directory_of_its_own(tmp_path):
    assert default_directory() == tmp_path / "dlcore-cache"


@pytest.mark.slow
def test_interpreters_the_tests_start_use_the_test_s_cache(tmp_path):
    done = run_python("import torch, dlcore; from dlcore.cachedir import default_directory; "
                      "dlcore.get_op('rms_norm', (torch.randn(2, 8), torch.ones(8))); print(default_directory())")
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.split()[-1]) == tmp_path / "dlcore-cache"
    assert (tmp_path / "dlcore-cache").is_dir()


def test_collection_already_has_a_cache_directory_that_is_not_the_user_s():
    assert AT_COLLECTION is not None, "collection would use the user's cache"
    assert not Path(AT_COLLECTION).resolve().is_relative_to(USER_CACHE.resolve())


def test_a_relative_or_home_cache_directory_is_made_absolute(monkeypatch, tmp_path):
    """A relative DLCORE_CACHE_DIR would move with the working directory (and SQLite's URI of the
    database needs an absolute path); ~ is the user's home, not a folder named ~."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DLCORE_CACHE_DIR", "relative")
    assert default_directory() == tmp_path / "relative"
    monkeypatch.setenv("DLCORE_CACHE_DIR", "~/somewhere")
    assert default_directory() == Path.home() / "somewhere"
