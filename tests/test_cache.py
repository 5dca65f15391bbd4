"""The disk cache: round trip, keys, safety against tampering, concurrency, export/import, recovery."""

import dataclasses
import importlib
import json
import os
import subprocess
import sys
import warnings

import diskcache
import pytest
import torch

import dlcore
import dlcore.dispatch.dispatcher
from dlcore.declarations.call import Call
from dlcore.declarations.implementation import source_modules
from dlcore.declarations.signature import make_signature
from dlcore.dispatch.key import SCHEMA_VERSION, Key
from dlcore.dispatch.store import CacheWarning, DiskCache, make_record
from dlcore.errors import CacheFileError
from dlcore.plugins.registry import registry
from dlcore.tuning.selection import Selection

EXPLODED = []


def _explode():
    EXPLODED.append("unpickled")
    return "boom"


class Boom:
    def __reduce__(self):
        return (_explode, ())


def selection(impl="triton", **config):
    return Selection(impl=impl, config=config or {"BLOCK_N": 128}, how="measured", time_ms=0.5,
                     measured={impl: 0.5}, when="2026-11-30T00:00:00+00:00")


def record(op="rms_norm", **config):
    return make_record(op, {"signature": "s"}, selection(**config))


def rms_norm_parts(x, w):
    reg = registry()
    op = reg.op("rms_norm")
    bound = op.bind((x, w))
    backend = reg.backend_for(x.device)
    profile = reg.profile(backend, x.device)
    candidates = reg.implementations_of("rms_norm")
    return op, bound, backend, profile, candidates


def test_round_trip(tmp_path):
    cache = DiskCache(tmp_path / "c")
    cache.put("rms_norm:abc", record(BLOCK_N=256))
    got = DiskCache(tmp_path / "c").get("rms_norm:abc")
    assert got == selection(BLOCK_N=256)
    assert DiskCache(tmp_path / "c").get("rms_norm:missing") is None


def test_key_changes_with_everything_a_selection_depends_on(monkeypatch):
    x, w = torch.randn(4, 64), torch.randn(64)
    op, bound, backend, profile, candidates = rms_norm_parts(x, w)
    signature = make_signature(op, bound, x.device)

    def key(sig=signature, prof=profile, back=backend, cands=candidates, passes=()):
        return Key.of(Call(op, bound, x.device, back, prof, sig, cands, {}), passes).digest

    base = key()
    assert key() == base
    assert key(cands=list(reversed(candidates))) == base  # the order plugins loaded in is no part of it
    half = make_signature(op, op.bind((x.half(), w.half())), x.device)
    assert key(sig=half) != base
    assert key(prof=dataclasses.replace(profile, arch="sm_90")) != base
    monkeypatch.setattr(type(backend), "version", property(lambda self: "9.9"))
    assert key() != base
    monkeypatch.undo()
    assert key(passes=("grid_folding",)) != base
    monkeypatch.setattr("dlcore.dispatch.key.triton_version", lambda: "0.0.1")
    assert key() != base
    monkeypatch.undo()
    monkeypatch.setattr(type(candidates[1]), "source_hash", lambda self: "edited")
    assert key() != base


def test_a_pickled_entry_is_never_unpickled(tmp_path):
    raw = diskcache.Cache(str(tmp_path / "c"))  # a writer with the default (pickling) policy
    raw.set("rms_norm:evil", Boom())
    raw.set("rms_norm:evil-text", "{not json")
    raw.close()
    cache = DiskCache(tmp_path / "c")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cache.get("rms_norm:evil") is None
        assert cache.get("rms_norm:evil-text") is None
        assert list(cache.items()) == []
    assert EXPLODED == []
    assert any("unreadable cache entry rms_norm:evil" in str(w.message) for w in caught)


def test_a_record_with_the_wrong_shape_is_ignored(tmp_path):
    cache = DiskCache(tmp_path / "c")
    cache._open().set("rms_norm:odd", json.dumps({"op": "rms_norm", "parts": {}, "selection": {"impl": 1}}))
    with pytest.warns(CacheWarning):
        assert cache.get("rms_norm:odd") is None


WRITER = """
import sys
from dlcore.dispatch.store import DiskCache, make_record
from dlcore.tuning.selection import Selection
cache = DiskCache(sys.argv[1])
for i in range(40):
    sel = Selection(impl="triton", config={"i": i, "writer": sys.argv[2]}, how="measured")
    cache.put(f"op:{sys.argv[2]}-{i}", make_record("op", {}, sel))
"""


@pytest.mark.slow
def test_concurrent_writers_lose_nothing(tmp_path):
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path / "c"), str(n)]) for n in range(4)]
    assert all(w.wait(timeout=120) == 0 for w in writers)
    keys = dict(DiskCache(tmp_path / "c").items())
    assert len(keys) == 160
    assert keys["op:3-39"]["selection"]["config"] == {"i": 39, "writer": "3"}


def digest(rec):
    """The store's key of a record: the digest of its op and parts, the only key an import takes."""
    return Key(rec["op"], tuple(sorted(rec["parts"].items()))).digest


def test_export_import_round_trip(tmp_path):
    source = DiskCache(tmp_path / "a")
    for i in range(3):
        rec = record(BLOCK_N=2**i)
        rec["parts"]["signature"] = f"s{i}"
        source.put(digest(rec), rec)
    assert source.export(tmp_path / "tuned.json") == 3
    target = DiskCache(tmp_path / "b")
    assert target.import_(tmp_path / "tuned.json") == (3, 0)
    assert dict(target.items()) == dict(source.items())


def test_import_rejects_bad_entries(tmp_path):
    path = tmp_path / "bad.json"
    good = record()
    bad_time, negative = record(), record()
    bad_time["selection"]["time_ms"], bad_time["parts"]["signature"] = "fast", "t"
    negative["selection"]["time_ms"], negative["parts"]["signature"] = -1e9, "n"
    entries = {digest(good): good, "b": {"selection": 3}, "../evil": good, digest(bad_time): bad_time,
               digest(negative): negative}
    path.write_text(json.dumps({"format": "dlcore-cache", "schema": SCHEMA_VERSION, "entries": entries}))
    target = DiskCache(tmp_path / "c")
    assert target.import_(path) == (1, 4)  # only the record under its own key, of the right field types
    assert target.keys() == [digest(good)]
    for text in ("[1, 2]", "not json", "[" * 100000 + "]" * 100000):
        path.write_text(text)
        with pytest.raises(CacheFileError, match="not a dlcore cache export"):
            DiskCache(tmp_path / "c").import_(path)
    path.write_text(json.dumps({"format": "dlcore-cache", "schema": 99, "entries": {digest(good): good}}))
    with pytest.raises(CacheFileError, match="holds cache schema 99"):
        DiskCache(tmp_path / "c").import_(path)


def test_a_corrupt_database_is_set_aside_and_rebuilt(tmp_path):
    directory = tmp_path / "c"
    DiskCache(directory).put("rms_norm:x", record())
    (directory / "cache.db").write_bytes(b"this is not a sqlite database" * 100)
    (directory / "notes.txt").write_text("a user's file")
    cache = DiskCache(directory)
    with pytest.warns(CacheWarning, match="moved cache.db to cache.db.corrupt-"):
        assert cache.get("rms_norm:x") is None
    cache.put("rms_norm:y", record())
    assert cache.get("rms_norm:y") is not None
    assert [p.name for p in directory.iterdir() if p.name.startswith("cache.db.corrupt-")]
    assert (directory / "notes.txt").read_text() == "a user's file"  # only the database moved


def _tamper(directory, sql, *params):
    import sqlite3

    db = sqlite3.connect(directory / "cache.db")
    db.execute(sql, params)
    db.commit()
    db.close()


def test_a_row_naming_a_file_outside_the_cache_is_neither_read_nor_deleted(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text(json.dumps(record()))  # a valid record: reading it would be wrong too
    directory = tmp_path / "c"
    DiskCache(directory).put("rms_norm:k", record())
    for mode in (2, 3, 4):  # diskcache's binary file, text file, pickle
        _tamper(directory, "UPDATE Cache SET mode = ?, filename = '../victim.txt', value = NULL WHERE key = ?",
                mode, "rms_norm:k")
        cache = DiskCache(directory)
        with pytest.warns(CacheWarning, match="unreadable cache entry"):
            assert cache.get("rms_norm:k") is None
        cache.put("rms_norm:k", record(BLOCK_N=64))  # replacing the row: diskcache would delete its file
        cache.delete("rms_norm:k")
        cache.put("rms_norm:k", record())
        cache.clear()
        cache.put("rms_norm:k", record())
        cache.close()
        assert victim.read_text() == json.dumps(record())
    with pytest.raises(ValueError, match="only inline text"):
        from dlcore.dispatch.jsondisk import TextOnlyDisk

        TextOnlyDisk(str(directory)).fetch(1, "../victim.txt", "{}", False)


def test_large_records_stay_inline(tmp_path):
    cache = DiskCache(tmp_path / "c")
    big = record(BLOCK_N=1, notes="x" * 200_000)  # over diskcache's 32 KiB file threshold
    cache.put("rms_norm:big", big)
    assert cache.get_record("rms_norm:big") == json.loads(json.dumps(big, sort_keys=True))
    assert [p.name for p in (tmp_path / "c").rglob("*.val")] == []


def test_tampered_settings_are_not_used(tmp_path):
    directory = tmp_path / "c"
    DiskCache(directory).put("rms_norm:x", record())
    _tamper(directory, "INSERT OR REPLACE INTO Settings VALUES ('disk_min_file_size', 0)")
    _tamper(directory, "INSERT OR REPLACE INTO Settings VALUES ('eviction_policy', 'nonsense')")
    cache = DiskCache(directory)
    assert cache.get("rms_norm:x") == selection()  # explicit settings win: nothing to set aside
    cache.put("rms_norm:y", record())
    assert [p.name for p in directory.rglob("*.val")] == []


def test_keys_that_are_not_text_are_skipped(tmp_path, capsys):
    directory = tmp_path / "c"
    DiskCache(directory).put("rms_norm:x", record())
    raw = diskcache.Cache(str(directory))
    raw.set(7, "seven")
    raw.set(b"bytes", "b")
    raw.close()
    cache = DiskCache(directory)
    with pytest.warns(CacheWarning, match="2 cache entries .* not text"):
        assert [k for k, _ in cache.items()] == ["rms_norm:x"]


def test_a_read_only_cache_is_served_not_repaired(tmp_path, monkeypatch):
    import os

    import dlcore.dispatch.store as store

    directory = tmp_path / "c"
    DiskCache(directory).put("rms_norm:x", record())
    before = sorted(p.name for p in directory.iterdir())
    real_access = os.access
    monkeypatch.setattr(store.os, "access",
                        lambda path, mode: False if mode == os.W_OK else real_access(path, mode))
    cache = DiskCache(directory)
    with pytest.warns(CacheWarning, match="read-only") as caught:
        assert cache.get("rms_norm:x") == selection()
        cache.put("rms_norm:y", record())
        assert cache.get("rms_norm:y") is None
        assert [k for k, _ in cache.items()] == ["rms_norm:x"]
    assert len(caught) == 1
    with pytest.raises(CacheFileError, match="read-only"):
        cache.clear()
    assert sorted(p.name for p in directory.iterdir()) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permission bits")
def test_a_read_only_directory_on_disk(tmp_path):
    directory = tmp_path / "c"
    DiskCache(directory).put("rms_norm:x", record())
    directory.chmod(0o555)
    tmp_path.chmod(0o555)
    try:
        cache = DiskCache(directory)
        with pytest.warns(CacheWarning, match="read-only"):
            assert cache.get("rms_norm:x") == selection()
            cache.put("rms_norm:y", record())
    finally:
        tmp_path.chmod(0o755)
        directory.chmod(0o755)


def test_a_cache_path_that_is_a_file_is_left_alone(tmp_path):
    path = tmp_path / "my-notes"
    path.write_text("mine")
    cache = DiskCache(path)
    with pytest.warns(CacheWarning, match="not a directory"):
        assert cache.get("rms_norm:x") is None
        cache.put("rms_norm:x", record())
        assert list(cache.items()) == []
    assert path.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my-notes"]


def test_get_op_runs_without_a_disk_cache_when_the_path_is_a_file(tmp_path):
    path = tmp_path / "not-a-dir"
    path.write_text("mine")
    code = (
        "import warnings, torch, dlcore\n"
        "warnings.simplefilter('error', DeprecationWarning)\n"
        "x, w = torch.randn(3, 64), torch.randn(64)\n"
        "out = dlcore.get_op('rms_norm', (x, w))(x, w)\n"
        "ref = dlcore.get_op('rms_norm', (x, w), impl='reference')(x, w)\n"
        "assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()\n"
    )
    env = {**os.environ, "DLCORE_CACHE_DIR": str(path), "DLCORE_TUNE": "off"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "not a directory" in done.stderr
    assert path.read_text() == "mine"


def test_get_op_remembers_a_measured_selection_across_processes(monkeypatch):
    from test_dispatch import OpsPlugin, double_op, with_plugins

    from dlcore.declarations.implementation import TorchImplementation

    impls = [TorchImplementation("double", "add", lambda x: x + x),
             TorchImplementation("double", "mul", lambda x: x * 2)]
    with_plugins(monkeypatch, OpsPlugin([double_op()], impls))
    x = torch.randn(64)
    first = dlcore.get_op("double", (x,))
    assert first.selection.how == "measured"
    # a new process: memory forgotten, plugins rediscovered; the disk remembers
    registry_now = registry()
    dlcore.dispatch.dispatcher.default().clear()
    monkeypatch.setattr("dlcore.plugins.registry._registry", registry_now)
    monkeypatch.setattr("dlcore.dispatch.dispatcher.select", lambda *a, **k: pytest.fail("measured again"))
    again = dlcore.get_op("double", (x,))
    assert again.selection == first.selection and again is not first


def test_the_source_hash_covers_every_module_a_kernel_takes_code_from():
    """add_rms_norm's plan launches rms_norm's backward kernels: editing rms_norm must change its key,
    and so must editing what rms_norm's backward sizes its npu tile by."""
    add_rms_norm = importlib.import_module("dlblas_kernels.kernels.add_rms_norm")
    modules = [m.__name__ for m in source_modules(add_rms_norm.plan)]
    assert modules == ["dlblas_kernels.blocks.npu", "dlblas_kernels.kernels.add_rms_norm",
                       "dlblas_kernels.kernels.rms_norm"]
    # The implementation's hash covers the same modules (its plan carries the kernel module's name).
    assert [m.__name__ for m in source_modules(add_rms_norm.KERNEL.implementation.plan)] == modules


def test_export_and_import_errors_are_named(tmp_path):
    cache = DiskCache(tmp_path / "c")
    with pytest.raises(CacheFileError, match="cannot read .*missing.json"):
        cache.import_(tmp_path / "missing.json")
    with pytest.raises(CacheFileError, match="cannot write .*x.json"):
        cache.export(tmp_path / "no-such-dir" / "x.json")
    (tmp_path / "entries.json").write_text(json.dumps({"format": "dlcore-cache", "entries": [1]}))
    with pytest.raises(CacheFileError, match="entries"):
        cache.import_(tmp_path / "entries.json")


def test_a_cached_config_outside_the_space_is_ignored(tmp_path, monkeypatch):
    from dlcore.dispatch.dispatcher import Dispatcher, config_problem

    dispatcher = Dispatcher(directory=tmp_path / "c")
    x, w = torch.randn(5, 64), torch.randn(64)
    call = dispatcher.prepare("rms_norm", (x, w))
    key = dispatcher.key_of(call)
    impl = call.candidates[0]
    default = impl.default_config(call.signature, call.profile)
    assert config_problem(impl, default, call) == ""
    assert config_problem(impl, {**default, "BLOCK_N": 3}, call) != ""
    assert config_problem(impl, ["BLOCK_N", 3], call) == "the config is a list, not a mapping"
    tampered = Selection(impl=impl.name, config={**default, "BLOCK_N": 3}, how="measured", time_ms=0.1,
                         measured={impl.name: 0.1})
    dispatcher.store.put(key.digest, make_record("rms_norm", key.as_dict(), tampered))
    with pytest.warns(CacheWarning, match="ignoring the cached selection of rms_norm"):
        bound = dispatcher.get_op("rms_norm", (x, w))
    assert bound.selection.config == default
    torch.testing.assert_close(bound(x, w), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w)


def test_a_directory_that_cannot_be_read_means_no_disk_cache(tmp_path, monkeypatch):
    """Permissions that deny reading the directory or its database: one warning, no disk cache,
    never a PermissionError from the first lookup (root ignores permission bits: os.access is
    made to answer as for another user)."""
    directory = tmp_path / "c"
    DiskCache(directory).put("rms_norm:x", record())
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if mode & os.R_OK else real(path, mode))
    cache = DiskCache(directory)
    with pytest.warns(CacheWarning, match="cannot read the kernel cache"):
        assert cache.get("rms_norm:x") is None
    assert cache.keys() == [] and not cache.writable
