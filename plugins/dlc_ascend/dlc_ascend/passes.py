"""The passes of ``triton-adapter-opt`` as dlcore passes: ttir -> linalg on npu, one pass at a time.

triton-ascend runs the adapter once with eight passes (its ``backends/ascend/compiler.py``,
``ttir_to_linalg``). Run one adapter process per pass, each reading the previous one's output,
they give the same module (checked on the kernels of dlblas-kernels, locations aside) and each
becomes a named :class:`~dlcore.compiler.passes.Pass` of stage ``linalg``: switched by
``dlcore lower --pass/--no-pass`` and ``DLCORE_DISABLE_PASSES``, its output recorded, so
``--dump`` shows the IR before and after each. The npu pipeline (:mod:`dlc_ascend.pipeline`) runs
them itself in ``order``: Triton's stages hook never sees a ``linalg`` stage.

Memory-access coalescing is the first and third pass: ``discrete_mask_access_conversion`` turns a
load or store whose mask picks scattered elements into one contiguous access and a select, and
``triton_to_unstructure`` splits a gather or scatter so that the structured dimensions stay block
accesses. Off, a kernel with such accesses still lowers, with per-element accesses instead.

``triton_to_linalg`` is the lowering itself: without it nothing becomes linalg, and the pipeline
refuses to run (a :class:`~dlcore.errors.LoweringError` says so) rather than hand ttir to
``bishengir-compile``.

Options are triton-ascend 3.2's for the A2/A3 parts dlc-ascend knows (``compile-on-910-95=False``:
no Ascend 950); ``named-ops=True`` keeps linalg named ops, without which bishengir-compile fails
("failed to legalize operation 'linalg.generic'").
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from dlc_ascend import invoke
from dlc_ascend.toolchain import ADAPTER, locate
from dlcore.api import Pass, StageContext, hookimpl

STAGE = "linalg"
#: the pass that makes linalg of ttir; the pipeline does not run without it
LOWERING = "triton_to_linalg"

_A2_A3 = "compile-on-910-95=False force-simt-template=False"
#: the compile's scratch key of the adapter runs retried after a crash
RETRIED = "dlc_ascend_adapter_retried"


@dataclass(frozen=True)
class AdapterPass:
    """``run`` of one adapter pass: ``triton-adapter-opt IN --FLAG[=OPTIONS] -o OUT``."""

    flag: str
    options: str = ""

    @property
    def argument(self) -> str:
        return f"--{self.flag}={self.options}" if self.options else f"--{self.flag}"

    def __call__(self, module: str, stage: StageContext) -> str:
        """The pass's output module; a crashed run is retried (:func:`dlc_ascend.invoke.comes_and_goes`),
        each retry kept in the compile's scratch under :data:`RETRIED` (the flag and exit status)."""
        adapter = locate(ADAPTER.name)
        for _ in range(invoke.ATTEMPTS):
            with tempfile.TemporaryDirectory(prefix="dlc-ascend-adapter-") as tmp:
                source, out = Path(tmp) / "in.mlir", Path(tmp) / "out.mlir"
                source.write_text(module)
                done = invoke.run(adapter, [str(source), self.argument, "-o", str(out)], STAGE,
                                  step=f"{self.argument} on {stage.kernel}")
                if not invoke.comes_and_goes(done):
                    return invoke.read_module(out, done)
                stage.compile.scratch.setdefault(RETRIED, []).append(f"--{self.flag}, exit status {done.returncode}")
        raise invoke.gave_up(done)


#: (dlcore name, adapter flag, options, what it does), in triton-ascend's order
ADAPTER_PASSES = (
    ("discrete_mask_access_conversion", "discrete-mask-access-conversion", _A2_A3,
     "memory-access coalescing: a load/store with a scattered mask becomes one contiguous access and a select"),
    ("triton_to_annotation", "triton-to-annotation", "",
     "Triton's compiler hints to the annotation dialect"),
    ("triton_to_unstructure", "triton-to-unstructure", _A2_A3,
     "memory-access coalescing: gathers/scatters split so their structured dimensions stay block accesses"),
    ("triton_to_hivm", "triton-to-hivm", "",
     "Triton ops with a HIVM counterpart to the HIVM dialect"),
    ("triton_to_hfusion", "triton-to-hfusion", "",
     "Triton ops with an HFusion counterpart to the HFusion dialect"),
    ("triton_to_llvm", "triton-to-llvm", "",
     "Triton ops with an LLVM counterpart (inline assembly, externs) to the LLVM dialect"),
    ("bubble_up_operation", "bubble-up-operation", "",
     "slices moved above the elementwise ops that feed them, so only the tile's part is computed"),
    (LOWERING, "triton-to-linalg",
     "global-kernel=false named-ops=True enable-nd2nz-on-vector=False enable-select-analysis=False "
     "compile-on-910-95=False",
     "the lowering: ttir to linalg on memrefs (not to be switched off: nothing else makes linalg)"),
)


def adapter_passes() -> list[Pass]:
    return [
        Pass(name=name, stage=STAGE, run=AdapterPass(flag, options), backends=("npu",), order=(i + 1) * 10,
             doc=f"triton-adapter-opt --{flag}: {what}")
        for i, (name, flag, options, what) in enumerate(ADAPTER_PASSES)
    ]


@hookimpl
def dlcore_passes() -> list[Pass]:
    return adapter_passes()
