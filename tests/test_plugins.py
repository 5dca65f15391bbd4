"""Plugin discovery: built-ins through entry points, third-party plugins, broken plugins, selection by env."""

import pytest
from isolated import run_json, run_python

from dlcore.plugins.registry import registry

REPORT_RECORDS = """
import json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from dlcore.plugins.registry import registry
    reg = registry()
    registry()
records = {r.id: [r.status, r.error, r.distribution, r.empty] for r in reg.plugins.records}
from dlcore.plugins.discovery import unread_groups
print(json.dumps({"records": records, "warnings": [str(w.message) for w in caught],
                  "ops": sorted(reg.ops), "backends": sorted(reg.backends), "unread": unread_groups()}))
"""


def test_builtins_arrive_through_entry_points():
    reg = registry()
    status = {r.id: (r.status, r.distribution) for r in reg.plugins.records}
    assert status["dlcore.backends:cpu"] == ("loaded", "dlc-core")
    for name in ("grid", "random", "tpe"):
        assert status[f"dlcore.strategies:{name}"] == ("loaded", "dlc-core")
    assert status["dlcore.backends:cuda"] == ("loaded", "dlc-cuda")
    assert status["dlcore.backends:npu"] == ("loaded", "dlc-ascend")
    assert status["dlcore.backends:mlu"] == ("loaded", "dlc-mlu")
    for kernel in ("silu_and_mul", "rms_norm", "ffn", "vendor_matmul", "vendor_ffn"):
        assert status[f"dlcore.kernels:{kernel}"] == ("loaded", "dlblas-kernels")
    assert {"cpu", "cuda", "npu", "mlu"} <= set(reg.backends)
    assert {"grid", "random", "tpe"} <= set(reg.strategies)
    assert {"silu_and_mul", "rms_norm", "ffn"} <= set(reg.ops)


@pytest.mark.slow
def test_third_party_plugin_adds_an_implementation_and_an_op(plugin_site):
    result = run_json("""
import json, torch, dlcore
from dlcore.plugins.registry import registry
g = torch.Generator().manual_seed(1)
x, w = torch.randn(16, 300, generator=g), torch.randn(300, generator=g)
op = dlcore.get_op("rms_norm", (x, w))
ref = registry().op("rms_norm").reference(x.double(), w.double())
forced = dlcore.get_op("rms_norm", (x, w), impl="chunked")
s = (torch.randn(300, generator=g) * 50)
softcap = dlcore.get_op("softcap", (s, 30.0))
print(json.dumps({
    "impls": [i.name for i in registry().implementations_of("rms_norm")],
    "plugins": {i.name: i.plugin for i in registry().implementations_of("rms_norm")},
    "chosen": op.impl.name, "how": op.selection.how, "measured": op.selection.measured,
    "chosen_err": (op(x, w).double() - ref).abs().max().item(),
    "forced": forced.impl.name, "forced_err": (forced(x, w).double() - ref).abs().max().item(),
    "softcap_impl": softcap.impl.name,
    "softcap_err": (softcap(s, 30.0).double() - 30.0 * torch.tanh(s.double() / 30.0)).abs().max().item(),
}))
""", plugin_site)
    assert sorted(result["impls"]) == ["chunked", "reference", "triton"]
    assert result["plugins"]["chunked"] == "dlcore.kernels:thirdparty_rms_norm"
    # two dedicated candidates: both measured on cloned inputs, the faster one chosen
    assert result["how"] == "measured"
    assert set(result["measured"]) == {"triton", "chunked"}
    assert result["chosen"] == min(result["measured"], key=result["measured"].get)
    assert result["chosen"] == "triton", "the chunked implementation is slow by design"
    assert result["chosen_err"] < 1e-4 and result["forced_err"] < 1e-4
    assert result["forced"] == "chunked"
    assert result["softcap_impl"] == "triton"
    assert result["softcap_err"] < 1e-4


def test_broken_plugins_are_isolated_and_reported(plugin_site):
    result = run_json(REPORT_RECORDS, plugin_site)
    records = result["records"]
    assert records["dlcore.kernels:raises_on_import"][0] == "failed"
    assert "ImportError: this plugin needs a library" in records["dlcore.kernels:raises_on_import"][1]
    assert records["dlcore.kernels:unknown_hook"][0] == "rejected"
    assert "dlcore_kernelz" in records["dlcore.kernels:unknown_hook"][1]
    assert records["dlcore.kernels:raising_hook"][0] == "failed"
    assert "declaring ops failed" in records["dlcore.kernels:raising_hook"][1]
    assert records["dlcore.backends:steals_cpu"][0] == "failed"
    assert "already owned by cpu" in records["dlcore.backends:steals_cpu"][1]
    assert records["dlcore.kernels:raises_on_import"][2] == "dlc-broken-demo"
    # a module without hook functions loads, and is marked as providing nothing
    assert records["dlcore.kernels:provides_nothing"][0] == "loaded" and records["dlcore.kernels:provides_nothing"][3]
    assert not any(r[3] for name, r in records.items() if name != "dlcore.kernels:provides_nothing")
    # an entry point in a misspelt group is never loaded: `dlcore plugins` names it and the group meant
    assert result["unread"] == ["dlcore.kernel: misspelt_group = dlc_broken_demo.provides_nothing "
                                "(dlc-broken-demo); did you mean dlcore.kernels?"]
    # everything else works
    assert {"rms_norm", "ffn", "silu_and_mul", "softcap"} <= set(result["ops"])
    assert "impostor" not in result["backends"]
    # each failure warned about once, even though the registry was asked twice
    broken = ["raises_on_import", "unknown_hook", "raising_hook", "steals_cpu"]
    for name in broken:
        assert sum(name in w for w in result["warnings"]) == 1, (name, result["warnings"])


@pytest.mark.slow
def test_broken_plugin_does_not_stop_get_op(plugin_site):
    result = run_json("""
import json, torch, dlcore
x = torch.randn(5, 64)
out = dlcore.get_op("silu_and_mul", (x,))(x)
ref = torch.nn.functional.silu(x[:, :32]) * x[:, 32:]
print(json.dumps({"err": (out - ref).abs().max().item()}))
""", plugin_site)
    assert result["err"] < 1e-5


@pytest.mark.slow
def test_cli_shows_the_load_errors(plugin_site):
    done = run_python("import sys; from dlcore.cli import main; sys.exit(main(['plugins', '-v']))", plugin_site)
    assert done.returncode == 0, done.stderr
    assert "raises_on_import" in done.stdout and "ImportError" in done.stdout
    assert "Traceback" in done.stdout
    assert "dlc-broken-demo" in done.stdout


@pytest.mark.slow
def test_disable_plugins(plugin_site):
    result = run_json(REPORT_RECORDS, plugin_site,
                      DLCORE_DISABLE_PLUGINS="raises_on_import,dlcore.kernels:unknown_hook,raising_hook,steals_cpu,ffn")
    records = result["records"]
    for name in ("dlcore.kernels:raises_on_import", "dlcore.kernels:unknown_hook", "dlcore.kernels:ffn"):
        assert records[name][0] == "disabled"
    assert result["warnings"] == []
    assert "ffn" not in result["ops"] and "rms_norm" in result["ops"]


@pytest.mark.slow
def test_only_the_named_plugins_load(plugin_site):
    result = run_json(REPORT_RECORDS, plugin_site, DLCORE_PLUGINS="softcap")
    records = result["records"]
    assert records["dlcore.kernels:softcap"][0] == "loaded"
    assert records["dlcore.kernels:rms_norm"][0] == "disabled"
    assert records["dlcore.backends:cuda"][0] == "disabled"
    # dlcore's own built-ins stay
    assert records["dlcore.backends:cpu"][0] == "loaded"
    assert result["ops"] == ["softcap"]


UNKNOWN_OP = """
import json
import torch
import dlcore
from dlcore.errors import UnknownOpError
try:
    dlcore.get_op("ffn", (torch.randn(2, 8),))
except UnknownOpError as exc:
    print(json.dumps({"message": str(exc), "disabled": exc.disabled}))
"""


@pytest.mark.slow
def test_an_op_of_a_disabled_plugin_says_by_what(plugin_site):
    result = run_json(UNKNOWN_OP, plugin_site, DLCORE_DISABLE_PLUGINS="ffn")
    assert "dlcore.kernels:ffn (dlblas-kernels), installed but disabled by DLCORE_DISABLE_PLUGINS=ffn" in \
        result["message"], result
    assert "Did you mean" not in result["message"]
    result = run_json(UNKNOWN_OP, plugin_site, DLCORE_PLUGINS="softcap")
    assert "left out: DLCORE_PLUGINS=softcap does not name it" in result["message"], result


FAILED_OP = """
import json
import torch
import dlcore
from dlcore.errors import UnknownOpError
messages = {}
for name in ("raises_on_import", "provides_nothing"):
    try:
        dlcore.get_op(name, (torch.randn(2, 8),))
    except UnknownOpError as exc:
        messages[name] = str(exc)
print(json.dumps(messages))
"""


@pytest.mark.slow
def test_an_op_of_a_plugin_that_failed_to_load_says_why(plugin_site):
    """The entry point named after the op failed to import, or loaded without hook functions: the
    error says so, and why, rather than that the op is unknown."""
    messages = run_json(FAILED_OP, plugin_site)
    message = messages["raises_on_import"]
    assert "dlcore.kernels:raises_on_import" in message and "installed but it failed to load: ImportError: " \
        "this plugin needs a library" in message, message
    assert "`dlcore plugins` shows the traceback" in message
    assert "loaded but it provides nothing: dlc_broken_demo.provides_nothing defines no dlcore_* hook" in \
        messages["provides_nothing"], messages


@pytest.mark.slow
def test_a_named_plugin_that_fails_raises(plugin_site):
    done = run_python("from dlcore.plugins.registry import registry; registry()", plugin_site,
                      DLCORE_PLUGINS="raises_on_import")
    assert done.returncode != 0
    assert "PluginLoadError" in done.stderr and "raises_on_import" in done.stderr
    done = run_python("from dlcore.plugins.registry import registry; registry()", plugin_site,
                      DLCORE_PLUGINS="no_such_plugin")
    assert "PluginLoadError" in done.stderr and "no_such_plugin" in done.stderr


@pytest.mark.slow
def test_nothing_is_discovered_or_probed_at_import():
    result = run_json("""
import json, sys
import dlcore, dlcore.dispatch.dispatcher, dlcore.plugins.registry
print(json.dumps({"registry": dlcore.plugins.registry._registry is not None,
                  "vendor": [m for m in ("torch_npu", "torch_mlu", "dlc_cuda", "dlblas_kernels") if m in sys.modules]}))
""")
    assert result == {"registry": False, "vendor": []}


CLASH = """
import json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch, dlcore
    from dlcore.plugins.registry import registry
    reg = registry()
    x, w = torch.randn(4, 64), torch.randn(64)
    silu = dlcore.get_op("silu_and_mul", (torch.randn(4, 64),))
    forced = dlcore.get_op("rms_norm", (x, w), impl="clash_torch")
    err = (forced(x, w) - reg.op("rms_norm").reference(x, w)).abs().max().item()
    impls = sorted(i.name for i in reg.implementations_of("rms_norm"))
records = {r.id: [str(r.status), r.distribution, r.clashes] for r in reg.plugins.records if r.name == "rms_norm"}
print(json.dumps({"records": records, "impls": impls, "err": err,
                  "warnings": [str(w.message) for w in caught if "is used by" in str(w.message)]}))
"""


@pytest.mark.slow
def test_an_entry_point_name_clash_is_isolated_and_reported(clash_site):
    result = run_json(CLASH, clash_site)
    records = result["records"]
    assert set(records) == {"dlcore.kernels:rms_norm@dlblas-kernels", "dlcore.kernels:rms_norm@dlc-clash-demo"}
    assert all(status == "loaded" for status, _, _ in records.values())
    assert "dlblas-kernels" in records["dlcore.kernels:rms_norm@dlc-clash-demo"][2][0]
    assert "dlc-clash-demo" in records["dlcore.kernels:rms_norm@dlblas-kernels"][2][0]
    assert {"triton", "clash_torch"} <= set(result["impls"]) and result["err"] < 1e-5
    [warning] = result["warnings"]
    assert "dlblas-kernels" in warning and "dlc-clash-demo" in warning and "rename" in warning


@pytest.mark.slow
def test_a_clashing_plugin_can_be_disabled_alone(clash_site):
    done = run_python("import sys; from dlcore.cli import main; sys.exit(main(['plugins']))", clash_site,
                      DLCORE_DISABLE_PLUGINS="dlcore.kernels:rms_norm@dlc-clash-demo")
    assert done.returncode == 0, done.stderr
    rows = {line.split()[2]: line for line in done.stdout.splitlines() if " rms_norm " in line}
    assert "loaded" in rows["dlblas-kernels"] and "disabled" in rows["dlc-clash-demo"]
    assert "name also used by dlc-clash-demo" in rows["dlblas-kernels"]


GUIDE_EXAMPLE = """
import contextlib, io, json, torch, dlcore
from dlcore.cli import main
from dlc_thirdparty_demo.softcap import softcap
g = torch.Generator().manual_seed(0)
x = (torch.randn(8, 300, generator=g) * 40).requires_grad_()
bound = dlcore.get_op("softcap", (x, 30.0))
y = bound(x, 30.0)
(dx,) = torch.autograd.grad(y.sum(), x)
(dx_fn,) = torch.autograd.grad(softcap(x, 30.0).sum(), x)
expected = 1 - torch.tanh(x.detach() / 30.0) ** 2
out = {"grad_err": (dx - expected).abs().max().item(), "fn_grad_err": (dx_fn - expected).abs().max().item()}
for argv in (["ops", "softcap"], ["ops", "rms_norm"], ["check", "softcap"]):
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        out[" ".join(argv) + " rc"] = main(argv)
    out[" ".join(argv)] = text.getvalue()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_the_guide_s_example_plugin_works_as_documented(plugin_site):
    """docs/plugins.md's example, tests/plugins/thirdparty: a new op with its backward, example sizes
    and space, and a second rms_norm implementation with its own space and limits."""
    result = run_json(GUIDE_EXAMPLE, plugin_site)
    assert result["grad_err"] < 1e-5 and result["fn_grad_err"] < 1e-5
    softcap = result["ops softcap"]
    assert result["ops softcap rc"] == 0 and "declared by dlcore.kernels:softcap" in softcap
    assert "example sizes (--shape): tokens=37, hidden=1000" in softcap, softcap
    assert "BLOCK: a power of two in [64, 1024]" in softcap, softcap
    rms_norm = result["ops rms_norm"]
    for words in ("weight", "contiguous,rows", "chunked", "CHUNK", "dlcore.kernels:thirdparty_rms_norm"):
        assert words in rms_norm, rms_norm
    assert result["check softcap rc"] == 0 and ": OK" in result["check softcap"]
