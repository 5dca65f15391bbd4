"""Triton's allocator for the global scratch some kernels ask for at launch (device-side tensor
descriptors: 128 bytes per descriptor and program).

Triton keeps the allocator in a context variable, and a thread starts without one: a kernel that
needs scratch, launched from a thread that never set an allocator (autograd's device thread, a
server's worker, a thread replaying a launch template another thread recorded) fails with
"Kernel requires a runtime memory allocation, but no allocator was set". dlcore launches
such kernels only after :func:`ensure_allocator`, which sets torch's caching allocator in the
calling context unless the caller set one of their own.
"""

from __future__ import annotations

from typing import Any

import torch


def _torch_allocator(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    # torch's caching allocator aligns to at least 512 bytes, above any alignment Triton asks for.
    return torch.empty(size, dtype=torch.int8, device="cuda")


def needs_allocator(compiled: Any) -> bool:
    """Whether a compiled Triton kernel asks for global scratch when launched."""
    return bool(getattr(getattr(compiled, "metadata", None), "global_scratch_size", 0))


def ensure_allocator() -> None:
    """Set torch's caching allocator as Triton's in the calling context, unless one is set there."""
    import triton
    from triton.runtime import _allocation  # Triton's own holder; no public getter exists

    current = getattr(_allocation, "_allocator", None)
    if current is None or isinstance(current.get(), getattr(_allocation, "NullAllocator", ())):
        triton.set_allocator(_torch_allocator)
