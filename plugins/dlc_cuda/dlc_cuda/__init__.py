"""dlcore backend for NVIDIA GPUs (torch device type ``cuda``)."""

from dlc_cuda.backend import CudaBackend

__all__ = ["CudaBackend"]
