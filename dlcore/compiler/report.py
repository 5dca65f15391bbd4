"""Compile reports: what each kernel asks of the hardware per target, and how long it compiled.

``dlcore lower --report`` prints one row per kernel and target: registers and spills (from
``ptxas``'s own report on CUDA), shared memory (Triton's metadata), the stages reached (how many of
the target's, and the last), the time of each stage and the whole compile.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from dlcore.compiler.lowering import Lowering, Resources

HEADER = ("kernel", "op", "target", "dtype", "regs", "spills (st/ld B)", "smem B", "stages", "ms per stage",
          "compile ms", "notes")

_REGISTERS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def ptxas_resources(log: str, shared: int | None = None) -> Resources:
    """Registers and spills from a ``ptxas -v`` log (Triton prints it with ``TRITON_DUMP_PTXAS_LOG``)."""
    registers = _REGISTERS.search(log)
    spills = _SPILLS.search(log)
    return Resources(
        registers=int(registers.group(1)) if registers else None,
        spill_stores=int(spills.group(1)) if spills else None,
        spill_loads=int(spills.group(2)) if spills else None,
        shared=shared,
    )


def _known(value: int | None) -> str:
    return "?" if value is None else str(value)


def row(lowering: Lowering, op: str, dtype: str, notes: Sequence[str] = ()) -> tuple[str, ...]:
    r = lowering.resources
    spills = "?" if r.spill_stores is None else f"{r.spill_stores}/{r.spill_loads}"
    reached = lowering.reached
    stages = f"{len(reached)}/{len(lowering.planned)} ({reached[-1] if reached else 'none'})"
    return (lowering.kernel, op, lowering.target, dtype, _known(r.registers), spills, _known(r.shared), stages,
            stage_times(lowering), f"{lowering.seconds * 1e3:.0f}", "; ".join(notes))


def stage_times(lowering: Lowering) -> str:
    """``ttir 120, linalg 250, hivm 180``: milliseconds of each stage reached."""
    return ", ".join(f"{s.stage} {s.seconds * 1e3:.0f}" for s in lowering.stages
                     if s.stage in lowering.planned and not s.after_pass)


def _unlabelled(op: str) -> str:
    """``softmax.triton backward`` of ``softmax.triton [looped rows] backward``."""
    return re.sub(r" \[[^]]*\]", "", op)


def portability_page(rows: Sequence[Sequence[str]], targets: Sequence[str], command: str) -> str:
    """docs/portability.md: per kernel launch, the last stage reached on each target (from
    :func:`row`'s rows; "not launched": the target's plan launches another kernel, e.g. the
    tensor-descriptor GEMM on sm_90 alone), why a kernel stopped early, and first the command that
    regenerates it."""
    reached: dict[tuple[str, str], dict[str, str]] = {}
    for r in rows:
        kernel, op, target, stages, times = r[0], r[1], r[2], r[7], r[8]
        last = stages.split("(")[-1].rstrip(")")
        reached.setdefault((op, kernel), {})[target] = f"{last} ({times})" if times else "no stage: see below"
    lines = [
        "# Portability: how far each kernel lowers, per target",
        "",
        "Regenerate (no GPU or NPU needed; npu's stages need triton-adapter-opt and bishengir-compile, see",
        "plugins/dlc_ascend/dlc_ascend/pipeline.py):",
        "",
        f"    {command}",
        "",
        "Each kernel as the plans of its op's example inputs and of each of its `example_paths` (decode,",
        "split-K, fp8 weights...) launch it, in float16 (fp8_gemm: float8_e4m3fn): one row for each form",
        "it compiles to (its constexprs, launch options and tensor dtypes), named after the path that",
        "first launched that form (`[looped rows]`; none: the op's example inputs). Each cell: the last",
        "stage reached, then milliseconds per stage; \"in another row\": that target lowers the kernel",
        "only under another row's label. npu stops at hivm where CANN's hivmc is absent;",
        "`dlcore ops` lists the kernels a backend declares it cannot lower, and why.",
        "",
        "| op | kernel | " + " | ".join(targets) + " |",
        "|---|---|" + "---|" * len(targets),
    ]
    # "in another row": the target lowers the kernel, but only under another row's label (its plans
    # launch it in fewer forms, or from other paths, than another target's)
    lowered = {(_unlabelled(op), kernel, t) for (op, kernel), cells in reached.items() for t in cells}
    for (op, kernel), cells in sorted(reached.items()):
        lines.append(f"| {op} | {kernel} | " + " | ".join(
            cells.get(t, "in another row" if (_unlabelled(op), kernel, t) in lowered else "not launched")
            for t in targets) + " |")
    stops = sorted({(r[1], r[0], r[2], note) for r in rows for note in r[10].split("; ")
                    if note.startswith(("stopped:", "declared:"))})
    if stops:
        lines += ["", "Where a kernel stops before the end of a target's pipeline (besides a missing tool):", ""]
        lines += [f"- {op} / {kernel} on {target}: {note}" for op, kernel, target, note in stops]
    return "\n".join(lines) + "\n"
