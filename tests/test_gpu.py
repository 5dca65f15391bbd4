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
