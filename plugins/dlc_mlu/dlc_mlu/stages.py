"""The mlu pipeline: TTIR from upstream Triton, then one stage driver per later stage.

The stages are :data:`PLANNED`: ``ttir`` -> ``linalg`` -> ``mlisa`` (MLU assembly) -> ``cnbin`` (the
device binary, a cnfatbin). A :class:`StageDriver` produces one stage from the one before it by
running its tools (:class:`~dlcore.compiler.toolchain.Tool`), each found by the same discovery as
every backend's (variable, packages, ``PATH``, the ``mlu`` tool cache), and checks what they wrote.

dlc-mlu drives the tools that are public: ``triton-linalg-opt`` for ``linalg`` and Neuware's
``cnas`` + ``cnlink`` for ``cnbin``. No published tool produces ``mlisa`` from linalg (Cambricon's
Triton backend does it inside its own ``libtriton``), so lowering stops before it and says so.

**The seam.** A Cambricon toolchain plugin fills a stage by declaring a driver in the entry-point
group ``dlc_mlu.stages`` (the object named is a :class:`StageDriver` or a list of them, its tools
declared as :class:`~dlcore.compiler.toolchain.Tool` objects); a driver for a stage replaces
dlc-mlu's own.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dlc_mlu import toolchain
from dlcore.api import (
    Lowering,
    LoweringError,
    StageOutput,
    Tool,
    ToolchainMissingError,
    lower_with_triton,
    parse_target,
)

if TYPE_CHECKING:
    from dlcore.api import KernelCall, Pipeline

PLANNED = ("ttir", "linalg", "mlisa", "cnbin")
GROUP = "dlc_mlu.stages"
#: product names -> the ISA Cambricon's compiler targets (``cnas -a``); ``mlu:mtp_NNN`` names one directly
ARCHS = {"MLU370": "mtp_372", "MLU590": "mtp_592"}
#: why a stage has no driver unless a plugin brings one
UNPUBLISHED = ("Cambricon's Triton toolchain is not published (nothing of it is on the package index; the "
               "`triton-shared` found there is an unrelated project)")
#: seconds one tool may run
TOOL_TIMEOUT = 600


@dataclass(frozen=True)
class StageInput:
    """What a driver is handed: the previous stage's output and the paths of its tools."""

    kernel: str
    #: the ISA, e.g. ``mtp_592``
    arch: str
    source: str | bytes
    tools: dict[str, Path]
    #: an empty folder, removed after the driver returns
    workdir: Path


@dataclass(frozen=True)
class StageDriver:
    """Produces ``stage`` from the stage before it in :data:`PLANNED`."""

    stage: str
    #: the tools it runs, each found (:func:`dlc_mlu.toolchain.find_tool`) before it runs
    tools: tuple[Tool, ...]
    run: Callable[[StageInput], str | bytes]
    #: why an output is wrong, or None: a tool that exits 0 is not trusted on that alone
    check: Callable[[str | bytes], str | None]


def run_tool(path: Path, args: Sequence[str], cwd: Path) -> str:
    """Run a tool; its standard output, or :class:`LoweringError` with its exit status and error output."""
    try:
        done = subprocess.run([str(path), *args], cwd=cwd, capture_output=True, text=True, timeout=TOOL_TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        raise LoweringError(f"{path.name} ran past {TOOL_TIMEOUT} s: {' '.join(exc.cmd)}") from None
    if done.returncode != 0:
        raise LoweringError(f"{path.name} failed (exit {done.returncode}): {' '.join([str(path), *args])}\n"
                            f"{done.stderr.strip()[-2000:]}")
    return done.stdout


# --- dlc-mlu's own drivers -----------------------------------------------------------------------

#: ``tt.`` ops Cambricon's linalg keeps (its README's ``triton-to-linalg`` example still reads the
#: program id with ``tt.get_program_id``: its backend lowers those later)
LINALG_KEEPS = frozenset({"tt.get_program_id", "tt.get_num_programs"})
_OP = re.compile(r"(?:^|=)\s*\"?(tt\.[a-z_]+)", re.MULTILINE)


def run_linalg(given: StageInput) -> str:
    source = given.workdir / f"{given.kernel}.ttir"
    source.write_text(given.source if isinstance(given.source, str) else given.source.decode())
    return run_tool(given.tools["triton-linalg-opt"], ["--triton-to-linalg", source.name], given.workdir)


def check_linalg(output: str | bytes) -> str | None:
    text = output if isinstance(output, str) else output.decode(errors="replace")
    if "func.func" not in text:
        return "the output holds no func.func (no linalg module was written)"
    left = sorted({op for op in _OP.findall(text)} - LINALG_KEEPS)
    return f"Triton ops left unlowered: {', '.join(left)}" if left else None


def run_cnbin(given: StageInput) -> bytes:
    """``cnas -O3 -a ARCH -i k.mlisa -o k.cnbin`` then ``cnlink --fatbin -i k.cnbin -o k.cnfatbin``, as
    Cambricon's Triton backend runs them (its ``make_cnbin``)."""
    work = given.workdir
    (work / "k.mlisa").write_text(given.source if isinstance(given.source, str) else given.source.decode())
    run_tool(given.tools["cnas"], ["-O3", "-a", given.arch, "-i", "k.mlisa", "-o", "k.cnbin"], work)
    run_tool(given.tools["cnlink"], ["--fatbin", "-i", "k.cnbin", "-o", "k.cnfatbin"], work)
    fatbin = work / "k.cnfatbin"
    return fatbin.read_bytes() if fatbin.is_file() else b""


def check_cnbin(output: str | bytes) -> str | None:
    return None if isinstance(output, bytes) and output else "cnlink wrote no cnfatbin"


BUILTIN = (
    StageDriver("linalg", (toolchain.TRITON_LINALG_OPT,), run_linalg, check_linalg),
    StageDriver("cnbin", (toolchain.CNAS, toolchain.CNLINK), run_cnbin, check_cnbin),
)


# --- the pipeline ---------------------------------------------------------------------------------

def drivers() -> dict[str, StageDriver]:
    """Stage -> driver: dlc-mlu's own, replaced by those plugins declare in :data:`GROUP`. An entry
    point that fails to load, or names something else, is reported with a warning and skipped."""
    found = {d.stage: d for d in BUILTIN}
    for point in importlib.metadata.entry_points(group=GROUP):
        try:
            loaded = point.load()
        except Exception as exc:  # noqa: BLE001 - a broken plugin is reported, not fatal
            warnings.warn(f"{GROUP} entry point {point.name!r} ({point.value}) failed to load: "
                          f"{type(exc).__name__}: {exc}", stacklevel=2)
            continue
        declared = loaded if isinstance(loaded, (list, tuple)) else [loaded]
        bad = [d for d in declared if not isinstance(d, StageDriver) or d.stage not in PLANNED[1:]]
        if bad:
            warnings.warn(f"{GROUP} entry point {point.name!r} ({point.value}) declares {bad!r}; expected "
                          f"StageDriver objects for the stages {', '.join(PLANNED[1:])}", stacklevel=2)
            continue
        found.update({d.stage: d for d in declared})
    return found


def isa(target: str) -> str:
    """The ISA of an mlu target: ``mlu:mtp_592`` or a product name of :data:`ARCHS`."""
    backend, arch = parse_target(target)
    if backend != "mlu":
        raise LoweringError(f"target {target!r} is not an mlu target (e.g. mlu:MLU370, mlu:mtp_592)")
    if re.fullmatch(r"mtp_\d+", arch):
        return arch
    if arch in ARCHS:
        return ARCHS[arch]
    raise LoweringError(f"unknown MLU {arch!r} in target {target!r}; known: {', '.join(ARCHS)}, or mtp_<ISA> "
                        f"(e.g. mtp_592)")


def lower(call: KernelCall, target: str, passes: Pipeline, specialize: bool = True) -> Lowering:
    """``call`` lowered for ``target`` as far as a driver and its tools exist (see the module doc).

    :raises ToolchainMissingError: a stage has no driver or a driver's tool is not found; its
        ``partial`` holds the stages reached and its ``missing`` the tools not found.
    :raises LoweringError: a tool failed or wrote what its stage's check rejects.
    """
    from triton.backends.compiler import GPUTarget

    arch = isa(target)
    # Triton's target-independent ttir, through the NVIDIA backend upstream Triton ships
    lowering = lower_with_triton(call, GPUTarget("cuda", 80, 32), target, passes, stop_after="ttir",
                                 specialize=specialize)
    lowering.planned = PLANNED
    found = drivers()
    source = lowering.stage("ttir").ir
    for before, stage in zip(PLANNED, PLANNED[1:]):
        stopped = f"{lowering.kernel} for {target}: lowered as far as {before}"
        driver = found.get(stage)
        if driver is None:
            raise ToolchainMissingError(
                f"{stopped}; no published tool lowers {before} to {stage}: {UNPUBLISHED}, and Cambricon's Triton "
                f"backend lowers linalg to MLISA inside its own libtriton. A Cambricon toolchain plugin fills this "
                f"stage with a StageDriver in the entry-point group {GROUP}", lowering)
        paths = {tool.name: toolchain.find_tool(tool) for tool in driver.tools}
        missing = tuple(name for name, where in paths.items() if where is None)
        if missing:
            how = "; ".join(f"{t.name}: {t.how_to_get}" for t in driver.tools if t.name in missing)
            raise ToolchainMissingError(f"{stopped}; {stage} needs {', '.join(missing)}, not found. {UNPUBLISHED}. "
                                        f"{how}", lowering, missing)
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="dlc-mlu-") as work:
            given = StageInput(lowering.kernel, arch, source, {n: f.path for n, f in paths.items()}, Path(work))
            try:
                output = driver.run(given)
            except LoweringError as exc:
                raise LoweringError(f"{stopped}; {stage}: {exc}", lowering) from None
        seconds = time.perf_counter() - start
        wrong = driver.check(output)
        if wrong is not None:
            raise LoweringError(f"{stopped}; {stage} ({', '.join(paths)}) exited 0 but its output is wrong: "
                                f"{wrong}", lowering)
        lowering.stages.append(StageOutput(stage, output, seconds))
        lowering.seconds += seconds
        source = output
    return lowering
