"""dlcore backend for Huawei Ascend NPUs (torch device type ``npu``)."""

from dlc_ascend.backend import AscendBackend

__version__ = "0.1.0"

__all__ = ["AscendBackend"]
