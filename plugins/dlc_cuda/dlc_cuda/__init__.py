"""dlcore backend for NVIDIA GPUs (torch device type ``cuda``)."""

from dlc_cuda.backend import CudaBackend

__version__ = "0.1.0"

__all__ = ["CudaBackend"]
