"""dlcore.language: each helper in the interpreter against torch, the mapping chosen for upstream
Triton and for triton-ascend (a fake one: its backend package and extension module planted in
``sys.modules``), and a kernel using every helper compiled for sm_90 by upstream Triton in a process
without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from isolated import run_json
from triton.runtime.interpreter import InterpretedFunction

import dlcore.language as dl
from dlcore.language import flavour, plain
from dlcore.language.flavour import ActiveTriton, TritonFlavour, detect
from dlcore.language.mapping import helpers_for

interpreted = pytest.mark.skipif(not isinstance(plain.extract_slice, InterpretedFunction),
                                 reason="runs the helpers in Triton's interpreter (TRITON_INTERPRET=1)")


@triton.jit
def slices_kernel(x_ptr, sub_ptr, extracted_ptr, inserted_ptr, offset,
                  M: tl.constexpr, N: tl.constexpr, OFF_M: tl.constexpr, SIZE_M: tl.constexpr,
                  STRIDE_M: tl.constexpr, OFF_N: tl.constexpr, SIZE_N: tl.constexpr, STRIDE_N: tl.constexpr,
                  RUNTIME_OFFSET: tl.constexpr):
    # x [M, N]; the slice [OFF_M :: STRIDE_M][:SIZE_M], [OFF_N :: STRIDE_N][:SIZE_N] read into
    # extracted [SIZE_M, SIZE_N] and sub [SIZE_M, SIZE_N] written over it into inserted [M, N].
    full = tl.arange(0, M)[:, None] * N + tl.arange(0, N)[None, :]
    part = tl.arange(0, SIZE_M)[:, None] * SIZE_N + tl.arange(0, SIZE_N)[None, :]
    x = tl.load(x_ptr + full)
    sub = tl.load(sub_ptr + part)
    # The offsets spelled out at each call: a tuple bound to a name would hold tensors, not constants.
    if RUNTIME_OFFSET:
        tl.store(extracted_ptr + part, dl.extract_slice(x, (offset, OFF_N), (SIZE_M, SIZE_N), (STRIDE_M, STRIDE_N)))
        tl.store(inserted_ptr + full,
                 dl.insert_slice(x, sub, (offset, OFF_N), (SIZE_M, SIZE_N), (STRIDE_M, STRIDE_N)))
    else:
        tl.store(extracted_ptr + part, dl.extract_slice(x, (OFF_M, OFF_N), (SIZE_M, SIZE_N), (STRIDE_M, STRIDE_N)))
        tl.store(inserted_ptr + full,
                 dl.insert_slice(x, sub, (OFF_M, OFF_N), (SIZE_M, SIZE_N), (STRIDE_M, STRIDE_N)))


@triton.jit
def persistent_kernel(x_ptr, out_ptr, items, BLOCK: tl.constexpr):
    # A persistent program per grid slot: items pid, pid + programs, ...; each item a block of
    # BLOCK elements, doubled and marked (the hints change nothing upstream).
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    lanes = tl.arange(0, BLOCK)
    for item in dl.persistent_range(pid, items, programs):
        x = tl.load(x_ptr + item * BLOCK + lanes)
        dl.multibuffer(x, 2)
        dl.compile_hint(x, "hint_a")
        dl.compile_hint(x, "hint_b", 42)
        tl.store(out_ptr + item * BLOCK + lanes, 2 * x)


@triton.jit
def plain_persistent_kernel(x_ptr, out_ptr, items, BLOCK: tl.constexpr):
    # persistent_kernel as written without dlcore.language.
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    lanes = tl.arange(0, BLOCK)
    for item in range(pid, items, programs):
        x = tl.load(x_ptr + item * BLOCK + lanes)
        tl.store(out_ptr + item * BLOCK + lanes, 2 * x)


# (M, N), (offset, size, stride) along rows, then along columns
SLICES = [
    ((8, 16), (4, 4, 1), (1, 8, 2)),   # an aligned block of rows, the odd columns
    ((8, 16), (0, 8, 1), (0, 4, 1)),   # whole rows, the first block of columns
    ((8, 16), (1, 2, 4), (12, 4, 1)),  # a strided phase of rows, the last block of columns
    ((4, 32), (0, 4, 1), (3, 8, 4)),   # one phase of an interleave of four
    ((8, 8), (0, 8, 1), (0, 8, 1)),    # all of x
]


def run_slices(shape, rows, cols, runtime_offset=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    m, n = shape
    x = torch.randn(m, n, generator=gen)
    sub = torch.randn(rows[1], cols[1], generator=gen)
    extracted = torch.full((rows[1], cols[1]), float("nan"))
    inserted = torch.full((m, n), float("nan"))
    slices_kernel[(1,)](x, sub, extracted, inserted, rows[0], m, n, *rows, *cols, runtime_offset)
    return x, sub, extracted, inserted


def torch_slice(rows, cols):
    return (slice(rows[0], rows[0] + rows[1] * rows[2], rows[2]), slice(cols[0], cols[0] + cols[1] * cols[2], cols[2]))


@interpreted
@pytest.mark.parametrize("runtime_offset", [False, True], ids=["constant", "runtime"])
@pytest.mark.parametrize("shape, rows, cols", SLICES)
def test_slices_match_torch(shape, rows, cols, runtime_offset):
    x, sub, extracted, inserted = run_slices(shape, rows, cols, runtime_offset)
    where = torch_slice(rows, cols)
    assert torch.equal(extracted, x[where])
    expected = x.clone()
    expected[where] = sub
    assert torch.equal(inserted, expected)


@interpreted
@pytest.mark.parametrize("rows, message", [((2, 4, 1), "multiple of its size"), ((0, 2, 2), "one phase")])
def test_insert_slice_refuses_what_plain_triton_cannot_reach(rows, message):
    with pytest.raises(Exception, match=message):
        run_slices((8, 16), rows, (0, 16, 1))


@interpreted
@pytest.mark.parametrize("programs", [1, 3, 8])
def test_persistent_range_visits_every_item_once(programs):
    x = torch.randn(7 * 16, generator=torch.Generator().manual_seed(programs))
    out = torch.full_like(x, float("nan"))
    persistent_kernel[(programs,)](x, out, 7, 16)
    assert torch.equal(out, 2 * x)


def test_upstream_mapping_when_triton_ascend_is_absent():
    assert detect() == ActiveTriton(TritonFlavour.UPSTREAM)
    assert dl.ACTIVE.flavour is TritonFlavour.UPSTREAM
    assert dl.persistent_range is range
    assert (dl.compile_hint, dl.multibuffer, dl.extract_slice, dl.insert_slice) == (
        plain.compile_hint, plain.multibuffer, plain.extract_slice, plain.insert_slice)


def plant(monkeypatch: pytest.MonkeyPatch, name: str, **attributes) -> types.ModuleType:
    """A fake module ``name`` that import machinery finds (``find_spec`` reads its spec)."""
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for key, value in attributes.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def sentinels(prefix: str) -> dict:
    return {name: f"{prefix}.{name}" for name in flavour.EXTENSION_NAMES}


def test_ascend_mapping_from_the_extension_module(monkeypatch):
    plant(monkeypatch, flavour.ASCEND_BACKEND)
    extension = plant(monkeypatch, flavour.ASCEND_EXTENSION, **sentinels("ext"))
    active = detect()
    assert active == ActiveTriton(TritonFlavour.ASCEND, extension)
    helpers = helpers_for(active)
    assert helpers.persistent_range is range
    assert (helpers.compile_hint, helpers.multibuffer, helpers.extract_slice, helpers.insert_slice) == (
        "ext.compile_hint", "ext.multibuffer", "ext.extract_slice", "ext.insert_slice")


def test_ascend_mapping_from_triton_language_as_triton_ascend_3_2_sets_it(monkeypatch):
    plant(monkeypatch, flavour.ASCEND_BACKEND)
    monkeypatch.setattr(flavour, "ASCEND_EXTENSION", "dlcore_test_absent_extension")
    for name, value in sentinels("tl").items():
        monkeypatch.setattr(tl, name, value, raising=False)
    active = detect()
    assert active == ActiveTriton(TritonFlavour.ASCEND, tl)
    assert helpers_for(active).extract_slice == "tl.extract_slice"


def test_triton_ascend_without_the_extension_gets_plain_triton(monkeypatch):
    plant(monkeypatch, flavour.ASCEND_BACKEND)
    monkeypatch.setattr(flavour, "ASCEND_EXTENSION", "dlcore_test_absent_extension")
    active = detect()
    assert active == ActiveTriton(TritonFlavour.ASCEND, None)
    assert helpers_for(active).insert_slice is plain.insert_slice


COMPILE = r"""
import json, re, sys
sys.path.insert(0, {tests!r})
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import test_language as t

def ttir(fn, signature, constexprs):
    source = ASTSource(fn, signature={{**signature, **{{k: "constexpr" for k in constexprs}}}}, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ttir"]

def ops(text):
    # the operation names of a TTIR module, in order
    return re.findall(r"^\s*(?:[%\w#:, ]+ = )?([a-z_]+\.[a-z_.]+)", text, re.MULTILINE)

persistent = {{"x_ptr": "*fp32", "out_ptr": "*fp32", "items": "i32"}}
slices = {{"x_ptr": "*fp32", "sub_ptr": "*fp32", "extracted_ptr": "*fp32", "inserted_ptr": "*fp32", "offset": "i32"}}
sizes = dict(M=8, N=16, OFF_M=4, SIZE_M=4, STRIDE_M=1, OFF_N=1, SIZE_N=8, STRIDE_N=2, RUNTIME_OFFSET=True)
print(json.dumps({{
    "helpers": ops(ttir(t.persistent_kernel, persistent, {{"BLOCK": 16}})),
    "plain": ops(ttir(t.plain_persistent_kernel, persistent, {{"BLOCK": 16}})),
    "slices": ops(ttir(t.slices_kernel, slices, sizes)),
}}))
"""


def test_kernels_using_the_helpers_compile_for_sm_90():
    """Upstream, the persistent loop and the hints leave the TTIR of the same kernel written
    without them; slices become gathers (extract) and selects (insert), no call left."""
    found = run_json(COMPILE.format(tests=str(Path(__file__).parent)), None, TRITON_INTERPRET="0")
    assert found["helpers"] == found["plain"]
    assert "scf.for" in found["helpers"]
    assert "tt.gather" in found["slices"] and "arith.select" in found["slices"]
    assert "tt.call" not in found["slices"]
