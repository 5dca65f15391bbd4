"""Compiling the kernels of a launch plan for a target that need not be present.

A :class:`~dlcore.declarations.implementation.LaunchPlan` built on ``meta`` tensors names every kernel with its
real arguments; from those, each kernel's Triton signature and constexprs are derived and
``triton.compile`` runs for a ``GPUTarget`` (no device needed), giving every IR stage
(:mod:`dlcore.compiler.signatures`).

By default a kernel is specialized on its argument values as a real launch would specialize it
(:func:`~dlcore.compiler.signatures.launch_signature`): pointers and integers known divisible by
16 carry ``tt.divisibility = 16``, integers equal to 1 become constants. Without that, loads come
out unvectorised and register counts inflated, so the code would not be the code that runs.

:func:`lower_with_triton` is what a backend's ``lower`` runs: a real compile (Triton's cache is not
read) with the pipeline's IR passes, every stage's output and time recorded, optionally stopped
after a stage. :func:`launches` builds the plans ``dlcore lower`` compiles: each op's example
inputs on ``meta`` tensors, the default config, the ``ast`` and ``launch`` passes applied.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from dlcore.compiler.signatures import ast_source, compile_options
from dlcore.compiler.signatures import compile_call as compile_call
from dlcore.declarations.device import DeviceProfile, planning_for
from dlcore.declarations.implementation import KernelCall
from dlcore.errors import DlcoreError, InvalidInputError, LoweringError, ToolchainMissingError

if TYPE_CHECKING:
    from dlcore.compiler.passes import Pipeline
    from dlcore.compiler.stages import StageOutput
    from dlcore.declarations.op import Op
    from dlcore.plugins.registry import Registry

# --------------------------------------------------------------------------------------------
# lowering one launch
# --------------------------------------------------------------------------------------------


@dataclass
class Resources:
    """What the binary asks of the hardware (``None``: not known for this target)."""

    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    shared: int | None = None


@dataclass
class Lowering:
    """What one kernel launch became for one target, stage by stage."""

    kernel: str
    target: str
    #: in order: ``python`` (the kernel's source after ast passes), ``source`` (Triton's first IR),
    #: then each stage the compile reached
    stages: list[StageOutput]
    #: every stage of the target's pipeline, reached or not
    planned: tuple[str, ...]
    seconds: float
    passes: tuple[str, ...] = ()
    resources: Resources = field(default_factory=Resources)
    #: Triton's compiled kernel, when the pipeline ran to its end
    compiled: Any = None
    #: what the backend's pipeline noted on the way (a retried tool run, a kernel's execution mode)
    notes: list[str] = field(default_factory=list)

    @property
    def reached(self) -> list[str]:
        """The pipeline stages that ran (``python``, ``source`` and the outputs of single passes excluded)."""
        return [s.stage for s in self.stages if s.stage in self.planned and not s.after_pass]

    def stage(self, name: str) -> StageOutput:
        """The output of stage ``name`` (not that of one of its passes)."""
        for s in self.stages:
            if s.stage == name and not s.after_pass:
                return s
        have = [s.stage for s in self.stages]
        raise KeyError(f"{self.kernel} for {self.target} has no stage {name!r}; it has {have}")


def parse_target(target: str) -> tuple[str, str]:
    """``"cuda:90"`` -> ``("cuda", "90")``."""
    backend, sep, arch = target.partition(":")
    if not sep or not backend or not arch:
        raise LoweringError(f"target {target!r} is not BACKEND:ARCH (e.g. cuda:80, cuda:90, cuda:100, npu:Ascend910B)")
    return backend, arch


def cuda_capability(target: str) -> int:
    backend, arch = parse_target(target)
    digits = arch.removeprefix("sm_").rstrip("a")
    if backend != "cuda" or not digits.isdigit():
        raise LoweringError(f"target {target!r} is not a CUDA target; expected cuda:CAPABILITY, e.g. cuda:90")
    return int(digits)


def _require_compilable(call: KernelCall) -> None:
    if type(call.kernel).__name__ == "InterpretedFunction":
        raise LoweringError(
            f"{call.kernel.fn.__name__} was created under TRITON_INTERPRET=1, which replaces Triton's compiler "
            "with the interpreter; lower kernels in a process without TRITON_INTERPRET (unset it or set it to 0)"
        )


def lower_with_triton(call: KernelCall, gpu_target: Any, target: str, passes: Pipeline,
                      stop_after: str | None = None, specialize: bool = True) -> Lowering:
    """Compile ``call`` for ``gpu_target`` (a Triton ``GPUTarget``), recording every stage.

    :param target: the dlcore name of the target, e.g. ``cuda:90``.
    :param passes: the pipeline whose IR passes run during the compile.
    :param stop_after: end the compile after this stage (the stages after it are not run).
    :param specialize: specialize on the argument values as a launch does (see
        :func:`~dlcore.compiler.signatures.launch_signature`); ``False``: only on the types and
        constexprs.
    """
    import triton
    from triton import knobs

    from dlcore.compiler import source, stages

    _require_compilable(call)
    src, sig = ast_source(call, gpu_target, specialize)
    python = stages.StageOutput("python", source.source_of(call.kernel), 0.0)
    compiled, failure = None, None
    with knobs.compilation.scope(), stages.capturing(passes, stop_after) as capture:
        knobs.compilation.always_compile = True  # a cache hit would skip every stage
        start = time.perf_counter()
        try:
            compiled = triton.compile(src, target=gpu_target, options=compile_options(sig))
        except stages.StopCompile:
            pass
        except DlcoreError:
            raise
        except Exception as exc:  # Triton's own: CompilationError (a type the target lacks), MLIR pass failures
            failure = exc
        seconds = time.perf_counter() - start
    ir_passes = tuple(p.name for p in passes.passes if p.is_ir)
    lowering = Lowering(sig.name, target, [python, *capture.outputs], capture.planned, seconds, ir_passes,
                        compiled=compiled)
    if failure is not None:
        first = str(failure).strip().splitlines()[-1] if str(failure).strip() else ""
        raise LoweringError(f"Triton {triton.__version__} could not compile {sig.name} for {target}: "
                            f"{type(failure).__name__}: {first}", partial=lowering) from failure
    if compiled is not None:
        lowering.resources.shared = getattr(compiled.metadata, "shared", None)
    return lowering


def ttir_then_missing(call: KernelCall, target: str, passes: Pipeline, later: tuple[str, ...],
                      tools: dict[str, str], specialize: bool = True) -> NoReturn:
    """Lower ``call`` to ttir with upstream Triton, then raise :class:`ToolchainMissingError`.

    For backends whose own pipeline is not wired yet: the ttir comes from Triton's
    target-independent ttir passes (run through its NVIDIA backend, the one upstream ships).

    :param later: the target's stages after ttir, e.g. ``("linalg", "hivm", "bin")``.
    :param tools: each executable those stages need -> what provides it; looked up on ``PATH``.
    :param specialize: as for :func:`lower_with_triton`.
    """
    from triton.backends.compiler import GPUTarget

    lowering = lower_with_triton(call, GPUTarget("cuda", 80, 32), target, passes, stop_after="ttir",
                                 specialize=specialize)
    lowering.planned = ("ttir", *later)
    missing = tuple(tool for tool in tools if shutil.which(tool) is None)
    if missing:
        named = ", ".join(f"{tool} (from {tools[tool]})" for tool in missing)
        why = f"{later[0]} and later stages need {named}, not found on PATH"
    else:
        why = f"the tools for {later[0]} and later stages are installed, but dlcore does not drive them yet"
    raise ToolchainMissingError(f"{lowering.kernel} for {target}: lowered as far as ttir; {why}", lowering, missing)


# --------------------------------------------------------------------------------------------
# the launches `dlcore lower` compiles
# --------------------------------------------------------------------------------------------

#: nominal devices for targets that need not be present: what launch passes size grids for
NOMINAL = {
    ("cuda", "75"): ("NVIDIA T4", 40),
    ("cuda", "80"): ("NVIDIA A100", 108),
    ("cuda", "86"): ("NVIDIA A40", 84),
    ("cuda", "89"): ("NVIDIA L40S", 142),
    ("cuda", "90"): ("NVIDIA H100 SXM", 132),
    ("cuda", "100"): ("NVIDIA B200", 148),
    ("cuda", "120"): ("NVIDIA RTX 5090", 170),
}
#: per compute capability: opt-in shared memory per block (bytes), registers and threads per
#: multiprocessor, as the CUDA programming guide's table of compute capabilities gives them
CUDA_LIMITS = {
    "75": (64 * 1024, 65536, 1024),
    "80": (163 * 1024, 65536, 2048),
    "86": (99 * 1024, 65536, 1536),
    "89": (99 * 1024, 65536, 1536),
    "90": (227 * 1024, 65536, 2048),
    "100": (227 * 1024, 65536, 2048),
    "120": (99 * 1024, 65536, 1536),
}
#: vendor and core count of each backend's targets when the arch is not listed in NOMINAL
NOMINAL_BACKENDS = {"cuda": ("nvidia", 1), "npu": ("huawei", 24), "mlu": ("cambricon", 8)}


def target_profile(target: str) -> DeviceProfile:
    """A nominal :class:`DeviceProfile` for ``target`` (no device is asked): the installed backend's
    (:meth:`~dlcore.declarations.backend.Backend.target_profile`), else from the tables above."""
    from dlcore.plugins.registry import registry

    backend, arch = parse_target(target)
    owner = registry().backends.get(backend)
    own = owner.target_profile(target) if owner is not None else None
    if own is not None:
        return own
    vendor, cores = NOMINAL_BACKENDS.get(backend, (backend, 1))
    name, cores = NOMINAL.get((backend, arch.removeprefix("sm_")), (f"{target} (nominal)", cores))
    if backend != "cuda":
        return DeviceProfile(backend=backend, vendor=vendor, name=name, arch=arch, cores=cores)
    capability = arch.removeprefix("sm_")
    shared, registers, threads = CUDA_LIMITS.get(capability, (0, 0, 0))
    return DeviceProfile(backend=backend, vendor=vendor, name=name, arch=f"sm_{capability}", cores=cores,
                         shared_memory_per_program=shared, registers_per_core=registers, threads_per_core=threads,
                         warp_size=32)


@dataclass
class Launch:
    """One kernel launch of one op's plan, ready to lower."""

    op: str
    impl: str
    dtype: torch.dtype
    call: KernelCall
    #: the kernel the plan launched, before ast and launch passes
    original: Any
    #: what the ast / launch passes did, or why they declined
    notes: list[str] = dataclasses.field(default_factory=list)
    #: a launch of the implementation's backward plan
    backward: bool = False
    #: the ``example_paths`` entry whose plan first launched this form of the kernel ("": the op's
    #: example inputs did)
    label: str = ""
    #: which form of the kernel this is among those the same plan launched first (1, 2, ...)
    form: int = 1

    @property
    def path(self) -> str:
        """The label and, for a plan's second form of a kernel on, which form: ``prefill, form 2``."""
        return ", ".join(([self.label] if self.label else []) + ([f"form {self.form}"] if self.form > 1 else []))

    @property
    def name(self) -> str:
        return f"{self.op}.{self.impl}" + (f" [{self.path}]" if self.path else "") + (
            " backward" if self.backward else "")


def launches(reg: Registry, selector: str | None, dtype: torch.dtype | None, sizes: dict[str, int],
             profile: DeviceProfile, passes: Pipeline) -> tuple[list[Launch], list[str]]:
    """The launches to lower, and a note for each kernel or implementation that has none: each
    form of a kernel (:func:`specialization`) once per implementation (and once for its backward),
    from the plans of the example inputs and of each of the op's ``example_paths``
    (:func:`example_sizes`); a form first launched by a path is labelled with its name.

    :param selector: an op name, ``op.impl``, or a kernel's function name; ``None``: every op.
    :param dtype: the example inputs' dtype; ``None``: float16, or the first dtype an
        implementation takes where it takes no float16.
    """
    from dlcore.compiler import source
    from dlcore.compiler.rewrite import apply_launch_passes
    from dlcore.declarations.signature import make_signature

    found: list[Launch] = []
    skipped: list[str] = []
    matched = False
    meta = torch.device("meta")
    for name in sorted(reg.ops):
        op = reg.ops[name]
        for impl in reg.implementations_of(name):
            if impl.kind != "triton":
                continue
            names = [source.kernel_name(k) for k in impl.kernels]
            wanted = selector is None or selector in (name, f"{name}.{impl.name}") or selector in names
            if not wanted:
                continue
            matched = True
            if dtype is None:  # float16, or the implementation's own where it takes no float16
                impl_dtype = torch.float16 if impl.dtypes is None or torch.float16 in impl.dtypes else impl.dtypes[0]
            elif impl.dtypes is not None and dtype not in impl.dtypes:
                skipped.append(f"{name}.{impl.name}: no {str(dtype).removeprefix('torch.')} support")
                continue
            else:
                impl_dtype = dtype
            if op.example is None:
                skipped.append(f"{name}.{impl.name}: the op declares no example inputs to build a plan from")
                continue
            plans = []
            for label, path in example_sizes(op, sizes):
                args = op.example_inputs(path, impl_dtype, meta)
                config = impl.default_config(make_signature(op, args, meta), profile)
                with planning_for(profile):  # the plans size their grids for the target, not for meta
                    plans.append((label, False, impl.plan(args, config, profile)))
                    if getattr(impl, "backward_plan", None) is not None:
                        try:
                            plans.append((label, True, impl.backward_plan(args, config, profile)))
                        except InvalidInputError as exc:  # a forward-only form (fused_moe's fp8 weights)
                            note = f"{name}.{impl.name} backward: {exc}"
                            if note not in skipped:  # one note, whichever of the paths refused
                                skipped.append(note)
            launched, lowered_once = set(), set()
            forms = Counter()  # per (label, backward, kernel): the forms found so far
            for label, backward, plan in plans:
                lowered = apply_launch_passes(plan, profile, passes)
                for before, after in zip(plan.calls, lowered.calls):
                    kernel = source.kernel_name(before.kernel)
                    launched.add(kernel)
                    form = (backward, kernel, specialization(after))
                    if (selector in names and selector != kernel) or form in lowered_once:
                        continue
                    lowered_once.add(form)
                    # a plan that launches one kernel in two forms (fused_moe's up and down GEMMs): a row each
                    forms[label, backward, kernel] += 1
                    notes = _notes(before, after, passes)
                    found.append(Launch(name, impl.name, impl_dtype, after, before.kernel, notes, backward, label,
                                        forms[label, backward, kernel]))
            for kernel in names:
                if kernel not in launched and (selector in (None, name, f"{name}.{impl.name}", kernel)):
                    skipped.append(f"{name}.{impl.name}/{kernel}: not launched by the plan for these inputs")
    if selector is not None and not matched:
        raise LoweringError(f"{selector!r} is no op, op.implementation or Triton kernel name; "
                            f"ops: {', '.join(sorted(reg.ops)) or 'none'}")
    return found, skipped


def example_sizes(op: Op, sizes: dict[str, int]) -> list[tuple[str, dict[str, int]]]:
    """The sizes to plan ``op`` at, each with its label: ``sizes`` where any are given, else its
    example sizes ("") and each of its ``example_paths`` (the inputs that take its other paths,
    labelled by their names), in that order."""
    if sizes:
        return [("", sizes)]
    return [("", {}), *op.example_paths.items()]


def specialization(call: KernelCall) -> tuple:
    """What tells two launches of one kernel apart once compiled: its constexprs and launch options
    (``num_warps``...), the dtypes of its tensors and which of its pointers are None. Two paths of
    an op that launch a kernel alike share one lowering; where they differ (softmax's looped rows,
    another block size), each is lowered. Sizes and strides are left out."""
    def kind(value):
        if isinstance(value, torch.Tensor):
            return str(value.dtype)
        # a tl.constexpr, a dtype: by its repr, which names its value
        return value if isinstance(value, (bool, int, float, str, type(None))) else repr(value)
    return (tuple(kind(a) for a in call.args if a is None or isinstance(a, torch.Tensor)),
            tuple(sorted((k, kind(v)) for k, v in call.kwargs.items())))


def _notes(before: KernelCall, after: KernelCall, passes: Pipeline) -> list[str]:
    from dlcore.compiler import folding, source

    notes = []
    if after.kernel is not before.kernel or after.grid != before.grid:
        notes.append(f"{source.kernel_name(before.kernel)} grid {before.grid} -> "
                     f"{source.kernel_name(after.kernel)} grid {after.grid}")
    elif folding.NAME in passes.names:
        reason = folding.check(before.kernel) or "the grid fits on the device at once"
        notes.append(f"{folding.NAME} left it as is: {reason}")
    return notes
