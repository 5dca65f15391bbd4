"""The decode block of flash attention (dlblas_kernels.blocks.attention_decode) through ``decode_calls``:
the split kernel alone (one split) and with the combine kernel (several), against the float64
formula ``softmax(scale * q k^T) v`` with the bottom-right causal mask, and its log-sum-exp.

On a CPU the kernels run in the interpreter at tiny sizes, a config naming the split count and a
16-key block so that the sizes below are no multiple of it and several splits occur."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import ON_GPU
from dlblas_kernels.blocks import attention_decode as decode
from isolated import run_json

from dlcore import InvalidInputError
from dlcore.compiler.lowering import target_profile
from dlcore.testing import assert_close, poison, randn, tolerance

SMALL = {"BLOCK_N": 16, "num_warps": 4, "num_stages": 2}
H200 = dataclasses.replace(target_profile("cuda:90"), name="NVIDIA H200", cores=132, shared_memory_per_program=232448)


def reference(q, k, v, causal: bool, scale: float):
    """``(out, lse)`` of the plain formula in the inputs' dtype: a row that sees no key gives 0, -inf."""
    sq, hq, sk, hk = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(hq // hk, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(hq // hk, dim=1)
    s = scale * qh @ kh.transpose(-1, -2)
    if causal:
        visible = torch.arange(sk, device=q.device)[None, :] <= torch.arange(sq, device=q.device)[:, None] + sk - sq
        s = s.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(lse.isinf(), 0.0, lse)[..., None])
    return (p @ vh).transpose(1, 2), lse


def outputs(q):
    batch, sq, hq, _ = q.shape
    return poison(torch.empty_like(q)), poison(torch.empty(batch, hq, sq, dtype=torch.float32, device=q.device))


def attend(q, k, v, causal, profile, config=None, scale=None):
    """Plan and launch; return ``(out, lse, names of the kernels launched)``."""
    out, lse = outputs(q)
    calls, scratch = decode.decode_calls(q, k, v, out, lse, causal=causal, scale=scale or q.shape[-1] ** -0.5,
                                         profile=profile, config=config)
    assert len(scratch) == 2 * (len(calls) > 1), "the split partials are handed back as scratch"
    for call in calls:
        call.launch()
    return out, lse, [c.kernel.__name__ for c in calls]


def check(q, k, v, out, lse, causal, scale=None):
    scale = scale or q.shape[-1] ** -0.5
    ref_out, ref_lse = reference(q.double(), k.double(), v.double(), causal, scale)
    assert_close(out, ref_out, q.dtype, reduce_dim=k.shape[1])
    visible = ~ref_lse.isinf()
    assert torch.equal(lse.isinf().cpu(), ref_lse.isinf().cpu()), "the rows that see no key differ"
    assert_close(lse[visible], ref_lse[visible], torch.float32, reduce_dim=q.shape[-1])


def qkv(batch, sq, sk, hq, hk, d, dtype, device, gen):
    return (randn(batch, sq, hq, d, dtype=dtype, device=device, generator=gen),
            randn(batch, sk, hk, d, dtype=dtype, device=device, generator=gen),
            randn(batch, sk, hk, d, dtype=dtype, device=device, generator=gen))


@pytest.mark.parametrize("batch, sq, sk, hq, hk, d, splits, causal", [
    (1, 1, 37, 4, 1, 64, 3, False),     # GQA 4/1, three splits, the last ragged
    (2, 1, 53, 8, 2, 128, 1, False),    # GQA 8/2, one split: written straight to out
    (1, 3, 45, 8, 2, 96, 2, True),      # causal, D 96 (a masked d)
    (1, 2, 45, 8, 4, 96, 2, True),      # GQA 2/1 causal
    (2, 2, 29, 2, 2, 192, 2, True),     # MHA, D 192
    (1, 4, 70, 4, 1, 256, 4, True),     # D 256, four splits
    (1, 2, 1, 4, 2, 64, 1, True),       # one key
    (1, 1, 600, 2, 1, 256, 38, False),  # 38 splits: the combine merges them 32 at a time
], ids=["gqa4-3splits", "gqa4-1split", "causal-d96", "gqa2-causal", "mha-d192", "d256-4splits", "one-key",
        "38splits"])
def test_matches_reference(batch, sq, sk, hq, hk, d, splits, causal, dtype, device, profile, gen):
    q, k, v = qkv(batch, sq, sk, hq, hk, d, dtype, device, gen)
    out, lse, names = attend(q, k, v, causal, profile, {**SMALL, "SPLITS": splits})
    assert names == ["decode_split_kernel"] + (["decode_combine_kernel"] if splits > 1 else [])
    check(q, k, v, out, lse, causal)


@pytest.mark.parametrize("splits", [1, 2])
def test_rows_that_see_no_key(splits, dtype, device, profile, gen):
    """Causal with Sq > Sk: query i sees keys j <= i - 4, so rows 0..3 see none (out 0, lse -inf, no
    NaN); with two splits rows 4..19 see none of the second split (a -inf partial merged)."""
    q, k, v = qkv(1, 24, 20, 2, 2, 64, dtype, device, gen)
    out, lse, _ = attend(q, k, v, True, profile, {**SMALL, "SPLITS": splits})
    assert torch.all(out[:, :4] == 0) and torch.all(lse[..., :4] == -math.inf)
    check(q, k, v, out, lse, True)


def test_strided_inputs(dtype, device, profile, gen):
    """k and v slices of a KV cache ``[B, Smax, Hk, D][:, :Sk]`` (k and v interleaved in one buffer),
    q a slice of a packed projection with every other element of D (a D stride of 2), and a scale
    given."""
    batch, sq, sk, hq, hk, d = 2, 2, 41, 4, 2, 64
    cache = randn(batch, 64, 2, hk, d, dtype=dtype, device=device, generator=gen)
    k, v = cache[:, :sk, 0], cache[:, :sk, 1]
    q = randn(batch, sq, hq + 2, 2 * d, dtype=dtype, device=device, generator=gen)[:, :, 1:hq + 1, ::2]
    out, lse, _ = attend(q, k, v, True, profile, {**SMALL, "SPLITS": 3}, scale=0.3)
    check(q, k, v, out, lse, True, scale=0.3)


def test_heuristic_config(device, profile, gen):
    """The device's own config (splits from its cores) gives the same result."""
    q, k, v = qkv(1, 1, 300, 8, 2, 64, torch.float32, device, gen)
    out, lse, _ = attend(q, k, v, False, profile)
    check(q, k, v, out, lse, False)


def meta(batch, sq, sk, hq, hk, d, dtype=torch.bfloat16):
    return (torch.empty(batch, sq, hq, d, device="meta", dtype=dtype),
            torch.empty(batch, sk, hk, d, device="meta", dtype=dtype))


@pytest.mark.parametrize("batch, sk, expected", [(1, 65536, 33), (1, 32768, 33), (1, 16384, 16), (1, 4096, 16),
                                                 (1, 1024, 16), (8, 65536, 4), (8, 4096, 2), (64, 4096, 1)])
def test_splits_fill_the_device(batch, sk, expected):
    """GQA 32/8 on an H200: B * Hk * splits makes whole waves: one program a multiprocessor, two
    (what one holds at these tiles) from 32768 keys on; one split once the kv heads alone fill the
    device."""
    q, k = meta(batch, 1, sk, 32, 8, 128)
    config = decode.default_config(q, k, H200)
    assert config["SPLITS"] == expected
    assert config["num_stages"] * 2 * config["BLOCK_N"] * 128 * 2 <= H200.shared_memory_per_program


@pytest.mark.parametrize("sq, hq, hk, expected", [(1, 32, 8, True), (16, 32, 8, True), (17, 32, 8, False),
                                                  (64, 16, 16, True), (128, 16, 16, False)])
def test_use_decode(sq, hq, hk, expected):
    q, k = meta(2, sq, 4096, hq, hk, 128)
    assert decode.use_decode(q, k, H200) is expected


def launched_tensors(plan):
    return [a for call in plan.calls for a in call.args if isinstance(a, torch.Tensor)]


@pytest.mark.parametrize("sk, return_lse", [(4096, False), (4096, True), (64, False)], ids=["splits", "splits-lse",
                                                                                           "one-split"])
def test_op_plans_declare_the_split_scratch(sk, return_lse):
    """flash_attention_v2's plans (the bound op's and the custom op's) hand their launches only
    inputs, results and declared scratch: what a bound op needs to replay its recorded launches
    (dlcore.runtime.replay.Replay) rather than plan again on every call. Undeclared, the split
    partials kept every decode call on the planning path (about 100 us of host time)."""
    from dlblas_kernels.kernels.flash_attention_v2 import plan, training_plan

    q = torch.zeros(1, 1, 32, 128)
    k, v = torch.zeros(1, sk, 8, 128), torch.zeros(1, sk, 8, 128)
    args = (q, k, v, False, None, return_lse)
    for make in (plan, training_plan):
        found = make(args, {}, H200)
        results = found.result if isinstance(found.result, tuple) else (found.result,)
        known = {id(t) for t in (q, k, v, *results, *found.scratch)}
        assert all(id(t) in known for t in launched_tensors(found)), make.__name__
        combine = ["decode_combine_kernel"] if sk > 64 else []
        assert [c.kernel.__name__ for c in found.calls] == ["decode_split_kernel", *combine]
        assert len(found.scratch) == (2 if sk > 64 else 0) + (make is plan and not return_lse)
        assert all(t.storage_offset() == 0 for t in found.scratch)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="launches are recorded for compiled kernels only")
def test_bound_op_replays_decode(gen):
    """On a GPU the bound op's first decode call records its two launches and later calls replay
    them (fresh outputs and scratch each time), with the same result."""
    from dlblas_kernels.kernels.flash_attention_v2 import KERNEL

    from dlcore.runtime.runner import launches

    q, k, v = qkv(1, 1, 4096, 32, 8, 128, torch.bfloat16, "cuda", gen)
    run = launches(KERNEL.implementation, {}, None)
    args = (q, k, v, False, None, False)
    first = run(args).clone()
    recordings = list(run.recordings.values())
    assert len(recordings) == 1 and recordings[0] is not None, "the decode launches were not recorded"
    assert len(recordings[0].launches) == 2 and len(recordings[0].scratch) == 3
    poison(first.new_empty(4 << 20))  # the caching allocator's next blocks hold garbage, not the last results
    again = run(args)
    assert torch.equal(again, first)
    ref_out, _ = reference(q.float(), k.float(), v.float(), False, 128 ** -0.5)
    atol, rtol = tolerance(torch.bfloat16)
    torch.testing.assert_close(again.float(), ref_out, atol=atol, rtol=rtol)


BAD = {
    "heads": (meta(1, 1, 8, 6, 4, 64), "kv heads"),
    "head_dim": (meta(1, 1, 8, 4, 2, 320), "head dimension"),
    "dtype": ((meta(1, 1, 8, 4, 2, 64)[0], meta(1, 1, 8, 4, 2, 64, torch.float16)[1]), "dtype"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_inputs(case):
    (q, k), words = BAD[case]
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device="meta")
    with pytest.raises(InvalidInputError, match=words):
        decode.decode_calls(q, k, k, out, lse, causal=False, scale=1.0, profile=H200)


def test_rotary_is_not_implemented():
    q, k = meta(1, 1, 8, 4, 2, 64)
    lse = torch.empty(1, 4, 1, device="meta")
    with pytest.raises(NotImplementedError):
        decode.decode_calls(q, k, k, torch.empty_like(q), lse, causal=False, scale=1.0, profile=H200,
                            rotary=(k, k, False))


CUBIN_SCRIPT = """
import json, torch
from triton.backends.compiler import GPUTarget
from dlcore.compiler.lowering import compile_call, target_profile
from dlblas_kernels.blocks import attention_decode as decode

def e(*shape, dtype):
    return torch.empty(*shape, device="meta", dtype=dtype)

found = {}
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    for name, (sq, d, splits) in {"one split": (1, 128, 1), "split": (2, 96, 8), "wide": (1, 256, 4)}.items():
        q, k = e(1, sq, 32, d, dtype=dtype), e(1, 4096, 8, d, dtype=dtype)
        out, lse = e(1, sq, 32, d, dtype=dtype), e(1, 32, sq, dtype=torch.float32)
        for call in decode.decode_calls(q, k, k, out, lse, causal=sq > 1, scale=0.1, profile=target_profile("cuda:90"),
                                        config={"SPLITS": splits})[0]:
            for capability in (80, 90, 100):
                kernel = compile_call(call, GPUTarget("cuda", capability, 32))
                key = f"{name}/{call.kernel.__name__}/{str(dtype)[6:]}/sm_{capability}"
                found[key] = len(kernel.asm.get("cubin", b""))
print(json.dumps(found))
"""


@pytest.mark.slow
def test_every_kernel_compiles_to_cubin():
    compiled = run_json(CUBIN_SCRIPT, None, TRITON_INTERPRET="0")
    kernels = {"one split": ["decode_split_kernel"], "split": ["decode_split_kernel", "decode_combine_kernel"],
               "wide": ["decode_split_kernel", "decode_combine_kernel"]}
    expected = {f"{name}/{kernel}/{dtype}/sm_{capability}" for name, names in kernels.items() for kernel in names
                for dtype in ("bfloat16", "float16", "float32") for capability in (80, 90, 100)}
    assert set(compiled) == expected
    assert all(size > 0 for size in compiled.values()), compiled


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="bfloat16 against a float32 reference needs a GPU")
def test_bfloat16_decode_on_gpu(profile, gen):
    """The benchmark's shape, Sq 1 against Sk 65536, GQA 32/8, D 128, B 1, with the device's own
    config (several splits): bfloat16 against the float32 formula on the same values."""
    q, k, v = qkv(1, 1, 65536, 32, 8, 128, torch.bfloat16, "cuda", gen)
    out, lse, names = attend(q, k, v, False, profile)
    assert names == ["decode_split_kernel", "decode_combine_kernel"]
    ref_out, ref_lse = reference(q.float(), k.float(), v.float(), False, 128 ** -0.5)
    atol, rtol = tolerance(torch.bfloat16)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), ref_out, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-4)
