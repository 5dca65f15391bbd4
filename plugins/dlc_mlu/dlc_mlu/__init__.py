"""dlcore backend for Cambricon MLUs (torch device type ``mlu``)."""

from dlc_mlu.backend import MluBackend

__all__ = ["MluBackend"]
