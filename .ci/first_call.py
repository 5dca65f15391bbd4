"""The first call of an op in a new process, with Triton's cache warm: milliseconds of each step.

    python3 .ci/first_call.py all [--runs 3] [--json docs/results/first_call.json]
    python3 .ci/first_call.py MODE [--profile DIR]

``all`` runs each mode once to fill Triton's and dlcore's caches, then ``--runs`` times more, each in
a new process, and writes the medians (and every run) as JSON. One MODE runs in this process and
prints one JSON line; with ``--profile DIR`` each step runs under cProfile and DIR/MODE.STEP.prof and
DIR/MODE.STEP.txt are written (a profiled run's times are inflated by the profiler).

MODE:
  dlcore   import torch, triton; import dlcore; CUDA init; inputs; dlcore.get_op('rms_norm', (x, w, 1e-6));
           its first call; a second call
  direct   import torch, triton; CUDA init; inputs; from dlblas_kernels.rms_norm import rms_norm; rms_norm(x, w, 1e-6)
  triton   import torch, triton; CUDA init; inputs; the module of a trivial @triton.jit add kernel
           (first_call_add.py); kernel[grid](...)
  key      import torch, triton; CUDA init; triton_key() (Triton's hash of its own files and libtriton.so);
           the CUDA backend's hash (ptxas version)

Inputs: x bfloat16 [FIRSTCALL_ROWS x FIRSTCALL_COLS] (default 4096 x 4096) and w [COLS], on cuda when
there is one; every timed step after CUDA init ends with a synchronize.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

MODES = ("dlcore", "direct", "triton", "key")


def run_all(argv: list[str]) -> int:
    runs = int(argv[argv.index("--runs") + 1]) if "--runs" in argv else 3
    path = argv[argv.index("--json") + 1] if "--json" in argv else None
    found: dict[str, list[dict]] = {}
    for mode in MODES:
        if mode != "key":  # fills the caches
            subprocess.run([sys.executable, __file__, mode], check=True, capture_output=True)
        found[mode] = []
        for _ in range(runs):
            done = subprocess.run([sys.executable, __file__, mode], check=True, capture_output=True, text=True)
            found[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
    result = summarize(found)
    text = json.dumps(result, indent=1)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


def summarize(found: dict[str, list[dict]]) -> dict:
    """Medians of each step per mode, with every run's milliseconds."""
    import platform

    modes = {}
    for mode, rows in found.items():
        steps = list(rows[0]["ms"])
        modes[mode] = {"median_ms": {s: round(statistics.median(r["ms"][s] for r in rows), 2) for s in steps},
                       "runs_ms": {s: [r["ms"][s] for r in rows] for s in steps}}
    runs = len(next(iter(found.values())))
    rows, cols = os.environ.get("FIRSTCALL_ROWS", 4096), os.environ.get("FIRSTCALL_COLS", 4096)
    return {"command": f"python3 .ci/first_call.py all --runs {runs} --json docs/results/first_call.json",
            "date": time.strftime("%Y-%m-%d", time.gmtime()), "python": platform.python_version(),
            "shape": f"rms_norm, x bfloat16 [{rows} x {cols}]", "modes": modes}


if __name__ == "__main__" and sys.argv[1] == "all":
    sys.exit(run_all(sys.argv[2:]))

import cProfile  # noqa: E402 - the single-mode run starts here
import io  # noqa: E402
import pstats  # noqa: E402

MODE = sys.argv[1]
PROFILE_DIR = sys.argv[sys.argv.index("--profile") + 1] if "--profile" in sys.argv else None
ROWS = int(os.environ.get("FIRSTCALL_ROWS", 4096))
COLS = int(os.environ.get("FIRSTCALL_COLS", 4096))
times: dict[str, float] = {}
sync = lambda: None  # noqa: E731 - a synchronize once CUDA is initialized


def step(name, fn, profile=True):
    profiler = cProfile.Profile() if PROFILE_DIR and profile else None
    if profiler:
        profiler.enable()
    start = time.perf_counter()
    result = fn()
    sync()
    times[name] = (time.perf_counter() - start) * 1e3
    if profiler:
        profiler.disable()
        stem = os.path.join(PROFILE_DIR, f"{MODE}.{name}")
        profiler.dump_stats(stem + ".prof")
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("cumulative").print_stats(45)
        stats.sort_stats("tottime").print_stats(25)
        with open(stem + ".txt", "w") as f:
            f.write(f"{MODE} {name}: {times[name]:.1f} ms under the profiler\n{text.getvalue()}")
    return result


def import_torch_triton():
    import torch
    import triton
    return torch, triton


torch, triton = step("import_torch_triton", import_torch_triton, profile=False)
device = "cuda" if torch.cuda.is_available() else "cpu"
if MODE == "dlcore":
    dlcore = step("import_dlcore", lambda: __import__("dlcore"))


def cuda_init():
    if device == "cuda":
        torch.empty(1, device=device)
        torch.cuda.synchronize()


step("cuda_init", cuda_init)
if device == "cuda":
    sync = torch.cuda.synchronize


def inputs():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, COLS, generator=gen).to(device=device, dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(COLS, generator=gen)).to(device=device, dtype=torch.bfloat16)
    return x, w


x, w = step("inputs", inputs)
extra: dict = {}
if MODE == "dlcore":
    op = step("get_op", lambda: dlcore.get_op("rms_norm", (x, w, 1e-6)))
    step("first_call", lambda: op(x, w, 1e-6))
    step("second_call", lambda: op(x, w, 1e-6))
    extra = {"op": type(op).__name__, "how": getattr(getattr(op, "selection", None), "how", None)}
elif MODE == "direct":
    import importlib

    rms_norm = step("import_kernel_module", lambda: importlib.import_module("dlblas_kernels.kernels.rms_norm").rms_norm)
    step("first_call", lambda: rms_norm(x, w, 1e-6))
    step("second_call", lambda: rms_norm(x, w, 1e-6))
elif MODE == "triton":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    add_kernel = step("import_kernel_module", lambda: __import__("first_call_add").add_kernel)
    y = x.flip(0).contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    grid = (triton.cdiv(n, 1024),)
    step("first_call", lambda: add_kernel[grid](x, y, out, n, BLOCK=1024))
    step("second_call", lambda: add_kernel[grid](x, y, out, n, BLOCK=1024))
    extra = {"max_abs_diff": (out.float() - (x + y).float()).abs().max().item()}
elif MODE == "key":
    from triton.runtime.cache import triton_key

    step("triton_key", triton_key)

    def backend_hash():
        from triton.compiler.compiler import make_backend
        from triton.runtime.driver import driver

        return make_backend(driver.active.get_current_target()).hash()

    try:
        step("backend_hash", backend_hash)
    except RuntimeError as exc:  # no GPU driver (the CPU interpreter)
        extra = {"backend_hash": str(exc)}
else:
    raise SystemExit(f"unknown mode {MODE!r}; one of all, {', '.join(MODES)}")

print(json.dumps({"mode": MODE, "device": device, "profiled": bool(PROFILE_DIR), **extra,
                  "ms": {k: round(v, 2) for k, v in times.items()}}))
