"""A kernel's Python source as a syntax tree, and new kernels built from rewritten trees.

``ast``-stage passes and grid folding rewrite a ``@triton.jit`` function's syntax tree, never its
text. :func:`rebuild` turns the rewritten tree into a new kernel that keeps the original's module
globals (the same ``tl``, helpers and constants) and its ``@triton.jit`` options; the new source is
registered with :mod:`linecache`, so Triton, the interpreter and tracebacks can read it like any
other source.
"""

from __future__ import annotations
import __future__

import ast
import hashlib
import inspect
import linecache
import textwrap
import types
from typing import Any

#: ``@triton.jit`` options carried over to a rebuilt kernel
JIT_OPTIONS = ("do_not_specialize", "do_not_specialize_on_alignment", "debug", "noinline")


def is_kernel(obj: Any) -> bool:
    """True for a ``@triton.jit`` function, compiled (``JITFunction``) or interpreted."""
    return type(obj).__name__ in ("JITFunction", "InterpretedFunction") and callable(getattr(obj, "fn", None))


def python_function(kernel: Any) -> types.FunctionType:
    """The plain Python function a kernel was made from."""
    return kernel.fn


def kernel_name(kernel: Any) -> str:
    return python_function(kernel).__name__


def syntax_tree(kernel: Any) -> ast.FunctionDef:
    """The kernel's ``def`` as a syntax tree, decorators removed (a fresh tree on every call)."""
    source = textwrap.dedent(inspect.getsource(python_function(kernel)))
    tree = ast.parse(source)
    function = next(node for node in tree.body if isinstance(node, ast.FunctionDef))
    function.decorator_list = []
    return function


def jit_options(kernel: Any) -> dict[str, Any]:
    """The ``@triton.jit`` options ``kernel`` was created with."""
    if type(kernel).__name__ == "InterpretedFunction":
        saved = getattr(kernel, "kwargs", {})
        return {k: saved[k] for k in JIT_OPTIONS if saved.get(k) is not None}
    return {k: getattr(kernel, k) for k in JIT_OPTIONS if getattr(kernel, k, None)}


def rebuild(kernel: Any, tree: ast.FunctionDef, tag: str) -> Any:
    """A new ``@triton.jit`` kernel from ``tree`` (a rewrite of ``kernel``'s ``def``).

    The function is compiled under a file name of its own (``<dlcore:module.name:tag:hash>``) whose
    text is the unparsed tree, and bound to ``kernel``'s module globals.
    """
    import triton

    original = python_function(kernel)
    if original.__closure__:
        raise ValueError(f"{original.__qualname__} closes over local variables; only module-level kernels rebuild")
    module = ast.fix_missing_locations(ast.Module(body=[tree], type_ignores=[]))
    text = ast.unparse(module) + "\n"
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    filename = f"<dlcore:{original.__module__}.{tree.name}:{tag}:{digest}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)
    # Annotations (tl.constexpr) must be what the original's were: strings under `from __future__ import annotations`.
    flags = original.__code__.co_flags & __future__.annotations.compiler_flag
    code = compile(text, filename, "exec", flags=flags, dont_inherit=True)
    # Running the module code in a scratch namespace evaluates the parameter defaults; the function
    # is then re-created on the kernel's own globals, which the scratch namespace must not replace.
    scratch = dict(original.__globals__)
    exec(code, scratch)  # noqa: S102 - our own unparsed tree, not user text
    made = scratch[tree.name]
    function = types.FunctionType(made.__code__, original.__globals__, tree.name, made.__defaults__)
    function.__kwdefaults__ = made.__kwdefaults__
    function.__annotations__ = made.__annotations__
    function.__qualname__ = tree.name
    function.__doc__ = made.__doc__
    return triton.jit(function, **jit_options(kernel))


def source_of(kernel: Any) -> str:
    """The kernel's ``def`` as text (for a rebuilt kernel: the rewritten source)."""
    return textwrap.dedent(inspect.getsource(python_function(kernel)))
