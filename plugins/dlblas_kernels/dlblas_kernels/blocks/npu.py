"""What kernels size by on an npu (Ascend's AI cores): a program's tiles live in the core's unified
buffer, ``DeviceProfile.shared_memory_per_program`` bytes, which bishengir-compile refuses to
overflow."""

from __future__ import annotations

from dlcore.api import DeviceProfile


def on_npu(profile: DeviceProfile | None) -> bool:
    return profile is not None and profile.backend == "npu"


def buffer_tile(profile: DeviceProfile | None, bytes_per_element: int, most: int) -> int:
    """``most`` elements, on npu no more than the unified buffer holds at ``bytes_per_element`` each
    (the power of two at or below); elsewhere, or with the buffer's size unknown, ``most``."""
    if not on_npu(profile) or not profile.shared_memory_per_program:
        return most
    fits = profile.shared_memory_per_program // bytes_per_element
    return min(most, 1 << (fits.bit_length() - 1))
