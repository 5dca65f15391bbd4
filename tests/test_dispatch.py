"""get_op end to end: signature -> candidates -> cache -> selection -> bound op."""

import time

import dlblas_kernels
import pytest
import torch

import dlcore
import dlcore.dispatch.dispatcher
import dlcore.plugins.registry
import dlcore.runtime.launch
import dlcore.tuning.selection
from dlcore.declarations.implementation import TorchImplementation
from dlcore.declarations.op import Op, TensorArg
from dlcore.errors import BackendUnavailableError, NoKernelError, UnknownImplementationError, UnknownOpError
from dlcore.plugins.discovery import PluginRecord, PluginStatus, discover
from dlcore.plugins.registry import Registry

F32 = (torch.float16, torch.float32)


def inputs(gen, *shapes, dtype=torch.float32):
    return tuple(torch.randn(*s, generator=gen).to(dtype) for s in shapes)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def with_plugins(monkeypatch, *plugins):
    """The real plugins plus ``plugins`` (objects with hookimpls), as the process registry."""
    found = discover()
    for i, plugin in enumerate(plugins):
        record = PluginRecord("dlcore.kernels", f"test{i}", "tests")
        record.status = PluginStatus.LOADED
        found.records.append(record)
        found.manager.register(plugin, name=record.id)
    reg = Registry(found)
    monkeypatch.setattr(dlcore.plugins.registry, "_registry", reg)
    return reg


class OpsPlugin:
    def __init__(self, ops=(), impls=()):
        self.ops, self.impls = list(ops), list(impls)

    @dlcore.hookimpl
    def dlcore_ops(self):
        return self.ops

    @dlcore.hookimpl
    def dlcore_implementations(self):
        return self.impls


def double_op(fallback=True):
    return Op("double", args=(TensorArg("x", F32),), reference=lambda x: x * 2, fallback=fallback)


@pytest.mark.parametrize("name, shapes, direct", [
    ("silu_and_mul", [(3, 5, 66)], dlblas_kernels.silu_and_mul),
    ("rms_norm", [(7, 100), (100,)], dlblas_kernels.rms_norm),
    ("ffn", [(9, 48), (40, 48), (40, 48), (48,)], dlblas_kernels.ffn),
])
def test_get_op_matches_direct_use(gen, name, shapes, direct):
    args = inputs(gen, *shapes)
    op = dlcore.get_op(name, args)
    assert op.impl.name == "triton"
    assert op.selection.how == "only candidate"
    assert "fallback only" in op.selection.declined["reference"]
    torch.testing.assert_close(op(*args), direct(*args), rtol=0, atol=0)


def test_in_process_cache_returns_the_same_bound_op_per_bucket(gen):
    x33, x40, x65 = (torch.randn(n, 64, generator=gen) for n in (33, 40, 65))
    w = torch.randn(64, generator=gen)
    first = dlcore.get_op("rms_norm", (x33, w))
    assert dlcore.get_op("rms_norm", (x40, w)) is first  # 33 and 40 rows share the bucket of 64
    assert dlcore.get_op("rms_norm", (x65, w)) is not first
    torch.testing.assert_close(first(x40, w), dlblas_kernels.rms_norm(x40, w), rtol=0, atol=0)


def test_the_tokens_key_policy_keeps_the_heads(gen):
    from dlcore.declarations.signature import bucket_shape

    assert bucket_shape((2, 5, 32, 128), "tokens") == (16, 32, 128)  # 10 tokens -> 16; heads and D kept
    assert bucket_shape((5, 28, 64), "tokens") == (8, 28, 64)
    assert bucket_shape((5, 64), "tokens") == (8, 64)  # no head dimension: as rows
    assert bucket_shape((2, 5, 32, 128), "rows") == (512, 128)
    assert bucket_shape((3, 1000, 32, 128), "sequence") == (4, 1024, 32, 128)  # batch and length apart
    assert bucket_shape((1000, 128), "sequence") == (1024, 128)  # not [B, S, H, D]: as rows
    q33, q40 = (torch.randn(1, n, 4, 16, generator=gen) for n in (33, 40))
    k33, k40 = (torch.randn(1, n, 2, 16, generator=gen) for n in (33, 40))
    cos33, cos40 = (torch.randn(1, n, 16, generator=gen) for n in (33, 40))
    first = dlcore.get_op("apply_rotary_pos_emb", (q33, k33, cos33, cos33))
    assert dlcore.get_op("apply_rotary_pos_emb", (q40, k40, cos40, cos40)) is first  # 33 and 40 tokens: 64
    assert first.signature.tensor("q").shape == (64, 4, 16)
    q8 = torch.randn(1, 33, 8, 16, generator=gen)
    assert dlcore.get_op("apply_rotary_pos_emb", (q8, k33, cos33, cos33)) is not first  # other heads, other key


def test_the_exact_input_memo_is_bounded(gen, monkeypatch):
    monkeypatch.setattr(dlcore.dispatch.dispatcher, "EXACT_LIMIT", 3)
    w = torch.randn(16, generator=gen)
    first = [torch.randn(rows, 16, generator=gen) for rows in (1, 2, 3, 4, 5)]
    bound = [dlcore.get_op("rms_norm", (x, w)) for x in first]
    assert len(dlcore.dispatch.dispatcher.default()._exact) == 3
    assert dlcore.get_op("rms_norm", (first[4], w)) is bound[4]
    assert dlcore.get_op("rms_norm", (first[0], w)) is bound[0]  # recomputed: same bucket, same bound op


def test_keyword_arguments(gen):
    x, w = inputs(gen, (4, 32), (32,))
    op = dlcore.get_op("rms_norm", (x,), {"weight": w, "eps": 1e-2})
    expected = dlblas_kernels.rms_norm(x, w, eps=1e-2)
    torch.testing.assert_close(op(x, w, eps=1e-2), expected, rtol=0, atol=0)
    assert not torch.equal(expected, dlblas_kernels.rms_norm(x, w))


def test_bfloat16_on_the_interpreter_falls_back_to_the_reference(gen):
    x, w = inputs(gen, (4, 32), (32,), dtype=torch.bfloat16)
    op = dlcore.get_op("rms_norm", (x, w))
    assert op.impl.name == "reference"
    assert "bfloat16" in op.selection.declined["triton"]
    assert op(x, w).dtype == torch.bfloat16


def test_requested_implementation(gen):
    x, w = inputs(gen, (4, 32), (32,))
    assert dlcore.get_op("rms_norm", (x, w), impl="reference").impl.name == "reference"
    with pytest.raises(UnknownImplementationError, match="has no implementation 'cublas'; it has: reference, triton"):
        dlcore.get_op("rms_norm", (x, w), impl="cublas")


def test_explain_says_what_and_why(gen):
    x, w = inputs(gen, (4, 32), (32,))
    text = dlcore.get_op("rms_norm", (x, w)).explain()
    for expected in ("op:        rms_norm", "chosen:    triton", "only candidate", "declined  reference",
                     "float32[4, 32]", "backend 'cpu'", "BLOCK_N"):
        assert expected in text, text


def test_unknown_op_suggests_the_closest_names():
    with pytest.raises(UnknownOpError, match="Did you mean 'rms_norm'"):
        dlcore.get_op("rmsnorm", ())


def test_no_kernel_error_lists_every_implementation_and_why(monkeypatch, gen):
    only_fp32 = TorchImplementation("double", "fp32_only", lambda x: x + x, dtypes=(torch.float32,))
    with_plugins(monkeypatch, OpsPlugin([double_op(fallback=False)], [only_fp32]))
    (x,) = inputs(gen, (8,), dtype=torch.float16)
    with pytest.raises(NoKernelError) as info:
        dlcore.get_op("double", (x,))
    assert "fp32_only: dtype float16 not supported (supports float32)" in str(info.value)
    assert "reference: double declares no fallback" in str(info.value)


def test_selection_measures_on_clones_and_skips_failures(monkeypatch, gen):
    def mutating(x):
        x.add_(100)  # a careless implementation: selection must not let it touch the caller's tensor
        return (x - 100) * 2

    def broken(x):
        raise RuntimeError("out of resources: shared memory")

    impls = [TorchImplementation("double", "mutating", mutating), TorchImplementation("double", "broken", broken)]
    with_plugins(monkeypatch, OpsPlugin([double_op()], impls))
    (x,) = inputs(gen, (16,))
    before = x.clone()
    op = dlcore.get_op("double", (x,))
    assert torch.equal(x, before)
    assert op.selection.how == "measured"
    assert op.impl.name == "mutating"
    assert set(op.selection.measured) == {"mutating"}
    assert "RuntimeError: out of resources" in op.selection.failed["broken"]
    assert "failed    broken" in op.explain()


class SlowBackward(torch.autograd.Function):
    """x * 2 whose backward takes 20 ms."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        time.sleep(0.02)
        return grad * 2


def test_a_training_call_is_chosen_by_forward_and_backward(monkeypatch, gen):
    """Inputs that require grad (grad mode on): the candidates are timed forward and backward, so
    the fast forward with the slow backward loses; a forward-only candidate fails (its outputs
    carry no gradient). The same inputs without grad: the fast forward wins. The two choices are
    kept apart."""

    def slow_forward(x):
        time.sleep(0.004)
        return x * 2

    impls = [TorchImplementation("double", "fast_forward", lambda x: SlowBackward.apply(x)),
             TorchImplementation("double", "slow_forward", slow_forward),
             TorchImplementation("double", "forward_only", lambda x: x.detach() * 2)]
    with_plugins(monkeypatch, OpsPlugin([double_op()], impls))
    (x,) = inputs(gen, (16,))
    inference = dlcore.get_op("double", (x,))
    assert inference.impl.name in ("fast_forward", "forward_only") and not inference.signature.training
    leaf = x.clone().requires_grad_()
    training = dlcore.get_op("double", (leaf,))
    assert training.signature.training and training.signature.key().endswith(" training")
    assert training.impl.name == "slow_forward", training.explain()
    assert set(training.selection.measured) == {"fast_forward", "slow_forward"}
    assert "NoBackwardError" in training.selection.failed["forward_only"]
    assert "(forward and backward: a training call)" in training.explain()
    (grad,) = torch.autograd.grad(training(leaf), leaf, torch.ones(16))
    assert torch.equal(grad, torch.full((16,), 2.0))
    with torch.no_grad():
        assert not dlcore.get_op("double", (leaf,)).signature.training
    assert dlcore.get_op("double", (x,)) is inference


def test_selection_takes_each_candidate_s_best_round(monkeypatch, gen):
    """Candidates are timed in rounds of alternating order and keep their best round: one slowed
    through the first round (a clock ramping up, a neighbour's work) still wins when it is faster."""
    calls = []

    def slow_at_first(x):
        calls.append(1)
        time.sleep(0.02 if len(calls) <= 6 else 0.0)  # the CPU timer: one warm-up and five timed calls
        return x * 2

    def steady(x):
        time.sleep(0.004)
        return x * 2

    impls = [TorchImplementation("double", "slow_at_first", slow_at_first),
             TorchImplementation("double", "steady", steady)]
    with_plugins(monkeypatch, OpsPlugin([double_op()], impls))
    op = dlcore.get_op("double", inputs(gen, (16,)))
    assert op.impl.name == "slow_at_first", op.explain()
    assert len(calls) == 6 * dlcore.tuning.selection.ROUNDS
    assert op.selection.measured["slow_at_first"] < op.selection.measured["steady"]


def test_a_near_tie_takes_more_rounds_of_the_two_fastest(monkeypatch, gen):
    """Two candidates within TIE_MARGIN after the first rounds are timed TIE_ROUNDS more rounds
    (those two alone), and the best round over all of them decides: here the one a hair slower
    through the first rounds and faster after; a clearly slower third is not timed again."""
    selection = dlcore.tuning.selection
    calls = {"late": [], "steady": [], "slow": []}
    first = 6 * selection.ROUNDS  # the CPU timer: one warm-up and five timed calls a round

    def late(x):
        calls["late"].append(1)
        time.sleep(0.0102 if len(calls["late"]) <= first else 0.006)
        return x * 2

    def steady(x):
        calls["steady"].append(1)
        time.sleep(0.010)
        return x * 2

    def slow(x):
        calls["slow"].append(1)
        time.sleep(0.030)
        return x * 2

    impls = [TorchImplementation("double", name, fn) for name, fn in
             (("late", late), ("steady", steady), ("slow", slow))]
    with_plugins(monkeypatch, OpsPlugin([double_op()], impls))
    op = dlcore.get_op("double", inputs(gen, (16,)))
    assert op.impl.name == "late", op.explain()
    rounds = selection.ROUNDS + selection.TIE_ROUNDS
    assert len(calls["late"]) == len(calls["steady"]) == 6 * rounds
    assert len(calls["slow"]) == first
    assert op.selection.measured["late"] < 8 < op.selection.measured["steady"]  # ms


def test_all_candidates_failing_is_a_no_kernel_error(monkeypatch, gen):
    def broken(x):
        raise RuntimeError("boom")

    impls = [TorchImplementation("double", f"broken{i}", broken) for i in range(2)]
    with_plugins(monkeypatch, OpsPlugin([double_op()], impls))
    with pytest.raises(NoKernelError, match="broken0: RuntimeError: boom"):
        dlcore.get_op("double", inputs(gen, (16,)))


def test_a_lone_candidate_is_not_measured(monkeypatch, gen):
    calls = []
    impl = TorchImplementation("double", "counted", lambda x: calls.append(1) or x * 2)
    with_plugins(monkeypatch, OpsPlugin([double_op()], [impl]))
    op = dlcore.get_op("double", inputs(gen, (16,)))
    assert op.selection.how == "only candidate" and calls == []


def test_meta_tensors_have_no_backend():
    x = torch.empty(4, 32, device="meta")
    with pytest.raises(BackendUnavailableError, match="no backend runs on device type 'meta'"):
        dlcore.get_op("rms_norm", (x, torch.empty(32, device="meta")))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_unavailable_backend_says_why():
    with pytest.raises(BackendUnavailableError, match="torch.cuda.is_available"):
        dlcore.plugins.registry.registry().backend_for(torch.device("cuda"))


def test_triton_kernels_need_the_interpreter_on_cpu(monkeypatch, gen):
    monkeypatch.setattr("dlcore.declarations.implementation.TritonImplementation.interpreted",
                        property(lambda self: False))
    x, w = inputs(gen, (4, 32), (32,))
    op = dlcore.get_op("rms_norm", (x, w))
    assert op.impl.name == "reference"
    assert "TRITON_INTERPRET=1" in op.selection.declined["triton"]


def test_bound_op_launches_through_the_plan(monkeypatch, gen):
    launched = []
    original = dlcore.runtime.launch.launch
    monkeypatch.setattr(dlcore.runtime.launch, "launch", lambda call: launched.append(call.kernel) or original(call))
    x, w = inputs(gen, (4, 32), (32,))
    dlcore.get_op("rms_norm", (x, w))(x, w)
    assert len(launched) == 1


def test_launch_passes_apply_to_bound_ops(monkeypatch, gen):
    """With grid folding enabled, the bound op launches the folded kernel on P programs, same results."""
    x = torch.randn(64, 96, generator=gen)
    plain = dlcore.get_op("silu_and_mul", (x,))(x)
    dlcore.dispatch.dispatcher.reset()
    monkeypatch.setenv("DLCORE_ENABLE_PASSES", "grid_folding")
    launched = []
    original = dlcore.runtime.launch.launch
    monkeypatch.setattr(dlcore.runtime.launch, "launch", lambda call: launched.append(call) or original(call))
    folded = dlcore.get_op("silu_and_mul", (x,))(x)
    assert torch.equal(plain, folded)
    (call,) = launched
    reg = dlcore.plugins.registry.registry()
    cores = reg.profile(reg.backend_for(x.device), x.device).cores
    assert call.grid[0] <= cores, call.grid
    assert call.kernel.__name__.endswith("folded"), call.kernel.__name__
