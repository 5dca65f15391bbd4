"""dlcore backend for Huawei Ascend NPUs (torch device type ``npu``)."""

from dlc_ascend.backend import AscendBackend

__all__ = ["AscendBackend"]
