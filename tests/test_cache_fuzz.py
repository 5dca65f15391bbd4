"""Fuzzing the state dlcore keeps under its cache directory: whatever a file holds, get_op stays
correct, nothing outside the directory changes, and ``dlcore cache list`` does not crash.

The files are those a real process writes (the selections' database, the plugin index, the launch
shelf), damaged one way at a time: random bytes, truncation, wrong JSON types, hostile database
rows, and a file where a directory belongs. Every damaged copy is checked by one fresh interpreter.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

#: fills a cache the way a user's process does: plugin index, a measured selection, the shelf
POPULATE = """
import torch, dlcore
from dlcore.dispatch.dispatcher import default
from dlcore.dispatch.store import make_record
from dlcore.tuning.selection import Selection
x, w = torch.randn(3, 64), torch.randn(64)
dlcore.get_op("rms_norm", (x, w))(x, w)
sel = Selection(impl="triton", config={"BLOCK_N": 64}, how="measured", time_ms=0.1, measured={"triton": 0.1})
for i in range(3):
    default().store.put(f"rms_norm:entry-{i}", make_record("rms_norm", {"signature": "s"}, sel))
"""

#: for each damaged directory: get_op against the reference, the CLI's listing, entries stored, a clear
CHECK = """
import json, sys, warnings, contextlib, io, os
import torch, dlcore
import dlcore.dispatch.dispatcher as dispatcher
from dlcore.cli import main
from dlblas_kernels.kernels.rms_norm import rms_norm_reference
results = {}
for directory in sys.argv[1:]:
    os.environ["DLCORE_CACHE_DIR"] = directory
    dispatcher.reset()
    outcome = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            x, w = torch.randn(5, 64), torch.randn(64)
            y = dlcore.get_op("rms_norm", (x, w))(x, w)
            outcome["error"] = float((y.double() - rms_norm_reference(x.double(), w.double(), 1e-6)).abs().max())
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                outcome["list"] = main(["cache", "list"])
                # storing over every entry, then clearing: where diskcache would delete a file a row names
                store = dispatcher.default().store
                for key in store.keys():
                    store.put(key, {"op": "rms_norm", "parts": {}, "selection": {"impl": "triton", "config": {},
                                                                                 "how": "measured"}})
                outcome["clear"] = main(["cache", "clear"])
        except Exception as exc:
            outcome["raised"] = f"{type(exc).__name__}: {exc}"
    outcome["warnings"] = sorted({type(w.message).__name__ for w in caught})
    results[directory] = outcome
print(json.dumps(results))
"""


def run_python(code: str, *args: str, cache: Path | None = None) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, "DLCORE_TUNE": "off", "TRITON_INTERPRET": "1"}
    if cache is not None:
        env["DLCORE_CACHE_DIR"] = str(cache)
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=900)


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _sql(db: Path, statement: str, *params) -> None:
    connection = sqlite3.connect(db)
    connection.execute(statement, params)
    connection.commit()
    connection.close()


def damages(rng: random.Random):
    """(label, damage(directory)) pairs: each spoils one file, or one place, of a populated cache."""

    def each_json(directory: Path, pattern: str, write) -> None:
        for path in directory.glob(pattern):
            write(path)

    def garbage(path: Path) -> None:
        path.write_bytes(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 4096))))

    def truncate(path: Path) -> None:
        path.write_bytes(path.read_bytes()[: max(1, path.stat().st_size // 2)])

    def typed(value):
        return lambda path: path.write_text(json.dumps(value))

    def index_ops_as_text(path: Path) -> None:
        data = json.loads(path.read_text())
        for entry in data["plugins"].values():
            entry["ops"] = ",".join(entry["ops"])
        path.write_text(json.dumps(data))

    def replace_with_dir(path: Path) -> None:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
        path.mkdir()
        (path / "x").write_text("")

    def replace_with_file(path: Path) -> None:
        shutil.rmtree(path)
        path.write_text("not a directory")

    db = "cache.db"
    yield "db: random bytes", lambda d: garbage(d / db)
    yield "db: truncated", lambda d: truncate(d / db)
    yield "db: empty file", lambda d: (d / db).write_bytes(b"")
    yield "db: a directory", lambda d: replace_with_dir(d / db)
    yield "db: a row naming a file outside", lambda d: _sql(
        d / db, "UPDATE Cache SET mode = 3, filename = '../../../outside/victim.txt', value = NULL")
    yield "db: a pickled row", lambda d: _sql(d / db, "UPDATE Cache SET mode = 4, value = ?", b"\x80\x04K\x01.")
    yield "db: keys that are not text", lambda d: _sql(d / db, "UPDATE Cache SET key = rowid, raw = 0")
    yield "db: values of the wrong JSON types", lambda d: _sql(d / db, "UPDATE Cache SET value = '[1, 2, 3]'")
    yield "db: settings garbage", lambda d: _sql(
        d / db, "UPDATE Settings SET value = 'nonsense' WHERE key IN ('eviction_policy', 'disk_min_file_size')")
    yield "db: tables dropped", lambda d: _sql(d / db, "DROP TABLE Cache")
    index = "plugins/kernels-*.json"
    yield "index: random bytes", lambda d: each_json(d, index, garbage)
    yield "index: truncated", lambda d: each_json(d, index, truncate)
    yield "index: not UTF-8", lambda d: each_json(d, index, lambda p: p.write_bytes(b"\xff\xfe\x00{"))
    yield "index: a list", lambda d: each_json(d, index, typed([1, 2]))
    yield "index: plugins a list", lambda d: each_json(d, index, typed({"schema": 1, "plugins": ["ffn"]}))
    yield "index: ops as text", lambda d: each_json(d, index, index_ops_as_text)
    yield "index: a directory", lambda d: each_json(d, index, replace_with_dir)
    yield "plugins: a file", lambda d: replace_with_file(d / "plugins")
    shelf = "launch/*/*.json"
    yield "shelf: random bytes", lambda d: each_json(d, shelf, garbage)
    yield "shelf: a list", lambda d: each_json(d, shelf, typed(["x"]))
    yield "cache directory: a file", lambda d: (shutil.rmtree(d), d.write_text("a user's notes"))


def test_damaged_cache_state_never_breaks_get_op_or_the_cli(tmp_path):
    baseline = tmp_path / "baseline"
    done = run_python(POPULATE, cache=baseline)
    assert done.returncode == 0, done.stderr
    assert (baseline / "cache.db").exists() and list(baseline.glob("plugins/kernels-*.json"))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.txt").write_text(json.dumps({"op": "rms_norm", "parts": {}, "selection": {}}))
    before = digest(outside)

    labels: dict[str, str] = {}
    for i, (label, damage) in enumerate(damages(random.Random(0))):
        directory = tmp_path / "cases" / f"{i:02d}" / "cache"
        directory.parent.mkdir(parents=True)
        shutil.copytree(baseline, directory)
        damage(directory)
        labels[str(directory)] = label
    done = run_python(CHECK, *labels)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.splitlines()[-1])
    for directory, outcome in results.items():
        label = labels[directory]
        assert "raised" not in outcome, f"{label}: {outcome['raised']}"
        assert outcome["error"] < 1e-4, f"{label}: get_op's result is off by {outcome['error']}"
        assert outcome["list"] == 0, label
        assert outcome["clear"] in (0, 2), label  # 2: a cache that cannot be written says so in one line
    assert digest(outside) == before, "a file outside the cache directory changed"
    # the user's file where the cache directory was configured is still theirs
    file_case = next(Path(d) for d, label in labels.items() if label == "cache directory: a file")
    assert file_case.read_text() == "a user's notes"
