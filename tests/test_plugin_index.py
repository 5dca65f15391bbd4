"""Kernel plugins loaded on first use: the index of what each provides, and when it is not trusted."""

import json
import os
import shutil
from pathlib import Path

import pytest
from isolated import run_json

# Every test starts two to five fresh interpreters.
pytestmark = pytest.mark.slow

REPORT = """
import json, sys, warnings
import torch
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import dlcore
    from dlcore.errors import UnknownOpError
    from dlcore.plugins.registry import registry
    x, w = torch.randn(4, 64), torch.randn(64)
    impls = sorted(i.name for i in registry().implementations_of("rms_norm"))
    y = dlcore.get_op("rms_norm", (x, w))(x, w)
    err = (y - x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w).abs().max().item()
    status = {r.id: r.status for r in registry().plugins.records if r.group == "dlcore.kernels"}
    modules = sorted(m for m in sys.modules if m.startswith(("dlblas_kernels.", "dlc_thirdparty_demo.")))
    try:
        dlcore.get_op("sofcap", (x, 1.0))
        unknown = ""
    except UnknownOpError as exc:
        unknown = str(exc)
    everything = sorted(registry().ops)
print(json.dumps({"impls": impls, "err": err, "status": status, "modules": modules, "unknown": unknown,
                  "ops": everything, "warnings": [str(w.message) for w in caught]}))
"""


def _index(cache: Path) -> dict:
    files = list((cache / "plugins").glob("kernels-*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


def test_a_second_process_loads_only_the_plugins_of_the_op_it_asks_for(plugin_site, tmp_path):
    cache = tmp_path / "cache"
    first = run_json(REPORT, plugin_site, DLCORE_CACHE_DIR=str(cache))
    assert first["status"]["dlcore.kernels:ffn"] == "loaded"  # nothing known yet: everything loads
    plugins = _index(cache)["plugins"]
    assert plugins["dlcore.kernels:rms_norm"]["ops"] == ["rms_norm"] and not plugins["dlcore.kernels:rms_norm"]["eager"]
    assert plugins["dlcore.kernels:thirdparty_rms_norm"]["ops"] == ["rms_norm"]
    assert plugins["dlcore.kernels:softcap"]["ops"] == ["softcap"]
    # a plugin that failed, or implements a hook the index cannot stand in for, is loaded every time
    for broken in ("raises_on_import", "unknown_hook", "raising_hook"):
        assert plugins.get(f"dlcore.kernels:{broken}", {"eager": True})["eager"], broken

    second = run_json(REPORT, plugin_site, DLCORE_CACHE_DIR=str(cache))
    # both providers of rms_norm, the built-in and the third-party one, and nothing else
    assert second["impls"] == first["impls"] == ["chunked", "reference", "triton"]
    assert second["err"] < 1e-4
    # rms_norm's module and the helper it sizes its npu tiles by: no other kernel module
    kernels = ["dlblas_kernels.blocks", "dlblas_kernels.blocks.npu", "dlblas_kernels.kernels",
               "dlblas_kernels.kernels.rms_norm"]
    assert second["modules"] == [*kernels, "dlc_thirdparty_demo.rms_norm"]
    for name in ("ffn", "silu_and_mul", "matmul", "softcap"):
        assert second["status"][f"dlcore.kernels:{name}"] == "deferred", name
    # what deferred plugins provide still counts: close names, and every op once listed
    assert "softcap" in second["unknown"]
    assert second["ops"] == first["ops"] and {"ffn", "softcap", "rms_norm"} <= set(second["ops"])
    # the broken plugins are still reported, once each, in every process
    for name in ("raises_on_import", "unknown_hook", "raising_hook"):
        assert sum(name in w for w in second["warnings"]) == 1, (name, second["warnings"])


def test_an_edited_plugin_is_loaded_and_learnt_again(plugin_site, tmp_path):
    site = tmp_path / "site"
    shutil.copytree(plugin_site, site)
    cache = tmp_path / "cache"
    run_json(REPORT, site, DLCORE_CACHE_DIR=str(cache))
    softcap = site / "dlc_thirdparty_demo" / "softcap.py"
    # the edit: softcap now also implements rms_norm (appended after the existing hooks)
    softcap.write_text(softcap.read_text() + '''

from dlcore import hookimpl
from dlcore.declarations.implementation import TorchImplementation


def _norm(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@hookimpl(specname="dlcore_implementations")
def more_implementations():
    return [TorchImplementation("rms_norm", "softcap_norm", _norm)]
''')
    stat = softcap.stat()
    os.utime(softcap, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    result = run_json(REPORT, site, DLCORE_CACHE_DIR=str(cache))
    assert "softcap_norm" in result["impls"], (result["status"], result["warnings"])
    assert result["status"]["dlcore.kernels:softcap"] == "loaded"
    assert sorted(_index(cache)["plugins"]["dlcore.kernels:softcap"]["ops"]) == ["rms_norm", "softcap"]


def test_an_unreadable_index_is_ignored(plugin_site, tmp_path):
    cache = tmp_path / "cache"
    first = run_json(REPORT, plugin_site, DLCORE_CACHE_DIR=str(cache))
    index = next((cache / "plugins").glob("kernels-*.json"))
    learnt = json.loads(index.read_text())
    ops_as_text = {**learnt, "plugins": {pid: {**e, "ops": ",".join(e["ops"])} for pid, e in learnt["plugins"].items()}}
    for damage in ("{not json", json.dumps({"schema": 1, "plugins": {"dlcore.kernels:ffn": {"value": 3}}}),
                   json.dumps([1, 2]), json.dumps(ops_as_text)):
        index.write_text(damage)
        result = run_json(REPORT, plugin_site, DLCORE_CACHE_DIR=str(cache))
        assert result["impls"] == first["impls"] and result["ops"] == first["ops"]
        assert result["status"]["dlcore.kernels:ffn"] == "loaded"  # unknown again: loaded, and learnt anew
        assert _index(cache)["plugins"]["dlcore.kernels:ffn"]["ops"] == ["ffn"]


def test_an_entry_of_the_wrong_types_is_not_trusted():
    from dlcore.plugins.index import Entry

    good = {"value": "m:p", "ops": ["rms_norm"], "eager": False, "root": "/r", "stamp": "s"}
    assert Entry.from_json(good) == Entry("m:p", ["rms_norm"], False, "/r", "s")
    for field, wrong in (("ops", "rms_norm"), ("ops", [1]), ("eager", "no"), ("value", 3), ("root", None)):
        assert Entry.from_json({**good, field: wrong}) is None, field
    assert Entry.from_json(["m:p"]) is None


def test_an_index_that_leaves_out_an_op_does_not_hide_it(plugin_site, tmp_path):
    """An entry edited (or gone stale) to list none of the ops its plugin provides: the op is not
    called unknown; every plugin is loaded before that is said."""
    cache = tmp_path / "cache"
    run_json(REPORT, plugin_site, DLCORE_CACHE_DIR=str(cache))
    index = next((cache / "plugins").glob("kernels-*.json"))
    learnt = json.loads(index.read_text())
    learnt["plugins"]["dlcore.kernels:rms_norm"]["ops"] = []
    index.write_text(json.dumps(learnt))
    result = run_json(REPORT, plugin_site, DLCORE_CACHE_DIR=str(cache))
    assert result["err"] < 1e-4 and result["status"]["dlcore.kernels:rms_norm"] == "loaded", result
    assert "unknown op 'sofcap'" in result["unknown"]
