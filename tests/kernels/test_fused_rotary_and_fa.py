from __future__ import annotations

import dataclasses
import math
import os

import dlblas_kernels
import pytest
import torch
from conftest import ON_GPU
from dlblas_kernels import vendor
from dlblas_kernels.blocks import attention, attention_grad
from dlblas_kernels.kernels import fused_rotary_and_fa as fused_rotary_and_fa_module
from dlblas_kernels.kernels.apply_rotary_pos_emb import apply_rotary_pos_emb_reference
from dlblas_kernels.kernels.fused_rotary_and_fa import (
    KERNEL,
    OP,
    composite,
    fused_rotary_and_fa,
    fused_rotary_and_fa_reference,
    fused_rotary_and_fa_training_reference,
    training_plan,
)
from gradients import check_backward

import dlcore
from dlcore import InvalidInputError, NoKernelError
from dlcore.declarations.device import DeviceProfile
from dlcore.declarations.implementation import LaunchPlan, VendorImplementation
from dlcore.declarations.signature import Signature, TensorSpec, make_signature
from dlcore.plugins.registry import registry
from dlcore.runtime.template import device_profile
from dlcore.testing import assert_close, poison, randn, tolerance, upcast

TRITON = KERNEL.implementation
INTERLEAVED = [False, True]
COMPOSITE = vendor.FUSED_ROTARY_AND_FA


@pytest.fixture(autouse=True)
def triton_kernel_only(monkeypatch, triton_candidates_only):
    """These tests are about the Triton kernel: the composite vendor candidate is left out of
    get_op's selection (on a GPU it may rightly be faster), as the other vendor candidates are."""
    left_out = os.environ.get("DLCORE_DISABLE_IMPLS", "")
    monkeypatch.setenv("DLCORE_DISABLE_IMPLS", ",".join(filter(None, (left_out, "fused_rotary_and_fa:composite"))))


def inputs(b, sq, sk, hq, hk, d, dtype, device, gen, table_batch=False):
    """Random q, k, v, and cos and sin tables ``[Sk, D]`` (``[B, Sk, D]`` with ``table_batch``) of
    random angles, one per (row, column): rotations, as in a model, but without LLaMA's duplicated
    halves or its smooth rows, so that a wrong row or a wrong pairing shows."""
    q = randn(b, sq, hq, d, dtype=dtype, device=device, generator=gen)
    k = randn(b, sk, hk, d, dtype=dtype, device=device, generator=gen)
    v = randn(b, sk, hk, d, dtype=dtype, device=device, generator=gen)
    angles = torch.rand(*((b,) if table_batch else ()), sk, d, generator=gen, dtype=torch.float64) * 2 * math.pi
    return q, k, v, angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)


def check(out, args):
    q, k = args[0], args[1]
    assert out.shape == q.shape and out.is_contiguous()
    assert_close(out, fused_rotary_and_fa_reference(*upcast(*args)), q.dtype, reduce_dim=k.shape[1])


# -- the reference ---------------------------------------------------------------------------------


def softmax_attention(q, k, v, causal, scale):
    """softmax(scale q k^T) v for Sq == Sk, k and v repeated over the query heads of each group."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v), scores.logsumexp(-1)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("interleaved", INTERLEAVED, ids=["half", "interleaved"])
def test_reference_is_rotary_then_attention(causal, interleaved, gen):
    """apply_rotary_pos_emb's reference, then the plain softmax formula; with fewer queries, the last
    rows of the same computation (the queries are the last Sq positions)."""
    q, k, v, cos, sin = upcast(*inputs(2, 9, 9, 4, 2, 8, torch.float64, "cpu", gen, table_batch=True))
    q_rot, k_rot = apply_rotary_pos_emb_reference(q, k, cos, sin, interleaved)
    out, lse = softmax_attention(q_rot, k_rot, v, causal, 0.3)
    got, got_lse = fused_rotary_and_fa_training_reference(q, k, v, cos, sin, causal, 0.3, interleaved)
    torch.testing.assert_close(got, out)
    torch.testing.assert_close(got_lse, lse)
    last, last_lse = fused_rotary_and_fa_training_reference(q[:, 5:], k, v, cos, sin, causal, 0.3, interleaved)
    torch.testing.assert_close(last, out[:, 5:])
    torch.testing.assert_close(last_lse, lse[:, :, 5:])


def test_reference_rows_that_see_no_key_are_zero_without_nan(gen):
    q, k, v, cos, sin = (t.requires_grad_(i < 3) for i, t in
                         enumerate(upcast(*inputs(1, 7, 3, 2, 1, 8, torch.float64, "cpu", gen))))
    out, lse = fused_rotary_and_fa_training_reference(q, k, v, cos, sin, True)
    assert torch.equal(out[:, :4], torch.zeros_like(out[:, :4])) and bool((lse[:, :, :4] == float("-inf")).all())
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert not any(g.isnan().any() for g in grads) and not grads[0][:, :4].any()


def test_cost():
    q, k, v, cos, sin, *rest = OP.example({"batch": 2, "seq": 6, "kv_seq": 0, "heads": 4, "kv_heads": 2,
                                           "head_dim": 8, "causal": 1, "interleaved": 0}, torch.float16,
                                          torch.device("meta"), torch.Generator().manual_seed(0))
    args = (q, k, v, cos, sin, *rest)
    moved, flops = OP.cost(args)
    assert flops == 4 * 2 * 4 * 8 * 21  # 6 * 7 / 2 pairs under causal
    assert moved == 2 * (2 * q.numel() + 2 * k.numel() + 2 * cos.numel())
    moved_bwd, flops_bwd = OP.cost(args, mode="bwd")
    assert flops_bwd == 5 * flops // 2 and moved_bwd == moved + 2 * (q.numel() + 2 * k.numel()) + 2 * q.numel() \
        + 4 * 2 * 4 * 6


# -- the kernels -----------------------------------------------------------------------------------


# (B, Sq, Sk, Hq, Hk, D, tables [B, Sk, D]), causal: rows and keys not multiples of any block; fewer
# queries (the last 11 of 37 positions, D / 2 not a power of two); more queries than keys (causal).
SHAPES = [*(((2, 19, 19, 4, 2, 16, False), causal) for causal in (False, True)),
          *(((1, 11, 37, 3, 1, 24, True), causal) for causal in (False, True)),
          ((2, 5, 3, 2, 2, 8, False), True)]


@pytest.mark.parametrize("interleaved", INTERLEAVED, ids=["half", "interleaved"])
@pytest.mark.parametrize("shape, causal", SHAPES, ids=str)
def test_matches_reference(shape, causal, interleaved, dtype, device, gen, run):
    args = (*inputs(*shape[:6], dtype, device, gen, shape[6]), causal, None, interleaved)
    check(run(OP, TRITON, args), args)


def test_more_queries_than_keys_gives_zero_rows(device, gen, run):
    """Causal with Sq > Sk: the first Sq - Sk queries see no key (out 0, lse -inf, no NaN)."""
    args = (*inputs(1, 9, 4, 2, 1, 8, torch.float32, device, gen), True, 0.5, False)
    plan = training_plan(args, TRITON.default_config(make_signature(OP, args, args[0].device),
                                                     device_profile(args[0].device)), device_profile(args[0].device))
    for t in plan.result:
        t.fill_(float("nan"))
    out, lse = plan.run()
    ref_out, ref_lse = fused_rotary_and_fa_training_reference(*upcast(*args))
    assert_close(out, ref_out, torch.float32)
    assert not out[:, :5].any() and bool((lse[:, :, :5] == float("-inf")).all())
    torch.testing.assert_close(lse[:, :, 5:], ref_lse[:, :, 5:].float())


@pytest.mark.parametrize("layout", ["packed qkv", "heads first", "column step", "strided tables"])
def test_non_contiguous_inputs(layout, dtype, device, gen, run):
    q, k, v, cos, sin = inputs(2, 13, 13, 4, 2, 16, dtype, device, gen, table_batch=True)
    if layout == "packed qkv":  # slices of one [B, S, Hq + 2 Hk, D] projection
        qkv = torch.cat([q, k, v], dim=2)
        q, k, v = qkv[:, :, :4], qkv[:, :, 4:6], qkv[:, :, 6:]
    elif layout == "heads first":  # [B, H, S, D] storage seen as [B, S, H, D]
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    elif layout == "column step":  # every other element of wider heads: a D stride of 2
        q, k, v = (torch.stack([t, t], -1)[..., 0] for t in (q, k, v))
    else:
        cos, sin = (torch.stack([t, t], -1)[..., 0].transpose(0, 1).contiguous().transpose(0, 1) for t in (cos, sin))
    assert not all(t.is_contiguous() for t in (q, k, v, cos, sin))
    for interleaved in INTERLEAVED:
        args = (q, k, v, cos, sin, True, None, interleaved)
        check(run(OP, TRITON, args), args)


def gradient_terms(sq, sk, group, d):
    """The products behind a gradient element, for its tolerance: dq sums ``dS k`` over the Sk keys,
    dk and dv sum over the Sq queries of each of the group's heads, and each ``dS`` holds ``dout . v``
    (D products), rounded to the input dtype for the tensor cores as every flash backward does."""
    return d * max(sk, sq * group)


@pytest.mark.parametrize("interleaved", INTERLEAVED, ids=["half", "interleaved"])
@pytest.mark.parametrize("shape, causal", [
    *(((2, 13, 13, 4, 2, 16, False), causal) for causal in (False, True)),
    *(((1, 7, 20, 2, 1, 24, True), causal) for causal in (False, True)),
    ((1, 10, 6, 3, 3, 8, False), True),
], ids=str)
def test_backward_matches_reference(shape, causal, interleaved, dtype, device, gen):
    b, sq, sk, hq, hk, d, table_batch = shape
    args = (*inputs(b, sq, sk, hq, hk, d, dtype, device, gen, table_batch), causal, None, interleaved)
    check_backward(fused_rotary_and_fa, fused_rotary_and_fa_reference, args, (0, 1, 2), gen,
                   reduce_dim=gradient_terms(sq, sk, hq // hk, d))


@pytest.mark.parametrize("shape, causal, interleaved", [
    ((2, 7, 9, 4, 2, 16, False), False, False),  # [Sk, D] tables, summed over the batch; queries take the last rows
    ((2, 9, 9, 2, 2, 16, True), True, True),  # [B, Sk, D] tables
    ((1, 10, 6, 3, 3, 8, False), True, False),  # Sq > Sk: the first queries see no key and take no row
], ids=str)
def test_learnt_tables_get_their_gradients(shape, causal, interleaved, dtype, device, gen):
    """cos and sin requiring grad (learnt tables) get float64 autograd's gradients through the
    reference, with q, k and v's, as the unfused composite gives them."""
    b, sq, sk, hq, hk, d, table_batch = shape
    args = (*inputs(b, sq, sk, hq, hk, d, dtype, device, gen, table_batch), causal, None, interleaved)
    check_backward(fused_rotary_and_fa, fused_rotary_and_fa_reference, args, (0, 1, 2, 3, 4), gen,
                   reduce_dim=gradient_terms(sq, sk, hq // hk, d) * b * hq)


def test_tables_are_reduced_only_when_asked(device, gen, monkeypatch):
    """sin alone wanted: its gradient, none for cos; q alone: the tables' reduction does not run."""
    args = (*inputs(1, 5, 7, 2, 1, 8, torch.float32, device, gen), True, None, False)
    check_backward(fused_rotary_and_fa, fused_rotary_and_fa_reference, args, (4,), gen,
                   reduce_dim=gradient_terms(5, 7, 2, 8) * 2)
    monkeypatch.setattr(fused_rotary_and_fa_module, "table_gradients",
                        lambda *a: pytest.fail("the tables' gradients computed"))
    q = args[0].detach().requires_grad_()
    fused_rotary_and_fa(q, *args[1:]).sum().backward()
    assert q.grad is not None


@pytest.mark.parametrize("sq", [9, 6, 12])
def test_backward_rotates_into_scratch(sq, device, gen):
    """Any Sq: q and k rotated into scratch (q from the tables' last Sq rows), the attention backward
    without rotation, dq' and dk' rotated back (the transposed rotation). Every tensor a launch
    writes beyond the gradients is declared scratch, so the plan replays."""
    q, k, v, cos, sin = inputs(1, sq, 9, 2, 1, 16, torch.float32, device, gen)
    out, lse = torch.empty_like(q), torch.empty(1, 2, sq, device=device)
    assert KERNEL.backward.plan is attention_grad.rotary_backward_plan
    plan = attention_grad.rotary_backward_plan((torch.empty_like(q), q, k, v, cos, sin, out, lse, True, None, False),
                                               {}, device_profile(q.device))
    names = [call.kernel.__name__ for call in plan.calls]
    attention_kernels = ["attention_bwd_preprocess_kernel", "attention_dkdv_kernel", "attention_dq_kernel"]
    assert names == ["rotary_kernel", *attention_kernels, "rotary_kernel"]
    forward, *attention_calls, backward = plan.calls
    assert not forward.kwargs["BACKWARD"] and backward.kwargs["BACKWARD"]
    assert forward.args[8] == 9 - sq  # q's first table row
    assert len(plan.scratch) == 3 and [t.shape for t in plan.scratch[:2]] == [q.shape, k.shape]
    # dq' and dk', which the tables' gradients reduce, are results
    assert [t.shape for t in plan.result] == [q.shape, k.shape, v.shape, q.shape, k.shape]


def test_backward_non_contiguous_inputs(dtype, device, gen):
    q, k, v, cos, sin = inputs(2, 9, 9, 4, 2, 16, dtype, device, gen)
    qkv = torch.cat([q, k, v], dim=2)
    args = (qkv[:, :, :4], qkv[:, :, 4:6], qkv[:, :, 6:], cos, sin, True, 0.2, True)
    check_backward(fused_rotary_and_fa, fused_rotary_and_fa_reference, args, (0, 1, 2), gen,
                   reduce_dim=gradient_terms(9, 9, 2, 16))


@pytest.mark.parametrize("sq, sk", [(5, 7), (7, 4)])
def test_float64_custom_op_passes_gradcheck(sq, sk, gen):
    """float64 runs the references (the path torch.autograd.gradcheck takes): the forward's and the
    backward custom op's agree (the output only: lse is a residual callers never see)."""
    q, k, v, cos, sin = inputs(1, sq, sk, 2, 1, 8, torch.float64, "cpu", gen)
    op = torch.ops.dlblas.fused_rotary_and_fa.default
    ints = [0] * (len(op._schema.arguments) - len(OP.args))
    assert torch.autograd.gradcheck(lambda q, k, v: op(q, k, v, cos, sin, True, 0.4, True, *ints)[0],
                                    [t.requires_grad_() for t in (q, k, v)])


def test_opcheck(device, gen):
    """The custom op's schema, fake and autograd registration (inputs requiring grad: its backward too)."""
    q, k, v, cos, sin = inputs(1, 6, 9, 2, 1, 8, torch.float32, device, gen)
    op = torch.ops.dlblas.fused_rotary_and_fa.default
    ints = [0] * (len(op._schema.arguments) - len(OP.args))
    torch.library.opcheck(op, (*(t.requires_grad_() for t in (q, k, v)), cos, sin, True, None, False, *ints))


def test_compiles_without_graph_breaks(device, gen):
    """An attention layer's core under torch.compile(fullgraph=True): one node, gradients as eager."""
    torch._dynamo.reset()
    q, k, v, cos, sin = inputs(1, 6, 6, 2, 1, 8, torch.float32, device, gen)

    def layer(q, k, v):
        return fused_rotary_and_fa(q * 2, k, v, cos, sin, True).square().sum()

    eager = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled = [t.clone().requires_grad_() for t in (q, k, v)]
    layer(*eager).backward()
    out = torch.compile(layer, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")(*compiled)
    out.backward()
    torch.testing.assert_close(out, layer(q, k, v))
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a.grad, b.grad)


def test_public_function_runs_the_plan(device, gen, run):
    args = (*inputs(1, 6, 6, 2, 1, 8, torch.float16, device, gen), True, None, True)
    assert dlblas_kernels.fused_rotary_and_fa is fused_rotary_and_fa
    assert torch.equal(fused_rotary_and_fa(*args), run(OP, TRITON, args))


@pytest.mark.parametrize("sq, sk", [(7, 7), (4, 9)])
def test_composite_baseline_matches_reference(sq, sk, device, gen):
    for causal in (False, True):
        args = (*inputs(2, sq, sk, 4, 2, 8, torch.float32, device, gen), causal, None, causal)
        assert_close(composite(*args), fused_rotary_and_fa_reference(*upcast(*args)), torch.float32)


# -- the descriptor path (Hopper), in the interpreter ---------------------------------------------


def rotary_forward(args, profile, config):
    q, k, v, cos, sin, causal, scale, interleaved = args
    out = poison(torch.empty(q.shape, dtype=q.dtype, device=q.device))
    lse = poison(torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=q.device))
    calls = attention.forward_calls(q, k, v, out, lse, causal=causal, scale=scale or q.shape[-1] ** -0.5,
                                    config=config, profile=profile, rotary=(cos, sin, interleaved))
    LaunchPlan(calls, (out, lse)).run()
    return calls[0].kwargs["TMA"], out


# (B, Sq, Sk, Hq, Hk, D, tables [B, Sk, D]), causal, dtype, descriptors taken: D 24 has halves of 12
# (tiles of 16, the rest zero-filled), which fp16 rows cannot start on 16 bytes (pointer loads);
# interleaved D 16 would split pair tiles narrower than tl.dot takes (pointer loads).
DESCRIPTOR_CASES = [
    ((1, 11, 37, 3, 1, 24, True), False, torch.float32, (True, True)),
    ((2, 19, 19, 4, 2, 24, False), True, torch.float32, (True, True)),
    ((1, 13, 29, 2, 2, 24, False), True, torch.float16, (False, True)),
    ((2, 21, 21, 2, 1, 16, False), True, torch.float16, (True, False)),
]


@pytest.mark.parametrize("interleaved", INTERLEAVED, ids=["half", "interleaved"])
@pytest.mark.parametrize("shape, causal, element, descriptors", DESCRIPTOR_CASES, ids=str)
def test_descriptor_path_matches_reference(shape, causal, element, descriptors, interleaved, device, gen, profile):
    """The k tiles and their cos and sin rows through tensor descriptors, as on Hopper (a profile
    claiming sm_90; the interpreter runs the descriptors too): ragged key blocks, halves narrower
    than their tiles; where the descriptors cannot take the tables, the pointer loads."""
    args = (*inputs(*shape[:6], element, device, gen, shape[6]), causal, None, interleaved)
    hopper = dataclasses.replace(profile, arch="sm_90")
    config = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2}
    tma, out = rotary_forward(args, hopper, config)
    assert tma == descriptors[interleaved]
    assert_close(out, fused_rotary_and_fa_reference(*upcast(*args)), element, reduce_dim=shape[2])


def test_default_config_fits_the_rotary_tiles():
    """128 x 128 blocks of 8 warps with 2 stages at D 128 in 16-bit (k, cos, sin and v per stage and
    the rotated k: 229 408 bytes measured of the H200's 232 448); float32 halves the key block twice."""
    from dlcore.compiler.lowering import target_profile

    hopper = target_profile("cuda:90")
    for dtype, expected in ((torch.bfloat16, (128, 128, 8, 2)), (torch.float32, (128, 32, 8, 2))):
        q = torch.empty(2, 8192, 16, 128, dtype=dtype, device="meta")
        cos = torch.empty(8192, 128, dtype=dtype, device="meta")
        sig = make_signature(OP, (q, q, q, cos, cos, True, None, False), q.device)
        config = TRITON.default_config(sig, hopper)
        assert (config["BLOCK_M"], config["BLOCK_N"], config["num_warps"], config["num_stages"]) == expected
        assert attention.shared_memory_bytes(config, 128, q.element_size(), rotary=True) <= \
            hopper.shared_memory_per_program


# -- the composite as a vendor candidate ---------------------------------------------------------

H200 = DeviceProfile(backend="cuda", vendor="nvidia", name="NVIDIA H200", arch="sm_90", cores=132)


def rotary_signature(dtype=torch.bfloat16, d=128, sq=8192, sk=8192, causal=False, device="cuda") -> Signature:
    """A fused_rotary_and_fa signature as make_signature gives it (B and S rounded up to powers of two)."""
    def spec(*shape):
        return TensorSpec(dtype, shape, "contiguous", True)

    return Signature("fused_rotary_and_fa", device,
                     (("q", spec(2, sq, 16, d)), ("k", spec(2, sk, 8, d)), ("v", spec(2, sk, 8, d)),
                      ("cos", spec(sk, d)), ("sin", spec(sk, d))),
                     (("causal", causal), ("softmax_scale", "NoneType"), ("interleaved", False)))


def test_composite_is_a_vendor_candidate_of_its_own_entry_point():
    assert isinstance(COMPOSITE, VendorImplementation)
    assert (COMPOSITE.op, COMPOSITE.name, COMPOSITE.kind) == ("fused_rotary_and_fa", "composite", "vendor")
    assert "apply_rotary_pos_emb" in COMPOSITE.library and "scaled_dot_product_attention" in COMPOSITE.library
    assert vendor.fused_rotary_and_fa_plugin.dlcore_implementations() == [COMPOSITE]
    impls = {i.name: i for i in registry().implementations_of("fused_rotary_and_fa")}
    assert {"triton", "composite"} <= set(impls)
    assert impls["composite"].plugin == "dlcore.kernels:vendor_fused_rotary_and_fa"
    assert OP.reference is not vendor.fused_rotary_and_fa


@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("element", [torch.float16, torch.bfloat16], ids=str)
def test_composite_takes_what_sdpa_runs(d, element):
    for causal in (False, True):
        for sq in (8192, 1024):
            assert COMPOSITE.supports(rotary_signature(element, d, sq=sq, causal=causal), H200) is None


@pytest.mark.parametrize("case, reason", [
    ("float32", "dtype float32"),
    ("head dim 100", "multiples of 8"),
    ("head dim 512", "up to 256"),
    ("cpu", "NVIDIA GPUs from sm_80"),
    ("sm_75", "NVIDIA GPUs from sm_80"),
    ("amd", "NVIDIA GPUs"),
])
def test_composite_declines_what_sdpa_does_not_run_fast(case, reason):
    sig, profile = rotary_signature(), H200
    if case == "float32":
        sig = rotary_signature(torch.float32)
    elif case.startswith("head dim"):
        sig = rotary_signature(d=int(case.split()[-1]))
    elif case == "cpu":
        sig, profile = rotary_signature(device="cpu"), dataclasses.replace(H200, backend="cpu", vendor="cpu", arch="")
    elif case == "sm_75":
        profile = dataclasses.replace(H200, arch="sm_75")
    else:
        profile = dataclasses.replace(H200, vendor="amd", arch="gfx942")
    declined = COMPOSITE.supports(sig, profile)
    assert declined is not None and reason in declined, declined


@pytest.mark.skipif(ON_GPU, reason="the cpu backend's selection")
def test_the_cpu_backend_declines_the_composite(monkeypatch, gen):
    monkeypatch.delenv("DLCORE_DISABLE_IMPLS")
    args = (*inputs(1, 6, 6, 2, 1, 8, torch.float16, "cpu", gen), True, None, False)
    bound = dlcore.get_op("fused_rotary_and_fa", args)
    assert bound.impl.name == "triton"
    assert "cpu backend does not run vendor libraries" in bound.selection.declined["composite"]
    with pytest.raises(NoKernelError, match="does not run vendor libraries"):
        dlcore.get_op("fused_rotary_and_fa", args, impl="composite")


@pytest.mark.parametrize("sq, sk", [(7, 7), (4, 9), (9, 4), (3, 0)])
@pytest.mark.parametrize("causal", [False, True])
def test_composite_candidate_matches_reference(sq, sk, causal, device, gen):
    """What the candidate computes (SDPA's math backend standing in on the CPU): causal with more
    queries than keys gives zeros for the queries that see none, as the kernel does."""
    if sq > sk and not causal:
        return  # refused by the op's check
    args = (*inputs(2, sq, sk, 4, 2, 8, torch.float32, device, gen), causal, 0.4, causal)
    out = vendor.fused_rotary_and_fa(*args)
    assert out.shape == args[0].shape and not out.isnan().any()
    if sk == 0:  # no key at all (the reference's tables have no row to take)
        assert not out.any()
        return
    assert_close(out, fused_rotary_and_fa_reference(*upcast(*args)), torch.float32)


# -- validation ------------------------------------------------------------------------------------

BAD = {
    "odd head dim": ("q", lambda a: {**a, "q": a["q"][..., :7], "k": a["k"][..., :7], "v": a["v"][..., :7],
                                     "cos": a["cos"][..., :7], "sin": a["sin"][..., :7]}),
    "k batch": ("k", lambda a: {**a, "k": a["k"][:1], "v": a["v"][:1]}),
    "v shape": ("v", lambda a: {**a, "v": a["v"][:, :4]}),
    "heads": ("k", lambda a: {**a, "q": a["q"][:, :, :3]}),
    "cos rows": ("cos", lambda a: {**a, "cos": a["cos"][:4], "sin": a["sin"][:4]}),
    "cos head dim": ("cos", lambda a: {**a, "cos": a["cos"][:, :6]}),
    "cos batch": ("cos", lambda a: {**a, "cos": a["cos"].expand(3, -1, -1), "sin": a["sin"].expand(3, -1, -1)}),
    "sin shape": ("sin", lambda a: {**a, "sin": a["sin"].expand(2, -1, -1)}),
    "sin dtype": ("sin", lambda a: {**a, "sin": a["sin"].half()}),
    "cos rank": ("cos", lambda a: {**a, "cos": a["cos"][0]}),
    "v dtype": ("v", lambda a: {**a, "v": a["v"].half()}),
    "more queries without causal": ("q", lambda a: {**a, "q": torch.cat([a["q"], a["q"]], 1)}),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_inputs_name_the_argument(case, device, gen, no_launch):
    name, change = BAD[case]
    q, k, v, cos, sin = inputs(2, 5, 5, 4, 2, 8, torch.float32, device, gen)
    args = change({"q": q, "k": k, "v": v, "cos": cos, "sin": sin})
    with pytest.raises(InvalidInputError) as raised:
        fused_rotary_and_fa(**args)
    assert raised.value.arg == name


# -- GPU -------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="bfloat16 against a float32 reference needs a GPU")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_bfloat16_against_float32_on_gpu(causal, gen):
    """B 2, H 16, S 2048, D 128 in bfloat16 with LLaMA's tables, forward and backward, against the
    float32 reference on the same bfloat16 values: the error of the output and of each gradient at
    most that of the composite (apply_rotary_pos_emb, then SDPA, in bfloat16) plus a quarter of
    bfloat16's tolerance."""
    args = OP.example({"batch": 2, "seq": 2048, "kv_seq": 0, "heads": 16, "kv_heads": 16, "head_dim": 128,
                       "causal": int(causal), "interleaved": 0}, torch.bfloat16, torch.device("cuda"), gen)
    dout = randn(*args[0].shape, dtype=torch.bfloat16, device="cuda", generator=gen)

    def run(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in args[:3]]
        out = fn(*leaves, *(t.to(dtype) for t in args[3:5]), *args[5:])
        return (out, *torch.autograd.grad(out, leaves, dout.to(dtype)))

    ours = run(fused_rotary_and_fa, torch.bfloat16)
    theirs = run(composite, torch.bfloat16)
    expected = run(fused_rotary_and_fa_reference, torch.float32)
    atol, _ = tolerance(torch.bfloat16)
    for name, got, base, want in zip(("out", "dq", "dk", "dv"), ours, theirs, expected):
        assert got.dtype == torch.bfloat16 and not torch.isnan(got).any(), name
        error, baseline = (got.float() - want).abs().max().item(), (base.float() - want).abs().max().item()
        assert error <= baseline + atol / 4, f"{name}: error {error:.3g}, the composite's {baseline:.3g}"
