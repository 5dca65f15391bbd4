"""The Triton internals dlcore's warm launch path relies on, checked once.

Checked at the first launch of a compiled kernel (:func:`checked`): ``triton.knobs.runtime``
(launch hooks, stages hook, JIT cache hooks), ``triton.knobs.compilation`` and ``triton.knobs.cache``;
``triton.runtime.driver.active`` (current device, stream, target; ``launcher_cls.__call__`` taking
grid, stream and function first); ``JITFunction.run`` launching as ``kernel.run(grid_0, grid_1,
grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata, launch_enter_hook,
launch_exit_hook, *args)``; a JITFunction's ``params`` (``is_constexpr``), ``arg_names``, ``fn``,
``pre_run_hooks``, ``debug`` and ``cache_key`` (:func:`kernel_missing`); ``CompiledKernel(src,
metadata_group, hash)`` with ``run``, ``function``, ``packed_metadata``, ``launch_metadata``, ``src``,
``hash`` and ``name``; ``ASTSource(fn, signature, constexprs, attrs)``;
``triton.runtime.cache.get_cache_manager`` and ``get_cache_invalidating_env_vars``. When any is
missing or different (another Triton), one warning names what, and every launch goes through
``kernel[grid](...)``: slower, never wrong.

Read against Triton 3.6.0 and 3.9.0: all of the above exist in both, with the same signatures. One
difference: in 3.9 the launch hooks are ``HookChain`` objects, never None; a chain with no calls
counts as no hook (:mod:`dlcore.runtime.launch`).
"""

from __future__ import annotations

import inspect
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

#: how JITFunction.run launches what it compiled (whitespace removed): the call
#: :func:`dlcore.runtime.launch.run_compiled` repeats
_TRITON_LAUNCH = ("kernel.run(grid_0,grid_1,grid_2,stream,kernel.function,kernel.packed_metadata,launch_metadata,"
                  "knobs.runtime.launch_enter_hook,knobs.runtime.launch_exit_hook,*bound_args.values())")


@dataclass
class Internals:
    """What the warm path takes from Triton; ``missing`` names what was not found (then nothing else
    of it is used, and every launch goes through ``kernel[grid](...)``)."""

    missing: list[str] = field(default_factory=list)
    runtime: Any = None
    compilation: Any = None
    cache: Any = None
    driver: Any = None
    compiled_kernel: Any = None
    ast_source: Any = None
    cache_manager: Any = None
    env_vars: Any = None

    @property
    def usable(self) -> bool:
        return not self.missing


#: what :func:`checked` found; None until the first launch asks
found: Internals | None = None


def _has(obj: Any, names: tuple[str, ...], label: str, missing: list[str]) -> None:
    missing.extend(f"{label}.{n}" for n in names if not hasattr(obj, n))


def _parameters(fn: Any) -> list[str]:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def check() -> Internals:
    """Look for every Triton internal the warm path relies on (see the module doc)."""
    result = Internals()
    missing = result.missing
    try:
        from triton import knobs

        result.runtime, result.compilation, result.cache = knobs.runtime, knobs.compilation, knobs.cache
        _has(result.runtime, ("launch_enter_hook", "launch_exit_hook", "add_stages_inspection_hook", "jit_cache_hook",
                              "debug"), "triton.knobs.runtime", missing)
        _has(result.compilation, ("always_compile", "override", "dump_ir", "instrumentation_mode"),
             "triton.knobs.compilation", missing)
        _has(result.cache, ("dir",), "triton.knobs.cache", missing)
    except (ImportError, AttributeError):
        missing.append("triton.knobs")
    try:
        from triton.runtime import driver

        result.driver = driver.active
        _has(result.driver, ("get_current_device", "get_current_stream", "get_current_target", "launcher_cls"),
             "triton.runtime.driver.active", missing)
        launcher = getattr(result.driver, "launcher_cls", None)
        if launcher is not None and _parameters(launcher.__call__)[1:6] != ["gridX", "gridY", "gridZ", "stream",
                                                                             "function"]:
            missing.append("launcher_cls.__call__(self, gridX, gridY, gridZ, stream, function, ...)")
    except (ImportError, AttributeError, RuntimeError):
        missing.append("triton.runtime.driver.active")
    try:
        from triton.runtime.jit import JITFunction

        source = re.sub(r"\s+", "", inspect.getsource(JITFunction.run))
        if _TRITON_LAUNCH not in source:
            missing.append("JITFunction.run launching through kernel.run(grid..., packed_metadata, hooks, *args)")
    except (ImportError, AttributeError, OSError, TypeError):
        missing.append("triton.runtime.jit.JITFunction.run")
    try:
        from triton.compiler.compiler import ASTSource, CompiledKernel

        result.compiled_kernel, result.ast_source = CompiledKernel, ASTSource
        _has(CompiledKernel, ("run", "launch_metadata"), "CompiledKernel", missing)
        if _parameters(CompiledKernel.__init__) != ["self", "src", "metadata_group", "hash"]:
            missing.append("CompiledKernel(src, metadata_group, hash)")
        if _parameters(ASTSource.__init__)[:5] != ["self", "fn", "signature", "constexprs", "attrs"]:
            missing.append("ASTSource(fn, signature, constexprs, attrs)")
    except ImportError:
        missing.append("triton.compiler.compiler.CompiledKernel")
    try:
        from triton._C.libtriton import get_cache_invalidating_env_vars
        from triton.runtime.cache import get_cache_manager

        result.cache_manager, result.env_vars = get_cache_manager, get_cache_invalidating_env_vars
    except ImportError:
        missing.append("triton.runtime.cache.get_cache_manager")
    return result


def checked() -> Internals:
    """The checked internals (checked at the first call); warns once when any is missing."""
    global found
    if found is None:
        found = check()
        if found.missing:
            import triton

            warnings.warn(f"dlcore launches every Triton kernel through kernel[grid](...): Triton {triton.__version__} "
                          f"lacks what its warm path relies on: {', '.join(found.missing)}", stacklevel=3)
    return found


def kernel_missing(kernel: Any) -> list[str]:
    """What the JIT function ``kernel`` lacks of what the warm path reads from it."""
    names = ("params", "arg_names", "fn", "pre_run_hooks", "debug", "cache_key")
    missing = [f"JITFunction.{n}" for n in names if not hasattr(kernel, n)]
    if not missing and not all(hasattr(p, "is_constexpr") for p in kernel.params):
        missing.append("JITFunction.params[i].is_constexpr")
    return missing
