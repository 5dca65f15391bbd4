"""The cross-entropy rows: each row's loss against its label, its log-sum-exp, and the gradient of
its logits; the building block of ``cross_entropy`` and ``fused_linear_cross_entropy``.

For row ``r`` of logits ``x [rows, V]`` with label ``t`` (float32 maths whatever the dtype)::

    z     = c * tanh(x / c)                          with a soft cap c (SOFTCAP), else z = x
    lse   = log(sum_j exp(z_j))
    loss  = (1 - eps) * (lse - z_t) + eps * (lse - sum_j z_j / V)     eps: the label smoothing
    dz_j  = g * (exp(z_j - lse) - (1 - eps) * [j == t] - eps / V)
    dx_j  = dz_j * (1 - (z_j / c) ** 2)              with a soft cap, else dz_j

A row whose label is ``ignore_index``, or outside ``[0, V)``, is ignored: loss 0, gradient 0, and
the label is never used as an address. (The ops refuse such labels before launching; a bound op
reused with other labels does not check them again, and such a row then counts as ignored.)

- :func:`ce_forward_kernel`: one program per row. An online pass over blocks of ``BLOCK_V`` keeps
  the row's running maximum and per-lane sums of ``exp(z - m)``, rescaled when the maximum grows
  (one exponential per element); the label's logit is one scalar load. GRAD: a second pass writes
  the gradient with ``g = 1`` (the caller scales it), in place where ``grad`` is ``x``.
- :func:`ce_backward_kernel`: the gradient from the saved log-sum-exp, one pass;
  ``g = dloss[r] * scale`` (SCALED: times the forward's reduction scale).
- :func:`ce_finish_kernel`: one program sums the row losses and counts the rows not ignored: the
  loss (the sum, or the mean: the sum over the count, NaN for no row as in torch) and the
  gradient's scale (1, or one over the count: 0 when every row is ignored, whose gradients torch
  also makes 0).
- :func:`column_sum_kernel`: ``out[v] (+)= sum_r g[r, v]`` in float32: a bias's gradient over row chunks.

``tanh`` is ``2 * sigmoid(2u) - 1`` (no libdevice: the interpreter and every backend take it).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def softcapped(x, cap, SOFTCAP: tl.constexpr):
    """``cap * tanh(x / cap)`` (SOFTCAP), else ``x``."""
    if SOFTCAP:
        x = cap * (2.0 * tl.sigmoid(2.0 * x / cap) - 1.0)
    return x


@triton.jit
def _label(labels_ptr, row, stride_l, V, ignore_index):
    """The row's label and whether it counts (not ``ignore_index``, within ``[0, V)``); an ignored
    row's label is 0, a safe address."""
    label = tl.load(labels_ptr + row * stride_l).to(tl.int64)
    valid = (label != ignore_index) & (label >= 0) & (label < V)
    return tl.where(valid, label, 0), valid


@triton.jit
def _row_gradient(z, lse, cols, label, valid, g, smoothing, cap, V, SOFTCAP: tl.constexpr, SMOOTH: tl.constexpr):
    """The gradient of one block of a row's raw logits (see the module doc)."""
    d = tl.exp2((z - lse) * LOG2E)
    if SMOOTH:
        d = d - tl.where(cols == label, 1.0 - smoothing, 0.0) - smoothing / V
    else:
        d = d - tl.where(cols == label, 1.0, 0.0)
    if SOFTCAP:
        d = d * (1.0 - (z / cap) * (z / cap))
    return tl.where(valid, d * g, 0.0)


@triton.jit
def ce_forward_kernel(
    x_ptr, labels_ptr, loss_ptr, lse_ptr, grad_ptr,
    V, stride_xr, stride_xv, stride_l, stride_gr, stride_gv,
    ignore_index, smoothing, cap,
    BLOCK_V: tl.constexpr, SOFTCAP: tl.constexpr, SMOOTH: tl.constexpr, GRAD: tl.constexpr,
):
    """Row ``program_id(0)``: its loss and log-sum-exp (float32), and with GRAD its gradient for
    ``g = 1`` into ``grad`` (``x`` itself for in place: each block is read before it is written)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xr
    label, valid = _label(labels_ptr, row, stride_l, V, ignore_index)
    cols = tl.arange(0, BLOCK_V)

    # Online: the running maximum m and per-lane sums of exp(z - m); m_safe stands in for m while
    # the row has seen only -inf (never computing -inf - -inf).
    m = tl.full((1,), -float("inf"), tl.float32)
    m_safe = tl.zeros((1,), tl.float32)
    sums = tl.zeros((BLOCK_V,), tl.float32)
    z_sum = tl.zeros((BLOCK_V,), tl.float32)
    for start in range(0, V, BLOCK_V):
        mask = start + cols < V
        x = tl.load(x_row + (start + cols) * stride_xv, mask=mask, other=0.0).to(tl.float32)
        z = tl.where(mask, softcapped(x, cap, SOFTCAP), -float("inf"))
        m = tl.maximum(m, tl.max(z, axis=0))
        m_new = tl.where(m == -float("inf"), 0.0, m)
        rescale = tl.exp2(tl.minimum(m_safe - m_new, 0.0) * LOG2E)
        sums = sums * rescale + tl.exp2((z - m_new) * LOG2E)
        m_safe = m_new
        if SMOOTH:
            z_sum += tl.where(mask, z, 0.0)
    lse = m_safe + tl.log(tl.sum(sums, axis=0))
    z_label = softcapped(tl.load(x_row + label * stride_xv).to(tl.float32), cap, SOFTCAP)
    loss = lse - z_label
    if SMOOTH:
        loss = (1.0 - smoothing) * loss + smoothing * (lse - tl.sum(z_sum, axis=0) / V)
    offs = tl.arange(0, 1)
    tl.store(loss_ptr + row + offs, tl.where(valid, loss, 0.0))
    tl.store(lse_ptr + row + offs, lse)

    if GRAD:
        g_row = grad_ptr + row * stride_gr
        for start in range(0, V, BLOCK_V):
            mask = start + cols < V
            z = softcapped(tl.load(x_row + (start + cols) * stride_xv, mask=mask, other=0.0).to(tl.float32),
                           cap, SOFTCAP)
            d = _row_gradient(z, lse, start + cols, label, valid, 1.0, smoothing, cap, V, SOFTCAP, SMOOTH)
            tl.store(g_row + (start + cols) * stride_gv, d.to(grad_ptr.dtype.element_ty), mask=mask)


@triton.jit
def ce_backward_kernel(
    x_ptr, labels_ptr, lse_ptr, dloss_ptr, scale_ptr, dx_ptr,
    V, stride_xr, stride_xv, stride_l, stride_d, stride_gr, stride_gv,
    ignore_index, smoothing, cap,
    BLOCK_V: tl.constexpr, SOFTCAP: tl.constexpr, SMOOTH: tl.constexpr, SCALED: tl.constexpr,
):
    """Row ``program_id(0)``'s gradient from its saved log-sum-exp: ``g = dloss[row * stride_d]``
    (a stride of 0: one gradient for every row), times ``scale[0]`` when SCALED."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xr
    dx_row = dx_ptr + row * stride_gr
    label, valid = _label(labels_ptr, row, stride_l, V, ignore_index)
    lse = tl.load(lse_ptr + row)
    g = tl.load(dloss_ptr + row * stride_d).to(tl.float32)
    if SCALED:
        g = g * tl.load(scale_ptr)
    cols = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        mask = start + cols < V
        z = softcapped(tl.load(x_row + (start + cols) * stride_xv, mask=mask, other=0.0).to(tl.float32),
                       cap, SOFTCAP)
        d = _row_gradient(z, lse, start + cols, label, valid, g, smoothing, cap, V, SOFTCAP, SMOOTH)
        tl.store(dx_row + (start + cols) * stride_gv, d.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def ce_finish_kernel(
    loss_rows_ptr, labels_ptr, loss_ptr, scale_ptr,
    rows, V, stride_l, ignore_index,
    BLOCK: tl.constexpr, MEAN: tl.constexpr,
):
    """One program: ``loss = sum(loss_rows)`` (over the count of rows not ignored, MEAN) and the
    gradient's ``scale`` (1; MEAN: one over the count, 0 for none)."""
    offs = tl.arange(0, BLOCK)
    total = tl.zeros((BLOCK,), tl.float32)
    count = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, rows, BLOCK):
        mask = start + offs < rows
        total += tl.load(loss_rows_ptr + start + offs, mask=mask, other=0.0)
        label = tl.load(labels_ptr + (start + offs).to(tl.int64) * stride_l, mask=mask, other=ignore_index)
        label = label.to(tl.int64)
        count += tl.where(mask & (label != ignore_index) & (label >= 0) & (label < V), 1.0, 0.0)
    total_sum = tl.sum(total, axis=0)
    n = tl.sum(count, axis=0)
    one = tl.arange(0, 1)
    if MEAN:
        tl.store(loss_ptr + one, tl.zeros((1,), tl.float32) + total_sum / n)
        tl.store(scale_ptr + one, tl.zeros((1,), tl.float32) + tl.where(n > 0, 1.0 / tl.maximum(n, 1.0), 0.0))
    else:
        tl.store(loss_ptr + one, tl.zeros((1,), tl.float32) + total_sum)
        tl.store(scale_ptr + one, tl.full((1,), 1.0, tl.float32))


@triton.jit
def column_sum_kernel(
    g_ptr, out_ptr, rows, V, stride_gr, stride_gv,
    BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """``out[v] = sum_r g[r, v]`` (float32), plus ``out``'s old value when ACCUMULATE; a program per
    ``BLOCK_V`` columns."""
    cols = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R, BLOCK_V), tl.float32)
    for start in range(0, rows, BLOCK_R):
        mask = ((start + r) < rows)[:, None] & (cols < V)[None, :]
        ptrs = g_ptr + (start + r).to(tl.int64)[:, None] * stride_gr + cols[None, :] * stride_gv
        acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    total = tl.sum(acc, axis=0)
    if ACCUMULATE:
        total += tl.load(out_ptr + cols, mask=cols < V, other=0.0)
    tl.store(out_ptr + cols, total, mask=cols < V)


KERNELS = (ce_forward_kernel, ce_backward_kernel, ce_finish_kernel, column_sum_kernel)
