"""get_op on CUDA tensors: the cuda backend, real timing, bfloat16; the warm launch path against
real compiled kernels. Skipped without a GPU."""

import json
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

import dlcore
from dlcore.declarations.implementation import KernelCall, LaunchPlan
from dlcore.plugins.registry import registry
from dlcore.runtime import internals, launch, replay
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
    # ffn has a vendor candidate (cuBLAS through torch), which may win: the kernel is checked too
    assert bound.impl.name in ("triton", "torch"), bound.explain()
    assert bound.profile.backend == "cuda" and bound.profile.arch.startswith("sm_")
    for chosen in (bound, dlcore.get_op(name, args, impl="triton")):
        out = chosen(*args)
        torch.cuda.synchronize()
        problem = mismatch(out, reference_result(op, args), sizes.get("hidden", 1))
        assert problem is None, f"{chosen.impl.name}: {problem}"


def test_selection_times_candidates_with_do_bench():
    op = registry().op("rms_norm")
    args = op.example({"tokens": 4096, "hidden": 4096}, torch.bfloat16, torch.device("cuda"), torch.Generator())
    backend = registry().backend_for(args[0].device)
    elapsed = backend.timer(lambda: op.reference(*args), args[0].device)
    assert 0 < elapsed < 100
    bound = dlcore.get_op("rms_norm", args, impl="reference")
    assert "cuda" in bound.explain()


def test_get_op_matmul_is_no_slower_than_cublas():
    """Few rows and a large K, where cuBLAS beats the Triton kernel: get_op measured both and
    returns something no slower than torch.matmul (2% for noise; alternating, best of three)."""
    from triton.testing import do_bench

    g = torch.Generator().manual_seed(0)
    a = torch.randn(128, 4096, generator=g).to("cuda", torch.bfloat16)
    b = (torch.randn(4096, 4096, generator=g) / 64).to("cuda", torch.bfloat16)
    bound = dlcore.get_op("matmul", (a, b))
    assert {"torch", "triton"} <= set(bound.selection.measured), bound.explain()
    ours, vendor = [], []
    for _ in range(3):
        ours.append(do_bench(lambda: bound(a, b), return_mode="median"))
        vendor.append(do_bench(lambda: torch.matmul(a, b), return_mode="median"))
    assert min(ours) <= 1.02 * min(vendor), (ours, vendor, bound.explain())


def test_the_vendor_matmul_keeps_float32_exact_unless_tf32_is_allowed():
    """allow_tf32=False is IEEE float32 even where the process asked for TF32, and the process's
    setting is untouched after the call."""
    from dlblas_kernels import vendor

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 1024, generator=g).cuda(), torch.randn(1024, 256, generator=g).cuda()
    reference = a.double() @ b.double()
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # TF32 for the process
    try:
        exact = (vendor.matmul(a, b, allow_tf32=False).double() - reference).abs().max().item()
        tf32 = (vendor.matmul(a, b, allow_tf32=True).double() - reference).abs().max().item()
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)
    assert exact < 5e-3 < tf32, (exact, tf32)


def test_warm_path_respects_every_specialization():
    """Bound ops (launch templates) and the launcher (plans run outside bound ops: the public
    functions, tuning) reuse compiled kernels only for arguments Triton would specialize alike."""
    import dlblas_kernels

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
    assert any(found.compiled for found in launch._entries.values() if found is not None)


REPLAYED = [("silu_and_mul", {"tokens": 3, "inter": 1000}), ("matmul", {"tokens": 37, "hidden": 200, "inter": 96}),
            ("ffn", {"tokens": 5, "hidden": 256, "inter": 192})]


@pytest.mark.parametrize("name, sizes", REPLAYED, ids=[n for n, _ in REPLAYED])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset"])
def test_bound_ops_replay_their_launches(name, sizes, offset, monkeypatch):
    """A bound op records its launches on the first call and replays them on later calls with the
    same exact inputs (new values each time); the results stay right and each is a new tensor."""
    replays = []
    original = replay.Recording.run
    monkeypatch.setattr(replay.Recording, "run", lambda self, args: replays.append(name) or original(self, args))
    op = registry().op(name)

    def inputs(seed):
        args = op.example_inputs(sizes, torch.float16, "cuda", seed)
        if offset:  # the first tensor at an address that is not 16-byte aligned
            first = args[0]
            flat = torch.empty(first.numel() + 1, dtype=first.dtype, device=first.device)
            args = (flat[1:].view(first.shape).copy_(first), *args[1:])
        return args

    bound = dlcore.get_op(name, inputs(0), impl="triton")  # not the vendor candidate, which may win here
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

    from dlcore.testing import upcast

    replays = []
    original = replay.Recording.run
    monkeypatch.setattr(replay.Recording, "run", lambda self, args: replays.append(name) or original(self, args))
    module = importlib.import_module(f"dlblas_kernels.kernels.{name}")
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


def _in_a_new_thread(fn):
    import threading

    found = []
    thread = threading.Thread(target=lambda: found.append(fn()))
    thread.start()
    thread.join()
    assert found, "the thread raised (see the warning above)"
    return found[0]


def test_a_launch_recorded_in_one_thread_replays_in_another(monkeypatch):
    """Kernels built on device-side tensor descriptors (the GEMM block's persistent kernel) ask
    Triton's allocator for scratch, and Triton keeps the allocator per thread: a bound matmul
    recorded here replays in new threads, and a training step of ffn whose backward was recorded
    on autograd's device thread replays on the caller's thread once device threads are off."""
    allocating = []
    original = replay.Recording.run
    monkeypatch.setattr(replay.Recording, "run",
                        lambda self, args: allocating.append(self.allocates) or original(self, args))
    op = registry().op("matmul")
    args = op.example_inputs({"tokens": 512, "hidden": 1024, "inter": 768}, torch.bfloat16, "cuda", 0)
    bound = dlcore.get_op("matmul", args, impl="triton")
    expected = reference_result(op, args)
    assert mismatch(bound(*args), expected, 1024) is None
    for _ in range(2):
        assert mismatch(_in_a_new_thread(lambda: bound(*args)), expected, 1024) is None
    assert any(allocating), "the matmul took the descriptor kernel (else this test shows nothing)"

    ffn = registry().op("ffn")
    args = ffn.example_inputs({"tokens": 512, "hidden": 1024, "inter": 768}, torch.bfloat16, "cuda", 1)
    leaves = [a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
              for a in args]
    bound = dlcore.get_op("ffn", leaves, impl="triton")
    try:
        for threads in (True, False):
            torch.autograd.set_multithreading_enabled(threads)
            for _ in range(2):
                out = bound(*leaves)
                grads = torch.autograd.grad(out, [a for a in leaves if isinstance(a, torch.Tensor) and
                                                  a.requires_grad], torch.ones_like(out))
                assert all(torch.isfinite(g).all() for g in grads)
    finally:
        torch.autograd.set_multithreading_enabled(True)


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


@triton.jit
def scale_kernel(x_ptr, out_ptr, n, scale, BLOCK: tl.constexpr):
    # out = x * scale, one block of BLOCK elements per program
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * scale, mask=mask)


def scale_call(x: torch.Tensor, out: torch.Tensor, scale: float) -> KernelCall:
    return KernelCall(scale_kernel, (triton.cdiv(x.numel(), 256),), (x, out, x.numel(), scale),
                      {"BLOCK": 256, "num_warps": 4})


def by_triton(x: torch.Tensor, scale: float) -> torch.Tensor:
    out = torch.full_like(x, float("nan"))
    call = scale_call(x, out, scale)
    call.kernel[call.grid](*call.args, **call.kwargs)
    return out


@pytest.fixture
def direct(monkeypatch):
    """The launches that called a compiled kernel directly (not through Triton's JITFunction.run)."""
    seen = []
    original = launch.run_compiled

    def spy(*a):
        seen.append(a[0])
        return original(*a)

    monkeypatch.setattr(launch, "run_compiled", spy)
    monkeypatch.setattr(replay, "run_compiled", spy)
    return seen


INPUTS = [(4096, 0, torch.float32), (4096, 1, torch.float32), (1000, 0, torch.float16), (1, 0, torch.bfloat16)]


@pytest.mark.parametrize("n, offset, dtype", INPUTS, ids=[f"{n}-{o}-{d}" for n, o, d in INPUTS])
def test_the_warm_path_matches_triton_on_a_real_kernel(n, offset, dtype, direct):
    """Every specialization (size class, alignment, dtype): the first launch goes through Triton, the
    next ones call the compiled kernel; the results are Triton's, bit for bit."""
    flat = torch.randn(n + offset, device="cuda", dtype=dtype)
    x = flat[offset:]
    expected = by_triton(x, 3.0)
    for i in range(3):
        out = torch.full_like(x, float("nan"))
        launch.launch(scale_call(x, out, 3.0))
        assert torch.equal(out, expected), i
    assert len(direct) == 2


def test_replays_match_triton_on_a_real_kernel(direct):
    def plan(args, config):
        (x,) = args
        out, doubled = torch.empty_like(x), torch.empty_like(x)
        return LaunchPlan([scale_call(x, doubled, 2.0), scale_call(doubled, out, config["scale"])], out,
                          scratch=(doubled,))

    run = replay.Replay(plan, {"scale": 1.5}, None)
    for i in range(4):
        x = torch.randn(3000, device="cuda")
        assert torch.equal(run((x,)), by_triton(by_triton(x, 2.0), 1.5)), i
    assert len(direct) >= 6, "three replays of two launches each"
    assert all(t is not None for t in run.recordings.values())


def test_the_fallback_on_a_real_kernel(monkeypatch, direct):
    """A missing internal: one warning, then every launch (plain or replayed) through kernel[grid]."""
    checked = internals.check()
    checked.missing.append("triton.knobs.runtime.launch_enter_hook")
    monkeypatch.setattr(internals, "found", None)
    monkeypatch.setattr(launch, "_entries", {})
    monkeypatch.setattr(internals, "check", lambda: checked)

    def plan(args, config):
        out = torch.empty_like(args[0])
        return LaunchPlan([scale_call(args[0], out, 2.0)], out)

    run = replay.Replay(plan, {}, None)
    with pytest.warns(UserWarning, match="launch_enter_hook") as warned:
        for _ in range(3):
            x = torch.randn(2048, device="cuda")
            out = torch.empty_like(x)
            launch.launch(scale_call(x, out, 2.0))
            assert torch.equal(out, by_triton(x, 2.0))
            assert torch.equal(run((x,)), by_triton(x, 2.0))
    assert len(warned) == 1 and direct == []
    assert set(run.recordings.values()) == {None}, "nothing recorded"


FIRST_CALL = """
import json, sys, time, torch, triton
import dlcore
x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16, generator=None)
w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
op = dlcore.get_op("rms_norm", (x, w))
start = time.perf_counter()
out = op(x, w)
torch.cuda.synchronize()
ms = (time.perf_counter() - start) * 1e3
ref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
from triton.runtime.cache import triton_key
print(json.dumps({"ms": ms, "error": (out.float() - ref).abs().max().item(),
                  "triton_key": triton_key.cache_info().currsize}))
"""


def test_a_new_process_launches_from_the_shelf(tmp_path):
    """The first call of a new process whose kernels an earlier process launched: loaded from
    Triton's cache through the shelf, so Triton never hashes its installation (triton_key)."""
    env = dict(os.environ, DLCORE_CACHE_DIR=str(tmp_path))
    found = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", FIRST_CALL], env=env, capture_output=True, text=True, check=True)
        found.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = found
    assert first["triton_key"] == 1 and second["triton_key"] == 0, found
    assert first["error"] < 0.1 and second["error"] < 0.1, found
