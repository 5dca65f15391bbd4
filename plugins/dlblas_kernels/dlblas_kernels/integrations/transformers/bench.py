"""The end-to-end benchmark: a transformers model as people run it, beside the same model with dlcore.

    python -m dlblas_kernels.integrations.transformers.bench [--preset llama3-8b,qwen3-30b-a3b] [--layers 2]
    dlcore bench-model ...      the same command, found through the ``dlcore.model_benchmarks`` entry point

A preset is a real model's configuration (its layer shapes and vocabulary) with ``--layers`` decoder
layers and random weights. Each column builds the model afresh (same seed), one after the other in
one process, memory freed between them, and measures the phases:

- ``train``: one training step, forward + loss (the model's own, ``labels`` given) + backward, on
  ``batch x tokens`` token ids; its time, tokens per second and peak memory (weights, gradients and
  activations: the gradients are set to None before each step, as an optimizer's ``zero_grad`` does);
- ``prefill``: a forward under ``no_grad`` filling a fresh ``DynamicCache``, the last position's
  logits only (``logits_to_keep=1``, as ``generate`` asks);
- ``decode_bN``: one new token for each of ``N`` sequences against a cache of ``cache_tokens``
  (random keys and values), ``decode_steps`` steps in a row, cropped back after each timed run; the
  time per token step.

Columns (:data:`COLUMNS`): ``eager`` (SDPA attention, MoE experts as transformers' per-expert
loop), ``compile`` (``torch.compile`` of the model as transformers builds it by default: MoE experts
then ``grouped_mm`` where torch has it), ``liger`` (Liger-Kernel's ``apply_liger_kernel_to_*`` on
the built model, where Liger has one for the family), ``grouped_mm`` (transformers' grouped-GEMM
experts; MoE models only), ``dlcore`` (``dlblas_kernels.integrations.transformers.apply(model)``)
and ``dlcore+compile`` (the same, then ``torch.compile``). A column that cannot run here is
skipped with the reason; one that fails records its error (per phase where the build succeeded)
and the run goes on. The names of the model's modeling module (which Liger rebinds) are restored
after every column, so that no column runs another's code.

Times are CUDA events around each run (``time.perf_counter`` on a CPU), after ``--warmup`` untimed
runs (where ``torch.compile`` compiles and dlcore selects its kernels); a phase's time is the median
of ``--iters`` runs. Progress goes to stderr; each preset's JSON is written to ``--out`` after every
column, so a run stopped early keeps what it measured. ``docs/results/render.py`` renders the JSON
of ``docs/results/e2e/`` into docs/performance.md. The presets and columns are
:mod:`~dlblas_kernels.integrations.transformers.bench_presets`'s, the phases and their timing
:mod:`~dlblas_kernels.integrations.transformers.bench_phases`'s; this module runs them and reports.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import json
import os
import shlex
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from dlblas_kernels.integrations.transformers.bench_phases import Settings, phase_names, release, run_phase
from dlblas_kernels.integrations.transformers.bench_presets import (
    COLUMN_NAMES,
    COLUMNS,
    DEFAULT_PRESETS,
    LIGER_FUNCTIONS,
    PHASES,
    PRESETS,
    Column,
    ModelPreset,
    Patch,
    dlcore_apply,
    unavailable,
)
from dlcore.api import first_line, table, versions

#: where the command writes its JSON by default (from the repository's root)
DEFAULT_OUT = os.path.join("docs", "results", "e2e")
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}
#: the lines of a failure's traceback kept in the JSON
TRACEBACK_LINES = 12


# -- a column -------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def restored_names(module_name: str) -> Iterator[None]:
    """Put back every name of ``module_name`` and every attribute of its classes as they were: Liger's
    patch rebinds the module's norm, MLP and rotary names, which the next column's build would take."""
    module = importlib.import_module(module_name)
    classes = [v for v in vars(module).values() if isinstance(v, type) and v.__module__ == module_name]
    saved = [(module, dict(vars(module)))] + [(cls, dict(vars(cls))) for cls in classes]
    try:
        yield
    finally:
        for owner, before in saved:
            for key in [k for k in vars(owner) if k not in before]:
                delattr(owner, key)
            for key, value in before.items():
                if vars(owner).get(key, _ABSENT) is not value:
                    setattr(owner, key, value)


_ABSENT = object()


def build(preset: ModelPreset, column: Column, settings: Settings) -> Any:
    """The column's model: built afresh from the seed, patched, compiled."""
    from transformers import AutoModelForCausalLM

    options: dict[str, Any] = {"attn_implementation": "sdpa", "dtype": settings.dtype}
    if preset.moe and column.experts is not None:
        options["experts_implementation"] = column.experts
    torch.manual_seed(settings.seed)
    with torch.device(settings.device):
        model = AutoModelForCausalLM.from_config(preset.build_config(settings.layers), **options)
    if column.patch == Patch.LIGER:
        liger = importlib.import_module("liger_kernel.transformers")
        getattr(liger, LIGER_FUNCTIONS[preset.model_type])(model=model)
    elif column.patch == Patch.DLCORE:
        model = dlcore_apply()(model)
    if column.compiled:
        model.forward = torch.compile(model.forward)
    return model


def failure(exc: BaseException) -> dict[str, Any]:
    lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
    tail = "".join(lines).rstrip().splitlines()[-TRACEBACK_LINES:]
    return {"status": "failed", "error": first_line(exc), "traceback": tail}


def run_column(preset: ModelPreset, column: Column, settings: Settings,
               progress: Callable[[str], None]) -> dict[str, Any]:
    """One column's record: its status, and each phase's numbers or why it has none."""
    record: dict[str, Any] = {"name": column.name, "description": column.description, "phases": {}}
    tell = lambda text: progress(f"[{preset.name}] {column.name}: {text}")  # noqa: E731
    why = unavailable(column, preset)
    if why is None and settings.out_of_time():
        why = "not started: the run's time budget was spent"
    if why is not None:
        tell(f"skipped ({why})")
        return {**record, "status": "skipped", "reason": why}
    model = None
    try:
        with restored_names(preset.modeling_module()):
            tell(f"building {settings.layers} layers")
            begin = time.perf_counter()
            try:
                model = build(preset, column, settings)
            except Exception as exc:  # noqa: BLE001 - a column that cannot be built is recorded; the run goes on
                tell(f"build failed: {first_line(exc)}")
                return {**record, **failure(exc)}
            record["build_s"] = round(time.perf_counter() - begin, 3)
            record["parameters"] = sum(p.numel() for p in model.parameters())
            for name in phase_names(settings):
                if settings.out_of_time():
                    record["phases"][name] = {"status": "skipped", "reason": "the run's time budget was spent"}
                    tell(f"{name} skipped (time budget)")
                    continue
                tell(f"{name} (warm-up {settings.warmup}, then {settings.iters} timed)")
                try:
                    result = run_phase(name, model, settings)
                except Exception as exc:  # noqa: BLE001 - one failing phase must not end the column
                    result = failure(exc)
                    model.zero_grad(set_to_none=True)
                    release(settings.device)
                record["phases"][name] = result
                tell(f"{name}: {phase_line(result)}")
    finally:
        del model
        if column.compiled:
            torch._dynamo.reset()
        release(settings.device)
    statuses = {p["status"] for p in record["phases"].values()}
    record["status"] = "ok" if statuses <= {"ok"} else "failed" if "ok" not in statuses else "partial"
    return record


def phase_line(result: dict[str, Any]) -> str:
    if result["status"] != "ok":
        return result.get("error") or result.get("reason", result["status"])
    parts = [f"{result['ms']:.2f} ms"]
    if "ms_per_token" in result:
        parts = [f"{result['ms_per_token']:.3f} ms a token step"]
    parts.append(f"{result['tokens_per_s']:.0f} tokens/s")
    if result.get("peak_memory_bytes"):
        parts.append(f"peak {result['peak_memory_bytes'] / 2**30:.2f} GiB")
    parts.append(f"warm-up {result['warmup_s']:.1f} s")
    return ", ".join(parts)


# -- a preset -------------------------------------------------------------------------------------------------


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def run_preset(preset: ModelPreset, settings: Settings, columns: Sequence[Column] = COLUMNS, command: str = "",
               progress: Callable[[str], None] = lambda line: None,
               written: Callable[[dict[str, Any]], None] = lambda report: None) -> dict[str, Any]:
    """Every column of ``preset``: the report (JSON-ready). ``written`` is handed the report after each
    column. Columns run uncompiled first (a spent time budget then costs the slow compiles), and are
    reported in :data:`COLUMNS` order."""
    import transformers

    order = {c.name: i for i, c in enumerate(COLUMNS)}
    columns = sorted(columns, key=lambda c: order.get(c.name, len(order)))
    report: dict[str, Any] = {
        "benchmark": "transformers", "preset": preset.name, "model": preset.source,
        "model_type": preset.model_type, "config": preset.config, "layers": settings.layers,
        "dtype": str(settings.dtype).removeprefix("torch."), "batch": settings.batch, "tokens": settings.tokens,
        "cache_tokens": settings.cache_tokens, "decode_batches": list(settings.decode_batches),
        "decode_steps": settings.decode_steps, "warmup": settings.warmup, "iters": settings.iters,
        "seed": settings.seed, "device": settings.device.type, "gpu": device_name(settings.device),
        "versions": {**versions(), "transformers": transformers.__version__},
        "environment": {k: v for k, v in os.environ.items() if k.startswith("DLCORE_") or k == "TRITON_INTERPRET"},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command, "columns": [{"name": c.name, "status": "pending"} for c in columns],
    }
    for column in sorted(columns, key=lambda c: c.compiled):
        try:
            report["columns"][columns.index(column)] = run_column(preset, column, settings, progress)
        except KeyboardInterrupt:
            # a time limit's SIGINT (.ci/e2e_bench.sh): the columns done so far stay in the JSON
            report["columns"][columns.index(column)] = {"name": column.name, "status": "failed",
                                                        "error": "interrupted", "phases": {}}
            written(report)
            raise
        written(report)
    return report


def summary_table(report: dict[str, Any]) -> str:
    """Milliseconds per phase and column (decode: per token step), tokens/s and peak memory of training."""
    names = sorted({n for c in report["columns"] for n in c.get("phases", {})},
                   key=lambda n: (n != "train", n != "prefill", int(n.removeprefix("decode_b") or 0)
                                  if n.startswith("decode_b") else 0))
    rows = []
    for column in report["columns"]:
        phases = column.get("phases", {})
        row = [column["name"], column["status"]]
        for name in names:
            result = phases.get(name, {})
            value = result.get("ms_per_token", result.get("ms"))
            row.append(f"{value:.3f}" if value is not None else "-")
        train = phases.get("train", {})
        row.append(f"{train['tokens_per_s']:.0f}" if train.get("tokens_per_s") else "-")
        row.append(f"{train['peak_memory_bytes'] / 2**30:.2f}" if train.get("peak_memory_bytes") else "-")
        rows.append(row)
    header = ["column", "status", *[f"{n} ms" for n in names], "train tokens/s", "train peak GiB"]
    return table(rows, header)


# -- the command ------------------------------------------------------------------------------------------------


def _names(text: str, known: Sequence[str], what: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{what} {text!r}: expected names from {', '.join(known)}, joined by commas")
    return names


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(n) for n in text.split(",") if n.strip())
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"bad counts {text!r}: expected positive integers joined by commas, e.g. 1,32")
    return counts


def _positive(text: str) -> int:
    value = _counts(text)
    if len(value) != 1:
        raise argparse.ArgumentTypeError(f"bad count {text!r}: expected one positive integer")
    return value[0]


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description="Times a transformers model built from a real model's config (random weights) in "
                               "training, prefill and decoding: eager, torch.compile, Liger-Kernel, grouped_mm "
                               "experts, dlcore and dlcore + torch.compile, each column in a fresh build.")
    p.add_argument("--preset", type=lambda t: _names(t, tuple(PRESETS), "--preset"), default=DEFAULT_PRESETS,
                   help=f"models, joined by commas: {', '.join(PRESETS)} (default {','.join(DEFAULT_PRESETS)}; "
                        "the tiny ones check the code path on a CPU)")
    p.add_argument("--columns", type=lambda t: _names(t, COLUMN_NAMES, "--columns"), default=COLUMN_NAMES,
                   help=f"default all: {','.join(COLUMN_NAMES)}")
    p.add_argument("--phases", type=lambda t: _names(t, PHASES, "--phases"), default=PHASES,
                   help=f"default all: {','.join(PHASES)}")
    p.add_argument("--layers", type=_positive, default=2, help="decoder layers (default 2)")
    p.add_argument("--batch", type=_positive, default=1, help="sequences of a training step and a prefill (default 1)")
    p.add_argument("--tokens", type=_positive, default=4096, help="tokens a sequence (default 4096)")
    p.add_argument("--decode-batches", type=_counts, default=(1, 32), help="decode batch sizes (default 1,32)")
    p.add_argument("--cache-tokens", type=_positive, default=None, help="tokens in the decode cache (default --tokens)")
    p.add_argument("--decode-steps", type=_positive, default=1,
                   help="token steps in one timed decode run (default 1: each run against exactly --cache-tokens)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--device", default=None, help="cuda when available, else cpu")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs a phase, compiles included (default 2)")
    p.add_argument("--iters", type=_positive, default=5, help="timed runs a phase; the median is reported (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="per preset: no column or phase starts after this many seconds (recorded as skipped)")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                   help=f"folder of the JSON, one PRESET.json each (default {DEFAULT_OUT}); '-' for none")
    return p


def command_line(args: argparse.Namespace, prog: str) -> str:
    """The command that repeats this run, every option spelled out."""
    parts = [*shlex.split(prog), "--preset", ",".join(args.preset), "--columns", ",".join(args.columns),
             "--phases", ",".join(args.phases), "--layers", str(args.layers), "--batch", str(args.batch),
             "--tokens", str(args.tokens), "--decode-batches", ",".join(map(str, args.decode_batches)),
             "--cache-tokens", str(args.cache_tokens), "--decode-steps", str(args.decode_steps),
             "--dtype", args.dtype, "--device", args.device, "--warmup", str(args.warmup),
             "--iters", str(args.iters), "--seed", str(args.seed)]
    if args.budget is not None:
        parts += ["--budget", f"{args.budget:g}"]
    return shlex.join(parts)


def write_json(report: dict[str, Any], folder: str) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{report['preset']}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)
    return path


def main(argv: Sequence[str] | None = None, prog: str = "python -m dlblas_kernels.integrations.transformers.bench",
         ) -> int:
    """Run the benchmark; 0 when some column measured something in every preset, 1 otherwise, 2 on bad options."""
    args = parser(prog).parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.cache_tokens = args.cache_tokens or args.tokens
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    command = command_line(args, prog)
    progress = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    measured_all = True
    for name in args.preset:
        settings = Settings(device=device, dtype=DTYPES[args.dtype], layers=args.layers, batch=args.batch,
                            tokens=args.tokens, decode_batches=args.decode_batches, cache_tokens=args.cache_tokens,
                            decode_steps=args.decode_steps, warmup=args.warmup, iters=args.iters, seed=args.seed,
                            phases=args.phases,
                            deadline=None if args.budget is None else time.monotonic() + args.budget)
        written = (lambda r: write_json(r, args.out)) if args.out != "-" else (lambda r: None)
        columns = [c for c in COLUMNS if c.name in args.columns]
        report = run_preset(PRESETS[name], settings, columns, command, progress, written)
        print(f"{name} ({report['gpu']}, {report['dtype']}, {args.layers} layers, batch {args.batch} x "
              f"{args.tokens} tokens; decode: ms a token step against {args.cache_tokens} cached tokens)")
        print(summary_table(report))
        if args.out != "-":
            print(f"wrote {os.path.join(args.out, name + '.json')}")
        measured_all &= any(c["status"] in ("ok", "partial") for c in report["columns"])
    return 0 if measured_all else 1


if __name__ == "__main__":
    sys.exit(main())
