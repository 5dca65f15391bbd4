"""The Dispatcher as an object: injectable registry and store, one key for everything that changes a choice."""

from __future__ import annotations

import torch

import dlcore
from dlcore.declarations.implementation import TorchImplementation
from dlcore.declarations.op import Op, TensorArg
from dlcore.dispatch.dispatcher import Dispatcher
from dlcore.plugins.discovery import PluginRecord, PluginStatus, discover
from dlcore.plugins.registry import Registry
from dlcore.tuning.selection import How


class DoublePlugin:
    """An op with two torch implementations, so that selecting measures (and stores) a choice."""

    @dlcore.hookimpl
    def dlcore_ops(self):
        return [Op("double", args=(TensorArg("x", (torch.float32,)),), reference=lambda x: x * 2)]

    @dlcore.hookimpl
    def dlcore_implementations(self):
        return [TorchImplementation("double", "add", lambda x: x + x),
                TorchImplementation("double", "mul", lambda x: x * 2)]


def registry_with_double() -> Registry:
    found = discover()
    record = PluginRecord("dlcore.kernels", "double", "tests")
    record.status = PluginStatus.LOADED
    found.records.append(record)
    found.manager.register(DoublePlugin(), name=record.id)
    return Registry(found)


def test_a_dispatcher_takes_its_registry_and_store(tmp_path):
    reg = registry_with_double()
    x = torch.randn(16)
    first = Dispatcher(lambda: reg, tmp_path / "a")
    bound = first.get_op("double", (x,))
    assert bound.selection.how is How.MEASURED
    torch.testing.assert_close(bound(x), x * 2)
    # the same store in another dispatcher: read back, not measured again
    again = Dispatcher(lambda: reg, tmp_path / "a").get_op("double", (x,))
    assert again.selection == bound.selection and again is not bound
    # another store: nothing there
    assert Dispatcher(lambda: reg, tmp_path / "b").store.get(bound.cache_key) is None
    # the process's own registry never heard of the op
    assert "double" not in dlcore.plugins.registry.registry().ops


def test_the_memo_sees_a_change_of_the_pass_variables(monkeypatch):
    x = torch.randn(64, 96)
    dispatcher = Dispatcher()
    plain = dispatcher.get_op("silu_and_mul", (x,))
    assert dispatcher.get_op("silu_and_mul", (x,)) is plain
    monkeypatch.setenv("DLCORE_ENABLE_PASSES", "grid_folding")
    folded = dispatcher.get_op("silu_and_mul", (x,))
    assert folded is not plain and folded.cache_key != plain.cache_key
    torch.testing.assert_close(folded(x), plain(x), rtol=0, atol=0)
    monkeypatch.delenv("DLCORE_ENABLE_PASSES")
    assert dispatcher.get_op("silu_and_mul", (x,)) is plain


def test_clear_forgets_the_choices_of_this_process_only(tmp_path):
    reg = registry_with_double()
    x = torch.randn(8)
    dispatcher = Dispatcher(lambda: reg, tmp_path)
    bound = dispatcher.get_op("double", (x,))
    dispatcher.clear()
    again = dispatcher.get_op("double", (x,))
    assert again is not bound and again.selection == bound.selection  # from the disk store


def test_a_triton_implementation_checks_its_callables_as_it_is_declared():
    """A TritonImplementation's plan and space take the device profile, as define_kernel's do: a
    plugin that leaves it out is told so when it declares, naming the implementation and the
    callable, rather than every selection of the op failing later."""
    import pytest

    from dlcore.declarations.implementation import TritonImplementation
    from dlcore.declarations.space import PowerOfTwo, SearchSpace
    from dlcore.errors import DeclarationError

    def plan(args, config, profile):
        raise AssertionError("not called")

    def default_config(signature, profile):
        return {}

    ok = TritonImplementation("softcap", "t", plan=plan, kernels=(), default_config=default_config,
                              space=lambda profile: SearchSpace([PowerOfTwo("BLOCK", 16, 64)]))
    assert ok.space() is not None
    with pytest.raises(DeclarationError, match=r"softcap.t: space is called as space\(profile\)"):
        TritonImplementation("softcap", "t", plan=plan, kernels=(), default_config=default_config,
                             space=lambda: SearchSpace([PowerOfTwo("BLOCK", 16, 64)]))
    with pytest.raises(DeclarationError,
                       match=r"plan is called as plan\(args, config, profile\).*its third argument"):
        TritonImplementation("softcap", "t", plan=lambda args, config: None, kernels=(),
                             default_config=default_config)
