"""Another implementation of dlblas' rms_norm: two passes over the row in small chunks.

It takes rms_norm's arguments as the op declares them (``dlcore ops rms_norm``: x, weight, eps;
x in the layouts contiguous or rows) and returns what the op's reference returns."""

import torch
import triton
import triton.language as tl

from dlcore.api import KernelCall, LaunchPlan, PowerOfTwo, SearchSpace, TritonImplementation, as_rows, hookimpl

#: the longest row it takes: one program per row, the row walked in chunks twice
MAX_HIDDEN = 65536


@triton.jit
def _chunked_rms_norm(x_ptr, w_ptr, y_ptr, K, stride_xr, stride_xc, stride_yr, eps, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    acc = tl.zeros([CHUNK], dtype=tl.float32)
    for start in range(0, K, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        x = tl.load(x_ptr + row * stride_xr + cols * stride_xc, mask=cols < K, other=0.0).to(tl.float32)
        acc += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / K + eps)
    for start in range(0, K, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        mask = cols < K
        x = tl.load(x_ptr + row * stride_xr + cols * stride_xc, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_yr + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


def _plan(args, config, profile):
    x, weight, eps = args
    x2 = as_rows(x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y2 = y.view(-1, x.shape[-1])
    call = KernelCall(_chunked_rms_norm, (x2.shape[0],),
                      (x2, weight, y2, x2.shape[1], x2.stride(0), x2.stride(1), y2.stride(0), eps),
                      {"CHUNK": config["CHUNK"]})
    return LaunchPlan([call], y)


def _supports(signature, profile):
    hidden = signature.tensor("x").shape[-1]
    return None if hidden <= MAX_HIDDEN else f"rows of {hidden} elements; it takes up to {MAX_HIDDEN}"


CHUNKED = TritonImplementation(
    "rms_norm", "chunked",
    plan=_plan, kernels=(_chunked_rms_norm,),
    default_config=lambda signature, profile: {"CHUNK": 16},
    space=lambda profile: SearchSpace([PowerOfTwo("CHUNK", 16, 128)]),
    supports=_supports,
    dtypes=(torch.float16, torch.float32),
    doc="two passes in chunks of 16 (slow on purpose: selection must not pick it)",
)


@hookimpl
def dlcore_implementations():
    return [CHUNKED]
