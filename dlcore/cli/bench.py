"""`dlcore bench`: time an op against its baselines on model shapes; table, JSON and plot.
`dlcore bench-model`: a whole model's benchmark, which a plugin provides (an entry point of
``dlcore.model_benchmarks``: dlblas-kernels' benchmarks transformers models)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from dlcore.bench.harness import KNOWN_BASELINES, MODES
from dlcore.bench.presets import DEFAULT_PRESET, PRESET_TOKENS, PRESETS, TOKENS, VARIANTS
from dlcore.bench.report import OWN
from dlcore.bench.timing import TIMERS
from dlcore.cli.options import DTYPES, default_dtype, require_plotting, resolve_device


def _names(text: str) -> tuple[str, ...]:
    """``torch,compile`` -> ``("torch", "compile")``; ``none`` or nothing: no baseline."""
    return () if text.strip().lower() in ("", "none") else tuple(n.strip() for n in text.split(",") if n.strip())


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(n) for n in text.split(",") if n.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad token counts {text!r}: expected integers, e.g. 1,64,4096") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"bad token counts {text!r}: expected positive integers")
    return counts


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench", help="time an op against torch, torch.compile and Liger on model shapes: GB/s, TFLOP/s, speedups",
        description="Times the op (through get_op) and each baseline on the same inputs, alternating round by "
                    "round; reports time, GB/s or TFLOP/s, the fraction of the device copy bandwidth measured in "
                    "the same run, and the speedup over each baseline with its geometric mean.",
    )
    p.add_argument("op")
    p.add_argument("--shapes", default=None,
                   help=f"a preset: {', '.join(PRESETS)} (default {DEFAULT_PRESET}; several joined by commas; "
                        "gqa: LLaMA-3 and Qwen2.5, mla: the DeepSeek models, gemm: the MLP GEMMs of LLaMA-3-8B, "
                        "LLaMA-3-70B, Qwen2.5-7B and DeepSeek-V3's shared expert); a preset ending in "
                        f"{', '.join('-' + v for v in VARIANTS)} swaps each model's hidden and inter sizes (gemm: "
                        "matmul's up projection, K = hidden, N = inter; gemm-down: the down projection, K = inter, "
                        "N = hidden); or named sizes, one set per ';' (tokens=4096,hidden=4096;tokens=1,hidden=4096); "
                        "or MxN in the order of the op's sizes (4096x4096,1x4096)")
    p.add_argument("--tokens", type=_counts, default=None,
                   help="token counts of the presets (default " + ",".join(map(str, TOKENS)) + "; " + "; ".join(
                       f"{name}: " + ",".join(map(str, counts)) for name, counts in PRESET_TOKENS.items()) + ")")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="bfloat16; float32 on a CPU")
    p.add_argument("--mode", choices=MODES, default="fwd",
                   help="fwd; bwd: the backward alone (the forward runs once untimed, then torch.autograd.grad of "
                        "the inputs the op declares differentiable, for a fixed grad_output); fwd+bwd")
    p.add_argument("--vs", type=_names, default=KNOWN_BASELINES,
                   help="baselines, joined by commas (default torch,compile,liger; none for none)")
    p.add_argument("--impls", type=_names, default=(),
                   help="implementations to time alone as well, each in a column dlcore[NAME] beside what get_op "
                        "chooses (joined by commas; a name from `dlcore ops`, or a kind one implementation has: "
                        "triton, vendor); the table then names the implementation chosen per shape and gives "
                        "'vs best': the fastest of these columns over get_op's time")
    p.add_argument("--device", default=None, help="cuda when available, else cpu")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per shape (default 3)")
    p.add_argument("--warmup", type=float, default=10, help="do_bench warm-up per round, ms (default 10)")
    p.add_argument("--rep", type=float, default=40, help="do_bench measuring time per round, ms (default 40)")
    p.add_argument("--timer", choices=TIMERS, default="do_bench",
                   help="do_bench (default: host time shows where it exceeds the GPU's) or cudagraph (calls "
                        "replayed from a CUDA graph on a side stream: GPU time alone, every implementation alike)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", metavar="FILE", default=None, help="write everything as JSON")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="draw each implementation per shape")
    p.set_defaults(func=run_bench_command)
    # Every argument, options and -h included, goes to the plugin's benchmark: no prefix character is
    # an option's here.
    m = sub.add_parser(
        "bench-model", add_help=False, prefix_chars="\0",
        help="time a whole model (training step, prefill, decode) with and without dlcore: the benchmark a plugin "
             "provides (dlblas-kernels[transformers]); `dlcore bench-model --help` gives its options",
    )
    m.add_argument("args", nargs=argparse.REMAINDER)
    m.set_defaults(func=run_bench_model_command)


def command_line(args: argparse.Namespace) -> str:
    """The command that repeats this run, every option spelled out."""
    parts = ["dlcore", "bench", args.op, "--shapes", args.shapes or "all", "--dtype", args.dtype,
             "--mode", args.mode, "--vs", ",".join(args.vs) or "none", "--device", args.device,
             "--rounds", str(args.rounds), "--warmup", f"{args.warmup:g}", "--rep", f"{args.rep:g}",
             "--timer", args.timer, "--seed", str(args.seed)]
    if args.tokens:
        parts += ["--tokens", ",".join(map(str, args.tokens))]
    if args.impls:
        parts += ["--impls", ",".join(args.impls)]
    return shlex.join(parts)


def run_bench_command(args: argparse.Namespace) -> int:
    from dlcore.bench.harness import default_timer, run_bench
    from dlcore.bench.presets import shapes_for
    from dlcore.errors import DlcoreError
    from dlcore.plugins.registry import registry

    device = resolve_device(args.device)
    args.device = str(device)
    args.dtype = default_dtype(args.dtype, device)
    if args.plot:
        require_plotting(args.plot)
    try:
        op = registry().op(args.op)
        if device.type == "cpu" and args.shapes is None and args.tokens is None:
            # The model presets reach 16384 tokens: hours in Triton's interpreter, and times that say
            # nothing about an accelerator.
            args.shapes = ",".join(f"{k}={v}" for k, v in op.example_sizes.items())
            print(f"dlcore bench: warning: on a CPU the kernels run in Triton's interpreter and the times say "
                  f"nothing about an accelerator's; timing the example sizes only ({args.shapes}); give "
                  f"--shapes to choose", file=sys.stderr)
        shapes, notes = shapes_for(op.example_sizes, args.shapes, args.tokens)
        timer, timer_name = default_timer(device, registry().backend_for(device), args.warmup, args.rep,
                                          args.timer)
        report = run_bench(
            op, shapes, dtype=DTYPES[args.dtype], device=device, mode=args.mode, baselines=args.vs,
            impls=args.impls, timer=timer, timer_name=timer_name, rounds=args.rounds, seed=args.seed, notes=notes,
            command=command_line(args), progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
    except (DlcoreError, ValueError) as exc:
        print(f"dlcore bench: error: {exc}", file=sys.stderr)
        return 2
    print(report.table())
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report.to_json(), f, indent=2)
        print(f"wrote {args.json_path}")
    if args.plot:
        from dlcore.bench.plot import plot

        plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 0 if any(r.ms(OWN) is not None for r in report.shapes) else 1


def run_bench_model_command(args: argparse.Namespace) -> int:
    """Run the one installed model benchmark (an entry point of ``dlcore.model_benchmarks``, naming a
    ``main(argv, prog) -> int``) with the command's arguments."""
    from importlib.metadata import entry_points

    from dlcore.errors import InvalidOptionError, PluginLoadError
    from dlcore.plugins.discovery import MODEL_BENCHMARK_GROUP

    found = sorted(entry_points(group=MODEL_BENCHMARK_GROUP), key=lambda ep: ep.name)
    if not found:
        raise InvalidOptionError(f"dlcore bench-model: no model benchmark is installed (no entry point in "
                                 f"{MODEL_BENCHMARK_GROUP}); pip install 'dlblas-kernels[transformers]'")
    if len(found) > 1:
        names = ", ".join(f"{ep.name} = {ep.value}" for ep in found)
        raise InvalidOptionError(f"dlcore bench-model: {len(found)} model benchmarks are installed ({names}); "
                                 f"run the one you want as python -m MODULE")
    try:
        main = found[0].load()
    except Exception as exc:  # noqa: BLE001 - any import failure of the plugin is reported the same way
        raise PluginLoadError(f"the model benchmark {found[0].name} = {found[0].value} cannot be loaded "
                              f"({type(exc).__name__}: {exc}); pip install 'dlblas-kernels[transformers]'") from exc
    return main(list(args.args), prog="dlcore bench-model")
