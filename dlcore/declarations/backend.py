"""The interface every hardware backend implements (see ``hookspecs.dlcore_backends``)."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dlcore.declarations.device import DeviceProfile
from dlcore.declarations.protocols import LoweringResult, PassPipeline, ToolchainSpec

if TYPE_CHECKING:
    from dlcore.declarations.implementation import Implementation, KernelCall
    from dlcore.declarations.signature import Signature


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run here, and if not, why."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


class Backend:
    """A hardware backend: owns torch device types, describes devices, times code.

    Subclasses set ``name`` and ``device_types`` and override what differs. Nothing here may
    probe a device or import a vendor runtime before ``available()`` is called.
    """

    name: str = ""
    device_types: tuple[str, ...] = ()
    #: implementation kinds this backend can run: "triton", "torch", and "vendor" (the vendor's
    #: library through torch, timed against the kernels; a backend whose kernels cannot be fairly
    #: timed against it leaves it out, as the cpu backend does)
    kinds: tuple[str, ...] = ("triton", "torch", "vendor")
    #: whether its timings say how fast kernels are on the hardware: False where Triton kernels run
    #: in the interpreter (the cpu backend), so that bench reports no fractions of a copy's bandwidth
    hardware_timings: bool = True
    #: the external compilers its ``lower`` runs, beyond Triton (``dlcore toolchain`` lists them,
    #: ``dlcore toolchain fetch NAME`` fills a toolchain's cache): each a
    #: :class:`dlcore.compiler.toolchain.Toolchain`
    toolchains: tuple[ToolchainSpec, ...] = ()

    @property
    def version(self) -> str:
        """The version of the distribution that provides this backend: part of cache keys."""
        package = type(self).__module__.split(".")[0]
        return str(getattr(sys.modules.get(package), "__version__", "0"))

    def available(self) -> Availability:
        """Whether the runtime is present and a device can be used; the reason when not."""
        return Availability(True)

    def profile(self, device: torch.device) -> DeviceProfile:
        """Describe ``device``. Called lazily, once per device."""
        raise NotImplementedError

    def accepts(self, impl: Implementation, signature: Signature) -> str | None:
        """``None`` if this backend can run ``impl`` on ``signature``, else the reason it cannot."""
        if impl.kind not in self.kinds:
            return f"the {self.name} backend does not run {impl.kind} implementations"
        return None

    def synchronize(self, device: torch.device) -> None:
        """Wait for all work queued on ``device``."""

    def timer(self, fn: Callable[[], object], device: torch.device, *, warmup: int = 1, reps: int = 5) -> float:
        """Median wall time of ``fn()`` in milliseconds, warm-up excluded."""
        for _ in range(warmup):
            fn()
        self.synchronize(device)
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            self.synchronize(device)
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    def target_profile(self, target: str) -> DeviceProfile | None:
        """The nominal :class:`DeviceProfile` of lowering target ``target`` (``BACKEND:ARCH`` of this
        backend), asked of no device: what plans are sized for and launch passes fold grids to when
        ``dlcore lower`` builds them. ``None``: dlcore's table of nominal targets serves
        (:func:`dlcore.compiler.lowering.target_profile`)."""
        return None

    def lower(self, call: KernelCall, target: str, passes: PassPipeline | None = None,
              specialize: bool = True) -> LoweringResult:
        """What one kernel launch becomes for ``target`` at each IR stage, without the hardware: a
        :class:`dlcore.compiler.lowering.Lowering`.

        :param call: a launch of a plan (built on ``meta`` tensors is enough): its kernel and
            arguments give the kernel's signature and constexprs; its grid is not used.
        :param target: ``BACKEND:ARCH`` for this backend, e.g. ``cuda:90`` or ``npu:Ascend910B``.
        :param passes: the :class:`dlcore.compiler.passes.Pipeline` whose IR passes run; default:
            this backend's registered passes (``ast`` and ``launch`` passes are applied to the plan
            before, see :func:`dlcore.compiler.rewrite.apply_launch_passes`).
        :param specialize: specialize the kernel on the argument values as a launch on the target
            would (16-byte aligned pointers, integers divisible by 16, integers equal to 1; see
            :func:`dlcore.compiler.signatures.launch_signature`); ``False``: on types and constexprs only.
        :raises LoweringError: the target is not this backend's, or the kernel cannot be compiled.
        :raises ToolchainMissingError: the pipeline stops where a compiler is not installed; its
            ``partial`` holds the stages reached.
        """
        from dlcore.errors import LoweringError

        raise LoweringError(f"the {self.name} backend has no compiler pipeline: it cannot lower for {target}")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} devices={self.device_types}>"
