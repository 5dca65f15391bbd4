"""The warm launch path (dlcore.runtime's internals, launch, shelf and replay) with stand-ins for
Triton's compiled kernels: its logic only, no GPU needed. What it does with real compiled kernels is
tests/test_gpu.py's.

The stand-in kernel computes ``out = x * scale`` in torch from the tensors it is handed, and counts
how it was reached: through ``kernel[grid](...)`` (the plan's path) or ``compiled.run`` (direct).
"""

import threading
import time
import warnings
from types import SimpleNamespace

import pytest
import torch

from dlcore.declarations.implementation import KernelCall, LaunchPlan, TorchImplementation, TritonImplementation
from dlcore.runtime import internals, launch, replay, runner, shelf


class Param(SimpleNamespace):
    pass


class Compiled:
    packed_metadata = "meta"
    function = "fn"

    def __init__(self, kernel):
        self.kernel = kernel

    def launch_metadata(self, grid, stream, *values):
        return ("metadata", grid)

    def run(self, g0, g1, g2, stream, function, packed, metadata, enter, leave, *values):
        self.kernel.replays.append((g0, g1, g2, stream, metadata))
        self.kernel.compute(*values)


class JITFunction:
    """Stands in for ``scale_kernel(x_ptr, out_ptr, n, scale, BLOCK: tl.constexpr = 64)``."""

    arg_names = ["x_ptr", "out_ptr", "n", "scale", "BLOCK"]
    params = [Param(is_constexpr=c) for c in (False, False, False, False, True)]
    debug = None
    cache_key = "source-hash"

    def __init__(self, compiled=Compiled):
        self.planned: list[tuple] = []
        self.replays: list[tuple] = []
        self.pre_run_hooks: list = []
        self.compiled = compiled(self)

        def fn(x_ptr, out_ptr, n, scale, BLOCK=64):
            pass

        self.fn = fn

    @staticmethod
    def compute(x, out, n, scale, block):
        assert block == 64
        if x.shape == out.shape:
            out.copy_(x * scale)
        else:
            out.view(-1)[:n].copy_(x.reshape(-1)[:n] * scale)

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.planned.append(grid)
            values = list(args) + [kwargs.get("BLOCK", 64)]
            self.compute(*values)
            return self.compiled

        return run


class Runtime(SimpleNamespace):
    pass


def fake_internals(**extra):
    runtime = Runtime(add_stages_inspection_hook=None, launch_enter_hook=None, launch_exit_hook=None,
                      jit_cache_hook=None, debug=False)
    driver = SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda device: 1234,
                             get_current_target=lambda: "target")
    compilation = SimpleNamespace(always_compile=False, override=False, dump_ir=False, instrumentation_mode="")
    return internals.Internals(runtime=runtime, driver=driver, compilation=compilation, cache=SimpleNamespace(dir="c"),
                            env_vars=dict, **extra)


@pytest.fixture
def triton_runtime(monkeypatch):
    found = fake_internals()
    monkeypatch.setattr(internals, "found", found)
    launch.clear()
    monkeypatch.setattr(shelf, "_stamp", "stamp")
    return found.runtime


@pytest.fixture
def replayed(monkeypatch):
    """The exact inputs replayed from a template so far (each call's first argument)."""
    seen = []
    original = replay.Recording.run
    monkeypatch.setattr(replay.Recording, "run", lambda self, args: seen.append(args[0]) or original(self, args))
    return seen


def launches(kernel):
    """Launches so far: through Triton (the first of a specialization) and direct."""
    return len(kernel.planned) + len(kernel.replays)


def scale_plan(kernel, *, view=False, scratch=False, offset=False, inplace=False, pair=False, declare=False):
    def plan(args, config, profile=None):  # a Replay's plan takes (args, config), an implementation's the profile too
        (x,) = args
        out = x if inplace else torch.empty_like(x)
        src = x.reshape(-1) if view else x[1:] if offset else x
        calls = [KernelCall(kernel, (x.numel(),), (src, out, x.numel() - (1 if offset else 0), config["scale"]),
                            {"BLOCK": 64})]
        tmp = ()
        if scratch:
            tmp = (torch.empty_like(x) if scratch is True else scratch(x),)
            calls = [KernelCall(kernel, (1,), (x, tmp[0], x.numel(), config["scale"])),
                     KernelCall(kernel, (1,), (tmp[0], out, x.numel(), 1.0))]
        result = out
        if pair:
            out2 = torch.empty_like(x)
            calls.append(KernelCall(kernel, (2, 3), (x, out2, x.numel(), 3.0)))
            result = (out, out2)
        return LaunchPlan(calls, result, scratch=tmp if declare else ())

    return plan


def test_first_call_records_then_replays_with_fresh_results(triton_runtime):
    kernel = JITFunction()
    run = replay.Replay(scale_plan(kernel, view=True), {"scale": 2.0}, None)
    outs = []
    for _ in range(4):
        x = torch.randn(3, 5)
        out = run((x,))
        torch.testing.assert_close(out, x * 2, rtol=0, atol=0)
        outs.append(out)
    assert len(kernel.planned) == 1 and len(kernel.replays) == 3
    assert kernel.replays[0] == (15, 1, 1, 1234, None)
    assert len({o.data_ptr() for o in outs}) == 4, "each call gets its own result"


def test_another_shape_stride_or_alignment_is_another_template(triton_runtime):
    kernel = JITFunction()
    run = replay.Replay(scale_plan(kernel), {"scale": 2.0}, None)
    base = torch.randn(40)
    inputs = [torch.randn(3, 5), torch.randn(5, 3), torch.randn(5, 3).t(), base[:15], base[1:16], base[:15]]
    for x in inputs:
        torch.testing.assert_close(run((x,)), x * 2, rtol=0, atol=0)
    assert len(run.recordings) == 5, "the last input repeats the fourth"
    # Recording launches through the kernel's entry: Triton compiles once per specialization (16-byte
    # aligned or not), every other launch calls the compiled kernel.
    assert len(kernel.planned) == 2 and len(kernel.replays) == 4
    assert replay.replay_key((base[:15],)) != replay.replay_key((base[1:16],))
    assert replay.replay_key((base[:15], 1.0)) != replay.replay_key((base[:15], 2.0))


@pytest.mark.filterwarnings("ignore::dlcore.runtime.replay.NotReplayedWarning")
def test_launches_that_cannot_be_traced_keep_the_plan_path(triton_runtime, replayed):
    kernel = JITFunction()
    run = replay.Replay(scale_plan(kernel, scratch=True), {"scale": 2.0}, None)
    for _ in range(3):
        x = torch.randn(16)
        torch.testing.assert_close(run((x,)), x * 2, rtol=0, atol=0)
    assert replayed == [] and list(run.recordings.values()) == [None]
    assert launches(kernel) == 6


def test_a_view_into_an_input_is_replayed_as_the_same_view_of_the_new_input(triton_runtime, replayed):
    kernel = JITFunction()
    run = replay.Replay(scale_plan(kernel, offset=True), {"scale": 2.0}, None)
    for _ in range(3):
        x = torch.randn(16)
        out = run((x,))
        # the kernel writes all but the last element (x[1:] * 2), which stays as torch.empty left it
        torch.testing.assert_close(out[:-1], x[1:] * 2, rtol=0, atol=0)
    assert len(replayed) == 2 and launches(kernel) == 3


def test_declared_scratch_is_allocated_afresh_for_each_replay(triton_runtime, replayed, monkeypatch):
    kernel = JITFunction()
    run = replay.Replay(scale_plan(kernel, scratch=True, declare=True), {"scale": 2.0}, None)
    handed = []
    compute = kernel.compute
    monkeypatch.setattr(kernel, "compute", lambda x, out, *rest: handed.append(out) or compute(x, out, *rest))
    for _ in range(3):
        x = torch.randn(16)
        torch.testing.assert_close(run((x,)), x * 2, rtol=0, atol=0)
    assert len(replayed) == 2 and launches(kernel) == 6
    scratch = handed[0::2]  # each call's first launch writes its scratch tensor
    assert all(t is not scratch[0] for t in scratch[1:]), "a replay allocates, never reuses the recorded tensor"
    assert all(t.shape == (16,) and t.dtype == torch.float32 for t in scratch)


def test_declared_scratch_that_aliases_an_input_is_not_recorded(triton_runtime, replayed):
    kernel = JITFunction()
    run = replay.Replay(scale_plan(kernel, scratch=lambda x: x, declare=True), {"scale": 2.0}, None)
    with pytest.warns(replay.NotReplayedWarning, match="a scratch tensor shares memory with an input") as caught:
        for _ in range(2):
            x = torch.randn(16)
            expected = x * 2  # before the call: the "scratch" is x itself, which the first launch overwrites
            torch.testing.assert_close(run((x,)), expected, rtol=0, atol=0)
    assert len(caught) == 1 and replayed == [] and launches(kernel) == 4


def test_a_result_that_is_an_input_is_returned_itself(triton_runtime):
    kernel = JITFunction()
    run = replay.Replay(scale_plan(kernel, inplace=True), {"scale": 2.0}, None)
    for _ in range(3):
        x = torch.randn(8)
        expected = x * 2
        assert run((x,)) is x
        torch.testing.assert_close(x, expected, rtol=0, atol=0)
    assert len(kernel.replays) == 2


def pair_plan(kernel):
    """out = a * 2 from a launch on (a, out), then out2 = b * 3: two inputs of one shape."""
    def plan(args, config):
        a, b = args
        out, out2 = torch.empty_like(a), torch.empty_like(b)
        return LaunchPlan([KernelCall(kernel, (1,), (a, out, a.numel(), 2.0)),
                           KernelCall(kernel, (1,), (b, out2, b.numel(), 3.0))], (out, out2))
    return plan


@pytest.mark.filterwarnings("ignore::dlcore.runtime.replay.NotReplayedWarning")
def test_inputs_at_one_address_are_not_recorded(triton_runtime, replayed):
    """Recorded with the same tensor twice, a replay could not tell the two inputs apart later."""
    kernel = JITFunction()
    run = replay.Replay(pair_plan(kernel), {}, None)
    same = torch.randn(6)
    for a, b in [(same, same), (torch.randn(6), torch.randn(6)), (torch.randn(6), torch.randn(6))]:
        out, out2 = run((a, b))
        torch.testing.assert_close(out, a * 2, rtol=0, atol=0)
        torch.testing.assert_close(out2, b * 3, rtol=0, atol=0)
    assert replayed == []  # the exact key is the same each time: it stays on the plan's path
    run = replay.Replay(pair_plan(kernel), {}, None)
    a, b = torch.randn(6), torch.randn(6)
    run((a, b))
    out, out2 = run((same, same))  # recorded with two tensors, replayed with one twice: still right
    torch.testing.assert_close(out, same * 2, rtol=0, atol=0)
    torch.testing.assert_close(out2, same * 3, rtol=0, atol=0)
    assert len(replayed) == 1


def test_tuple_results_and_several_launches(triton_runtime, replayed):
    kernel = JITFunction()
    run = replay.Replay(scale_plan(kernel, pair=True), {"scale": 2.0}, None)
    for _ in range(3):
        x = torch.randn(7)
        a, b = run((x,))
        torch.testing.assert_close(a, x * 2, rtol=0, atol=0)
        torch.testing.assert_close(b, x * 3, rtol=0, atol=0)
    assert len(replayed) == 2 and kernel.replays[-1][:3] == (2, 3, 1)


def test_launch_hooks_get_metadata(triton_runtime):
    kernel = JITFunction()
    run = replay.Replay(scale_plan(kernel), {"scale": 2.0}, None)
    run((torch.randn(4),))
    triton_runtime.launch_enter_hook = lambda metadata: None
    run((torch.randn(4),))
    assert kernel.replays[-1][-1] == ("metadata", (4, 1, 1))


def test_a_new_stages_hook_records_again(triton_runtime):
    kernel = JITFunction()
    run = replay.Replay(scale_plan(kernel), {"scale": 2.0}, None)
    x = torch.randn(4)
    run((x,))
    run((x,))
    triton_runtime.add_stages_inspection_hook = lambda *a: None
    run((x,))
    run((x,))
    assert len(kernel.planned) == 2 and len(kernel.replays) == 2


def test_the_transform_runs_when_recording_only(triton_runtime):
    kernel = JITFunction()
    seen = []

    def transform(plan):
        seen.append(plan)
        return plan

    run = replay.Replay(scale_plan(kernel), {"scale": 2.0}, transform)
    for _ in range(3):
        run((torch.randn(4),))
    assert len(seen) == 1


def test_templates_are_bounded(triton_runtime, monkeypatch):
    monkeypatch.setattr(replay, "LIMIT", 3)
    kernel = JITFunction()
    run = replay.Replay(scale_plan(kernel), {"scale": 2.0}, None)
    for n in range(1, 8):
        run((torch.randn(n),))
    assert len(run.recordings) == 3
    assert [k[0][1] for k in run.recordings] == [torch.Size([5]), torch.Size([6]), torch.Size([7])]


def test_only_compiled_replayable_implementations_replay():
    def make(replayable, kernel):
        return TritonImplementation("op", "t", plan=scale_plan(kernel), kernels=(kernel,),
                                    default_config=lambda s, p: {}, replayable=replayable)

    kernel = JITFunction()
    assert isinstance(runner.launches(make(True, kernel), {"scale": 1.0}, None), replay.Replay)
    assert not isinstance(runner.launches(make(False, kernel), {"scale": 1.0}, None), replay.Replay)
    Interpreted = type("InterpretedFunction", (JITFunction,), {})
    assert not isinstance(runner.launches(make(True, Interpreted()), {"scale": 1.0}, None), replay.Replay)


def test_a_guard_checks_each_exact_input_once_before_its_plan(triton_runtime, replayed):
    """A bound op's check of its inputs: on a new exact input only, before anything is planned; a
    refused input is neither launched nor recorded, and replays never pay for the check."""
    kernel = JITFunction()
    checked = []

    def guard(args):
        checked.append(tuple(args[0].shape))
        if args[0].dim() > 1:
            raise ValueError("refused")

    run = replay.Replay(scale_plan(kernel), {"scale": 2.0}, None, guard)
    for _ in range(3):
        x = torch.randn(4)
        torch.testing.assert_close(run((x,)), x * 2, rtol=0, atol=0)
    assert checked == [(4,)] and len(replayed) == 2
    with pytest.raises(ValueError, match="refused"):
        run((torch.randn(2, 2),))
    assert launches(kernel) == 3 and len(run.recordings) == 1
    run((torch.randn(5),))
    assert checked == [(4,), (2, 2), (5,)]


@pytest.mark.parametrize("replayable", [True, False])
def test_every_path_of_a_runner_takes_its_guard(triton_runtime, replayable):
    """Planned on every call (not replayable, or interpreted) or not, and with an argument that
    cannot be a key (checked on every call)."""
    kernel = JITFunction()
    checked = []
    impl = TritonImplementation("op", "t", plan=scale_plan(kernel), kernels=(kernel,),
                                default_config=lambda s, p: {}, replayable=replayable)
    run = runner.launches(impl, {"scale": 2.0}, None, lambda args: checked.append(args))
    x = torch.randn(4)
    for _ in range(2):
        torch.testing.assert_close(run((x,)), x * 2, rtol=0, atol=0)
    assert len(checked) == 1
    reference = runner.runner(TorchImplementation("op", "torch", lambda x, scales: x * scales[0]), {}, None,
                              lambda args: checked.append(args))
    for _ in range(2):
        torch.testing.assert_close(reference((x, [3.0])), x * 3, rtol=0, atol=0)
    assert len(checked) == 3


def test_an_unhashable_argument_takes_the_plan_path(triton_runtime, replayed):
    kernel = JITFunction()

    def plan(args, config):
        x, scales = args
        out = torch.empty_like(x)
        return LaunchPlan([KernelCall(kernel, (1,), (x, out, x.numel(), scales[0]))], out)

    run = replay.Replay(plan, {}, None)
    for _ in range(2):
        x = torch.randn(4)
        torch.testing.assert_close(run((x, [2.0])), x * 2, rtol=0, atol=0)
    assert replayed == [] and run.recordings == {}


def test_a_result_filled_on_the_host_is_not_recorded(triton_runtime, replayed):
    """A plan that zero-fills a result no launch writes (an empty sum's gradient, say): a replay would
    hand back uninitialised memory, so it keeps the plan's path."""
    kernel = JITFunction()

    def plan(args, config):
        (x,) = args
        out, total = torch.empty_like(x), torch.zeros(4)
        return LaunchPlan([KernelCall(kernel, (1,), (x, out, x.numel(), 2.0), {"BLOCK": 64})], (out, total))

    run = replay.Replay(plan, {}, None)
    for _ in range(3):
        x = torch.randn(8)
        out, total = run((x,))
        torch.testing.assert_close(out, x * 2, rtol=0, atol=0)
        assert not total.any()
    assert replayed == [] and launches(kernel) == 3


def test_custom_op_bodies_replay_per_config(triton_runtime, replayed):
    """dlcore.runtime.torch_ops.Launches: one set of templates per config integers; all-zero integers mean a
    default that depends on the inputs, computed from the args of the call that records."""
    from dlcore.runtime.torch_ops import Launches

    kernel = JITFunction()
    configs = []

    def config(args, ints):
        configs.append(ints)
        return {"scale": float(ints[0]) if any(ints) else float(args[0].shape[0])}

    launches = Launches(scale_plan(kernel), config)
    for ints, rows in [((3,), 2), ((3,), 2), ((0,), 2), ((0,), 5), ((0,), 5), ((3,), 5)]:
        x = torch.randn(rows, 4)
        expected = x * (3.0 if ints[0] else rows)
        torch.testing.assert_close(launches.run((x,), ints), expected, rtol=0, atol=0)
    assert configs == [(3,), (0,), (0,), (3,)], "the config is computed when recording only"
    assert len(replayed) == 2


def test_a_plan_with_nothing_to_launch_is_not_recorded(monkeypatch):
    """Empty inputs launch nothing: no driver is asked (there may be none) and nothing is kept."""
    monkeypatch.setattr(internals, "found", None)
    monkeypatch.setattr(internals, "check", lambda: pytest.fail("asked about Triton's internals"))
    run = replay.Replay(lambda args, config: LaunchPlan([], torch.empty(0)), {}, None)
    assert run((torch.empty(0),)).shape == (0,) and run((torch.empty(0),)).shape == (0,)
    assert list(run.recordings.values()) == [None]


def test_direct_launches_after_the_first(triton_runtime):
    kernel = JITFunction()
    for n in (16, 16, 32, 7):
        x = torch.randn(n)
        out = torch.empty_like(x)
        launch.launch(KernelCall(kernel, (1,), (x, out, n, 2.0), {"BLOCK": 64}))
        torch.testing.assert_close(out, x * 2, rtol=0, atol=0)
    assert len(kernel.planned) == 2, "16 and 32 specialize alike; 7 does not divide by 16"
    assert len(kernel.replays) == 2


class SlowToCompile(JITFunction):
    """Its first launch takes long enough for other threads to arrive; counts how many overlap."""

    def __init__(self):
        super().__init__()
        self.inside, self.most = 0, 0

    def __getitem__(self, grid):
        launch_it = super().__getitem__(grid)

        def run(*args, **kwargs):
            self.inside += 1
            self.most = max(self.most, self.inside)
            time.sleep(0.05)
            self.inside -= 1
            return launch_it(*args, **kwargs)

        return run


SlowToCompile.__name__ = "JITFunction"  # what the launch path takes for a compiled kernel


def test_threads_launching_a_new_specialization_compile_it_once(triton_runtime):
    kernel = SlowToCompile()
    xs = [torch.randn(64) for _ in range(4)]
    outs = [torch.empty_like(x) for x in xs]
    calls = [KernelCall(kernel, (1,), (x, out, 64, 2.0), {"BLOCK": 64}) for x, out in zip(xs, outs)]
    threads = [threading.Thread(target=launch.launch, args=(call,)) for call in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert kernel.most == 1 and len(kernel.planned) == 1 and len(kernel.replays) == 3
    for x, out in zip(xs, outs):
        torch.testing.assert_close(out, x * 2, rtol=0, atol=0)


def test_an_empty_hook_chain_is_no_hook(triton_runtime):
    """Triton 3.9's launch hooks are chains, never None: an empty one builds no launch metadata."""
    triton_runtime.launch_enter_hook = SimpleNamespace(calls=[])
    triton_runtime.launch_exit_hook = SimpleNamespace(calls=[])
    kernel = JITFunction()
    x = torch.randn(4)
    for _ in range(2):
        launch.launch(KernelCall(kernel, (1,), (x, torch.empty_like(x), 4, 2.0)))
    assert kernel.replays == [(1, 1, 1, 1234, None)]


def test_kernels_with_pre_run_hooks_go_through_triton(triton_runtime):
    kernel = JITFunction()
    kernel.pre_run_hooks.append(lambda *args, **kwargs: None)
    x = torch.randn(4)
    for _ in range(3):
        launch.launch(KernelCall(kernel, (1,), (x, torch.empty_like(x), 4, 2.0)))
    assert len(kernel.planned) == 3 and kernel.replays == []


def test_the_installed_triton_has_every_internal(monkeypatch):
    """The capability check against the Triton installed here (3.6 or 3.9 in CI), its GPU driver
    stood in for (the CPU has none): nothing is missing."""
    from triton.runtime import driver

    class Launcher:
        def __call__(self, gridX, gridY, gridZ, stream, function, *args):
            pass

    active = SimpleNamespace(get_current_device=None, get_current_stream=None, get_current_target=None,
                             launcher_cls=Launcher)
    monkeypatch.setattr(driver, "_active", active)
    assert internals.check().missing == []


def test_a_changed_launch_convention_is_missing(monkeypatch):
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction as Real

    monkeypatch.setattr(driver, "_active", SimpleNamespace())

    def run(self, *args, grid, warmup, **kwargs):
        kernel = self.compile()
        kernel.run(grid, kernel.function, *args)

    monkeypatch.setattr(Real, "run", run)
    missing = internals.check().missing
    assert any(m.startswith("JITFunction.run") for m in missing), missing
    assert "triton.runtime.driver.active.launcher_cls" in missing


@pytest.fixture
def lacking(monkeypatch):
    """Triton's internals checked anew, one reported missing."""
    found = fake_internals(missing=["triton.knobs.runtime.launch_enter_hook"])
    monkeypatch.setattr(internals, "found", None)
    launch.clear()
    monkeypatch.setattr(internals, "check", lambda: found)
    return found


def test_a_missing_internal_warns_once_and_every_launch_goes_through_triton(lacking):
    kernel = JITFunction()
    run = replay.Replay(scale_plan(kernel), {"scale": 2.0}, None)
    with pytest.warns(UserWarning, match="launch_enter_hook") as warned:
        for _ in range(3):
            x = torch.randn(8)
            torch.testing.assert_close(run((x,)), x * 2, rtol=0, atol=0)
            out = torch.empty_like(x)
            launch.launch(KernelCall(kernel, (1,), (x, out, 8, 3.0)))
            torch.testing.assert_close(out, x * 3, rtol=0, atol=0)
    assert len(warned) == 1
    assert len(kernel.planned) == 6 and kernel.replays == []


def test_a_kernel_lacking_an_attribute_turns_the_warm_path_off(triton_runtime):
    kernel = JITFunction()
    del kernel.pre_run_hooks
    x = torch.randn(4)
    with pytest.warns(UserWarning, match="pre_run_hooks"):
        launch.launch(KernelCall(kernel, (1,), (x, torch.empty_like(x), 4, 2.0)))
    other = JITFunction()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            launch.launch(KernelCall(other, (1,), (x, torch.empty_like(x), 4, 2.0)))
    assert len(other.planned) == 2 and other.replays == []


class Shelved(Compiled):
    """A compiled kernel as Triton hands it back: its source (signature, constants, attributes),
    its cache hash and name."""

    hash = "abc123"
    name = "scale_kernel"

    def __init__(self, kernel):
        super().__init__(kernel)
        self.src = SimpleNamespace(signature={"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "scale": "fp32",
                                              "BLOCK": "constexpr"},
                                   constants={(4,): 64}, attrs={(0,): [["tt.divisibility", 16]]})


def test_a_new_process_loads_the_shelved_kernel_from_tritons_cache(triton_runtime, monkeypatch):
    kernel = JITFunction(Shelved)
    x = torch.randn(16)
    launch.launch(KernelCall(kernel, (1,), (x, torch.empty_like(x), 16, 2.0), {"BLOCK": 64}))
    assert len(kernel.planned) == 1
    loaded = []

    def compiled_kernel(src, group, hash):
        loaded.append((src, group, hash))
        return kernel.compiled

    groups = {"abc123": {"scale_kernel.json": "/cache/abc123/scale_kernel.json"}}
    cache_manager = lambda key: SimpleNamespace(get_group=lambda name: groups.get(key))  # noqa: E731
    monkeypatch.setattr(internals.found, "cache_manager", cache_manager)
    monkeypatch.setattr(internals.found, "compiled_kernel", compiled_kernel)
    monkeypatch.setattr(internals.found, "ast_source", lambda *a: a)
    launch.clear()  # a new process: nothing in memory
    out = torch.empty_like(x)
    launch.launch(KernelCall(kernel, (1,), (x, out, 16, 2.0), {"BLOCK": 64}))
    torch.testing.assert_close(out, x * 2, rtol=0, atol=0)
    assert len(kernel.planned) == 1 and len(kernel.replays) == 1, "launched directly, not through Triton"
    ((fn, signature, constants, attrs), group, hash), = loaded
    assert fn is kernel and signature == kernel.compiled.src.signature and hash == "abc123"
    assert constants == {(4,): 64} and attrs == {(0,): [["tt.divisibility", 16]]}
    launch.clear()
    groups.clear()  # Triton's cache emptied meanwhile: through Triton again
    launch.launch(KernelCall(kernel, (1,), (x, out, 16, 2.0), {"BLOCK": 64}))
    assert len(kernel.planned) == 2 and len(loaded) == 1


def test_nothing_is_shelved_while_a_stages_hook_is_installed(triton_runtime):
    triton_runtime.add_stages_inspection_hook = lambda *a: None
    kernel = JITFunction(Shelved)
    x = torch.randn(16)
    launch.launch(KernelCall(kernel, (1,), (x, torch.empty_like(x), 16, 2.0)))
    assert launch._entries[kernel].shelf is None


def test_launch_options_are_part_of_the_key(triton_runtime):
    kernel = JITFunction()
    x = torch.randn(16)
    for options in ({"num_warps": 4}, {"num_warps": 8}, {"num_warps": 4, "launch_pdl": True}, {"num_warps": 4}):
        launch.launch(KernelCall(kernel, (1,), (x, torch.empty_like(x), 16, 2.0), options))
    assert len(kernel.planned) == 3 and len(kernel.replays) == 1


def test_the_shelf_keeps_the_most_recently_shelved(tmp_path, monkeypatch):
    monkeypatch.setattr(shelf, "SHELF_LIMIT", 3)
    kept = shelf.Shelf(tmp_path / "kernel.json")
    compiled = Shelved(JITFunction())
    for name in ("a", "b", "c", "a", "d"):  # a is shelved again (another hash, say) after c
        compiled.hash = f"hash-{name}-{len(kept.entries)}"
        kept.store(name, compiled)
    assert list(kept.entries) == ["c", "a", "d"]
    assert list(shelf.Shelf(tmp_path / "kernel.json").entries) == ["c", "a", "d"]  # as written


class ScratchCompiled(Compiled):
    """A compiled kernel that asks Triton's allocator for global scratch (device-side tensor
    descriptors do), as Triton's launcher does: it fails where the launching thread has none."""

    metadata = SimpleNamespace(global_scratch_size=128)

    def run(self, *args):
        from triton.runtime import _allocation

        self.kernel.allocations.append(_allocation._allocator.get()(128, 128, None))
        super().run(*args)


def _without_allocator(fn):
    """Run ``fn`` in a new thread: Triton's allocator context variable starts unset there."""
    errors = []

    def target():
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - reported to the test's thread
            errors.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


def test_a_thread_replaying_or_launching_a_kernel_with_scratch_gets_an_allocator(triton_runtime, monkeypatch):
    """A template recorded by one thread and replayed by another (autograd's device thread, a
    server's workers), and a direct launch from a new thread: Triton's allocator is set in the
    launching thread before a kernel that asks it for scratch runs, torch's caching allocator."""
    from dlcore.runtime import allocator

    handed = []
    monkeypatch.setattr(allocator, "_torch_allocator", lambda size, alignment, stream: handed.append(size) or "buf")
    kernel = JITFunction(compiled=ScratchCompiled)
    kernel.allocations = []
    run = replay.Replay(scale_plan(kernel), {"scale": 2.0}, None)
    x = torch.randn(3, 5)
    _without_allocator(lambda: run((x,)))  # recorded: the plan's path, then a template
    assert len(kernel.planned) == 1
    outs = []
    for _ in range(2):
        _without_allocator(lambda: outs.append(run((x,))))
    for out in outs:
        torch.testing.assert_close(out, x * 2, rtol=0, atol=0)
    assert len(kernel.replays) == 2 and kernel.allocations == ["buf", "buf"] and handed == [128, 128]
    out = torch.empty_like(x)
    _without_allocator(lambda: launch.launch(KernelCall(kernel, (1,), (x, out, 15, 3.0), {"BLOCK": 64})))
    assert len(kernel.replays) == 3 and kernel.allocations[-1] == "buf"
    torch.testing.assert_close(out, x * 3, rtol=0, atol=0)


def test_kernels_without_scratch_leave_the_allocator_alone(triton_runtime):
    from triton.runtime import _allocation

    kernel = JITFunction()
    run = replay.Replay(scale_plan(kernel), {"scale": 2.0}, None)
    seen = []

    def calls():
        run((torch.randn(4),))
        run((torch.randn(4),))
        seen.append(_allocation._allocator.get())

    _without_allocator(calls)
    assert len(kernel.replays) == 1 and isinstance(seen[0], _allocation.NullAllocator)


def test_public_function_works_out_its_config_once_per_exact_input(monkeypatch):
    """A kernel's public function takes its heuristic config from a memo keyed like the launch
    templates: the signature and the heuristic run on the first call of an exact input only."""
    from dlblas_kernels.kernels.rms_norm import rms_norm

    from dlcore.runtime import public_function

    made = []
    real = public_function.make_signature
    monkeypatch.setattr(public_function, "make_signature", lambda *a, **k: made.append(1) or real(*a, **k))
    # shapes no other test uses: the memo lives as long as the process
    x, w = torch.randn(5, 1013), torch.randn(1013)
    first = rms_norm(x, w)
    torch.testing.assert_close(rms_norm(x, w), first)
    assert len(made) == 1
    rms_norm(torch.randn(6, 1013), w)  # another shape: worked out again
    rms_norm(x.half(), w.half())  # another dtype
    assert len(made) == 3
    rms_norm(torch.randn(5, 1013), w)  # the first key again
    assert len(made) == 3
