"""The backward block of flash attention (dlblas_kernels.blocks.attention_grad): dq, dk and dv against torch
autograd of the float64 formula ``softmax(scale q k^T) v`` (GQA, causal bottom-right, the rotary
variant with the rotation applied first). ``out`` and ``lse`` come from the same float64 forward,
cast down, so these tests need no forward kernel."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import ON_GPU
from dlblas_kernels.blocks import attention_grad as ag
from isolated import run_json

from dlcore.testing import assert_close, poison, randn


def attention64(q, k, v, causal, scale, tables=None, interleaved=False, rounding=torch.float64):
    """``(out, lse)`` of attention on float64 ``q [B,Sq,Hq,D]``, ``k, v [B,Sk,Hk,D]``; with
    ``tables = (cos, sin)`` (``[Sk, D]`` or ``[B, Sk, D]``) q and k rotated first (queries with
    the last Sq rows), the rotated values rounded to ``rounding`` as the kernels (and any pipeline
    in that dtype) round them before the products, the gradients passing the rounding unchanged.
    Rows that see no key: out 0, lse -inf."""
    sq, hq, sk, hk = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    if tables is not None:
        cos, sin = (t if t.dim() == 3 else t[None] for t in tables)
        cos, sin = cos[:, :, None], sin[:, :, None]
        rows = (torch.arange(sq, device=q.device) + sk - sq).clamp(min=0)  # queries that see no key: row 0
        q = q * cos[:, rows] + ag._rotate_half(q, interleaved) * sin[:, rows]
        k = k * cos + ag._rotate_half(k, interleaved) * sin
        q, k = (x + (x.to(rounding).double() - x).detach() for x in (q, k))
    k, v = k.repeat_interleave(hq // hk, dim=2), v.repeat_interleave(hq // hk, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if causal:
        s = s.masked_fill(~torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq), -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("bhij,bjhd->bihd", p, v), lse


class Case:
    """Inputs in ``dtype`` (made leaves in float64 for autograd), the forward's out and lse, random
    output gradients, and the float64 gradients of q, k and v."""

    def __init__(self, b, sq, sk, hq, hk, d, causal, dtype, device, gen, *, dlse=False, tables=None,
                 interleaved=False, scale=None):
        self.causal, self.dtype = causal, dtype
        self.scale = scale if scale is not None else d ** -0.5
        self.q, self.k, self.v = (randn(b, s, h, d, dtype=dtype, device=device, generator=gen)
                                  for s, h in ((sq, hq), (sk, hk), (sk, hk)))
        # Tables of random angles, one per lane (the kernels must not assume duplicated halves).
        angles = None if tables is None else randn(*tables, sk, d, device=device, generator=gen, scale=3.0)
        self.tables = None if tables is None else (angles.cos().to(dtype), angles.sin().to(dtype))
        self.interleaved = interleaved
        leaves = [t.double().requires_grad_() for t in (self.q, self.k, self.v)]
        tables64 = None if self.tables is None else tuple(t.double() for t in self.tables)
        out, lse = attention64(*leaves, causal, self.scale, tables64, interleaved, dtype)
        self.dout = randn(*out.shape, dtype=dtype, device=device, generator=gen)
        self.dlse = randn(*lse.shape, device=device, generator=gen) if dlse else None
        grads = [self.dout.double()] + ([self.dlse.double()] if dlse else [])
        self.expected = torch.autograd.grad([out, lse] if dlse else [out], leaves, grads)
        self.out, self.lse, self.lse64 = out.detach().to(dtype), lse.detach().float(), lse.detach()

    def run(self, profile, config=None, dq=None, dk=None, dv=None, **inputs):
        """The block's launches into NaN-filled dq, dk, dv (new, or the given views); returns them.
        With tables, :func:`ag.rotary_backward_plan`'s launches (its results and scratch poisoned),
        whose results are copied into dq, dk, dv."""
        dq, dk, dv = (poison(t if t is not None else torch.empty_like(x))
                      for t, x in ((dq, self.q), (dk, self.k), (dv, self.v)))
        args = {name: inputs.get(name, getattr(self, name)) for name in ("dout", "q", "k", "v", "out")}
        if self.tables is not None:
            plan = ag.rotary_backward_plan((args["dout"], args["q"], args["k"], args["v"], *self.tables, args["out"],
                                            self.lse, self.causal, self.scale, self.interleaved), config or {}, profile)
            for t in (*plan.result, *plan.scratch):
                poison(t)
            for call in plan.calls:
                call.launch()
            for into, got in zip((dq, dk, dv), plan.result):
                into.copy_(got)
            return dq, dk, dv
        for call in ag.backward_calls(args["dout"], args["q"], args["k"], args["v"], args["out"], self.lse, self.dlse,
                                      dq, dk, dv, causal=self.causal, scale=self.scale, profile=profile,
                                      config=config):
            call.launch()
        return dq, dk, dv

    def check(self, grads):
        reduce = max(self.q.shape[1], self.k.shape[1])
        for name, got, want in zip("qkv", grads, self.expected):
            assert got.dtype == self.dtype, name
            assert_close(got, want, self.dtype, reduce)


CASES = [
    pytest.param(1, 37, 37, 2, 2, 64, False, False, id="D64"),
    pytest.param(2, 45, 29, 4, 2, 96, True, True, id="D96-gqa-causal-Sq>Sk-dlse"),
    pytest.param(1, 29, 70, 4, 1, 128, True, False, id="D128-mqa-causal-Sq<Sk"),
    pytest.param(1, 33, 50, 2, 1, 192, False, True, id="D192-mqa-Sq<Sk-dlse"),
    pytest.param(1, 21, 17, 2, 2, 256, True, False, id="D256-causal-Sq>Sk"),
]


@pytest.mark.parametrize("b, sq, sk, hq, hk, d, causal, dlse", CASES)
def test_gradients_match_autograd(b, sq, sk, hq, hk, d, causal, dlse, dtype, device, gen, profile):
    case = Case(b, sq, sk, hq, hk, d, causal, dtype, device, gen, dlse=dlse)
    case.check(case.run(profile))


@pytest.mark.parametrize("dlse", [False, True], ids=["no-dlse", "dlse"])
def test_rows_without_keys_get_zero_gradients(dlse, device, gen, profile):
    """Causal with Sq > Sk: the first Sq - Sk queries see no key (lse -inf, out 0): their dq rows are
    exactly 0 and nothing anywhere is NaN, whatever dlse holds for them."""
    case = Case(2, 40, 13, 2, 1, 64, True, torch.float32, device, gen, dlse=dlse)
    assert torch.isinf(case.lse[:, :, :27]).all()
    dq, dk, dv = case.run(profile)
    assert not any(torch.isnan(t).any() for t in (dq, dk, dv))
    assert (dq[:, :27] == 0).all()
    case.check((dq, dk, dv))


def test_packed_qkv_and_strided_gradients(dtype, device, gen, profile):
    """q, k, v sliced from one packed projection [B, S, Hq + 2 Hk, D] (no copy), and dq, dk, dv
    written into views of wider buffers."""
    case = Case(2, 41, 41, 4, 2, 64, True, dtype, device, gen)
    packed = torch.cat([case.q, case.k, case.v], dim=2)
    q, k, v = packed[:, :, :4], packed[:, :, 4:6], packed[:, :, 6:]
    wide = [torch.empty(*t.shape[:-1], t.shape[-1] + 8, dtype=dtype, device=device)[..., 8:]
            for t in (case.q, case.k, case.v)]
    grads = case.run(profile, None, *wide, q=q, k=k, v=v)
    assert all(g.data_ptr() == w.data_ptr() for g, w in zip(grads, wide))
    case.check(grads)


def test_any_strides(relayout, device, gen, profile):
    """Every input in a non-contiguous layout (row padding, or a stride of 2 along D)."""
    case = Case(1, 35, 35, 2, 1, 64, False, torch.float16, device, gen, dlse=True)
    inputs = {name: relayout(getattr(case, name)) for name in ("dout", "q", "k", "v", "out")}
    case.check(case.run(profile, **inputs))


TILES = [
    pytest.param({"DKDV_BLOCK_N": 16, "DKDV_BLOCK_M": 32, "DQ_BLOCK_M": 16, "DQ_BLOCK_N": 32}, id="blocks<steps"),
    pytest.param({"DKDV_BLOCK_N": 64, "DKDV_BLOCK_M": 16, "DQ_BLOCK_M": 64, "DQ_BLOCK_N": 16}, id="blocks>steps"),
    pytest.param({"DKDV_TMA": 1, "DQ_TMA": 1}, id="descriptors"),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("tiles", TILES)
def test_tiles(tiles, causal, device, gen, profile):
    """Other tile shapes (more or fewer query steps per key block than one, and the other way) and
    the tensor-descriptor loads, Sq and Sk not multiples of any block, Sq < Sk and Sq > Sk."""
    config = {**ag.backward_config(torch.empty(1, 1, 1, 64), causal, profile), **tiles}
    for sq, sk in ((45, 61), (61, 45)):
        case = Case(1, sq, sk, 4, 2, 64, causal, torch.float32, device, gen, dlse=True)
        case.check(case.run(profile, config))


ROTARY = [
    pytest.param(29, 45, 4, 2, 64, True, False, (), id="half-D64-gqa-causal-Sq<Sk"),
    pytest.param(37, 37, 2, 2, 96, False, True, (2,), id="interleaved-D96-batched-tables"),
    pytest.param(40, 40, 4, 1, 128, True, False, (1,), id="half-D128-mqa-causal"),
    pytest.param(45, 29, 2, 1, 64, True, True, (2,), id="interleaved-D64-batched-causal-Sq>Sk"),
    pytest.param(21, 50, 2, 2, 32, False, True, (), id="interleaved-D32-Sq<Sk"),
]


@pytest.mark.parametrize("sq, sk, hq, hk, d, causal, interleaved, tables", ROTARY)
def test_rotary_gradients_match_autograd(sq, sk, hq, hk, d, causal, interleaved, tables, dtype, device, gen,
                                         profile):
    """q and k given unrotated; the gradients flow through the rotation (any table values)."""
    case = Case(2, sq, sk, hq, hk, d, causal, dtype, device, gen, tables=tables, interleaved=interleaved)
    case.check(case.run(profile))


def test_rotary_plan_rotates_into_scratch(device, gen, profile):
    """rotary_backward_plan: q and k rotated into scratch by apply_rotary_pos_emb's kernel (q from the
    tables' last Sq rows), the plain backward launches on the scratch, dq' and dk' rotated back."""
    case = Case(2, 13, 21, 4, 2, 16, True, torch.float32, device, gen, tables=(), interleaved=False)
    plan = ag.rotary_backward_plan((case.dout, case.q, case.k, case.v, *case.tables, case.out, case.lse, True, None,
                                    False), {}, profile)
    names = [call.kernel.__name__ for call in plan.calls]
    assert names == ["rotary_kernel", *(k.__name__ for k in ag.BACKWARD_KERNELS), "rotary_kernel"]
    q_rot, k_rot, stats = plan.scratch
    dq, dk, dv, dq_rot, dk_rot = plan.result  # dq' and dk' returned, for the tables' gradients
    first, *attention_calls, last = plan.calls
    assert first.args[:4] == (case.q, case.k, q_rot, k_rot) and not first.kwargs["BACKWARD"]
    assert first.args[6:9] == (2 * 13, 13, 21 - 13)  # q's tokens, its sequence, its first table row
    assert attention_calls[1].args[:2] == (q_rot, k_rot)
    assert attention_calls[1].args[5:7] == (dk_rot, dv) and attention_calls[2].args[5] is dq_rot
    assert last.args[:4] == (dq_rot, dk_rot, dq, dk) and last.kwargs["BACKWARD"]


# -- what the op modules call: the torch references, results and plans ------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_reference_matches_autograd(causal, gen):
    case = Case(2, 23, 17, 4, 2, 32, causal, torch.float64, "cpu", gen, dlse=True, scale=0.3)
    got = ag.backward_reference(case.dout, case.q, case.k, case.v, case.out, case.lse64, case.dlse, causal, 0.3,
                                None, None)
    for g, want in zip(got, case.expected):
        assert_close(g, want, torch.float64)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_rotary_reference_matches_autograd(interleaved, gen):
    case = Case(2, 13, 19, 4, 2, 16, True, torch.float64, "cpu", gen, tables=(2,), interleaved=interleaved)
    got = ag.rotary_backward_reference(case.dout, case.q, case.k, case.v, *case.tables, case.out, case.lse64,
                                       True, None, interleaved)
    for g, want in zip(got, case.expected):
        assert_close(g, want, torch.float64)


def test_reference_signatures_are_custom_op_schemas():
    """The op modules declare these references as their backward custom ops: their annotations
    must make schemas."""
    assert torch.library.infer_schema(ag.backward_reference, mutates_args=()) == (
        "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, bool causal, "
        "float? softmax_scale, Tensor? kv_start, Tensor? kv_end) -> (Tensor, Tensor, Tensor)")
    assert torch.library.infer_schema(ag.rotary_backward_reference, mutates_args=()) == (
        "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor out, Tensor lse, bool causal, "
        "float? softmax_scale, bool interleaved) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")


def test_plans(device, gen, profile, launch):
    """backward_plan and rotary_backward_plan: new contiguous dq, dk, dv, the stats declared as scratch."""
    case = Case(1, 19, 19, 2, 1, 64, True, torch.float16, device, gen, dlse=True)
    plan = ag.backward_plan((case.dout, case.q, case.k, case.v, case.out, case.lse, case.dlse, True, None), {}, profile)
    assert len(plan.scratch) == 1 and plan.scratch[0].shape == (2, 1, 2, 19)
    grads = launch(plan)
    assert all(g.is_contiguous() for g in grads)
    case.check(grads)
    case = Case(1, 19, 23, 2, 1, 64, True, torch.float16, device, gen, tables=(), interleaved=True)
    plan = ag.rotary_backward_plan((case.dout, case.q, case.k, case.v, *case.tables, case.out, case.lse, True, None,
                                    True), {}, profile)
    case.check(launch(plan))


# -- real targets -------------------------------------------------------------------------------------------

CUBIN_SCRIPT = """
import json, torch
from triton.backends.compiler import GPUTarget
from dlcore.compiler.lowering import compile_call, target_profile
from dlblas_kernels.blocks import attention_grad as ag

def e(*shape, dtype):
    return torch.empty(*shape, device="meta", dtype=dtype)

def variants():
    hopper, ampere = target_profile("cuda:90"), target_profile("cuda:80")
    for name, dtype, d, hk, causal, dlse, profile in (
            ("descriptors", torch.bfloat16, 128, 16, False, False, hopper),
            ("descriptors gqa causal dlse", torch.bfloat16, 128, 4, True, True, hopper),
            ("pointers D96 causal", torch.float16, 96, 4, True, True, ampere),
            ("descriptors D192", torch.float16, 192, 16, False, False, hopper),
            ("float32", torch.float32, 64, 16, True, False, hopper)):
        q, k = e(2, 300, 16, d, dtype=dtype), e(2, 300, hk, d, dtype=dtype)
        lse = e(2, 16, 300, dtype=torch.float32)
        yield name, ag.backward_calls(q, q, k, k, q, lse, lse if dlse else None, q, k, k, causal=causal, scale=0.1,
                                      profile=profile, stats=e(2, 2, 16, 300, dtype=torch.float32))

found = {}
for name, calls in variants():
    for call in calls:
        for capability in (80, 90, 100):
            kernel = compile_call(call, GPUTarget("cuda", capability, 32))
            found[f"{name}/{call.kernel.__name__}/{int(call.kwargs.get('TMA', 0))}/sm_{capability}"] = \\
                len(kernel.asm.get("cubin", b""))
print(json.dumps(found))
"""


@pytest.mark.slow
def test_every_kernel_compiles_to_cubin():
    """Each backward kernel, with descriptors and pointers, causal or not, padded D, float32, for
    cuda:80, cuda:90 and cuda:100 on a CPU-only machine."""
    compiled = run_json(CUBIN_SCRIPT, None, TRITON_INTERPRET="0")
    kernels = {k.__name__ for k in ag.BACKWARD_KERNELS}
    assert {key.split("/")[1] for key in compiled} == kernels
    assert {key.rsplit("/", 1)[1] for key in compiled} == {"sm_80", "sm_90", "sm_100"}
    assert any(key.split("/")[2] == "1" for key in compiled), "no descriptor variant"
    assert all(size > 0 for size in compiled.values()), compiled


# -- on the GPU: bfloat16 at the benchmark shape against a float32 reference ---------------------------------


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected).norm() / expected.norm()).item()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="bfloat16 against a float32 reference needs a GPU")
@pytest.mark.parametrize("hq, hk", [(16, 16), (32, 8)], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_bfloat16_against_float32_on_gpu(causal, hq, hk, profile):
    """B 2, S 8192, D 128 in bfloat16: out and lse from float32 SDPA (the efficient kernel) on the
    same bfloat16 values, the gradients against float32 SDPA's autograd."""
    gen = torch.Generator(device="cuda").manual_seed(14)
    b, s, d = 2, 8192, 128
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", generator=gen).bfloat16() for h in (hq, hk, hk, hq))
    leaves = [t.float().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    k32, v32 = (t.repeat_interleave(hq // hk, dim=1) for t in leaves[1:])
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(leaves[0], k32, v32, None, True,
                                                                      is_causal=causal)[:2]
    expected = torch.autograd.grad(out, leaves, dout.float().transpose(1, 2))
    grads = [poison(torch.empty_like(t)) for t in (q, k, v)]
    for call in ag.backward_calls(dout, q, k, v, out.detach().transpose(1, 2).bfloat16(), lse[..., :s].contiguous(),
                                  None, *grads, causal=causal, scale=d ** -0.5, profile=profile):
        call.launch()
    for name, got, want in zip("qkv", grads, expected):
        error = relative_error(got, want.transpose(1, 2))
        assert not torch.isnan(got).any() and error < 1e-2, (name, error)
