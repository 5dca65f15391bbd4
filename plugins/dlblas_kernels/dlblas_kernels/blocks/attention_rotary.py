"""The rotary side of attention's forward kernel (its ``ROTARY`` path): each row's rotary pair
halves loaded, by pointer or through tensor descriptors, and rotated by the table rows of their
positions (:func:`~dlblas_kernels.blocks.rotary.rotate_pairs`, the rotary embedding's own rule), in
the input dtype; :func:`load_rows`, a masked tile, for the plain rows too.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dlblas_kernels.blocks.rotary import rotate_pairs


@triton.jit
def load_rows(base, rows, row_mask, cols, col_mask, stride_row, stride_col):
    """The ``[len(rows), len(cols)]`` tile at ``base``, masked-off elements 0."""
    return tl.load(base + rows[:, None] * stride_row + cols[None, :] * stride_col,
                   mask=row_mask[:, None] & col_mask[None, :], other=0.0)


@triton.jit
def load_pairs(base, rows, row_mask, p, stride_row, stride_col, HEAD_DIM: tl.constexpr,
                INTERLEAVED: tl.constexpr):
    """The two halves ``(a, b)`` of the rotary pairs of each row: columns ``(p, p + D/2)``, or
    ``(2p, 2p + 1)`` when INTERLEAVED, for ``p < D/2`` (beyond: 0)."""
    p_mask = p < HEAD_DIM // 2
    if INTERLEAVED:
        a = load_rows(base, rows, row_mask, 2 * p, p_mask, stride_row, stride_col)
        b = load_rows(base, rows, row_mask, 2 * p + 1, p_mask, stride_row, stride_col)
    else:
        a = load_rows(base, rows, row_mask, p, p_mask, stride_row, stride_col)
        b = load_rows(base, rows, row_mask, p + HEAD_DIM // 2, p_mask, stride_row, stride_col)
    return a, b


@triton.jit
def rotated_pairs(base, rows, row_mask, positions, cos_base, sin_base, p,
                   stride_row, stride_col, stride_cos_s, stride_cos_d, stride_sin_s, stride_sin_d,
                   HEAD_DIM: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The pair halves of rows ``rows`` rotated by the table rows ``positions``, in the input dtype."""
    a, b = load_pairs(base, rows, row_mask, p, stride_row, stride_col, HEAD_DIM, INTERLEAVED)
    # Query rows before the first position (Sq > Sk) have no table row: they rotate to 0.
    table_mask = row_mask & (positions >= 0)
    cos_a, cos_b = load_pairs(cos_base, positions, table_mask, p, stride_cos_s, stride_cos_d, HEAD_DIM, INTERLEAVED)
    sin_a, sin_b = load_pairs(sin_base, positions, table_mask, p, stride_sin_s, stride_sin_d, HEAD_DIM, INTERLEAVED)
    out_a, out_b = rotate_pairs(a.to(tl.float32), b.to(tl.float32), cos_a.to(tl.float32), cos_b.to(tl.float32),
                                sin_a.to(tl.float32), sin_b.to(tl.float32), False)
    return out_a.to(a.dtype), out_b.to(a.dtype)


@triton.jit
def pair_sources(base, n_rows, stride_row, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Tensor descriptors of the rotary pair halves of ``[n_rows, HEAD_DIM]`` rows (unit column
    stride) at ``base``: rotate-half, one per half (columns ``[0, D/2)`` and ``[D/2, D)``, each a
    ``[BLOCK_R, BLOCK_P]`` block, zero past the half); interleaved, the whole row twice (the halves
    are split after the load)."""
    if INTERLEAVED:
        whole = tl.make_tensor_descriptor(base, shape=[n_rows, HEAD_DIM], strides=[stride_row, 1],
                                          block_shape=[BLOCK_R, BLOCK_D])
        return whole, whole
    else:
        first = tl.make_tensor_descriptor(base, shape=[n_rows, HEAD_DIM // 2], strides=[stride_row, 1],
                                          block_shape=[BLOCK_R, BLOCK_P])
        second = tl.make_tensor_descriptor(base + HEAD_DIM // 2, shape=[n_rows, HEAD_DIM // 2],
                                           strides=[stride_row, 1], block_shape=[BLOCK_R, BLOCK_P])
        return first, second


@triton.jit
def tile_pairs(first, second, row, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The pair halves ``(a, b)`` of rows ``row ... row + BLOCK_R`` from :func:`pair_sources`'s
    descriptors (zero past the end of the rows): two loads, or one whole-row load split into its
    even and odd lanes."""
    if INTERLEAVED:
        whole = first.load([row, 0])
        a, b = tl.split(tl.reshape(whole, [BLOCK_R, BLOCK_P, 2]))
    else:
        a = first.load([row, 0])
        b = second.load([row, 0])
    return a, b


@triton.jit
def rotated_tiles(x_first, x_second, cos_first, cos_second, sin_first, sin_second, row, position,
                   BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, INTERLEAVED: tl.constexpr):
    """:func:`rotated_pairs` through descriptors: the pair halves of rows ``row ...`` rotated by the
    table rows ``position ...`` (not negative), in the input dtype (rows past the end are 0)."""
    a, b = tile_pairs(x_first, x_second, row, BLOCK_R, BLOCK_P, INTERLEAVED)
    cos_a, cos_b = tile_pairs(cos_first, cos_second, position, BLOCK_R, BLOCK_P, INTERLEAVED)
    sin_a, sin_b = tile_pairs(sin_first, sin_second, position, BLOCK_R, BLOCK_P, INTERLEAVED)
    out_a, out_b = rotate_pairs(a.to(tl.float32), b.to(tl.float32), cos_a.to(tl.float32), cos_b.to(tl.float32),
                                sin_a.to(tl.float32), sin_b.to(tl.float32), False)
    return out_a.to(a.dtype), out_b.to(a.dtype)
