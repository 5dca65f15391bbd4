"""flash_attention_v2's forward and the attention block's forward (dlblas_kernels.blocks.attention) against
the float64 reference of ``softmax(scale * q k^T) v``: odd sizes (Sq, Sk no multiple of a block,
Sq != Sk both ways), every head dimension, GQA and MQA, causal or not, out and lse, outputs poisoned
first; rows that see no key; q, k and v sliced from a packed projection; the rotary tiles against
apply_rotary_pos_emb's reference; bad inputs; the cubins; bfloat16 on a GPU at the benchmark shape.

On a CPU the descriptor path runs in the interpreter under a profile that claims sm_90."""

from __future__ import annotations

import dataclasses

import dlblas_kernels
import pytest
import torch
from conftest import ON_GPU
from dlblas_kernels.blocks import attention
from dlblas_kernels.kernels.apply_rotary_pos_emb import apply_rotary_pos_emb_reference
from dlblas_kernels.kernels.flash_attention_v2 import (
    KERNEL,
    OP,
    attended_pairs,
    cost,
    default_config,
    flash_attention_v2_reference,
    flash_attention_v2_training_reference,
    space,
)
from isolated import run_json

from dlcore import InvalidInputError
from dlcore.compiler.lowering import target_profile
from dlcore.declarations.implementation import LaunchPlan
from dlcore.declarations.signature import make_signature
from dlcore.testing import assert_close, poison, randn, upcast

TRITON = KERNEL.implementation
# Blocks of 16 rows and keys: every test shape spans several, with ragged last ones.
SMALL = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=2)


def inputs(batch, sq, sk, hq, hk, d, dtype, device, gen):
    q = randn(batch, sq, hq, d, dtype=dtype, device=device, generator=gen)
    k = randn(batch, sk, hk, d, dtype=dtype, device=device, generator=gen)
    v = randn(batch, sk, hk, d, dtype=dtype, device=device, generator=gen)
    return q, k, v


def check(out, lse, q, k, v, causal, softmax_scale=None):
    """out and lse against the float64 reference; P is rounded to the input dtype before its
    product with v (as every flash kernel does): the tolerance of a reduction over Sk."""
    want_out, want_lse = flash_attention_v2_training_reference(*upcast(q, k, v), causal, softmax_scale)
    assert_close(out, want_out, q.dtype, reduce_dim=k.shape[1])
    assert lse.dtype == torch.float32
    assert_close(lse, want_lse, torch.float32, reduce_dim=q.shape[-1])


def forward(q, k, v, causal, profile, config=SMALL, rotary=None, scale=None):
    """The block's launches on fresh outputs, poisoned first: ``(out, lse)``."""
    out = poison(torch.empty(q.shape, dtype=q.dtype, device=q.device))
    lse = poison(torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=q.device))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    calls = attention.forward_calls(q, k, v, out, lse, causal=causal, scale=scale, config=config,
                                    profile=profile, rotary=rotary)
    LaunchPlan(calls, (out, lse)).run()
    return out, lse


@pytest.fixture(params=["pointers", "descriptors"])
def profile_of_path(request, profile, device):
    """The profile that takes one load path: the device's (pointers off Hopper), or one claiming sm_90."""
    if request.param == "descriptors":
        return dataclasses.replace(profile, arch="sm_90")
    return profile if profile.arch != "sm_90" else dataclasses.replace(profile, arch="sm_80")


SHAPES = [
    # batch, Sq, Sk, Hq, Hk, D, causal
    (1, 37, 37, 2, 1, 64, False),
    (1, 37, 37, 2, 1, 64, True),
    (2, 20, 45, 4, 2, 96, True),    # Sq < Sk: the diagonal starts 25 keys in
    (1, 45, 20, 2, 2, 128, True),   # Sq > Sk: the first 25 rows see no key
    (1, 19, 33, 3, 3, 192, False),
    (2, 17, 9, 4, 1, 256, False),   # MQA
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-q{}-k{}-h{}:{}-d{}{}".format(*s[:6], "-causal" * s[6]))
def test_matches_reference(shape, dtype, device, gen, run):
    *sizes, causal = shape
    q, k, v = inputs(*sizes, dtype, device, gen)
    out, lse = run(OP, TRITON, (q, k, v, causal, None, True), SMALL)
    check(out, lse, q, k, v, causal)


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_every_head_dimension(d, causal, dtype, device, gen, profile):
    q, k, v = inputs(1, 5, 11, 2, 1, d, dtype, device, gen)
    check(*forward(q, k, v, causal, profile), q, k, v, causal)


@pytest.mark.parametrize("shape", [(1, 23, 40, 4, 2, 96, True), (2, 33, 20, 2, 1, 64, True),
                                   (1, 17, 17, 2, 2, 192, False)], ids=["q23-k40-d96", "q33-k20-d64", "q17-k17-d192"])
def test_both_load_paths(shape, profile_of_path, dtype, device, gen):
    *sizes, causal = shape
    q, k, v = inputs(*sizes, dtype, device, gen)
    calls = attention.forward_calls(q, k, v, torch.empty_like(q), torch.empty(0), causal=causal, scale=1.0,
                                    config=SMALL, profile=profile_of_path)
    assert calls[0].kwargs["TMA"] == (profile_of_path.arch == "sm_90")
    check(*forward(q, k, v, causal, profile_of_path), q, k, v, causal)


@pytest.mark.parametrize("shape", [(1, 37, 37, 2, 1, 64, False), (1, 37, 37, 2, 1, 64, True),
                                   (2, 20, 45, 4, 2, 96, True), (1, 45, 20, 2, 2, 128, True),
                                   (2, 17, 9, 4, 1, 256, False)],
                         ids=["q37-k37-d64", "q37-k37-d64-causal", "q20-k45-d96-causal", "q45-k20-d128-causal",
                              "q17-k9-d256"])
def test_warp_specialised_loop(shape, dtype, device, gen, profile):
    """WARP_SPECIALIZE: one loop over every key block, each masked (Triton specialises one loop a
    kernel, without a branch in it), on the descriptor path; rows that see no key still get 0 and
    -inf. Pointer loads and the rotary kernel keep the two loops."""
    *sizes, causal = shape
    q, k, v = inputs(*sizes, dtype, device, gen)
    hopper = dataclasses.replace(profile, arch="sm_90")
    config = dict(SMALL, WARP_SPECIALIZE=1)
    for where, specialised in ((hopper, True), (dataclasses.replace(profile, arch="sm_80"), False)):
        calls = attention.forward_calls(q, k, v, torch.empty_like(q), torch.empty(0), causal=causal, scale=1.0,
                                        config=config, profile=where)
        assert calls[0].kwargs["WARP_SPECIALIZE"] is specialised
        out, lse = forward(q, k, v, causal, where, config)
        assert not out.isnan().any()
        check(out, lse, q, k, v, causal)
    cos = sin = torch.ones(k.shape[1], q.shape[-1], dtype=dtype, device=device)
    rotary = attention.forward_calls(q, k, v, torch.empty_like(q), torch.empty(0), causal=causal, scale=1.0,
                                     config=config, profile=hopper, rotary=(cos, sin, False))
    assert rotary[0].kwargs["WARP_SPECIALIZE"] is False


def test_rows_that_see_no_key(dtype, device, gen, profile):
    """Causal with Sq > Sk: the first Sq - Sk rows see no key: out 0, lse -inf, no NaN anywhere."""
    q, k, v = inputs(1, 40, 7, 2, 1, 64, dtype, device, gen)
    out, lse = forward(q, k, v, True, profile)
    assert not out.isnan().any() and not lse.isnan().any()
    assert (out[:, :33] == 0).all() and (lse[:, :, :33] == float("-inf")).all()
    assert lse[:, :, 33:].isfinite().all()
    check(out, lse, q, k, v, True)
    # and no key at all
    empty = k[:, :0]
    out, lse = forward(q, empty, empty, False, profile)
    assert (out == 0).all() and (lse == float("-inf")).all()


@pytest.mark.parametrize("config", [
    dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1),
    dict(BLOCK_M=16, BLOCK_N=32, num_warps=2, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
], ids=lambda c: "{BLOCK_M}x{BLOCK_N}".format(**c))
def test_configs(config, device, gen, profile):
    q, k, v = inputs(1, 40, 53, 2, 1, 64, torch.float32, device, gen)
    for causal in (False, True):
        check(*forward(q, k, v, causal, profile, config), q, k, v, causal)


def test_softmax_scale(device, gen, run):
    q, k, v = inputs(1, 21, 30, 2, 1, 64, torch.float32, device, gen)
    out, lse = run(OP, TRITON, (q, k, v, True, 0.3, True), SMALL)
    check(out, lse, q, k, v, True, 0.3)


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_packed_projection_without_copy(heads, dtype, device, gen, profile):
    """q, k and v as views of one qkv projection ``[B, S, Hq + 2 Hk, D]`` (and ``[B, S, 3, H, D]``):
    the kernel reads them in place, no copy."""
    hq, hk = heads
    qkv = randn(2, 29, hq + 2 * hk, 64, dtype=dtype, device=device, generator=gen)
    q, k, v = qkv[:, :, :hq], qkv[:, :, hq:hq + hk], qkv[:, :, hq + hk:]
    if hq == hk:
        q, k, v = qkv.view(2, 29, 3, hq, 64).unbind(2)
    out = poison(torch.empty(q.shape, dtype=dtype, device=device))
    lse = poison(torch.empty(2, hq, 29, device=device))
    (call,) = attention.forward_calls(q, k, v, out, lse, causal=True, scale=0.125, config=SMALL, profile=profile)
    assert all(a is t for a, t in zip(call.args, (q, k, v)))
    call.launch()
    check(out, lse, q, k, v, True, 0.125)


def test_head_dimension_stride(dtype, device, gen, profile):
    """Every other element of wider heads: a D stride of 2 (the pointer loads take any strides)."""
    q, k, v = inputs(1, 19, 26, 2, 1, 64, dtype, device, gen)
    wide = [poison(torch.empty(*t.shape[:-1], 128, dtype=dtype, device=device)) for t in (q, k, v)]
    views = [w[..., ::2].copy_(t) for w, t in zip(wide, (q, k, v))]
    check(*forward(*views, False, profile), q, k, v, False)


# --- rotary --------------------------------------------------------------------------------------

def rotated_reference(q, k, v, cos, sin, interleaved, causal):
    """apply_rotary_pos_emb's reference on q (the table's last Sq rows) and on k, then attention."""
    sq, sk = q.shape[1], k.shape[1]
    q64, k64, cos64, sin64 = upcast(q, k, cos, sin)
    q_rot, _ = apply_rotary_pos_emb_reference(q64, q64, cos64[..., sk - sq:, :], sin64[..., sk - sq:, :], interleaved)
    _, k_rot = apply_rotary_pos_emb_reference(k64, k64, cos64, sin64, interleaved)
    # The kernel rounds the rotated tiles to the input dtype, as the unfused rotary kernel's output is.
    q_rot, k_rot = q_rot.to(q.dtype).double(), k_rot.to(k.dtype).double()
    return flash_attention_v2_training_reference(q_rot, k_rot, v.double(), causal)


ROTARY_CASES = [
    # batch, Sq, Sk, Hq, Hk, D, causal, table
    (1, 20, 37, 4, 2, 64, True, "shared"),
    (2, 21, 21, 2, 1, 96, False, "batched"),
    (1, 13, 21, 2, 2, 128, True, "transposed"),
]


def check_rotary(case, interleaved, dtype, device, gen, profile):
    """ROTARY: the tiles rotated after loading equal apply_rotary_pos_emb's reference followed by
    attention; cos and sin ``[Sk, D]``, ``[B, Sk, D]``, or stored transposed."""
    *sizes, causal, table = case
    batch, _, sk, _, _, d = sizes
    q, k, v = inputs(*sizes, dtype, device, gen)
    lead = (batch,) if table == "batched" else ()
    cos, sin = (randn(*lead, sk, d, dtype=dtype, device=device, generator=gen) for _ in range(2))
    if table == "transposed":
        cos, sin = cos.T.contiguous().T, sin.T.contiguous().T
    out, lse = forward(q, k, v, causal, profile, rotary=(cos, sin, interleaved))
    want_out, want_lse = rotated_reference(q, k, v, cos, sin, interleaved, causal)
    assert_close(out, want_out, dtype, reduce_dim=sk)
    assert_close(lse, want_lse, torch.float32, reduce_dim=d)


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate-half", "interleaved"])
@pytest.mark.parametrize("case", ROTARY_CASES, ids=["q20-k37-d64-causal", "q21-k21-d96", "q13-k21-d128-causal"])
def test_rotary_tiles(case, interleaved, dtype, device, gen, profile):
    check_rotary(case, interleaved, dtype, device, gen, profile)


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate-half", "interleaved"])
def test_rotary_tiles_beside_descriptors(interleaved, device, gen, profile):
    """On Hopper the k tiles and their cos and sin rows take descriptors (a pair of halves, or whole
    interleaved rows split), as v and out do; the q tile, rotated once, pointer loads."""
    hopper = dataclasses.replace(profile, arch="sm_90")
    check_rotary(ROTARY_CASES[0], interleaved, torch.float16, device, gen, hopper)


# --- key padding ---------------------------------------------------------------------------------

def bounds(batch, sk, padding, device):
    """``(kv_start, kv_end)`` int32 ``[B]`` of a padded batch: ``left`` (valid keys a suffix, as
    transformers' generate pads), ``right`` (a prefix) or ``both``; the rows differ, one is unpadded,
    one sees no key at all, and one bound lies outside ``[0, Sk]`` (clamped)."""
    cut = [0, 3, sk // 2 + 1, sk, 1][:batch]
    start = torch.tensor([-2 if c == 0 else c for c in cut], dtype=torch.int32, device=device)
    end = torch.tensor([sk + 5 if c == 0 else sk - c for c in cut], dtype=torch.int32, device=device)
    return {"left": (start, None), "right": (None, end), "both": (start, end - 1)}[padding]


def check_padded(out, lse, q, k, v, causal, kv_start, kv_end):
    want_out, want_lse = flash_attention_v2_training_reference(*upcast(q, k, v), causal, None, True, kv_start, kv_end)
    assert_close(out, want_out, q.dtype, reduce_dim=k.shape[1])
    assert_close(lse, want_lse, torch.float32, reduce_dim=q.shape[-1])


PADDED_SHAPES = [
    # batch, Sq, Sk, Hq, Hk, D, causal
    (4, 37, 37, 4, 2, 32, True),    # prefill: left-padded rows see no key before their first valid one
    pytest.param((4, 37, 37, 4, 2, 32, False), marks=pytest.mark.slow),
    (3, 20, 45, 2, 1, 24, True),    # a chunk against a longer cache
    (5, 1, 41, 4, 1, 16, True),     # a decoding step: the decode block
]
PADDED_IDS = ["q37-k37-gqa-causal", "q37-k37-gqa", "q20-k45-d24-causal", "q1-k41-decode"]


@pytest.mark.parametrize("padding", ["left", "right", "both"])
@pytest.mark.parametrize("shape", PADDED_SHAPES, ids=PADDED_IDS)
def test_key_padding(shape, padding, device, gen, run):
    """kv_start and kv_end mask each batch's keys outside them, causal bottom-right over the whole
    Sk; rows that see no key give 0 and -inf (the op's plan: the prefill kernel, or the decode block)."""
    *sizes, causal = shape
    q, k, v = inputs(*sizes, torch.float32, device, gen)
    kv_start, kv_end = bounds(q.shape[0], k.shape[1], padding, device)
    out, lse = run(OP, TRITON, (q, k, v, causal, None, True, kv_start, kv_end), SMALL)
    check_padded(out, lse, q, k, v, causal, kv_start, kv_end)
    if causal and padding == "left" and q.shape[1] == k.shape[1]:
        assert (out[1, :3] == 0).all() and torch.isneginf(lse[1, :, :3]).all()


@pytest.mark.parametrize("padding", ["left", "right"])
def test_key_padding_both_load_paths(padding, profile_of_path, device, gen):
    """The prefill kernel's pointer and descriptor loads, 16-key blocks, with the padding masks."""
    q, k, v = inputs(4, 29, 35, 4, 2, 32, torch.float32, device, gen)
    kv_start, kv_end = bounds(4, 35, padding, device)
    out = poison(torch.empty_like(q))
    lse = poison(torch.empty(4, 4, 29, device=device))
    calls = attention.forward_calls(q, k, v, out, lse, causal=True, scale=32 ** -0.5, config=SMALL,
                                    profile=profile_of_path, kv_start=kv_start, kv_end=kv_end)
    LaunchPlan(calls, (out, lse)).run()
    check_padded(out, lse, q, k, v, True, kv_start, kv_end)


@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("causal", [pytest.param(False, marks=pytest.mark.slow), True], ids=["full", "causal"])
def test_key_padding_backward(causal, padding, device, gen):
    """dq, dk and dv through the custom op against autograd through the float64 reference (GQA);
    the keys a batch does not see get zero dk and dv."""
    q, k, v = (t.requires_grad_() for t in inputs(4, 23, 23, 4, 2, 16, torch.float32, device, gen))
    kv_start, kv_end = bounds(4, 23, padding, device)
    out = dlblas_kernels.flash_attention_v2(q, k, v, causal, None, False, kv_start, kv_end)
    dout = randn(*out.shape, dtype=out.dtype, device=device, generator=gen)
    got = torch.autograd.grad(out, (q, k, v), dout)
    wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = flash_attention_v2_reference(*wide, causal, None, False, kv_start, kv_end)
    expected = torch.autograd.grad(want, wide, dout.double())
    assert_close(out, want, torch.float32, reduce_dim=23)
    for g, e in zip(got, expected):
        assert_close(g, e, torch.float32, reduce_dim=23)
    seen = torch.arange(23, device=device)[None, :]
    seen = (seen >= (kv_start if kv_start is not None else 0)[..., None]) if padding == "left" \
        else (seen < kv_end[:, None])
    assert (got[1][~seen] == 0).all() and (got[2][~seen] == 0).all()


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_key_padding_backward_longer(causal, device, gen):
    """Both bounds, Sq < Sk, MQA and a head of 40 over several of the backward's blocks."""
    q, k, v = (t.requires_grad_() for t in inputs(3, 37, 70, 4, 1, 40, torch.float32, device, gen))
    kv_start, kv_end = bounds(3, 70, "both", device)
    out = dlblas_kernels.flash_attention_v2(q, k, v, causal, None, False, kv_start, kv_end)
    dout = randn(*out.shape, dtype=out.dtype, device=device, generator=gen)
    got = torch.autograd.grad(out, (q, k, v), dout)
    wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = flash_attention_v2_reference(*wide, causal, None, False, kv_start, kv_end)
    for g, e in zip(got, torch.autograd.grad(want, wide, dout.double())):
        assert_close(g, e, torch.float32, reduce_dim=70)


def test_key_padding_compiles_out_when_absent(device, gen, profile):
    """Without kv_start and kv_end every launch is the unpadded kernel (the padding code is
    constexpr-gated); with one, only its flag is set."""
    q, k, v = inputs(2, 20, 20, 2, 1, 16, torch.float32, device, gen)
    lse = torch.empty(2, 2, 20, device=device)
    (call,) = attention.forward_calls(q, k, v, torch.empty_like(q), lse, causal=True, scale=0.25, config=SMALL,
                                      profile=profile)
    assert not call.kwargs["KV_START"] and not call.kwargs["KV_END"]
    start = torch.zeros(2, dtype=torch.int32, device=device)
    (call,) = attention.forward_calls(q, k, v, torch.empty_like(q), lse, causal=True, scale=0.25, config=SMALL,
                                      profile=profile, kv_start=start)
    assert call.kwargs["KV_START"] and not call.kwargs["KV_END"]


@pytest.mark.parametrize("bound, expected", [
    (lambda b: torch.zeros(b + 1, dtype=torch.int32), r"\[B\]"),
    (lambda b: torch.zeros(b, dtype=torch.int64), "int32"),
    (lambda b: torch.zeros(b, 1, dtype=torch.int32), "rank"),
], ids=["batch", "dtype", "rank"])
@pytest.mark.parametrize("name", ["kv_start", "kv_end"])
def test_bad_key_padding_names_the_argument(name, bound, expected, device, gen, no_launch):
    q, k, v = inputs(2, 7, 7, 4, 2, 16, torch.float32, device, gen)
    with pytest.raises(InvalidInputError, match=rf"\b{name}\b"):
        dlblas_kernels.flash_attention_v2(q, k, v, **{name: bound(2).to(device)})


def test_torch_baseline_takes_key_padding(device, gen):
    q, k, v = inputs(3, 9, 12, 4, 2, 16, torch.float32, device, gen)
    kv_start, kv_end = bounds(3, 12, "both", device)
    got = OP.baselines["torch"]()(q, k, v, True, 0.2, False, kv_start, kv_end)
    want = flash_attention_v2_reference(*upcast(q, k, v), True, 0.2, False, kv_start, kv_end)
    assert_close(got, want, torch.float32, reduce_dim=12)


# --- the op --------------------------------------------------------------------------------------

def test_public_function_and_get_op(device, gen):
    import dlcore

    q, k, v = inputs(2, 37, 37, 4, 2, 64, torch.float32, device, gen)
    out = dlblas_kernels.flash_attention_v2(q, k, v, causal=True)
    assert isinstance(out, torch.Tensor)
    assert_close(out, flash_attention_v2_reference(*upcast(q, k, v), True), torch.float32, reduce_dim=37)
    out, lse = dlcore.get_op("flash_attention_v2", (q, k, v), {"return_lse": True})(q, k, v, return_lse=True)
    check(out, lse, q, k, v, False)


@pytest.mark.parametrize("batch, sq, sk, hq", [(0, 1, 9, 4), (0, 5, 9, 4), (2, 0, 9, 4), (2, 5, 0, 4), (2, 5, 9, 0)],
                         ids=["no-batch-decode", "no-batch", "no-queries", "no-keys", "no-heads"])
def test_empty_inputs(batch, sq, sk, hq, device, gen):
    """Empty inputs give empty (or, without keys, zero) outputs: no launch divides by a count of 0."""
    q, k, v = inputs(batch, sq, sk, hq, 2, 16, torch.float32, device, gen)
    out, lse = dlblas_kernels.flash_attention_v2(q, k, v, return_lse=True)
    assert out.shape == q.shape and lse.shape == (batch, hq, sq)
    if sk == 0:
        assert (out == 0).all()


@pytest.mark.parametrize("change, name", [
    (lambda q, k, v: (q, k[:1], v[:1]), "k"),                    # batch
    (lambda q, k, v: (q, k[..., :32], v[..., :32]), "k"),        # head dimension
    (lambda q, k, v: (q[:, :, :3], k, v), "k"),                  # 2 kv heads do not divide 3
    (lambda q, k, v: (q, k, v[:, :5]), "v"),                     # Sk of v
    (lambda q, k, v: (q, k, v.half()), "v"),                     # dtype
    (lambda q, k, v: (q[0], k, v), "q"),                         # rank
    (lambda q, k, v: (q.new_zeros(2, 7, 4, 320), k.new_zeros(2, 7, 2, 320), v.new_zeros(2, 7, 2, 320)), "q"),
], ids=["batch", "head_dim", "heads", "kv_seq", "dtype", "rank", "head_dim>256"])
def test_bad_inputs_name_the_argument(change, name, device, gen, no_launch):
    q, k, v = change(*inputs(2, 7, 7, 4, 2, 64, torch.float32, device, gen))
    with pytest.raises(InvalidInputError, match=rf"\b{name}\b"):
        dlblas_kernels.flash_attention_v2(q, k, v)


@pytest.mark.parametrize("shape", [(2, 9, 9, 4, 2, True), (1, 7, 12, 2, 1, True), (1, 12, 7, 2, 2, False)],
                         ids=["q9-k9-gqa-causal", "q7-k12-causal", "q12-k7"])
def test_torch_baseline(shape, device, gen):
    """The eager-torch baseline (SDPA, torch's choice of backend) computes the op, causal bottom-right."""
    batch, sq, sk, hq, hk, causal = shape
    q, k, v = inputs(batch, sq, sk, hq, hk, 32, torch.float32, device, gen)
    got = OP.baselines["torch"]()(q, k, v, causal, 0.2)
    assert_close(got, flash_attention_v2_reference(*upcast(q, k, v), causal, 0.2), torch.float32, reduce_dim=sk)


def test_cost_counts_attended_pairs():
    assert attended_pairs(8, 8, False) == 64
    assert attended_pairs(8, 8, True) == 36
    for sq, sk in ((5, 11), (11, 5), (1, 9), (9, 1), (7, 7)):
        rows = torch.arange(sq)[:, None]
        keys = torch.arange(sk)[None, :]
        assert attended_pairs(sq, sk, True) == int((keys <= rows + sk - sq).sum())
    q, k = torch.empty(2, 8192, 16, 128, dtype=torch.bfloat16), torch.empty(2, 8192, 16, 128, dtype=torch.bfloat16)
    _, flops = cost((q, k, k, False, None, False))
    assert flops == 4 * 2 * 16 * 8192 * 8192 * 128
    _, causal = cost((q, k, k, True, None, False))
    assert causal == 4 * 2 * 16 * 128 * 8192 * 8193 // 2


def test_default_config_fits_the_device():
    hopper = target_profile("cuda:90")
    for d in (64, 96, 128, 192, 256):
        for dtype in (torch.bfloat16, torch.float32):
            q = torch.empty(2, 8192, 16, d, dtype=dtype, device="meta")
            config = default_config(make_signature(OP, (q, q, q, True, None, False), q.device), hopper)
            if d <= 128 and dtype == torch.bfloat16:
                assert space(hopper).is_valid(config) is None, config
            assert attention.fit(config, d, q.element_size(), hopper) == config
    # the rotary tiles pipeline cos and sin beside k, and hold the rotated k: 128 x 128 blocks fit 2 stages
    config = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)
    assert attention.fit(config, 128, 2, hopper, rotary=True) == {**config, "num_stages": 2}


def test_space_offers_no_warp_specialised_loop_unless_asked():
    """Triton 3.6.0's specialised loop gave wrong outputs on sm_90 at S 8192 (space's docstring):
    the space a tuner searches holds none; asked for, only 4-warp programs of 128 rows on sm_90."""
    hopper = target_profile("cuda:90")
    assert not any(c["WARP_SPECIALIZE"] for c in space(hopper).configs())
    assert "WARP_SPECIALIZE" in space(hopper).is_valid(dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=2,
                                                            WARP_SPECIALIZE=1))
    asked = [c for c in space(hopper, warp_specialize=True).configs() if c["WARP_SPECIALIZE"]]
    assert asked and all(c["num_warps"] == 4 and c["BLOCK_M"] == 128 for c in asked)


def test_blocks_within_the_npu_unified_buffer():
    """On npu the forward's blocks are at most :data:`attention.NPU_BLOCKS`: bishengir-compile 1.2
    overflowed the Ascend 910B's 192 KiB unified buffer with 128 x 128 causal blocks (D 64 and 128)
    and 128-row blocks at D 256 (192 and 256); the backward's preprocess takes 32 rows of heads of
    256. CUDA keeps its tiles."""
    from dlblas_kernels.blocks import attention_grad

    npu, hopper = target_profile("npu:Ascend910B2"), target_profile("cuda:90")
    expected = {(64, False): (128, 128), (64, True): (128, 64), (128, False): (128, 128), (128, True): (128, 64),
                (192, False): (64, 64), (192, True): (64, 32), (256, False): (64, 64), (256, True): (64, 32)}
    for (d, causal), blocks in expected.items():
        q = torch.empty(1, 1024, 16, d, dtype=torch.bfloat16, device="meta")
        out, lse = torch.empty_like(q), torch.empty(1, 16, 1024, device="meta")
        sig = make_signature(OP, (q, q, q, causal, None, False), q.device)
        for profile, want in ((npu, blocks), (hopper, None)):
            config = default_config(sig, profile)
            (call,) = attention.forward_calls(q, q, q, out, lse, causal=causal, scale=1.0, config=config,
                                              profile=profile)
            got = (call.kwargs["BLOCK_M"], call.kwargs["BLOCK_N"])
            fitted = attention.fit(config, d, 2, profile)
            assert got == (want or (fitted["BLOCK_M"], fitted["BLOCK_N"])), (d, causal, profile.backend, got)
    assert [attention_grad.preprocess_rows(w, npu) for w in (64, 128, 256)] == [64, 64, 32]
    assert [attention_grad.preprocess_rows(w, hopper) for w in (64, 128, 256)] == [64, 64, 64]


# --- compiled ------------------------------------------------------------------------------------

CUBIN_SCRIPT = """
import json, re, torch
from triton.backends.compiler import GPUTarget
from dlcore.compiler.lowering import compile_call, target_profile
from dlblas_kernels.blocks.attention import forward_calls

def e(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, device="meta", dtype=dtype)

def variants():
    hopper, ampere = target_profile("cuda:90"), target_profile("cuda:80")
    config = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}
    for d, causal in ((128, False), (96, True)):
        q, k, out, lse = e(2, 300, 8, d), e(2, 300, 2, d), e(2, 300, 8, d), e(2, 8, 300, dtype=torch.float32)
        yield f"descriptors d{d}", forward_calls(q, k, k, out, lse, causal=causal, scale=0.1, config=config,
                                                 profile=hopper)
        if d == 128:
            yield "pointers", forward_calls(q, k, k, out, lse, causal=causal, scale=0.1, config=config,
                                            profile=ampere)
        else:
            yield "rotary", forward_calls(q, k, k, out, lse, causal=causal, scale=0.1, config=config,
                                          profile=hopper, rotary=(e(300, d), e(300, d), True))
        specialised = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 4, "num_stages": 2, "WARP_SPECIALIZE": 1}
        yield f"warp-specialised d{d}", forward_calls(q, k, k, out, lse, causal=causal, scale=0.1,
                                                      config=specialised, profile=hopper)

found = {}
for name, calls in variants():
    for call in calls:
        assert call.kwargs["TMA"] == (not name.startswith("pointers")), name
        assert call.kwargs["WARP_SPECIALIZE"] == name.startswith("warp-specialised"), name
        # the specialised loop only for sm_90, whose plans alone take it
        for capability in (90,) if call.kwargs["WARP_SPECIALIZE"] else (80, 90, 100):
            kernel = compile_call(call, GPUTarget("cuda", capability, 32))
            found[f"{name}/sm_{capability}"] = len(kernel.asm.get("cubin", b""))
            if call.kwargs["WARP_SPECIALIZE"]:
                found[f"{name}/partitions"] = len(set(re.findall(r"partition[0-9]+\\(", kernel.asm["ttgir"])))
                found[f"{name}/shared"] = kernel.metadata.shared
print(json.dumps(found))
"""


@pytest.mark.slow
def test_forward_compiles_to_cubin():
    compiled = run_json(CUBIN_SCRIPT, None, TRITON_INTERPRET="0")
    specialised = ("warp-specialised d128", "warp-specialised d96")
    model = attention.shared_memory_bytes(
        {"BLOCK_M": 128, "BLOCK_N": 128, "num_stages": 2, "WARP_SPECIALIZE": 1}, 128, 2)
    for name in specialised:  # a producer and two consumer warpgroups; the model to within the barriers
        assert compiled.pop(f"{name}/partitions") == 2, name
        assert 0 <= compiled.pop(f"{name}/shared") - model <= 1024, name
    expected = {f"{name}/sm_{capability}" for name in ("descriptors d128", "descriptors d96", "pointers", "rotary")
                for capability in (80, 90, 100)}
    expected |= {f"{name}/sm_90" for name in specialised}
    assert set(compiled) == expected
    assert all(size > 0 for size in compiled.values()), compiled


# --- GPU -----------------------------------------------------------------------------------------

def float32_attention(q, k, v, causal):
    """``(out, lse)`` in float32 one (batch, head) at a time (an [S, S] score matrix each)."""
    batch, sq, hq, _ = q.shape
    sk, hk = k.shape[1:3]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, hq, sq, dtype=torch.float32, device=q.device)
    for b in range(batch):
        for h in range(hq):
            g = h // (hq // hk)
            o, m = flash_attention_v2_training_reference(q[b:b + 1, :, h:h + 1].float(), k[b:b + 1, :, g:g + 1].float(),
                                                         v[b:b + 1, :, g:g + 1].float(), causal)
            out[b, :, h], lse[b, h] = o[0, :, 0], m[0, 0]
    return out, lse


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="bfloat16 against a float32 reference needs a GPU")
@pytest.mark.parametrize("causal", [False, True])
def test_bfloat16_at_the_benchmark_shape(causal, gen):
    """B 2, H 16, S 8192, D 128 in bfloat16 against float32 attention on the same values: the
    output's error at most SDPA flash's own plus a quarter of bfloat16's tolerance; lse within
    float32's tolerance of a reduction over D."""
    from dlblas_kernels.blocks.sdpa import sdpa_attention as sdpa
    from torch.nn.attention import SDPBackend

    q, k, v = inputs(2, 8192, 8192, 16, 16, 128, torch.bfloat16, "cuda", gen)
    out, lse = dlblas_kernels.flash_attention_v2(q, k, v, causal=causal, return_lse=True)
    want_out, want_lse = float32_attention(q, k, v, causal)
    theirs = sdpa(q, k, v, causal, None, SDPBackend.FLASH_ATTENTION)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    error, baseline = (out.float() - want_out).abs().max().item(), (theirs.float() - want_out).abs().max().item()
    assert error <= baseline + 1.6e-2 / 4, f"error {error:.3g}, SDPA flash {baseline:.3g}"
    assert_close(lse, want_lse.double(), torch.float32, reduce_dim=128)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="the descriptor path at every head dimension needs a GPU")
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_bfloat16_every_head_dimension_on_gpu(d, gen):
    """The default config of each head dimension (descriptors on Hopper), causal with Sq < Sk and GQA."""
    q, k, v = inputs(2, 1000, 1500, 8, 2, d, torch.bfloat16, "cuda", gen)
    out, lse = dlblas_kernels.flash_attention_v2(q, k, v, causal=True, return_lse=True)
    want_out, want_lse = float32_attention(q, k, v, True)
    assert (out.float() - want_out).abs().max().item() <= 1.6e-2
    assert_close(lse, want_lse.double(), torch.float32, reduce_dim=d)
