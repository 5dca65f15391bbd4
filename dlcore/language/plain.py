"""The plain-Triton forms of the helpers: what upstream Triton, its interpreter, and a
triton-ascend without the language extension compile.

Compile hints have no op in upstream Triton and vanish. An extracted slice is a ``tl.gather``
along each axis not taken whole: any offset (a constant or a scalar computed in the kernel) and
stride, but power-of-two sizes (each is a ``tl.arange``); on a GPU each such axis costs a gather
(shuffles within a warp, shared memory across warps). An inserted slice is a reshape, a broadcast
and a select per axis, so only slices that a reshape reaches: one phase of an interleave, or an
aligned block. triton-ascend's ``tensor.extract_slice`` / ``insert_slice`` have neither limit.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def compile_hint(x, name: tl.constexpr, value=None):
    """Nothing: upstream Triton has no annotation op for triton-ascend's compiler hints."""
    pass


@triton.jit
def multibuffer(x, copies: tl.constexpr):
    """Nothing: upstream Triton's loops are pipelined by ``num_stages`` instead."""
    pass


@triton.jit
def _along(index, shape, axis: tl.constexpr):
    """The 1-D ``index`` laid along ``axis`` of a tensor of ``shape`` with that axis as long as
    ``index``, broadcast over the other axes (as ``tl.gather`` wants its indices)."""
    RANK: tl.constexpr = len(shape)
    N: tl.constexpr = index.shape[0]
    index = tl.reshape(index, (1,) * axis + (N,) + (1,) * (RANK - 1 - axis))
    return tl.broadcast_to(index, shape[:axis] + (N,) + shape[axis + 1:])


@triton.jit
def extract_slice(x, offsets, sizes, strides):
    """``x[o0 : o0 + s0 * t0 : t0, o1 : ..., ...]``: along axis ``d``, ``sizes[d]`` elements from
    ``offsets[d]`` every ``strides[d]``. The slice must lie inside ``x``. An axis with
    ``sizes[d] == x.shape[d]`` is taken whole."""
    RANK: tl.constexpr = len(x.shape)
    tl.static_assert(len(offsets) == RANK and len(sizes) == RANK and len(strides) == RANK,
                     "extract_slice: one offset, size and stride per dimension of x")
    y = x
    for d in tl.static_range(RANK):
        if sizes[d] != x.shape[d]:
            tl.static_assert(strides[d] >= 1, "extract_slice: strides must be at least 1")
            index = offsets[d] + strides[d] * tl.arange(0, sizes[d])
            y = tl.gather(y, _along(index, y.shape, d), d)
    return y


@triton.jit
def _spread(sub, axis: tl.constexpr, N: tl.constexpr, STRIDE: tl.constexpr):
    """``sub`` stretched along ``axis`` to ``N`` elements: element ``i`` takes ``sub``'s element
    ``i // STRIDE`` (each repeated STRIDE times) or, with STRIDE 1, ``i % size`` (sub repeated)."""
    # Shapes are spelled out, not bound to names: a tuple bound to a plain name becomes tensors.
    SIZE: tl.constexpr = sub.shape[axis]
    if STRIDE == 1:
        stretched = tl.broadcast_to(tl.reshape(sub, sub.shape[:axis] + (1, SIZE) + sub.shape[axis + 1:]),
                                    sub.shape[:axis] + (N // SIZE, SIZE) + sub.shape[axis + 1:])
    else:
        stretched = tl.broadcast_to(tl.reshape(sub, sub.shape[:axis] + (SIZE, 1) + sub.shape[axis + 1:]),
                                    sub.shape[:axis] + (SIZE, STRIDE) + sub.shape[axis + 1:])
    return tl.reshape(stretched, sub.shape[:axis] + (N,) + sub.shape[axis + 1:])


@triton.jit
def insert_slice(full, sub, offsets, sizes, strides):
    """``full`` with ``sub`` written over the slice that :func:`extract_slice` with the same
    ``offsets``, ``sizes`` and ``strides`` reads (``sub.shape == sizes``); the rest of ``full`` as
    it was.

    Plain Triton has no scatter into registers: along each axis not taken whole, the slice must be
    one phase of an interleave (``sizes[d] * strides[d] == full.shape[d]``, ``offsets[d] <
    strides[d]``) or an aligned block (``strides[d] == 1``, ``offsets[d]`` a multiple of
    ``sizes[d]``), so that ``sub`` reaches its places by a reshape and a broadcast."""
    RANK: tl.constexpr = len(full.shape)
    tl.static_assert(len(offsets) == RANK and len(sizes) == RANK and len(strides) == RANK,
                     "insert_slice: one offset, size and stride per dimension of full")
    spread = sub
    inside = tl.full(full.shape, 1, tl.int1)
    for d in tl.static_range(RANK):
        if sizes[d] != full.shape[d]:
            position = tl.arange(0, full.shape[d])
            if strides[d] == 1:
                tl.static_assert(full.shape[d] % sizes[d] == 0,
                                 "insert_slice: a block slice must divide its dimension (plain Triton)")
                if not isinstance(offsets[d], tl.tensor):  # a constant: checked here
                    tl.static_assert(offsets[d] % sizes[d] == 0,
                                     "insert_slice: a block slice must start at a multiple of its size (plain Triton)")
                on_slice = (position >= offsets[d]) & (position < offsets[d] + sizes[d])
            else:
                tl.static_assert(sizes[d] * strides[d] == full.shape[d],
                                 "insert_slice: a strided slice must be one phase of its dimension, "
                                 "sizes[d] * strides[d] == full.shape[d] (plain Triton)")
                if not isinstance(offsets[d], tl.tensor):  # a constant: checked here
                    tl.static_assert(offsets[d] < strides[d],
                                     "insert_slice: a strided slice must start before its first stride (plain Triton)")
                on_slice = position % strides[d] == offsets[d]
            spread = _spread(spread, d, full.shape[d], strides[d])
            inside = inside & tl.reshape(on_slice, (1,) * d + (full.shape[d],) + (1,) * (RANK - 1 - d))
    return tl.where(inside, spread, full)
