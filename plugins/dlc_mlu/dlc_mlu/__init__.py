"""dlcore backend for Cambricon MLUs (torch device type ``mlu``)."""

from dlc_mlu.backend import MluBackend

__version__ = "0.1.0"

__all__ = ["MluBackend"]
