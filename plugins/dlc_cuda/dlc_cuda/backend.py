"""The ``cuda`` backend: NVIDIA GPUs through torch.cuda, timed with Triton's ``do_bench``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from dlcore.api import Availability, Backend, DeviceProfile, hookimpl

if TYPE_CHECKING:
    from dlcore.api import KernelCall, Lowering, Pipeline


class CudaBackend(Backend):
    name = "cuda"
    device_types = ("cuda",)

    def available(self) -> Availability:
        if not torch.cuda.is_available():
            build = "a CPU-only build of torch" if torch.version.cuda is None else "no visible GPU or driver"
            return Availability(False, f"torch.cuda.is_available() is False ({build})")
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            return Availability(False, f"triton cannot be imported: {exc}")
        return Availability(True)

    def profile(self, device: torch.device) -> DeviceProfile:
        props = torch.cuda.get_device_properties(device)
        if torch.version.hip is not None:
            vendor, arch = "amd", getattr(props, "gcnArchName", "gfx").split(":")[0]
        else:
            vendor, arch = "nvidia", f"sm_{props.major}{props.minor}"
        return DeviceProfile(
            backend=self.name,
            vendor=vendor,
            name=props.name,
            arch=arch,
            cores=props.multi_processor_count,
            memory_bytes=props.total_memory,
            shared_memory_per_program=getattr(props, "shared_memory_per_block_optin", 0),
            registers_per_core=getattr(props, "regs_per_multiprocessor", 0),
            threads_per_core=getattr(props, "max_threads_per_multi_processor", 0),
            warp_size=getattr(props, "warp_size", 32),
            l2_bytes=getattr(props, "L2_cache_size", 0),
        )

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def timer(self, fn: Callable[[], object], device: torch.device, *, warmup: int = 1, reps: int = 5) -> float:
        """Median milliseconds from ``triton.testing.do_bench`` (L2 flushed between runs)."""
        from triton.testing import do_bench

        with torch.cuda.device(device):
            return float(do_bench(fn, warmup=max(warmup, 5), rep=max(reps * 5, 25), return_mode="median"))

    def lower(self, call: KernelCall, target: str, passes: Pipeline | None = None,
              specialize: bool = True) -> Lowering:
        """``triton.compile`` for ``cuda:CAPABILITY`` (``cuda:80``, ``cuda:90``, ``cuda:100``), no GPU
        needed: ttir, ttgir, llir, ptx and cubin, with registers and spills from ptxas's report."""
        import contextlib
        import io

        from triton import knobs
        from triton.backends.compiler import GPUTarget

        from dlcore.api import cuda_capability, default_pipeline, lower_with_triton, ptxas_resources

        gpu_target = GPUTarget("cuda", cuda_capability(target), 32)
        passes = passes if passes is not None else default_pipeline(self.name)
        log = io.StringIO()
        # Triton prints ptxas's -v report to stdout when asked; it is the only place spills appear.
        with knobs.nvidia.scope(), contextlib.redirect_stdout(log):
            knobs.nvidia.dump_ptxas_log = True
            lowering = lower_with_triton(call, gpu_target, target, passes, specialize=specialize)
        lowering.resources = ptxas_resources(log.getvalue(), shared=lowering.resources.shared)
        return lowering


@hookimpl
def dlcore_backends() -> list[Backend]:
    return [CudaBackend()]
