"""Timing an op against its baselines, shape by shape, on the same inputs; the numbers that come out.

For each shape the op's example inputs are built once. The op (through ``get_op``, named
``dlcore``), optionally one of its implementations alone (``get_op(..., impl=NAME)``, named
``dlcore[NAME]``: e.g. the Triton kernel beside what selection chose, which may be the vendor
library) and each baseline (``torch`` and ``liger`` from ``op.baselines``; ``compile``: the op's
``compile`` baseline, a composite written to be compiled, when it declares one, else its ``torch``
baseline, through ``torch.compile``, compiled afresh for each shape) are warmed up once,
then timed in rounds: each round times every implementation once, starting one further along each
round, so that a clock or thermal drift spreads over all of them alike. An implementation's time is
the median of its rounds; each round is one timer call (``triton.testing.do_bench``'s median on
CUDA, the backend's timer elsewhere).

Rates and speedups are :mod:`dlcore.bench.report`'s. A baseline that is missing or fails is left
out with a note, never replaced by something else.

A baseline function may carry ``prepare(args) -> args``: what a caller does once, not per call
(ffn's composite over ``[w1; w3]`` concatenated once, as a caller that keeps ``w13`` does). In
``fwd`` it runs once per shape, outside the timing, and the baseline is timed on what it returns;
in ``bwd`` it runs in the untimed forward, and in ``fwd+bwd`` in each timed call (the backward
must reach the op's own inputs).
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import os
import platform
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from dlcore.bench.presets import Shape
from dlcore.bench.report import OWN, Report, ShapeResult, impl_column
from dlcore.bench.timing import (
    GraphTimer,
    Timer,
    copy_bandwidth,
    copy_ms,
    default_copy_bytes,
    default_timer,
    first_line,
    host_call_us,
    time_round_robin,
)
from dlcore.declarations.op import Op
from dlcore.errors import DlcoreError

COMPILE = "compile"
#: baselines every op may declare; ``compile`` is built from ``torch``
KNOWN_BASELINES = ("torch", COMPILE, "liger")
MODES = ("fwd", "bwd", "fwd+bwd")


# -- the implementations ---------------------------------------------------------------------------

def load_baselines(op: Op, names: list[str]) -> tuple[dict[str, Callable[..., Any]], list[str]]:
    """The requested baselines available here, and a note per missing one.

    Under ``compile`` the function to compile: the op's own ``compile`` baseline when it declares
    one, else its ``torch`` baseline.
    """
    found: dict[str, Callable[..., Any]] = {}
    notes: list[str] = []
    for name in names:
        if name == COMPILE:
            source = COMPILE if COMPILE in op.baselines else "torch"
            fn, why = _load(op, source)
            if fn is not None:
                found[COMPILE] = fn
            elif source == COMPILE:
                notes.append(f"{COMPILE}: the op's function to compile: {why}; skipped")
            else:
                notes.append(f"{COMPILE}: needs the op's 'torch' baseline, which is not available; skipped")
            continue
        fn, why = _load(op, name)
        if fn is not None:
            found[name] = fn
        else:
            notes.append(f"{name}: {why}; skipped")
    return found, notes


#: where a baseline's ``prepare`` runs, per mode
PREPARED = {"fwd": "prepared once per shape, untimed", "bwd": "prepared in the untimed forward",
            "fwd+bwd": "prepared in each timed call"}


def baseline_doc(name: str, fn: Callable[..., Any], mode: str = "fwd") -> str:
    """What a baseline runs, in a line: its function's name and the first line of its docstring."""
    module = getattr(fn, "__module__", None) or ""
    if module.partition(".")[0] == "torch" or module == "":  # torch.matmul: torch._C's, documented by torch
        label, first = f"torch.{getattr(fn, '__name__', type(fn).__name__)}", []
    else:
        label = f"{module}.{getattr(fn, '__qualname__', type(fn).__name__)}"
        first = (inspect.getdoc(fn) or "").strip().splitlines()
    text = f"{label}: {first[0]}" if first else label
    text = f"torch.compile of {text}" if name == COMPILE else text
    if getattr(fn, "prepare", None) is not None:
        text += f" ({PREPARED[mode]}: {getattr(fn.prepare, '__qualname__', 'prepare')})"
    return text


def _load(op: Op, name: str) -> tuple[Callable[..., Any] | None, str]:
    factory = op.baselines.get(name)
    if factory is None:
        return None, f"{op.name} declares no {name!r} baseline"
    try:
        fn = factory()
    except Exception as exc:  # noqa: BLE001 - a broken optional library is a note, not a crash
        return None, f"failed to load ({first_line(exc)})"
    return fn, "not installed here"


def compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile(fn)`` for one static shape, starting from an empty Dynamo cache.

    Resetting first keeps each shape's graph static and out of the recompile limit (past it,
    Dynamo silently runs the function eagerly).
    """
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False)


@contextlib.contextmanager
def _retainable_compiled_backward() -> Iterator[None]:
    """Compiled backwards that may run more than once per forward (``retain_graph=True``): with
    donated buffers, AOTAutograd frees saved tensors during the first one."""
    import torch._functorch.config as functorch_config

    if not hasattr(functorch_config, "donated_buffer"):
        yield
        return
    with functorch_config.patch(donated_buffer=False):
        yield


# -- one run -----------------------------------------------------------------------------------------

@dataclass
class Bench:
    """What a run needs besides the shapes; :func:`run_bench` builds it."""

    op: Op
    dtype: torch.dtype
    device: torch.device
    mode: str
    timer: Timer
    rounds: int
    seed: int
    baselines: dict[str, Callable[..., Any]]
    #: implementations run alone, each in a ``dlcore[NAME]`` column
    impls: list[str] = field(default_factory=list)
    #: notes about the whole run, each once
    notes: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def cost(self, args: tuple) -> tuple[int | None, int | None]:
        """Bytes and flops of this mode; None when the op does not say."""
        cost = self.op.cost
        if cost is None:
            self.note(f"{self.op.name} declares no cost: no GB/s, TFLOP/s or copy fraction")
            return None, None
        if self.mode == "fwd":
            return cost(args)
        if "mode" not in inspect.signature(cost).parameters:
            self.note(f"{self.op.name}'s cost(args) gives forward bytes only; declare "
                      f"cost(args, mode='fwd'|'bwd') for the rates of its backward")
            return None, None
        nbytes, flops = cost(args, mode="bwd")
        if self.mode == "fwd+bwd":
            fwd_bytes, fwd_flops = cost(args, mode="fwd")
            nbytes, flops = nbytes + fwd_bytes, flops + fwd_flops
        return nbytes, flops

    def implementations(self, args: tuple, result: ShapeResult) -> dict[str, Callable[..., Any]]:
        """The op through ``get_op``, each implementation alone, and the baselines, for these inputs
        (``compile`` built afresh, ``prepare`` done). In ``bwd`` modes ``get_op`` is asked with the
        differentiable inputs requiring grad: a training call, chosen by forward and backward."""
        from dlcore.dispatch.dispatcher import get_op

        if self.mode != "fwd":  # a training call: get_op chooses by forward and backward
            wrt = [i for i in self.op.differentiable()
                   if isinstance(args[i], torch.Tensor) and args[i].is_floating_point()]
            args = _with_grad(args, wrt)
        bound = get_op(self.op.name, args)
        result.chosen = f"{bound.impl.name} {bound.config}"
        result.impl = bound.impl.name
        result.selection = {key: value for key, value in bound.selection.to_json().items()
                            if key in ("how", "measured", "failed", "declined")}
        if getattr(bound.impl, "fallback_only", False):
            result.notes.append(f"{OWN} ran {bound.impl.name}: no dedicated kernel accepts these inputs here")
        impls: dict[str, Callable[..., Any]] = {OWN: bound}
        for name in self.impls:
            try:
                impls[impl_column(name)] = get_op(self.op.name, args, impl=name)
            except DlcoreError as exc:
                result.notes.append(f"{impl_column(name)}: {first_line(exc)}; left out")
        for name, fn in self.baselines.items():
            run = compiled(fn) if name == COMPILE else fn
            prepare = getattr(fn, "prepare", None)
            impls[name] = run if prepare is None else self._prepared(run, prepare, args)
        return impls

    def _prepared(self, fn: Callable[..., Any], prepare: Callable[[tuple], tuple],
                  args: tuple) -> Callable[..., Any]:
        """``fn`` on ``prepare``'s arguments: prepared once here in ``fwd``, per call otherwise."""
        if self.mode == "fwd":
            with torch.no_grad():
                prepared = tuple(prepare(args))
            return lambda *_: fn(*prepared)
        return lambda *given: fn(*prepare(given))

    def run_shape(self, shape: Shape, requested: list[str]) -> ShapeResult:
        result = ShapeResult(shape)
        args = self.op.example_inputs(shape.sizes, self.dtype, self.device, self.seed)
        result.nbytes, result.flops = self.cost(args)
        try:
            impls = self.implementations(args, result)
        except DlcoreError as exc:
            result.notes.append(f"{OWN}: {first_line(exc)}; shape skipped")
            return result
        impls = {name: impls[name] for name in [OWN, *map(impl_column, self.impls), *requested] if name in impls}
        work = self.workloads(impls, args, result)
        if OWN not in work:
            return result
        result.rounds, failed = time_round_robin(work, self.timer, self.rounds)
        result.notes += [f"{name}: failed while timed ({why}); left out" for name, why in failed.items()]
        return result

    def workloads(self, impls: dict[str, Callable[..., Any]], args: tuple,
                  result: ShapeResult) -> dict[str, Callable[[], object]]:
        """A no-argument callable per implementation doing this mode's work, each run once already."""
        if self.mode == "fwd":
            prepare = _forward(args)
        else:
            try:
                prepare = self._backward(impls[OWN], args, result)
            except Exception as exc:  # noqa: BLE001 - reported like any failure of the op
                result.notes.append(f"{OWN}: failed ({first_line(exc)}); shape skipped")
                return {}
            if prepare is None:
                return {}
        work: dict[str, Callable[[], object]] = {}
        reference: tuple = ()
        for name, fn in impls.items():
            try:
                run, watched = prepare(fn)
                out = _tensors(run())
            except Exception as exc:  # noqa: BLE001 - a failing baseline is a note, never a crash
                result.notes.append(f"{name}: failed ({first_line(exc)}); left out")
                if name == OWN:
                    return {}
                continue
            if name == OWN:
                reference = out
            else:
                diff = _max_abs_diff(reference, out)
                if diff is None:
                    result.notes.append(f"{name}: its results do not have the shapes of {OWN}'s; left out")
                    continue
                result.max_abs_diff[name] = diff
            if any(not torch.equal(t, pristine) for t, pristine in watched):
                what = "inputs" if self.mode == "fwd" else "output gradients"
                self.note(f"{name}: writes into its {what} (in place), so each timed call moves fewer bytes than "
                          f"a functional one; they were restored before the next implementation's check")
                if name == OWN:  # its results may be those inputs: keep them as the reference
                    reference = tuple(t.clone() for t in reference)
                for t, pristine in watched:
                    t.copy_(pristine)
            work[name] = run
        return work

    def _backward(self, own: Callable[..., Any], args: tuple,
                  result: ShapeResult) -> Prepare | None:
        """How to time this mode's backward: the inputs the op declares differentiable (floating-point
        tensors only) require grad, every implementation is asked for the gradients of exactly those."""
        wrt = [i for i in self.op.differentiable() if isinstance(args[i], torch.Tensor) and args[i].is_floating_point()]
        grad_args = _with_grad(args, wrt)
        outs = [t for t in _tensors(own(*grad_args)) if t.requires_grad] if wrt else []
        if not outs:
            result.notes.append(f"{OWN}: {self.op.name} has no backward (its outputs carry no autograd graph); "
                                f"{self.mode} skipped")
            return None
        generator = torch.Generator().manual_seed(self.seed + 1)
        grads = [torch.randn(t.shape, generator=generator).to(device=t.device, dtype=t.dtype) for t in outs]
        inputs = [grad_args[i] for i in wrt]
        if self.mode == "bwd":
            return _backward_only(grad_args, inputs, grads)
        return _forward_backward(grad_args, inputs, grads)


#: ``prepare(fn) -> (run, watched)``: ``watched`` pairs each tensor ``fn`` is handed (and might
#: write into) with a copy of its values as they must be
Watched = list[tuple[torch.Tensor, torch.Tensor]]
Prepare = Callable[[Callable[..., Any]], tuple[Callable[[], object], Watched]]


def _forward(args: tuple) -> Prepare:
    """Each implementation's forward on ``args`` itself; their tensors are copied once to watch them."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    watched = [(t, t.clone()) for t in tensors]

    def prepare(fn: Callable[..., Any]) -> tuple[Callable[[], object], Watched]:
        def run() -> object:
            with torch.no_grad():
                return fn(*args)
        return run, watched
    return prepare


def _backward_only(args: tuple, inputs: list[torch.Tensor], grads: list[torch.Tensor]) -> Prepare:
    """The forward runs once, outside the timing; each timed call runs the backward of its graph,
    ``torch.autograd.grad`` of ``inputs`` only (no ``.grad`` accumulation, nothing else differentiated).

    Each implementation gets its own copy of ``grads``: some backwards (Liger's) write into them.
    """
    def prepare(fn: Callable[..., Any]) -> tuple[Callable[[], object], Watched]:
        outs = _differentiable_outputs(fn(*args), len(grads))
        own = [g.clone() for g in grads]
        return lambda: torch.autograd.grad(outs, inputs, own, retain_graph=True), list(zip(own, grads))
    return prepare


def _forward_backward(args: tuple, inputs: list[torch.Tensor], grads: list[torch.Tensor]) -> Prepare:
    def prepare(fn: Callable[..., Any]) -> tuple[Callable[[], object], Watched]:
        own = [g.clone() for g in grads]
        return (lambda: torch.autograd.grad(_differentiable_outputs(fn(*args), len(grads)), inputs, own),
                list(zip(own, grads)))
    return prepare


def _differentiable_outputs(out: object, count: int) -> list[torch.Tensor]:
    outs = [t for t in _tensors(out) if t.requires_grad]
    if len(outs) != count:
        raise RuntimeError(f"{len(outs)} outputs require grad, expected {count}")
    return outs


def _with_grad(args: tuple, indices: list[int]) -> tuple:
    """Fresh leaves with the values of ``args``; those at ``indices`` require grad."""
    return tuple(a.detach().clone().requires_grad_(i in indices) if isinstance(a, torch.Tensor) else a
                 for i, a in enumerate(args))


def _tensors(out: object) -> tuple[torch.Tensor, ...]:
    items = out if isinstance(out, (tuple, list)) else (out,)
    return tuple(t for t in items if isinstance(t, torch.Tensor))


#: elements per slice of :func:`_max_abs_diff`
DIFF_SLICE = 1 << 26


def _max_abs_diff(reference: tuple, out: tuple) -> float | None:
    """The largest absolute difference between matching tensors; None if the shapes differ."""
    if len(reference) != len(out) or any(a.shape != b.shape for a, b in zip(reference, out)):
        return None
    worst = 0.0
    for a, b in zip(reference, out):
        a, b = a.detach().reshape(-1), b.detach().reshape(-1)
        # in slices: a float32 copy of a model's expert gradients whole would be tens of GiB
        for start in range(0, a.numel(), DIFF_SLICE):
            part = slice(start, start + DIFF_SLICE)
            worst = max(worst, (a[part].float() - b[part].float()).abs().max().item())
    return worst


def versions() -> dict[str, str | None]:
    from importlib import metadata

    found: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__,
                                    "cuda": torch.version.cuda}
    for dist in ("triton", "dlc-core", "dlblas-kernels", "liger-kernel"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = None
    return found


def run_bench(
    op: Op,
    shapes: list[Shape],
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    mode: str = "fwd",
    baselines: tuple[str, ...] | list[str] = ("torch", COMPILE, "liger"),
    impls: tuple[str, ...] | list[str] = (),
    timer: Timer | None = None,
    timer_name: str = "",
    rounds: int = 3,
    seed: int = 0,
    copy_bytes: int | None = None,
    notes: list[str] | None = None,
    command: str = "",
    progress: Callable[[str], None] | None = None,
) -> Report:
    """Time ``op`` and ``baselines`` on each of ``shapes``; see the module docstring.

    :param impls: implementations to run alone beside what ``get_op`` chooses, each in a
        ``dlcore[NAME]`` column: names of the op's implementations, or a kind (``triton``,
        ``vendor``) that exactly one of them has.
    :param timer: milliseconds of a no-argument callable; default :func:`default_timer`.
    :param notes: notes so far (from choosing the shapes), kept in the report.
    :raises ValueError: the op declares no example inputs, an unknown mode or baseline.
    :raises DlcoreError: no backend for ``device``.
    """
    from dlcore.plugins.registry import registry

    if op.example is None:
        raise ValueError(f"op {op.name!r} declares no example inputs; `dlcore bench` cannot build them")
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
    unknown = [b for b in baselines if b not in KNOWN_BASELINES and b not in op.baselines]
    if unknown:
        known = ", ".join(dict.fromkeys([*KNOWN_BASELINES, *op.baselines]))
        raise ValueError(f"unknown baseline {', '.join(map(repr, unknown))}; {op.name} can be compared with {known}")
    device = torch.device(device)
    reg = registry()
    impl_names, impl_notes = implementations_named(op.name, reg.implementations_of(op.name), impls)
    backend = reg.backend_for(device)
    if timer is None:
        timer, timer_name = default_timer(device, backend)
    copy_bytes = copy_bytes or default_copy_bytes(device)
    loaded, missing = load_baselines(op, list(baselines))
    requested = [b for b in baselines if b in loaded]
    report = Report(op.name, mode, dtype, reg.profile(backend, device).as_dict(), requested, copy_bytes,
                    impls=[impl_column(n) for n in impl_names],
                    baseline_docs={b: baseline_doc(b, loaded[b], mode) for b in requested},
                    timer=timer_name, rounds=rounds, command=command,
                    date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    versions=versions(), environment={k: v for k, v in os.environ.items()
                                                      if k.startswith("DLCORE_") or k == "TRITON_INTERPRET"})
    bench = Bench(op, dtype, device, mode, timer, rounds, seed, loaded, impl_names,
                  notes=[*(notes or []), *missing, *impl_notes])
    copy_timer = timer.copy_timer if isinstance(timer, GraphTimer) else timer
    # A graph timer's shapes run on its stream from the start (see GraphTimer).
    on_stream = torch.cuda.stream(timer.stream) if isinstance(timer, GraphTimer) else contextlib.nullcontext()
    copies = backend.hardware_timings
    if copies:
        report.copy_gbps.append(copy_bandwidth(device, copy_timer, copy_bytes))
        report.host_us.append(host_call_us(device, backend))
    else:
        bench.notes.append(f"no copy fractions: the {backend.name} backend runs Triton kernels in the interpreter, "
                           "whose times say nothing of a device's bandwidth")
    with _retainable_compiled_backward(), on_stream:
        for i, shape in enumerate(shapes, 1):
            result = bench.run_shape(shape, requested)
            if copies and result.bound == "memory" and result.rounds.get(OWN):
                result.copy_ms = copy_ms(device, copy_timer, result.nbytes)
            report.shapes.append(result)
            if progress is not None:
                progress(f"[{i}/{len(shapes)}] {shape.label()}: "
                         f"{result.progress_line([*report.impls, *requested])}")
    if copies:
        report.copy_gbps.append(copy_bandwidth(device, copy_timer, copy_bytes))
        report.host_us.append(host_call_us(device, backend))
    report.notes = bench.notes
    return report


def implementations_named(op: str, implementations: list[Any], requested: tuple[str, ...] | list[str],
                          ) -> tuple[list[str], list[str]]:
    """The implementations ``requested`` names (each a name, or a kind exactly one implementation
    has), and a note for each that names none or several: like a missing baseline, left out."""
    found: list[str] = []
    notes: list[str] = []
    names = [i.name for i in implementations]
    for name in requested:
        kind = [i.name for i in implementations if i.kind == name]
        if name in names or len(kind) == 1:
            found.append(name if name in names else kind[0])
            continue
        what = f"several implementations of kind {name!r} ({', '.join(kind)})" if kind else \
            f"no implementation or kind {name!r}"
        notes.append(f"{impl_column(name)}: {op} has {what} (it has "
                     + ", ".join(f"{i.name} ({i.kind})" for i in implementations) + "); skipped")
    return list(dict.fromkeys(found)), notes

