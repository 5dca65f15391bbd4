"""The IR dump pass: ``DLC_DUMP_IR=1`` writes every stage of every kernel compiled in the process.

Files go to ``DLC_DUMP_DIR`` (default ``./dlc_ir``), one folder per compile,
``<kernel>-<hash>/<nn>-<stage>.<ext>``: ``<hash>`` the start of Triton's hash of the compile,
``<nn>`` the stage's position in the pipeline (``01-ttir.ttir``, ``02-ttgir.ttgir``,
``03-llir.ll``, ``04-ptx.ptx``, ``05-cubin.cubin`` on CUDA; ``02-linalg.mlir``, ``03-hivm.mlir``
on npu). A stage made by a sequence of passes (npu's linalg) also has the IR after each pass,
``<nn>-<stage>.<k>-<pass>.<ext>`` (``02-linalg.1-discrete_mask_access_conversion.mlir``): the IR
before pass k is the file of pass k-1, or the previous stage's.

The pass only reads IR, so while it is on Triton's cache is not read (see
:mod:`dlcore.compiler.stages`): every compile runs and is dumped. It deletes and overwrites
nothing: a file already there with other content stays, and the new one is written beside it as
``<nn>-<stage>.<k>.<ext>``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dlcore.compiler.passes import EVERY_IR_STAGE, Pass
from dlcore.compiler.stages import StageContext, StageOutput, extension, ir_text
from dlcore.plugins.hookspecs import hookimpl

NAME = "ir_dump"


def requested() -> bool:
    """``DLC_DUMP_IR`` is set to something other than empty or ``0``."""
    return os.environ.get("DLC_DUMP_IR", "").strip() not in ("", "0")


def dump_root() -> Path:
    return Path(os.environ.get("DLC_DUMP_DIR") or "dlc_ir")


def write_new(path: Path, data: str | bytes) -> Path:
    """Write ``data`` at ``path`` or, if another file is there, beside it; return where it went."""
    payload = data.encode() if isinstance(data, str) else data
    stem, suffix = path.name.split(".", 1) if "." in path.name else (path.name, "")
    candidate, k = path, 0
    while True:
        try:
            with open(candidate, "xb") as f:
                f.write(payload)
            return candidate
        except FileExistsError:
            if candidate.read_bytes() == payload:
                return candidate
        k += 1
        candidate = path.with_name(f"{stem}.{k}.{suffix}" if suffix else f"{stem}.{k}")


def folder_for(stage: StageContext) -> Path:
    """This compile's folder, created on its first stage."""
    folder = stage.compile.scratch.get(NAME)
    if folder is None:
        folder = dump_root() / f"{stage.kernel}-{stage.hash[:16]}"
        folder.mkdir(parents=True, exist_ok=True)
        stage.compile.scratch[NAME] = folder
    return folder


def file_name(index: int, stage: str, ext: str, after_pass: str = "", step: int = 0) -> str:
    """``<nn>-<stage>.<ext>``, or for the IR after pass number ``step`` of the stage,
    ``<nn>-<stage>.<step>-<pass>.<ext>``."""
    return f"{index:02d}-{stage}.{step}-{after_pass}.{ext}" if after_pass else f"{index:02d}-{stage}.{ext}"


def dump_after_pass(output: StageOutput, step: int, context: StageContext, passes: Iterable[Pass]) -> None:
    """Under ``DLC_DUMP_IR`` (the ``ir_dump`` pass among a stage's ``passes``), the IR after pass number
    ``step`` of a stage a backend runs pass by pass itself, beside the stage's own file."""
    if any(p.name == NAME for p in passes):
        name = file_name(context.index, output.stage, output.extension, output.after_pass, step)
        write_new(folder_for(context) / name, output.ir)


def dump_stage(module: Any, stage: StageContext) -> None:
    ir = ir_text(module)
    write_new(folder_for(stage) / file_name(stage.index, stage.stage, extension(stage.stage, ir)), ir)


@hookimpl
def dlcore_passes() -> list[Pass]:
    return [Pass(
        name=NAME,
        stage=EVERY_IR_STAGE,
        run=dump_stage,
        default_on=requested(),
        # last in every stage: the dump shows what the next stage receives
        order=1_000_000,
        changes_ir=False,
        doc="DLC_DUMP_IR=1: every stage of every kernel compiled, under DLC_DUMP_DIR (default ./dlc_ir)",
    )]
