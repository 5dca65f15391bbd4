"""get_op on CUDA tensors: the cuda backend, real timing, bfloat16. Skipped without a GPU."""

import pytest
import torch

import dlcore
from dlcore.plugins.registry import registry
from dlcore.tuning.verify import mismatch, reference_result

pytestmark = pytest.mark.gpu

SIZES = {
    "silu_and_mul": [{"tokens": 1, "inter": 4096}, {"tokens": 1000, "inter": 1411}],
    "rms_norm": [{"tokens": 1, "hidden": 4096}, {"tokens": 333, "hidden": 8192}, {"tokens": 7, "hidden": 12345}],
    "ffn": [{"tokens": 1, "hidden": 4096, "inter": 1024}, {"tokens": 515, "hidden": 2048, "inter": 2816}],
}
CASES = [(op, sizes) for op, all_sizes in SIZES.items() for sizes in all_sizes]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name, sizes", CASES, ids=[f"{op}-{'x'.join(map(str, s.values()))}" for op, s in CASES])
def test_get_op_on_cuda(name, sizes, dtype):
    op = registry().op(name)
    args = op.example(sizes, dtype, torch.device("cuda"), torch.Generator().manual_seed(0))
    bound = dlcore.get_op(name, args)
    assert bound.impl.name == "triton", bound.explain()
    assert bound.profile.backend == "cuda" and bound.profile.arch.startswith("sm_")
    out = bound(*args)
    torch.cuda.synchronize()
    reduce_dim = sizes.get("hidden", 1)
    problem = mismatch(out, reference_result(op, args), reduce_dim)
    assert problem is None, problem


def test_selection_times_candidates_with_do_bench():
    op = registry().op("rms_norm")
    args = op.example({"tokens": 4096, "hidden": 4096}, torch.bfloat16, torch.device("cuda"), torch.Generator())
    backend = registry().backend_for(args[0].device)
    elapsed = backend.timer(lambda: op.reference(*args), args[0].device)
    assert 0 < elapsed < 100
    bound = dlcore.get_op("rms_norm", args, impl="reference")
    assert "cuda" in bound.explain()


def test_warm_path_respects_every_specialization():
    """Bound ops (launch templates) and the launcher (plans run outside bound ops: the public
    functions, tuning) reuse compiled kernels only for arguments Triton would specialize alike."""
    import dlblas_kernels

    from dlcore.runtime.launcher import _layouts

    op = registry().op("rms_norm")
    for rows in (1, 16, 17, 64):
        for offset in (0, 1, 8):
            flat = torch.randn(rows * 4096 + offset, device="cuda", dtype=torch.float16)
            x = flat[offset:].view(rows, 4096)
            w = torch.randn(4096, device="cuda", dtype=torch.float16)
            expected = reference_result(op, (x, w, 1e-6))
            for _ in range(3):
                out = dlcore.get_op("rms_norm", (x, w))(x, w)
                assert mismatch(out, expected, 4096) is None, (rows, offset)
                out = dlblas_kernels.rms_norm(x, w)
                assert mismatch(out, expected, 4096) is None, (rows, offset, "public function")
    assert any(layout.compiled for layout in _layouts.values())


REPLAYED = [("silu_and_mul", {"tokens": 3, "inter": 1000}), ("matmul", {"tokens": 37, "hidden": 200, "inter": 96}),
            ("ffn", {"tokens": 5, "hidden": 256, "inter": 192})]


@pytest.mark.parametrize("name, sizes", REPLAYED, ids=[n for n, _ in REPLAYED])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset"])
def test_bound_ops_replay_their_launches(name, sizes, offset, monkeypatch):
    """A bound op records its launches on the first call and replays them on later calls with the
    same exact inputs (new values each time); the results stay right and each is a new tensor."""
    from dlcore.runtime import replay

    replays = []
    original = replay.Template.run
    monkeypatch.setattr(replay.Template, "run", lambda self, args: replays.append(name) or original(self, args))
    op = registry().op(name)

    def inputs(seed):
        args = op.example_inputs(sizes, torch.float16, "cuda", seed)
        if offset:  # the first tensor at an address that is not 16-byte aligned
            first = args[0]
            flat = torch.empty(first.numel() + 1, dtype=first.dtype, device=first.device)
            args = (flat[1:].view(first.shape).copy_(first), *args[1:])
        return args

    bound = dlcore.get_op(name, inputs(0))
    assert bound.impl.replayable
    seen = set()
    for seed in range(1, 5):
        args = inputs(seed)
        out = bound(*args)
        seen.add(out.data_ptr())
        problem = mismatch(out, reference_result(op, args), max(sizes.values()))
        assert problem is None, (seed, problem)
    assert len(replays) == 3


TRAINED = [("silu_and_mul", {"tokens": 3, "inter": 1000}, 1000),
           ("rms_norm", {"tokens": 5, "hidden": 4096}, 4096),
           ("apply_rotary_pos_emb", {"tokens": 7, "heads": 8, "kv_heads": 2, "head_dim": 128}, 128),
           ("partial_rotary_emb", {"tokens": 3, "heads": 16, "nope_dim": 128, "rope_dim": 64, "v_dim": 128}, 64)]


@pytest.mark.parametrize("name, sizes, reduce_dim", TRAINED, ids=[n for n, _, _ in TRAINED])
def test_custom_op_bodies_replay_their_launches(name, sizes, reduce_dim, monkeypatch):
    """Under autograd the forward and the backward go through the custom op's body
    (torch_ops.Launches): recorded on the first step, replayed on later steps with new values;
    outputs and gradients stay right (compared with the float64 reference's)."""
    import importlib

    from dlcore.runtime import replay
    from dlcore.testing import upcast

    replays = []
    original = replay.Template.run
    monkeypatch.setattr(replay.Template, "run", lambda self, args: replays.append(name) or original(self, args))
    module = importlib.import_module(f"dlblas_kernels.{name}")
    public, op = getattr(module, name), registry().op(name)
    differentiable = op.differentiable()
    for seed in range(4):
        args = op.example_inputs(sizes, torch.float16, "cuda", seed)
        leaves = tuple(a.detach().requires_grad_(i in differentiable) if isinstance(a, torch.Tensor) else a
                       for i, a in enumerate(args))
        out = public(*leaves)
        outs = out if isinstance(out, tuple) else (out,)
        grads = [torch.randn_like(o) for o in outs]
        got = torch.autograd.grad(outs, [leaves[i] for i in differentiable], grads)
        wide = tuple(a.detach().requires_grad_(i in differentiable) if isinstance(a, torch.Tensor) else a
                     for i, a in enumerate(upcast(*args)))
        ref = op.reference(*wide)
        refs = ref if isinstance(ref, tuple) else (ref,)
        want = torch.autograd.grad(refs, [wide[i] for i in differentiable], [g.double() for g in grads])
        for a, b in zip((*outs, *got), (*refs, *want)):
            problem = mismatch(a, (b.detach(),), reduce_dim)
            assert problem is None, (name, seed, problem)
    assert len(replays) >= 3, "later steps replay (forward, backward or both)"


@pytest.mark.parametrize("mode", ["fwd", "bwd"])
def test_graph_timer_times_forwards_and_backwards(mode):
    """--timer cudagraph: each implementation captured and replayed, backwards included (their
    forwards run on the timer's stream, so their kernels are captured too)."""
    from dlcore.bench.harness import default_timer, run_bench
    from dlcore.bench.presets import Shape

    device = torch.device("cuda")
    op = registry().op("rms_norm")
    timer, name = default_timer(device, registry().backend_for(device), rep_ms=5, kind="cudagraph")
    report = run_bench(op, [Shape({"tokens": 64, "hidden": 1024})], dtype=torch.bfloat16, device=device,
                       mode=mode, baselines=("torch",), timer=timer, timer_name=name, rounds=1)
    (result,) = report.shapes
    assert not result.notes, result.notes
    assert 0 < result.ms("dlcore") < 1 and 0 < result.ms("torch") < 1
