"""get_op on CUDA tensors: the cuda backend, real timing, bfloat16. Skipped without a GPU."""

import pytest
import torch

import dlcore
from dlcore.registry import registry
from dlcore.verify import mismatch, reference_result

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

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
    """The launcher reuses compiled kernels only for arguments Triton would specialize alike."""
    from dlcore.launcher import _layouts

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
    assert any(layout.compiled for layout in _layouts.values())
