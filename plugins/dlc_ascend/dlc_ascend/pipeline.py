"""The npu lowering pipeline: ttir -> linalg -> hivm -> bin, each stage's output checked.

- ``ttir``: upstream Triton's target-independent passes (:func:`dlcore.compiler.lowering.lower_with_triton`
  through its NVIDIA backend, stopped after ttir): upstream ships no Ascend backend, and its ttir is
  what ``triton-adapter-opt`` reads.
- ``linalg``: the passes of stage ``linalg`` in order, the adapter's eight among them
  (:mod:`dlc_ascend.passes`, one adapter process each); the IR after each is kept. Checked: a
  ``func.func`` and no ``tt.`` operation left (attributes such as ``tt.divisibility`` stay).
- ``hivm``: ``bishengir-compile --target=<part>`` with triton-ascend 3.2's options for A2/A3 parts,
  on the linalg without its ``mix_mode`` attribute (triton-ascend strips it too; the pipeline notes
  it: ``aiv`` vector cores only, ``mix`` cube and vector cores). Its ``--save-temps`` folder holds
  ``module.hivm.opt.mlir``, the HIVM IR, checked for ``hivm.hir`` operations.
- ``bin``: the same ``bishengir-compile`` run goes on to CANN's ``hivmc`` (found from ``PATH``; one
  found elsewhere, e.g. by ``DLC_ASCEND_HIVMC``, is put first on its ``PATH``), which writes the
  device binary. The run's time is split between hivm and bin at the moment the HIVM IR was written.
  Without ``hivmc`` the lowering stops after hivm with
  :class:`~dlcore.errors.ToolchainMissingError`.

Failures that come and go (:mod:`dlc_ascend.invoke`: a crash, or one of bishengir-compile's
:data:`TRANSIENT` messages) are retried, up to :data:`~dlc_ascend.invoke.ATTEMPTS` runs, and the retries
are noted on the lowering; every other failure stops at once. ffn's weight-streaming kernel fails
about a third of fresh bishengir-compile runs (27 of 80, bishengir-compile 1.2.0; every other kernel
0 of 10), and triton-adapter-opt crashes about once in 150 runs of a pass. A missing tool stops the
lowering with :class:`~dlcore.errors.ToolchainMissingError`, whose ``partial`` holds the stages
reached and whose message says how to get the tool. Passes bound to ``hivm`` or ``bin`` only read
their stage (one bishengir run makes both, so a changed module could not reach the binary): one that
changes it is an error.

Temporary folders are removed; ``DLC_DUMP_IR=1`` and ``dlcore lower --dump`` show every stage and
every linalg pass (:mod:`dlcore.compiler.dump`).
"""

from __future__ import annotations

import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dlc_ascend import invoke, passes
from dlc_ascend.chips import Chip, chip
from dlc_ascend.toolchain import ADAPTER, ADAPTER_VERSION, BISHENGIR, HIVMC, find, locate
from dlcore.api import (
    EVERY_IR_STAGE,
    Compile,
    DlcoreError,
    Lowering,
    LoweringError,
    Pass,
    Pipeline,
    StageContext,
    StageOutput,
    ToolchainMissingError,
    dump_after_pass,
    ir_text,
    lower_with_triton,
    parse_target,
)

if TYPE_CHECKING:
    from dlcore.api import Found, KernelCall

STAGES = ("ttir", "linalg", "hivm", "bin")
#: the upstream Triton whose ttir the adapter reads (a newer one's holds operations it has no dialect for)
TTIR_TRITON = "3.6.0"
#: the Triton target whose backend runs the ttir passes: (backend, capability, warp size)
TTIR_TARGET = ("cuda", 80, 32)

#: triton-ascend 3.2's bishengir-compile options for A2/A3 parts (``linalg_to_bin_enable_npu_compile_A2_A3``)
BISHENGIR_OPTIONS = (
    "--enable-auto-multi-buffer=True",
    "--enable-auto-bind-sub-block=True",
    "--enable-hfusion-compile=true",
    "--enable-hivm-compile=true",
    "--enable-triton-kernel-compile=true",
)
#: bishengir-compile's messages for failures another run of the same input need not repeat
TRANSIENT = ("hivm.hir.store only support store ub to gm", "Failed to collect vector loop tiling info")
#: bishengir-compile runs at most, per kernel, while its failures come and go
ATTEMPTS = invoke.ATTEMPTS
#: what ``--save-temps`` leaves: the HIVM IR after HIVM's optimisations
HIVM_FILE = "module.hivm.opt.mlir"
#: the device binary for ``-o kernel``: ``kernel.o`` from bishengir-compile 1.2, ``kernel_reloc.o`` before
BINARY_FILES = ("kernel.o", "kernel_reloc.o")

# An operation's name where an operation starts a line: after its results (`%a, %b:2 = `), in the
# custom (`tt.load`) or generic (`"tt.reduce"`) form. Attribute names (`{tt.divisibility = 16}`)
# and types (`!tt.ptr`) never stand there.
_OPERATION = re.compile(r'^\s*(?:%[^=\n"]*=\s*)?"?([A-Za-z_]\w*\.[\w.$]+)', re.MULTILINE)
_MIX_MODE = re.compile(r',\s*mix_mode\s*=\s*"([^"]*)"')


def operations(ir: str) -> list[str]:
    """The names of the operations in ``ir`` (MLIR text), in order, repeats kept."""
    return _OPERATION.findall(ir)


def check_linalg(ir: str) -> None:
    """:raises LoweringError: ``ir`` holds no function, or Triton operations the adapter left."""
    ops = operations(ir)
    left = sorted({op for op in ops if op.startswith("tt.")})
    if left:
        raise LoweringError(f"{ADAPTER.name} left Triton operations it did not lower in the linalg stage: "
                            f"{', '.join(left)} (it exits 0 all the same); the kernel must be written without "
                            "what it cannot lower")
    if "func.func" not in ops:
        raise LoweringError(f"{ADAPTER.name} gave no func.func in the linalg stage (it starts {ir.strip()[:80]!r})")


def check_hivm(ir: str) -> None:
    """:raises LoweringError: ``ir`` holds no ``hivm.hir`` operation."""
    if not any(op.startswith("hivm.hir.") for op in operations(ir)):
        raise LoweringError(f"{BISHENGIR.name} wrote {HIVM_FILE} without hivm.hir operations in the hivm stage "
                            f"(it starts {ir.strip()[:80]!r})")


def without_mix_mode(linalg: str) -> tuple[str, str]:
    """``linalg`` without its ``mix_mode`` attribute (bishengir-compile rejects it), and the mode
    (``aiv``, ``aic``, ``mix``; empty when absent)."""
    found = _MIX_MODE.search(linalg)
    return _MIX_MODE.sub("", linalg), found.group(1) if found else ""


# --------------------------------------------------------------------------------------------
# the stage drivers
# --------------------------------------------------------------------------------------------


def run_passes(module: str, stage_passes: tuple[Pass, ...], context: StageContext) -> list[StageOutput]:
    """Run the IR passes of one stage the backend makes itself (not Triton), in order.

    Returns the IR after each pass bound to the stage (``after_pass`` set) and, last, the stage's
    output; a pass bound to every stage (the IR dump) runs but adds no output of its own.

    :raises LoweringError: a pass failed (a tool's failure keeps its own error).
    """
    outputs: list[StageOutput] = []
    start = time.perf_counter()
    for p in stage_passes:
        began = time.perf_counter()
        out = _run_pass(p, module, context)
        if out is not None:
            module = ir_text(out)
        if p.stage != EVERY_IR_STAGE:
            outputs.append(StageOutput(context.stage, module, time.perf_counter() - began, after_pass=p.name))
            dump_after_pass(outputs[-1], len(outputs), context, stage_passes)
    outputs.append(StageOutput(context.stage, module, time.perf_counter() - start))
    return outputs


def linalg(ttir: str, pipeline: Pipeline, context: StageContext) -> list[StageOutput]:
    """ttir -> linalg: the pipeline's ``linalg`` passes, then the check (see the module docstring).

    :raises LoweringError: ``triton_to_linalg`` is switched off, a pass failed, or the result is
        not linalg.
    :raises ToolchainMissingError: ``triton-adapter-opt`` is not found.
    """
    stage_passes = pipeline.at(passes.STAGE)
    if passes.LOWERING not in {p.name for p in stage_passes}:
        raise LoweringError(f"the pass {passes.LOWERING} is switched off (--no-pass or DLCORE_DISABLE_PASSES): it "
                            "is what lowers ttir to linalg, so the npu pipeline cannot go past ttir; switch it on")
    locate(ADAPTER.name)
    try:
        outputs = run_passes(ttir, stage_passes, context)
    except LoweringError as exc:
        mismatch = triton_mismatch()
        if mismatch and not isinstance(exc, ToolchainMissingError):
            raise LoweringError(mismatch, exc.partial) from exc
        raise
    check_linalg(str(outputs[-1].ir))
    return outputs


def triton_mismatch(version: str | None = None) -> str:
    """Why the adapter may not read this Triton's ttir, in one line ('' on the Triton it reads):
    a newer Triton's ttir holds operations it has no dialect for (Triton 3.9's ``ttg.barrier``)."""
    if version is None:
        import triton

        version = triton.__version__
    if version.split(".")[:2] == TTIR_TRITON.split(".")[:2]:
        return ""
    return (f"{ADAPTER.name} (triton-ascend {ADAPTER_VERSION}) reads the ttir of upstream Triton {TTIR_TRITON}, "
            f"and this is Triton {version}: lower for npu where triton=={TTIR_TRITON} is installed "
            f"(`pip install triton=={TTIR_TRITON}` in a virtualenv of its own, or `nox -s ascend`)")


@dataclass
class Bishengir:
    """What the bishengir-compile run of one kernel made."""

    hivm: str
    #: the device binary; ``None`` without ``hivmc``
    binary: bytes | None
    hivm_seconds: float
    bin_seconds: float
    #: the execution mode the adapter chose (``aiv``: vector cores only; ``mix``: cube and vector)
    mix_mode: str
    #: the stderr tail of each failed run that was retried
    retried: list[str] = field(default_factory=list)


def hivm(linalg_ir: str, part: Chip, hivmc: Found | None) -> Bishengir:
    """linalg -> HIVM IR, and the binary when ``hivmc`` is given (see the module docstring).

    :raises LoweringError: bishengir-compile failed (after :data:`ATTEMPTS` runs if each failure came and
        went), or wrote no HIVM IR, or (with ``hivmc``) no binary.
    :raises ToolchainMissingError: ``bishengir-compile`` is not found.
    """
    bishengir = locate(BISHENGIR.name)
    source, mix_mode = without_mix_mode(linalg_ir)
    retried: list[str] = []
    for _ in range(ATTEMPTS):
        with tempfile.TemporaryDirectory(prefix="dlc-ascend-bishengir-") as tmp:
            folder = Path(tmp)
            (folder / "kernel.ttadapter.mlir").write_text(source)
            started = time.time()
            done = invoke.run(bishengir, ["kernel.ttadapter.mlir", f"--target={part.name}", *BISHENGIR_OPTIONS,
                                          f"--save-temps={folder}", "-o", str(folder / "kernel")], "hivm",
                              cwd=folder, path_prefix=(hivmc.path.parent,) if hivmc is not None else ())
            if not invoke.comes_and_goes(done, TRANSIENT):
                return _made(folder, done, started, hivmc, mix_mode, retried)
            retried.append(done.tail())
    raise invoke.gave_up(done, TRANSIENT)


def _made(folder: Path, done: invoke.ToolRun, started: float, hivmc: Found | None, mix_mode: str,
          retried: list[str]) -> Bishengir:
    written = folder / HIVM_FILE
    if not written.is_file() or not written.read_text(errors="replace").strip():
        if done.returncode != 0:
            raise done.failure(f"it wrote no {HIVM_FILE}")
        raise LoweringError(f"{BISHENGIR.name} exited 0 in the hivm stage but wrote no {HIVM_FILE}; "
                            f"its output ends:\n{done.tail()}")
    ir = written.read_text(errors="replace")
    check_hivm(ir)
    hivm_seconds = min(max(written.stat().st_mtime - started, 0.0), done.seconds)
    binary = None
    if hivmc is not None:
        if done.returncode != 0:
            raise invoke.ToolRun(done.tool, "bin", done.returncode, done.stdout, done.stderr, done.seconds).failure(
                f"it made HIVM IR, then failed making the binary with {hivmc.path}")
        made = [folder / name for name in BINARY_FILES if (folder / name).is_file()]
        binary = made[0].read_bytes() if made else b""
        if not binary:
            raise LoweringError(f"{BISHENGIR.name} exited 0 in the bin stage but wrote no {' or '.join(BINARY_FILES)}; "
                                f"its output ends:\n{done.tail()}")
    return Bishengir(ir, binary, hivm_seconds, done.seconds - hivm_seconds, mix_mode, retried)


# --------------------------------------------------------------------------------------------
# one lowering
# --------------------------------------------------------------------------------------------


@dataclass
class _TtirCompile:
    """Records the ttir compile as Triton's stages hook saw it (run as the last ttir pass)."""

    context: StageContext | None = None

    def __call__(self, module: object, stage: StageContext) -> None:
        self.context = stage


@dataclass(frozen=True)
class NpuCompile:
    """What the passes of the npu stages see: one :class:`Compile` sharing the ttir compile's hash
    and its scratch (so the IR dump writes every stage into the ttir's folder)."""

    compile: Compile
    metadata: dict

    @classmethod
    def after(cls, ttir: StageContext | None, kernel: str, part: Chip) -> NpuCompile:
        scratch = ttir.compile.scratch if ttir is not None else {}
        metadata = {"hash": ttir.hash if ttir is not None else ""}
        return cls(Compile("npu", f"npu:{part.name}", None, STAGES, kernel, scratch), metadata)

    def context(self, stage: str) -> StageContext:
        return StageContext(stage, STAGES.index(stage) + 1, self.compile, self.metadata)


def part_of(target: str) -> Chip:
    """The Ascend part of ``npu:PART`` (``npu:Ascend910B`` is :data:`dlc_ascend.chips.DEFAULT`).

    :raises LoweringError: not an npu target, or an unknown part (the known ones listed).
    """
    backend, arch = parse_target(target)
    if backend != "npu":
        raise LoweringError(f"target {target!r} is not an npu target; expected npu:PART, e.g. npu:Ascend910B2")
    return chip(arch)


def lower(call: KernelCall, target: str, pipeline: Pipeline, specialize: bool = True) -> Lowering:
    """Lower one launch for ``target`` (``npu:PART``) through every stage the installed tools allow.

    :raises LoweringError: a stage failed; its ``partial`` holds the stages before.
    :raises ToolchainMissingError: a tool is missing; ``partial`` holds the stages reached.
    """
    part = part_of(target)
    start = time.perf_counter()
    lowering, ttir = _ttir(call, target, pipeline, specialize)
    try:
        _later_stages(lowering, pipeline, NpuCompile.after(ttir, lowering.kernel, part), part)
    except LoweringError as exc:
        lowering.seconds = time.perf_counter() - start
        if isinstance(exc, ToolchainMissingError):
            raise ToolchainMissingError(f"{lowering.kernel} for {target}: lowered as far as {lowering.reached[-1]}; "
                                        f"{exc}", lowering, exc.missing) from exc
        if exc.partial is None:
            exc.partial = lowering
        raise
    lowering.seconds = time.perf_counter() - start
    return lowering


def _ttir(call: KernelCall, target: str, pipeline: Pipeline, specialize: bool) -> tuple[Lowering, StageContext | None]:
    from triton.backends.compiler import GPUTarget

    seen = _TtirCompile()
    # last in the ttir stage, after the IR dump: the folder the dump chose is then in the compile's scratch
    watch = Pass("dlc_ascend_ttir_compile", "ttir", seen, order=2**31, changes_ir=False)
    try:
        lowering = lower_with_triton(call, GPUTarget(*TTIR_TARGET), target,
                                     Pipeline(pipeline.backend, (*pipeline.passes, watch)), stop_after="ttir",
                                     specialize=specialize)
    except DlcoreError:
        raise
    except Exception as exc:  # Triton's own compile errors: CompilationError, MLIR pass failures
        name = getattr(call.kernel, "__name__", repr(call.kernel))
        raise LoweringError(f"upstream Triton could not make ttir of {name} for {target}: "
                            f"{type(exc).__name__}: {exc}") from exc
    lowering.planned = STAGES
    lowering.passes = tuple(p.name for p in pipeline.passes if p.is_ir)
    if "ttir" not in lowering.reached:
        raise LoweringError(f"upstream Triton stopped before ttir for {lowering.kernel}", lowering)
    return lowering, seen.context


def _later_stages(lowering: Lowering, pipeline: Pipeline, stages: NpuCompile, part: Chip) -> None:
    lowering.stages.extend(linalg(str(lowering.stage("ttir").ir), pipeline, stages.context("linalg")))
    crashed = stages.compile.scratch.pop(passes.RETRIED, [])
    if crashed:
        lowering.notes.append(f"{ADAPTER.name} retried {len(crashed)}x after a crash ({'; '.join(crashed)})")
    hivmc = find(HIVMC.name)
    made = hivm(str(lowering.stage("linalg").ir), part, hivmc)
    if made.mix_mode:
        lowering.notes.append(f"mix_mode {made.mix_mode}")
    if made.retried:
        first = made.retried[0].strip().splitlines()[-1].strip()
        lowering.notes.append(f"{BISHENGIR.name} retried {len(made.retried)}x after a failure that comes and goes "
                              f"({first})")
    lowering.stages.append(StageOutput("hivm", made.hivm, made.hivm_seconds))
    _read_only(made.hivm, pipeline.at("hivm"), stages.context("hivm"))
    if made.binary is None:
        locate(HIVMC.name)  # raises, saying how to get it
        raise ToolchainMissingError(f"{HIVMC.name} is needed for the bin stage", missing=(HIVMC.name,))
    lowering.stages.append(StageOutput("bin", made.binary, made.bin_seconds))
    _read_only(made.binary, pipeline.at("bin"), stages.context("bin"))


def _run_pass(p: Pass, module: str | bytes, context: StageContext) -> object:
    try:
        return p.run(module, context)
    except DlcoreError:
        raise
    except Exception as exc:
        raise LoweringError(f"pass {p.name!r} failed in the {context.stage} stage of {context.kernel}: "
                            f"{type(exc).__name__}: {exc}") from exc


def _read_only(module: str | bytes, stage_passes: tuple[Pass, ...], context: StageContext) -> None:
    for p in stage_passes:
        out = _run_pass(p, module, context)
        if out is not None and ir_text(out) != module:
            raise LoweringError(f"pass {p.name!r} changed the {context.stage} stage of {context.kernel}; on npu one "
                                f"{BISHENGIR.name} run makes hivm and bin, so only passes that read them may run there")
