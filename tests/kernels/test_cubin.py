"""The backward kernels, and the forward variants the ops' examples do not reach, compile for real
NVIDIA targets on a CPU-only machine (``tests/test_compile.py`` compiles the forward plans of the
examples): plans built on ``meta`` tensors, each launch through ``triton.compile`` for
``GPUTarget('cuda', 80|90, 32)``, in a process without ``TRITON_INTERPRET``."""

from __future__ import annotations

import pytest
from isolated import run_json

# A fresh interpreter compiles every variant to a cubin.
pytestmark = pytest.mark.slow

SCRIPT = """
import importlib, json, torch
from triton.backends.compiler import GPUTarget
from dlcore.compiler.lowering import compile_call
from dlcore.runtime.template import UNKNOWN_DEVICE as profile

rms, silu, add, rope, mla, gate = (importlib.import_module("dlblas_kernels.kernels." + name) for name in
                                   ("rms_norm", "silu_and_mul", "add_rms_norm", "apply_rotary_pos_emb",
                                    "partial_rotary_emb", "topk_gating"))

def e(*shape, dtype):
    return torch.empty(*shape, device="meta", dtype=dtype)

def plans(dtype):
    x, w = e(37, 300, dtype=dtype), e(300, dtype=dtype)
    one_block, looping = {"BLOCK_M": 4, "BLOCK_N": 512, "num_warps": 4}, {"BLOCK_M": 1, "BLOCK_N": 128, "num_warps": 2}
    yield "rms_norm.backward", rms.backward_plan((x, x, w, None, 1e-6), one_block, profile)
    yield "rms_norm.backward.looping+dres", rms.backward_plan((x, x, w, x, 1e-6), looping, profile)
    yield "add_rms_norm.looping", add.plan((x, w, x, 1e-6), looping, profile)
    yield "silu_and_mul.backward", silu.backward_plan((e(37, 300, dtype=dtype), e(37, 600, dtype=dtype)),
                                                      {"BLOCK_N": 256, "num_warps": 2}, profile)
    q, k, cos = e(2, 7, 8, 64, dtype=dtype), e(2, 7, 2, 64, dtype=dtype), e(7, 64, dtype=dtype)
    four = {"BLOCK_H": 4, "num_warps": 4}
    yield "apply_rotary_pos_emb.interleaved", rope.plan((q, k, cos, cos, True, False), four, profile)
    yield "apply_rotary_pos_emb.backward", rope.backward_plan((q, k, cos, cos, False), four, profile)
    q, k, cos = e(3, 5, 1, 2, dtype=dtype), e(3, 5, 3, 2, dtype=dtype), e(3, 5, 2, dtype=dtype)
    yield "apply_rotary_pos_emb.tiny", rope.plan((q, k, cos, cos, True, False), {"BLOCK_H": 1, "num_warps": 1}, profile)
    q, k_pe, kv, cos = e(2, 7, 8, 192, dtype=dtype), e(2, 7, 1, 64, dtype=dtype), e(2, 7, 8, 256, dtype=dtype), \\
        e(2, 7, 64, dtype=dtype)
    yield "partial_rotary_emb.backward", mla.backward_plan(
        (q, e(2, 7, 2, 8, 192, dtype=dtype), cos, cos, k_pe, kv, 128, 64, 128), {"BLOCK_H": 4, "num_warps": 4}, profile)
    q, k_pe, kv, cos = e(4, 3, 2, dtype=dtype), e(4, 1, 2, dtype=dtype), e(4, 3, 1, dtype=dtype), e(4, 2, dtype=dtype)
    yield "partial_rotary_emb.tiny", mla.plan((q, k_pe, kv, cos, cos, 0, 2, 1), {"BLOCK_H": 2, "num_warps": 1}, profile)
    logits, top = e(300, 256, dtype=dtype), {"BLOCK_S": 32, "num_warps": 16}
    yield "topk_gating.e256.k8", gate.plan((logits, 8, 1.0, 2), top, profile)
    grads = (e(1, dtype=torch.float32)[0], e(2400, dtype=torch.float32))
    kept = (e(2400, dtype=torch.int32), e(256, dtype=torch.int32))
    yield "topk_gating.backward", gate.backward_plan((*grads, logits, *kept, 8), top, profile)

found = {}
for dtype, capability in ((torch.bfloat16, 90), (torch.float16, 80), (torch.float32, 80)):
    for name, plan in plans(dtype):
        for call in plan.calls:
            kernel = compile_call(call, GPUTarget("cuda", capability, 32))
            found[f"{name}/{call.kernel.__name__}/{str(dtype)[6:]}/sm_{capability}"] = len(kernel.asm.get("cubin", b""))
print(json.dumps(found))
"""

VARIANTS = ["rms_norm.backward", "rms_norm.backward.looping+dres", "add_rms_norm.looping", "silu_and_mul.backward",
            "apply_rotary_pos_emb.interleaved", "apply_rotary_pos_emb.backward", "apply_rotary_pos_emb.tiny",
            "partial_rotary_emb.backward", "partial_rotary_emb.tiny", "topk_gating.e256.k8", "topk_gating.backward"]
TARGETS = ["bfloat16/sm_90", "float16/sm_80", "float32/sm_80"]


@pytest.fixture(scope="module")
def compiled():
    return run_json(SCRIPT, None, TRITON_INTERPRET="0")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_compiles_to_cubin(compiled, variant, target):
    keys = [k for k in compiled if k.startswith(f"{variant}/") and k.endswith(f"/{target}")]
    assert keys, f"nothing compiled for {variant} {target}: {sorted(compiled)}"
    assert all(compiled[k] > 0 for k in keys), keys
