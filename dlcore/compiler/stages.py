"""dlcore's hook into Triton's compiler stages.

Triton (>= 3.6) hands every compile's stage functions (``ttir``, ``ttgir``, ``llir``, ``ptx``,
``cubin``, ...) to one callable, ``triton.knobs.runtime.add_stages_inspection_hook``, which may
wrap or replace them. dlcore installs one :class:`StagesHook` there that:

- chains to the hook installed before it, never replacing it: that hook runs first, and dlcore's
  passes wrap the stages it left;
- runs the IR passes of the pipeline on each stage's output (see :mod:`dlcore.compiler.passes`);
- while lowering (:func:`capturing`), records each stage's output and time, and can stop the
  compile after a stage;
- keys Triton's compile cache by the passes that change IR, so that a binary compiled without
  them is never reused: from Triton 3.7, through the hook's no-argument call, which returns a
  (key, hash) pair; on Triton 3.6, which has no such call, by salting the key Triton's cache
  manager is created with;
- while a pass that only reads IR is on (the IR dump), turns on ``TRITON_ALWAYS_COMPILE`` so no
  compile is skipped by the cache.

Nothing is installed until a pipeline with IR passes is used (:func:`ensure_installed`).
"""

from __future__ import annotations

import base64
import contextlib
import contextvars
import hashlib
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from dlcore.compiler.passes import Pass, Pipeline, default_pipeline
from dlcore.errors import PassError

#: the file extension of each stage's output (``python``: the kernel's source after ast passes)
EXTENSIONS = {"python": "py", "source": "mlir", "ttir": "ttir", "ttgir": "ttgir", "llir": "ll", "ptx": "ptx",
              "cubin": "cubin", "amdgcn": "amdgcn", "hsaco": "hsaco", "linalg": "mlir", "hivm": "mlir"}
#: Triton's target backend names -> the dlcore backend that owns them
BACKENDS = {"cuda": "cuda", "hip": "cuda"}


def extension(stage: str, ir: Any) -> str:
    return EXTENSIONS.get(stage, "bin" if isinstance(ir, bytes) else "txt")


def ir_text(ir: Any) -> str | bytes:
    """A stage's output as text (binaries stay bytes)."""
    return ir if isinstance(ir, (str, bytes)) else str(ir)


# --------------------------------------------------------------------------------------------
# what an IR pass sees
# --------------------------------------------------------------------------------------------


@dataclass
class Compile:
    """One Triton compile, as the hook saw it: shared by every stage and pass of that compile."""

    backend: str
    target: Any
    options: Any
    stages: tuple[str, ...]
    kernel: str = ""
    #: free space for passes, per compile (e.g. the dump pass keeps its folder here)
    scratch: dict[str, Any] = field(default_factory=dict)

    def name_from(self, ir: Any, metadata: dict) -> str:
        if not self.kernel:
            self.kernel = metadata.get("name") or _function_name(ir) or "kernel"
        return self.kernel


@dataclass
class StageContext:
    """What an IR pass is given beside the module: which stage ran, of which compile."""

    stage: str
    index: int  # 1-based position of the stage in this compile's pipeline
    compile: Compile
    metadata: dict

    @property
    def kernel(self) -> str:
        return self.compile.kernel

    @property
    def backend(self) -> str:
        return self.compile.backend

    @property
    def hash(self) -> str:
        """Triton's hash of this compile (its cache key)."""
        return str(self.metadata.get("hash", ""))


_FUNCTION = re.compile(r"(?:tt\.func|llvm\.func|define)[^@]*@\"?([\w.$]+)")


def _function_name(ir: Any) -> str:
    if isinstance(ir, bytes):
        return ""
    found = _FUNCTION.search(str(ir))
    return found.group(1) if found else ""


# --------------------------------------------------------------------------------------------
# recording a lowering
# --------------------------------------------------------------------------------------------


@dataclass
class StageOutput:
    """What one stage made, or (``after_pass`` set) the IR after one pass within that stage: a
    backend whose stage is a sequence of passes (npu's linalg) records each, so a dump shows the IR
    before and after every pass."""

    stage: str
    ir: str | bytes
    seconds: float
    after_pass: str = ""

    @property
    def extension(self) -> str:
        return extension(self.stage, self.ir)


@dataclass
class Capture:
    """Every stage's output during one compile; optionally stop after ``stop_after``."""

    stop_after: str | None = None
    outputs: list[StageOutput] = field(default_factory=list)
    planned: tuple[str, ...] = ()


class StopCompile(Exception):
    """Raised inside Triton's compile to end it after the stage a lowering asked for."""


_capture: contextvars.ContextVar[Capture | None] = contextvars.ContextVar("dlcore_capture", default=None)
_pipeline: contextvars.ContextVar[Pipeline | None] = contextvars.ContextVar("dlcore_pipeline", default=None)


@contextlib.contextmanager
def capturing(passes: Pipeline, stop_after: str | None = None) -> Iterator[Capture]:
    """Within this block, compiles in this thread run ``passes``' IR passes and are recorded."""
    capture = Capture(stop_after=stop_after)
    token_c, token_p = _capture.set(capture), _pipeline.set(passes)
    installed_here = _state.hook is None
    install()
    try:
        yield capture
    finally:
        _capture.reset(token_c)
        _pipeline.reset(token_p)
        if installed_here:
            uninstall()


# --------------------------------------------------------------------------------------------
# the hook
# --------------------------------------------------------------------------------------------


class StagesHook:
    """The callable dlcore installs as ``triton.knobs.runtime.add_stages_inspection_hook``."""

    def __init__(self, previous: Callable[..., Any] | None):
        self.previous = previous

    def __call__(self, backend=None, stages=None, options=None, language=None, capability=None):
        if stages is None and options is None and language is None and capability is None:
            return self.key()
        if self.previous is not None:
            self.previous(backend, stages, options, language, capability)
        _wrap_stages(backend, stages, options)
        return None

    def key(self) -> tuple[str, str]:
        """(key, hash) for Triton's cache: the previous hook's, extended by dlcore's IR passes."""
        own = current_ir_key()
        if self.previous is None:
            return own, _sha(own) if own else ""
        previous_key, previous_hash = self.previous()
        if not own:
            return previous_key, previous_hash
        return previous_key + own, _sha(str(previous_hash) + own)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _dlcore_backend(triton_backend: Any) -> str:
    name = getattr(getattr(triton_backend, "target", None), "backend", "") or ""
    return BACKENDS.get(name, name)


def _wrap_stages(backend: Any, stages: dict, options: Any) -> None:
    name = _dlcore_backend(backend)
    passes = _pipeline.get() or default_pipeline(name)
    capture = _capture.get()
    if capture is not None:
        capture.planned = tuple(stages)
    compile_ = Compile(name, getattr(backend, "target", None), options, tuple(stages))
    for index, (stage, function) in enumerate(list(stages.items()), start=1):
        stage_passes = passes.at(stage)
        if stage_passes or capture is not None:
            stages[stage] = _wrapped(function, stage, index, stage_passes, compile_, capture)


def _wrapped(function: Callable, stage: str, index: int, passes: tuple[Pass, ...], compile_: Compile,
             capture: Capture | None) -> Callable:
    def run_stage(src: Any, metadata: dict) -> Any:
        if capture is not None:
            if capture.stop_after is not None and any(o.stage == capture.stop_after for o in capture.outputs):
                raise StopCompile(stage)
            if not capture.outputs:
                capture.outputs.append(StageOutput("source", ir_text(src), 0.0))
        start = time.perf_counter()
        module = function(src, metadata)
        compile_.name_from(module, metadata)
        for p in passes:
            context = StageContext(stage, index, compile_, metadata)
            try:
                out = p.run(module, context)
            except Exception as exc:
                raise PassError(f"IR pass {p.name!r} failed after stage {stage} of {compile_.kernel}: {exc}") from exc
            if out is not None:
                module = out
        if capture is not None:
            capture.outputs.append(StageOutput(stage, ir_text(module), time.perf_counter() - start))
        return module

    return run_stage


# --------------------------------------------------------------------------------------------
# installing
# --------------------------------------------------------------------------------------------


def key_call_supported() -> bool:
    """Whether Triton asks the hook for a (key, hash) pair (Triton >= 3.7)."""
    import triton

    major, minor = (int(re.match(r"\d+", part).group()) for part in triton.__version__.split(".")[:2])
    return (major, minor) >= (3, 7)


def current_ir_key() -> str:
    """What dlcore's IR passes add to the compile cache key right now."""
    passes = _pipeline.get()
    if passes is not None:
        return passes.ir_key
    return _process_ir_key()


def _process_pipelines() -> list[Pipeline]:
    from dlcore.plugins.registry import registry

    return [default_pipeline(backend) for backend in registry().backends]


def _process_ir_key() -> str:
    keys = {p.fingerprint for pipe in _process_pipelines() for p in pipe.passes if p.is_ir and p.changes_ir}
    return ",".join(sorted(keys))


def _inspecting() -> bool:
    """Whether a pass that only reads IR is on (it must see every compile, cached or not)."""
    return any(p.is_ir and not p.changes_ir for pipe in _process_pipelines() for p in pipe.passes)


@dataclass
class _State:
    hook: StagesHook | None = None
    restore: list[Callable[[], None]] = field(default_factory=list)


_state = _State()
_lock = threading.Lock()


def installed() -> StagesHook | None:
    return _state.hook


def ensure_installed() -> None:
    """Install the hook once per process (cheap when it already is)."""
    if _state.hook is None:
        install()


def install() -> StagesHook:
    """Install dlcore's hook, chained to the one already there; idempotent."""
    from triton import knobs

    with _lock:
        current = knobs.runtime.add_stages_inspection_hook
        if isinstance(current, StagesHook):
            _state.hook = current
            return current
        hook = StagesHook(previous=current)
        knobs.runtime.add_stages_inspection_hook = hook
        _state.hook = hook
        _state.restore = [lambda: _put_back_hook(hook)]
        if not key_call_supported():
            _state.restore.append(_salt_cache_manager())
        if _inspecting():
            _state.restore.append(_always_compile())
        return hook


def uninstall() -> None:
    """Remove dlcore's hook (the previous one is put back) and undo what installing changed."""
    with _lock:
        for undo in reversed(_state.restore):
            undo()
        _state.hook = None
        _state.restore = []


def _put_back_hook(hook: StagesHook) -> None:
    from triton import knobs

    if knobs.runtime.add_stages_inspection_hook is hook:
        knobs.runtime.add_stages_inspection_hook = hook.previous


def _always_compile() -> Callable[[], None]:
    from triton import knobs

    variable = "TRITON_ALWAYS_COMPILE"
    had, env = "always_compile" in knobs.compilation.__dict__, os.environ.get(variable)
    before = knobs.compilation.__dict__.get("always_compile")
    knobs.compilation.always_compile = True

    def undo() -> None:
        if had:
            knobs.compilation.__dict__["always_compile"] = before
        else:
            knobs.compilation.__dict__.pop("always_compile", None)
        if env is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = env

    return undo


def _salt_cache_manager() -> Callable[[], None]:
    """Triton 3.6: make the cache manager's key depend on the IR passes (its compile key cannot)."""
    from triton import knobs
    from triton.runtime.cache import FileCacheManager

    had = "manager_class" in knobs.cache.__dict__
    before = knobs.cache.__dict__.get("manager_class")
    base = knobs.cache.manager_class or FileCacheManager

    class SaltedCacheManager(base):  # type: ignore[misc, valid-type]
        def __init__(self, key, override=False, dump=False):
            salt = current_ir_key()
            if salt and not override and not dump:
                digest = hashlib.sha256(f"{key}-{salt}".encode()).digest()
                key = base64.b32encode(digest).decode().rstrip("=")
            super().__init__(key, override=override, dump=dump)

    knobs.cache.__dict__["manager_class"] = SaltedCacheManager

    def undo() -> None:
        if had:
            knobs.cache.__dict__["manager_class"] = before
        else:
            knobs.cache.__dict__.pop("manager_class", None)

    return undo
