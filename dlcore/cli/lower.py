"""`dlcore lower`: every IR stage of an op's kernels for a target, printed or written; `--report`."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from dlcore.cli.options import DTYPES, parse_sizes

DEFAULT_TARGET = "cuda:90"


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "lower",
        help="every IR stage of an op's kernels for a target (no device needed); --report: registers, spills, "
             "shared memory, stages, compile time",
    )
    p.add_argument("name", nargs="?", help="an op, op.implementation, or kernel function name (or --all)")
    p.add_argument("--all", action="store_true", help="every op's Triton kernels")
    p.add_argument("--target", action="append", metavar="BACKEND:ARCH",
                   help=f"cuda:80, cuda:90, cuda:100, npu:Ascend910B, ...; repeatable (default {DEFAULT_TARGET})")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="dtype of the example inputs (default float16, or the first an implementation takes where "
                        "it takes no float16: fp8_gemm's float8_e4m3fn)")
    p.add_argument("--shape", type=parse_sizes, default={}, help="named sizes of the example inputs, e.g. tokens=4096")
    p.add_argument("--stage", action="append", metavar="STAGE",
                   help="print only this stage (repeatable), e.g. ttgir; the exit status is then 0 when every kernel "
                        "reached the stages named, whatever stopped it after them (npu:... --stage hivm without "
                        "hivmc), or is declared unable to (a LoweringLimit, named on stderr and in `dlcore ops`)")
    p.add_argument("--dump", metavar="DIR", type=Path,
                   help="write the stages to DIR/<kernel>-<target>/<nn>-<stage>.<ext> instead of printing them")
    p.add_argument("--pass", dest="enable", action="append", default=[], metavar="NAME",
                   help="turn on an opt-in pass (e.g. grid_folding on cuda)")
    p.add_argument("--no-pass", dest="disable", action="append", default=[], metavar="NAME",
                   help="turn a pass off")
    p.add_argument("--report", action="store_true",
                   help="one row per kernel and target instead of the IR (what is shown when neither --stage nor "
                        "--dump is given: every stage of every kernel runs to thousands of lines)")
    p.add_argument("--markdown", metavar="FILE", type=Path,
                   help="with --report: also write the portability page (docs/portability.md) to FILE")
    p.add_argument("--no-specialize", dest="specialize", action="store_false",
                   help="compile on the argument types only, not specialized on their values as a launch is "
                        "(16-byte aligned pointers, integers divisible by 16, integers equal to 1 made constants)")
    p.set_defaults(func=run_lower)


@dataclass
class _Tally:
    """What a ``dlcore lower`` run gathers over its targets and launches."""

    rows: list = field(default_factory=list)
    failed: bool = False
    #: the notes and the (missing tools, target) errors said once
    said: set = field(default_factory=set)
    #: launches that fell short of the stages asked for, and those declared unable to reach them
    short: list = field(default_factory=list)
    known: list = field(default_factory=list)
    #: the stages of the targets' pipelines, in order
    stages: dict[str, None] = field(default_factory=dict)


def run_lower(args: argparse.Namespace) -> int:
    from dlcore.compiler.lowering import launches, parse_target, target_profile
    from dlcore.compiler.passes import pipeline
    from dlcore.plugins.registry import registry

    if not args.name and not args.all:
        print("dlcore lower: name an op, op.implementation or kernel, or pass --all", file=sys.stderr)
        return 2
    # the IR of every stage of every kernel is thousands of lines: without a stage or a folder to
    # put it in, the report says what each kernel reached, and where to look next
    hint = not (args.stage or args.dump or args.report)
    args.report = args.report or hint
    reg = registry()
    dtype = None if args.dtype is None else DTYPES[args.dtype]
    tally = _Tally()
    for target in args.target or [DEFAULT_TARGET]:
        backend_name, _ = parse_target(target)
        backend = reg.backends.get(backend_name)
        if backend is None:
            print(f"dlcore lower: no backend {backend_name!r} is installed (loaded: {', '.join(reg.backends)}); "
                  "install dlc-cuda, dlc-ascend or dlc-mlu", file=sys.stderr)
            return 2
        passes = pipeline(backend_name, args.enable, args.disable)
        # an unknown target part or kernel name raises a LoweringError: `dlcore: error: ...`, exit 2
        todo, skipped = launches(reg, None if args.all else args.name, dtype, args.shape, target_profile(target),
                                 passes)
        for note in skipped:
            if note not in tally.said:
                tally.said.add(note)
                print(f"skipped {note}", file=sys.stderr)
        progress = Progress(target, len(todo), quiet=not (args.report or args.dump))
        for launch in todo:
            _lower_launch(args, reg, backend, target, passes, launch, progress, tally)
        progress.clear()
    _summarise(args, tally, hint)
    return 1 if tally.failed else 0


def _lower_launch(args: argparse.Namespace, reg, backend, target: str, passes, launch, progress: Progress,
                  tally: _Tally) -> None:
    """Lower one launch for ``target``: its IR printed or written, its report row and any shortfall
    added to ``tally``."""
    from dlcore.compiler import report, source
    from dlcore.compiler.lowering import parse_target
    from dlcore.errors import LoweringError, ToolchainMissingError

    backend_name, arch = parse_target(target)
    progress.show(f"{launch.name}/{source.kernel_name(launch.original)}")
    notes = list(launch.notes) + ([] if args.specialize else ["not specialized (--no-specialize)"])
    error = None
    try:
        # specialize= only when asked off: a backend written before the option still lowers
        lowering = backend.lower(launch.call, target, passes, **({} if args.specialize else {"specialize": False}))
    except LoweringError as exc:
        error, lowering = exc, exc.partial
    if lowering is not None:
        notes.extend(lowering.notes)
    enough = _enough(lowering, error, args.stage)
    missing = error.missing if isinstance(error, ToolchainMissingError) else ()
    kernel = source.kernel_name(launch.original)
    declared = _declared(reg, launch, backend_name, kernel, arch) if error is not None else None
    if declared is not None:
        notes.append(f"declared: stops before {declared.stage} on {declared.backend}: {declared.reason}")
    if not enough and declared is not None:
        # a kernel its implementation declares it cannot lower (`dlcore ops` says why): named, no failure
        tally.known.append(f"{launch.name}/{kernel} ({target})")
    elif not enough:
        tally.failed = True
        tally.short.append((f"{launch.name}/{kernel} ({target})", missing, target))
    if error is not None:
        # a missing tool that stops every kernel after the stages asked for is no failure: said once
        if not enough or (missing, target) not in tally.said:
            progress.clear()
            print(f"dlcore lower: {launch.name}: {error}", file=sys.stderr)
            tally.said.add((missing, target))
        notes.append(f"needs {', '.join(missing)}" if missing else f"stopped: {str(error).splitlines()[0]}")
        if lowering is None:
            return
    if args.dump is not None:
        progress.clear()  # the folder's line goes to stdout, on the same terminal
        _write(lowering, args.dump, args.stage, _folder_suffix(launch))
    elif not args.report:
        _print(lowering, launch, notes, passes.names, args.stage)
    tally.rows.append(report.row(lowering, launch.name, str(launch.dtype).removeprefix("torch."), notes))
    tally.stages.update(dict.fromkeys(lowering.planned))


def _summarise(args: argparse.Namespace, tally: _Tally, hint: bool) -> None:
    """The report (and its portability page), then on stderr where to find the IR and which kernels
    did not get as far as asked."""
    from dlcore.bench.table import table
    from dlcore.cachedir import write_text
    from dlcore.compiler import report

    if args.report:
        print(table(tally.rows, report.HEADER))
        if args.markdown is not None:
            write_text(args.markdown, report.portability_page(tally.rows, args.target or [DEFAULT_TARGET],
                                                              _command(args)))
    if hint:
        print(f"dlcore lower: the IR itself: --stage {'|'.join(tally.stages) or 'STAGE'} (repeatable), or --dump DIR "
              "for every stage", file=sys.stderr)
    if args.stage and tally.known:
        print(f"dlcore lower: {len(tally.known)} kernels declared unable to reach {', '.join(args.stage)} "
              f"(see `dlcore ops`): {', '.join(tally.known)}", file=sys.stderr)
    if tally.short:
        goal = f"reach {', '.join(args.stage)}" if args.stage else "finish their pipeline"
        print(f"dlcore lower: {len(tally.short)} kernels did not {goal}: {_shortfall(tally.short)}", file=sys.stderr)


class Progress:
    """``lowering 37/124 for npu:Ascend910B2: softmax.triton/softmax_kernel``, one status line on
    stderr rewritten per launch while a report or a dump is made (the IR itself streams to stdout
    otherwise), and only where stderr is a terminal: a log or a pipe gets the messages alone."""

    def __init__(self, target: str, total: int, quiet: bool = False, stream=None):
        self.target, self.total, self.done, self.shown = target, total, 0, False
        self.stream = sys.stderr if stream is None else stream
        self.on = not quiet and self.stream.isatty()

    def show(self, what: str) -> None:
        self.done += 1
        if self.on:
            self.stream.write(f"\r\033[K  lowering {self.done}/{self.total} for {self.target}: {what}")
            self.stream.flush()
            self.shown = True

    def clear(self) -> None:
        """Wipe the status line, before another message and at the end."""
        if self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.shown = False


def _shortfall(short: list[tuple[str, tuple[str, ...], str]]) -> str:
    """The kernels that stopped short, by name; those a missing tool stopped, counted per tool and target."""
    named = [name for name, missing, _ in short if not missing]
    wanting = Counter((", ".join(missing), target) for _, missing, target in short if missing)
    parts = [", ".join(named)] if named else []
    parts += [f"{n} for want of {tools} ({target})" for (tools, target), n in wanting.items()]
    return "; ".join(parts)




def _declared(reg, launch, backend: str, kernel: str, arch: str):
    """The limit the launch's implementation declares for ``kernel`` on ``backend`` and target ``arch``, if any."""
    impl = next((i for i in reg.implementations_of(launch.op) if i.name == launch.impl), None)
    return impl.limit(backend, kernel, arch) if impl is not None else None


def _command(args: argparse.Namespace) -> str:
    """The ``dlcore lower`` command line that gives this report."""
    parts = ["dlcore lower", "--all" if args.all else args.name]
    parts += [f"--target {t}" for t in args.target or [DEFAULT_TARGET]]
    parts += [f"--dtype {args.dtype}"] if args.dtype is not None else []
    parts += [f"--shape {','.join(f'{k}={v}' for k, v in args.shape.items())}"] if args.shape else []
    parts += [f"--pass {n}" for n in args.enable] + [f"--no-pass {n}" for n in args.disable]
    parts += [] if args.specialize else ["--no-specialize"]
    return " ".join([*parts, "--report", f"--markdown {args.markdown}"])


def _enough(lowering, error, stages: list[str] | None) -> bool:
    """Whether a lowering did what was asked: every stage named (``--stage``), or without
    ``--stage`` the whole pipeline."""
    if stages:
        return lowering is not None and all(stage in lowering.reached for stage in stages)
    return error is None


def _selected(lowering, stages: list[str] | None, passes: bool = False) -> list:
    """The outputs to show: those of the stages named (all without), with the IR after each pass
    within a stage only if ``passes``."""
    return [s for s in lowering.stages if (not stages or s.stage in stages) and (passes or not s.after_pass)]


def _print(lowering, launch, notes: list[str], pass_names: tuple[str, ...], stages: list[str] | None) -> None:
    for s in _selected(lowering, stages):
        dtype = str(launch.dtype).removeprefix("torch.")
        print(f"// ===== {launch.name}: {lowering.kernel} for {lowering.target} ({dtype}), stage {s.stage}; "
              f"passes: {', '.join(pass_names) or 'none'} =====")
        for note in notes:
            print(f"// {note}")
        if isinstance(s.ir, bytes):
            print(f"// {len(s.ir)} bytes of {s.stage}; write it with --dump DIR")
        else:
            print(s.ir.rstrip("\n"))
        print()


def file_name(lowering, stage) -> str:
    """``<nn>-<stage>.<ext>``: nn the stage's place in the target's pipeline, 00 before it;
    ``<nn>-<stage>.<k>-<pass>.<ext>`` for the IR after the stage's k-th pass."""
    from dlcore.compiler.dump import file_name as named

    index = lowering.planned.index(stage.stage) + 1 if stage.stage in lowering.planned else 0
    steps = [s for s in lowering.stages if s.stage == stage.stage and s.after_pass]
    step = next((k for k, s in enumerate(steps, start=1) if s is stage), 0)
    return named(index, stage.stage, stage.extension, stage.after_pass, step)


def _folder_suffix(launch) -> str:
    """``-<path>`` for a form of the kernel an example path launched (softmax's ``-looped-rows``,
    fused_moe's ``-prefill-form-2``), then ``-backward`` for a backward launch (rotary's one kernel
    serves both directions)."""
    path = "-".join("".join(c if c.isalnum() else " " for c in launch.path).split())
    return (f"-{path}" if path else "") + ("-backward" if launch.backward else "")


def _write(lowering, root: Path, stages: list[str] | None, suffix: str = "") -> None:
    from dlcore.compiler.dump import write_new

    folder = root / f"{lowering.kernel}{suffix}-{lowering.target.replace(':', '')}"
    folder.mkdir(parents=True, exist_ok=True)
    written = [write_new(folder / file_name(lowering, s), s.ir).name for s in _selected(lowering, stages, passes=True)]
    print(f"{folder}: {' '.join(written)}")
