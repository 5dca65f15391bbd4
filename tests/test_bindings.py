"""Bindings remembered between processes: a new process recalls what an earlier one bound, without
plugin discovery, and only while nothing it was made from has changed."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from isolated import run_json

import dlcore
from dlcore import bindings
from dlcore.signature import Signature, make_signature

# the broken test plugins are disabled: a plugin that fails to load keeps every process on the full path
BROKEN = "raises_on_import,unknown_hook,raising_hook,steals_cpu"

REPORT = """
import json, sys, torch
import dlcore
torch.manual_seed(0)
x = torch.randn(7, 80, device="{device}", dtype=torch.float16)[:, :72]  # rows 80 apart
w = torch.randn(72, device="{device}", dtype=torch.float16)
op = dlcore.get_op("rms_norm", (x, w))
watched = ("dlcore.dispatch", "dlcore.registry", "stevedore", "diskcache", "dlblas_kernels.rms_norm")
before = sorted(m for m in watched if m in sys.modules)
y = op(x, w, *{extra})  # the first call: with eps or without, both restore the op
after = sorted(m for m in watched if m in sys.modules)
xd = x.double()
expected = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
print(json.dumps({{"kind": type(op).__name__, "before": before, "after": after,
                  "err": (y.double() - expected).abs().max().item(), "impl": op.impl.name, "config": op.config,
                  "how": op.selection.how, "key": op.cache_key}}))
"""


@pytest.fixture
def site(plugin_site, tmp_path):
    """The test plugins, in a copy this test may edit."""
    copy = tmp_path / "site"
    shutil.copytree(plugin_site, copy)
    return copy


def _run(site, cache, device, extra="()", **env):
    return run_json(REPORT.format(device=device, extra=extra), site, DLCORE_CACHE_DIR=str(cache),
                    DLCORE_DISABLE_PLUGINS=BROKEN, **env)


def _file(cache) -> tuple:
    """The one binding file under ``cache``, and its binding."""
    (path,) = (cache / "bindings").glob("*/*.json")
    return path, json.loads(path.read_text())


def _until_recalled(site, cache, device):
    """Processes until one recalls; the first measures (rms_norm has two candidates here), which
    changes the selections on disk, so only the second one's binding is trusted."""
    first = _run(site, cache, device)
    assert first["kind"] == "BoundOp" and first["how"] == "measured", first
    second = _run(site, cache, device)
    assert second["kind"] == "BoundOp" and second["how"] == "measured" and second["key"] == first["key"]
    third = _run(site, cache, device)
    assert third["kind"] == "RecalledOp", third
    return second, third


def test_a_new_process_recalls_the_binding_without_discovery(site, tmp_path, kernel_device):
    cache = tmp_path / "cache"
    full, recalled = _until_recalled(site, cache, kernel_device)
    with_eps = _run(site, cache, kernel_device, extra="(1e-6,)")
    assert with_eps["kind"] == "RecalledOp" and with_eps["after"] == recalled["after"] and with_eps["err"] < 2e-2
    assert recalled["before"] == []  # get_op imported none of them
    # its first call imported the kernel's module and no more: no registry, no stevedore, no sqlite
    assert not {"dlcore.dispatch", "dlcore.registry", "stevedore", "diskcache"} & set(recalled["after"])
    assert (recalled["impl"], recalled["config"], recalled["how"], recalled["key"]) == \
        (full["impl"], full["config"], full["how"], full["key"])
    assert recalled["err"] < 2e-2 and full["err"] < 2e-2
    path, data = _file(cache)
    record = data["binding"]
    assert record["op"] == "rms_norm" and record["environ"]["DLCORE_DISABLE_PLUGINS"] == BROKEN
    assert any("dlc_thirdparty_demo" in root for root in record["roots"])  # the other candidate's code


def test_a_changed_cache_environment_device_or_plugin_retires_the_binding(site, tmp_path, kernel_device):
    cache = tmp_path / "cache"
    _until_recalled(site, cache, kernel_device)
    path, data = _file(cache)

    # other variables a selection depends on: the full path
    assert _run(site, cache, kernel_device, DLCORE_TUNE_CHECK="all")["kind"] == "BoundOp"
    # another device model behind the same name
    other = json.loads(json.dumps(data))
    other["binding"]["device"] = "another model (9, 9)"
    path.write_text(json.dumps(other))
    assert _run(site, cache, kernel_device)["kind"] == "BoundOp"
    assert _run(site, cache, kernel_device)["kind"] == "RecalledOp"  # the full path wrote it anew

    # an edit to any plugin the op's candidates come from
    softcap = site / "dlc_thirdparty_demo" / "softcap.py"
    softcap.write_text(softcap.read_text() + "\n# edited\n")
    assert _run(site, cache, kernel_device)["kind"] == "BoundOp"
    assert _run(site, cache, kernel_device)["kind"] == "RecalledOp"

    # the selections on disk change: `dlcore cache clear`
    env = {**os.environ, "DLCORE_CACHE_DIR": str(cache)}
    subprocess.run([sys.executable, "-m", "dlcore.cli", "cache", "clear"], check=True, env=env, capture_output=True)
    assert _run(site, cache, kernel_device)["kind"] == "BoundOp"


def test_a_damaged_file_is_ignored_and_rewritten(site, tmp_path, kernel_device):
    cache = tmp_path / "cache"
    full, _ = _until_recalled(site, cache, kernel_device)
    path, data = _file(cache)
    for damage in ("{not json", json.dumps([1]), json.dumps({**data, "binding": {"device": 3}}),
                   json.dumps({**data, "key": "another key"})):
        path.write_text(damage)
        result = _run(site, cache, kernel_device)
        assert result["kind"] == "BoundOp" and result["err"] < 2e-2
        assert _run(site, cache, kernel_device)["kind"] == "RecalledOp"


def test_a_binding_that_no_longer_restores_takes_the_full_path(site, tmp_path, kernel_device):
    cache = tmp_path / "cache"
    full, _ = _until_recalled(site, cache, kernel_device)
    path, data = _file(cache)
    record = data["binding"]
    for plugin in ({"plugin": record["plugins"]["op"]["plugin"], "value": "json"},  # no such hook there
                   {**record["plugins"]["op"], "value": "dlc_thirdparty_demo.softcap"}):  # no rms_norm there
        record["plugins"]["op"] = plugin
        path.write_text(json.dumps(data))
        result = _run(site, cache, kernel_device)
        assert result["kind"] == "RecalledOp" and "dlcore.dispatch" in result["after"]
        assert (result["impl"], result["config"]) == (full["impl"], full["config"]) and result["err"] < 2e-2
        _, data = _file(cache)  # replaced by what the full path bound
        record = data["binding"]
        assert record["plugins"]["op"]["value"] == "dlblas_kernels.rms_norm"


def test_a_plugin_that_fails_to_load_keeps_every_process_on_the_full_path(plugin_site, tmp_path, kernel_device):
    cache = tmp_path / "cache"
    for _ in range(3):
        result = run_json(REPORT.format(device=kernel_device, extra="()"), plugin_site, DLCORE_CACHE_DIR=str(cache))
        assert result["kind"] == "BoundOp"
    assert not (cache / "bindings").exists()


def test_signatures_keep_through_json(kernel_device):
    x = torch.randn(5, 3, 8, device=kernel_device).transpose(0, 1)
    w = torch.randn(8, device=kernel_device)
    from dlcore.registry import registry

    op = registry().op("rms_norm")
    signature = make_signature(op, (x, w, 1e-5), x.device)
    assert Signature.from_json(json.loads(json.dumps(signature.to_json()))) == signature
    with pytest.raises(ValueError):
        Signature.from_json({**signature.to_json(), "tensors": [["x", "not_a_dtype", [1], "contiguous", True]]})


def test_the_exact_key_tells_apart_what_validation_depends_on():
    x = torch.randn(4, 8)
    key = bindings.exact_key("rms_norm", (x, torch.ones(8)), None)
    assert key == bindings.exact_key("rms_norm", (torch.randn(4, 8), torch.ones(8)), None)
    for other in ((x.t().contiguous().t(), torch.ones(8)), (x.half(), torch.ones(8)), (x[:, :4], torch.ones(4)),
                  (x[1:], torch.ones(8))):
        assert bindings.exact_key("rms_norm", other, None) != key
    assert bindings.exact_key("rms_norm", (x,), {"weight": torch.ones(8)}) is None
    assert bindings.exact_key("rms_norm", (x, [1, 2]), None) is None


def test_in_process_the_full_path_notes_what_it_bound(kernel_device):
    x, w = torch.randn(3, 16, device=kernel_device), torch.randn(16, device=kernel_device)
    op = dlcore.get_op("rms_norm", (x, w))
    store = bindings.store()
    (record,) = store.added.values()
    store_keys = list(store.added)
    assert record["impl"] == op.impl.name and record["cache_key"] == op.cache_key
    bindings.flush()
    path, data = _file(store.directory)
    assert data["binding"] == record and data["key"] == next(iter(store_keys))


def test_a_binding_keeps_the_generation_its_choice_was_made_under(kernel_device):
    """A second exact input of an already bound signature takes the choice in memory: its binding
    must not claim a newer generation of the selections than the one that choice was made under."""
    from dlcore.cachedir import generation, new_generation

    w = torch.randn(16, device=kernel_device)
    first = dlcore.get_op("rms_norm", (torch.randn(3, 16, device=kernel_device), w))
    directory = bindings.store().directory
    made_under = generation(directory)
    new_generation(directory)  # another process stores a selection
    second = dlcore.get_op("rms_norm", (torch.randn(4, 16, device=kernel_device), w))  # same bucket
    assert second is first
    assert {r["generation"] for r in bindings.store().added.values()} == {made_under}


def test_a_choice_kept_in_memory_is_bound_under_the_generation_it_was_made_under(kernel_device):
    """A call that misses the bound ops in memory but finds the selection this process made: its
    binding too must carry the generation the disk had when that choice was made."""
    from dlcore.cachedir import generation, new_generation

    x, w = torch.randn(3, 16, device=kernel_device), torch.randn(16, device=kernel_device)
    dlcore.get_op("rms_norm", (x, w))
    directory = bindings.store().directory
    made_under = generation(directory)
    new_generation(directory)
    dlcore.dispatch._bound.clear()  # as if bound for other options: only the selection is in memory
    dlcore.get_op("rms_norm", (torch.randn(4, 16, device=kernel_device), w))
    assert len(bindings.store().added) == 2
    assert {r["generation"] for r in bindings.store().added.values()} == {made_under}


def test_at_most_limit_bindings_are_kept_the_newest(monkeypatch):
    from dlcore.cachedir import generation

    monkeypatch.setattr(bindings, "LIMIT", 2)
    store = bindings.store()
    for i in range(3):
        store.add(f"key {i}", {"generation": generation(store.directory), "n": i})
        bindings.flush()
        time.sleep(0.05)  # distinct modification times, whatever the file system's granularity
    kept = sorted(json.loads(p.read_text())["binding"]["n"] for p in (store.directory / "bindings").glob("*/*.json"))
    assert kept == [1, 2]
    assert store.read("key 2") == {"generation": generation(store.directory), "n": 2}
    assert store.read("key 0") is None
