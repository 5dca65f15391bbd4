"""A second implementation of dlblas' rms_norm, in torch, under a clashing entry-point name."""

import torch

from dlcore import hookimpl
from dlcore.declarations.implementation import TorchImplementation


def _rms_norm(x, weight, eps=1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


@hookimpl
def dlcore_implementations():
    return [TorchImplementation("rms_norm", "clash_torch", _rms_norm)]
