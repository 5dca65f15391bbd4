"""Ops that write into their arguments refuse tensors that share memory (issue: aliasing in-place rotary)."""

import pytest
import torch
from dlblas_kernels.kernels.apply_rotary_pos_emb import apply_rotary_pos_emb, apply_rotary_pos_emb_reference

import dlcore
from dlcore.declarations.op import Op, ScalarArg, TensorArg
from dlcore.declarations.overlap import Overlap, overlap, overlaps_itself
from dlcore.errors import DeclarationError, InvalidInputError
from dlcore.testing import assert_close


def test_overlaps_itself():
    base = torch.randn(4, 6)
    assert not overlaps_itself(base)
    assert not overlaps_itself(base.t())
    assert not overlaps_itself(base[:, ::2])
    assert not overlaps_itself(torch.randn(1, 5).expand(1, 5))  # size-1 dims never overlap
    assert overlaps_itself(torch.randn(1, 5).expand(3, 5))
    assert overlaps_itself(base.as_strided((3, 4), (2, 1)))  # rows of 4 every 2 elements


def test_overlap_between_tensors():
    buf = torch.randn(2, 5, 6, 8)
    assert overlap(buf, buf) is Overlap.FULL
    assert overlap(buf[:, :, :3], buf[:, :, 3:]) is Overlap.NONE  # packed qkv heads: interleaved, disjoint
    flat = torch.randn(100)
    assert overlap(flat[:60], flat[40:]) is Overlap.PARTIAL
    assert overlap(flat[:50], flat[50:]) is Overlap.NONE
    assert overlap(flat, torch.randn(100)) is Overlap.NONE


def rotary_inputs(s=5, hq=4, hk=2, d=8):
    q, k = torch.randn(2, s, hq, d), torch.randn(2, s, hk, d)
    cos, sin = torch.randn(2, s, d), torch.randn(2, s, d)
    return q, k, cos, sin


@pytest.mark.parametrize("entry", ["direct", "get_op"])
def test_inplace_rotary_refuses_memory_it_would_write_twice(entry):
    q, k, cos, sin = rotary_inputs(hq=2)

    def call(q, k):
        if entry == "direct":
            return apply_rotary_pos_emb(q, k, cos, sin, False, True)
        return dlcore.get_op("apply_rotary_pos_emb", (q, k, cos, sin, False, True))(q, k, cos, sin, False, True)

    expanded = torch.randn(2, 5, 1, 8).expand(2, 5, 2, 8)
    with pytest.raises(InvalidInputError, match="q has elements that share memory"):
        call(expanded, k)
    with pytest.raises(InvalidInputError, match="k has elements that share memory"):
        call(q, expanded)
    before = q.clone()
    with pytest.raises(InvalidInputError, match="q and k are the same memory"):
        call(q, q)
    assert torch.equal(q, before)  # refused before anything was written
    flat = torch.randn(2 * 5 * 2 * 8 + 16)
    with pytest.raises(InvalidInputError, match="q and k are partly the same memory"):
        call(flat[: 160].view(2, 5, 2, 8), flat[16:].view(2, 5, 2, 8))
    with pytest.raises(InvalidInputError, match="q and cos are partly the same memory"):
        shared = torch.randn(160)
        apply_rotary_pos_emb(shared.view(2, 5, 2, 8), k, shared[:80].view(2, 5, 8), sin, False, True)


def test_out_of_place_rotary_still_reads_expanded_inputs():
    q, k, cos, sin = rotary_inputs(hq=2)
    expanded = torch.randn(2, 5, 1, 8).expand(2, 5, 2, 8)
    q_out, _ = apply_rotary_pos_emb(expanded, k, cos, sin)
    assert_close(q_out, apply_rotary_pos_emb_reference(expanded.double(), k.double(), cos.double(),
                                                       sin.double())[0], torch.float32)


def test_a_declaration_that_writes_an_unknown_argument_is_refused():
    with pytest.raises(DeclarationError, match="writes"):
        Op("bad", (TensorArg("x", (torch.float32,)), ScalarArg("inplace", (bool,), default=False, writes=("y",))),
           reference=lambda x, inplace: x)
