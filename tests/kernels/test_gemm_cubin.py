"""Every launch variant of the GEMM block (dlblas_kernels.blocks.gemm) and matmul's backward compiles to a
cubin for cuda:80, cuda:90 and cuda:100 on a CPU-only machine: plans built on ``meta`` tensors,
each launch through ``triton.compile`` in a process without ``TRITON_INTERPRET``. The descriptor
variants are planned for an sm_90 profile (where they run) and compiled for every target; the
warp-specialised ones for sm_90 alone (the only target whose plans take them; Triton fails them on
sm_100), where their programs must come out specialised."""

from __future__ import annotations

import pytest
from isolated import run_json

# A fresh interpreter compiles every variant to a cubin.
pytestmark = pytest.mark.slow

SCRIPT = """
import dataclasses, json, re, torch
from triton.backends.compiler import GPUTarget
from dlcore.compiler.lowering import compile_call, target_profile
from dlblas_kernels.blocks import gemm
from dlblas_kernels.kernels import matmul

hopper = target_profile("cuda:90")
ampere = target_profile("cuda:80")
small = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}

def e(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, device="meta", dtype=dtype)

def variants():
    a, w, c, bias, rstd = e(300, 256), e(200, 256), e(300, 200), e(200), e(300, dtype=torch.float32)
    epi = gemm.Epilogue(bias=bias, activation="gelu_tanh")
    yield "pointers", gemm.gemm_calls(a, w.T, c, {**small, "TMA": 0}, hopper, epilogue=epi)[0]
    yield "split-k pointers", gemm.gemm_calls(a, w.T, c, {**small, "TMA": 0, "SPLIT_K": 4}, ampere, epilogue=epi)[0]
    yield "descriptors", gemm.gemm_calls(a, w.T, c, small, hopper, epilogue=epi)[0]
    yield "descriptors b row-major", gemm.gemm_calls(a, e(256, 200), c, {**small, "FLATTEN": 0}, hopper)[0]
    yield "split-k descriptors", gemm.gemm_calls(a, w.T, c, {**small, "SPLIT_K": 2}, hopper, epilogue=epi)[0]
    yield "descriptors a transposed", gemm.gemm_calls(e(256, 320).T, w.T, e(320, 200), small, hopper)[0]
    yield "activation gradient", gemm.gemm_calls(a, w.T, c, small, hopper, epilogue=gemm.Epilogue(
        bias=bias, activation="silu", act_grad=c))[0]
    for name, profile in (("swiglu descriptors", hopper), ("swiglu pointers", ampere)):
        yield name, gemm.swiglu_calls(a, None, None, rstd, c, small, profile, w13=e(400, 256), gate=c, up=e(300, 200))
    dc = e(300, 200)
    yield "matmul backward", matmul.backward_plan((dc, a, w.T, bias, "relu", False), small, hopper).calls
    yield "matmul float32 tf32", gemm.gemm_calls(a.float(), w.T.float(), c.float(), {**small, "BLOCK_K": 32}, hopper,
                                                 input_precision="tf32")[0]
    ws = {**small, "BLOCK_M": 128, "BLOCK_N": 128, "WARP_SPECIALIZE": 1}
    yield "warp-specialised descriptors", gemm.gemm_calls(a, w.T, c, ws, hopper, epilogue=epi)[0]
    yield "warp-specialised, flatten asked", gemm.gemm_calls(a, w.T, c, {**ws, "FLATTEN": 1}, hopper)[0]
    yield "warp-specialised split-k", gemm.gemm_calls(a, w.T, c, {**ws, "SPLIT_K": 2}, hopper)[0][:1]
    yield "8 warps, specialisation asked", gemm.gemm_calls(a, w.T, c, {**ws, "num_warps": 8}, hopper)[0]

found = {}
for name, calls in variants():
    for call in calls:
        specialised = "specialis" in name
        for capability in (90,) if specialised else (80, 90, 100):
            kernel = compile_call(call, GPUTarget("cuda", capability, 32))
            found[f"{name}/{call.kernel.__name__}/sm_{capability}"] = len(kernel.asm.get("cubin", b""))
            if specialised:
                found[f"{name}/partitions"] = len(set(re.findall(r"partition[0-9]+\\(", kernel.asm["ttgir"])))
print(json.dumps(found))
"""

VARIANTS = {
    "pointers": ["gemm_kernel"],
    "split-k pointers": ["gemm_kernel", "splitk_reduce_kernel"],
    "descriptors": ["gemm_tma_kernel"],
    "descriptors b row-major": ["gemm_tma_kernel"],
    "split-k descriptors": ["gemm_tma_kernel", "splitk_reduce_kernel"],
    "descriptors a transposed": ["gemm_tma_kernel"],
    "activation gradient": ["gemm_tma_kernel"],
    "swiglu descriptors": ["gemm_tma_kernel"],
    "swiglu pointers": ["gemm_kernel"],
    "matmul backward": ["gemm_tma_kernel", "column_sum_kernel"],
    "matmul float32 tf32": ["gemm_tma_kernel"],
}


@pytest.fixture(scope="module")
def compiled():
    return run_json(SCRIPT, None, TRITON_INTERPRET="0")


@pytest.mark.parametrize("capability", [80, 90, 100])
@pytest.mark.parametrize("variant", VARIANTS)
def test_compiles_to_cubin(compiled, variant, capability):
    for kernel in VARIANTS[variant]:
        key = f"{variant}/{kernel}/sm_{capability}"
        assert compiled.get(key, 0) > 0, f"{key} not compiled: {sorted(compiled)}"


# warp-specialised variant -> the partitions Triton gives its program on sm_90 (a producer and two
# consumers; none where it ignores the request)
SPECIALISED = {
    "warp-specialised descriptors": 2,
    "warp-specialised, flatten asked": 2,  # loop_flags turns the flattening off
    "warp-specialised split-k": 2,
    "8 warps, specialisation asked": 0,  # what warp_specialize_constraints keeps out of the spaces
}


@pytest.mark.parametrize("variant", SPECIALISED)
def test_warp_specialised_descriptor_kernel(compiled, variant):
    assert compiled.get(f"{variant}/gemm_tma_kernel/sm_90", 0) > 0, sorted(compiled)
    assert compiled[f"{variant}/partitions"] == SPECIALISED[variant]
