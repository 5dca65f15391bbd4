"""The disk cache: round trip, keys, safety against tampering, concurrency, export/import, recovery."""

import dataclasses
import importlib
import json
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
from dlcore.dispatch.key import Key
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


def test_export_import_round_trip(tmp_path):
    source = DiskCache(tmp_path / "a")
    for i in range(3):
        source.put(f"rms_norm:{i}", record(BLOCK_N=2**i))
    assert source.export(tmp_path / "tuned.json") == 3
    target = DiskCache(tmp_path / "b")
    assert target.import_(tmp_path / "tuned.json") == (3, 0)
    assert dict(target.items()) == dict(source.items())


def test_import_rejects_bad_entries(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"format": "dlcore-cache", "entries": {"a": record(), "b": {"selection": 3}}}))
    assert DiskCache(tmp_path / "c").import_(path) == (1, 1)
    for text in ("[1, 2]", "not json"):
        path.write_text(text)
        with pytest.raises(CacheFileError, match="not a dlcore cache export"):
            DiskCache(tmp_path / "c").import_(path)


def test_a_corrupt_database_is_set_aside_and_rebuilt(tmp_path):
    directory = tmp_path / "c"
    DiskCache(directory).put("rms_norm:x", record())
    (directory / "cache.db").write_bytes(b"this is not a sqlite database" * 100)
    cache = DiskCache(directory)
    with pytest.warns(CacheWarning, match="moved it to"):
        assert cache.get("rms_norm:x") is None
    cache.put("rms_norm:y", record())
    assert cache.get("rms_norm:y") is not None
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("c.corrupt-")]


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
    """add_rms_norm's plan launches rms_norm's backward kernels: editing rms_norm must change its key."""
    add_rms_norm = importlib.import_module("dlblas_kernels.kernels.add_rms_norm")
    modules = [m.__name__ for m in source_modules(add_rms_norm.plan)]
    assert modules == ["dlblas_kernels.kernels.add_rms_norm", "dlblas_kernels.kernels.rms_norm"]
    # The implementation's hash covers the same modules (its plan carries the kernel module's name).
    assert [m.__name__ for m in source_modules(add_rms_norm.KERNEL.implementation.plan)] == modules
