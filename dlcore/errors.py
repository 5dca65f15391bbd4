"""The one error hierarchy of dlcore.

Every message says what was given, what was expected, and what to do next.
"""

from __future__ import annotations

from typing import Any


class DlcoreError(Exception):
    """Base of every error dlcore raises on purpose."""


class UnknownOpError(DlcoreError, LookupError):
    """No op of that name is registered."""

    def __init__(self, name: str, known: list[str], closest: list[str], disabled: str = ""):
        """:param closest: near spellings among ``known``; a name that differs only in case
            (``RMS_NORM``) is put first whether given or not.
        :param disabled: when the op's plugin is installed but not loaded, which and why."""
        self.name = name
        same = [k for k in known if k.lower() == name.lower()]
        self.closest = closest = same + [c for c in closest if c not in same]
        self.disabled = disabled
        if disabled:
            super().__init__(f"op {name!r} is provided by {disabled}. Registered ops: {', '.join(sorted(known))}.")
            return
        hint = f" Did you mean {', '.join(repr(c) for c in closest)}?" if closest else ""
        listing = ", ".join(sorted(known)) or "none (is dlblas-kernels installed? `dlcore plugins` lists what loaded)"
        super().__init__(f"unknown op {name!r}.{hint} Registered ops: {listing}.")


class InvalidInputError(DlcoreError, ValueError):
    """An argument has the wrong dtype, rank, shape, device or strides. Nothing was launched."""

    def __init__(self, op: str, arg: str, got: str, expected: str, hint: str = ""):
        self.op = op
        self.arg = arg
        self.got = got
        self.expected = expected
        message = f"{op}: {arg} {got}; {op} accepts {expected}"
        if hint:
            message += f". {hint}"
        super().__init__(message)


class InvalidCallError(DlcoreError, TypeError):
    """``get_op`` (or another entry point) was given something of the wrong kind in place of an op's
    name or its arguments; the message names the parameter."""


class NoKernelError(DlcoreError):
    """Every implementation of the op declined the inputs."""

    def __init__(self, op: str, signature: str, reasons: dict[str, str]):
        self.op = op
        self.reasons = dict(reasons)
        lines = "\n".join(f"  - {impl}: {why}" for impl, why in reasons.items()) or "  (no implementation)"
        super().__init__(f"no implementation of {op!r} accepts {signature}:\n{lines}")


class BackendUnavailableError(DlcoreError):
    """No loaded backend can run on the inputs' device."""


class PluginLoadError(DlcoreError):
    """A plugin that the user asked for by name could not be loaded."""


class UnknownImplementationError(DlcoreError, LookupError):
    """An implementation asked for by name does not exist for the op."""


class UnknownStrategyError(DlcoreError, LookupError):
    """A search strategy asked for by name is not registered."""


class SearchSpaceError(DlcoreError, ValueError):
    """A search space, or a config checked against one, is malformed."""


class PluginConflictError(DlcoreError, ValueError):
    """Two plugins provide the same thing (an op, an implementation, a backend's device type, a
    strategy); the later one is dropped."""


class DeclarationError(DlcoreError, ValueError):
    """An op, a kernel or a search space is declared wrongly (a bug in the plugin that declares it),
    or something it does not declare is asked of it (example inputs, say)."""


class CacheFileError(DlcoreError, ValueError):
    """A file handed to the cache (``dlcore cache import``) is not a dlcore cache export."""


class InvalidOptionError(DlcoreError, ValueError):
    """An option (an argument of ``get_op``, ``tune`` or a search, or the variable standing for it) has
    a value dlcore does not know."""


class WrongResultError(DlcoreError):
    """A config computed a result that does not match the op's reference."""


class NoBackwardError(DlcoreError):
    """A training call (inputs that require grad) met an implementation whose outputs carry no
    gradient: it computes the forward only."""


class NoDoubleBackwardError(NoBackwardError):
    """A gradient of gradients (``create_graph=True``, then a backward through the gradients it gave)
    met a kernel whose backward gives first-order gradients only; the message names the ops that do."""


class PassError(DlcoreError):
    """A compiler pass is malformed, unknown, or failed while running."""


class FoldingRefused(DlcoreError):
    """A kernel or launch that grid folding cannot rewrite safely; the message says why."""


class LoweringError(DlcoreError):
    """A kernel could not be lowered for a target; ``partial`` holds the stages it reached, if any
    (a :class:`dlcore.compiler.lowering.Lowering`)."""

    def __init__(self, message: str, partial: Any = None):
        super().__init__(message)
        self.partial = partial


class ToolchainMissingError(LoweringError):
    """Lowering stopped where a compiler the target needs is not installed; the message names it."""

    def __init__(self, message: str, partial: Any = None, missing: tuple[str, ...] = ()):
        super().__init__(message, partial)
        #: the executables not found
        self.missing = missing


class ToolchainBrokenError(ToolchainMissingError):
    """A compiler the target needs was found but does not run, or answers as another program would;
    the message says where it was found, why it is unusable, and how to replace it."""


class ToolFetchError(DlcoreError):
    """``dlcore toolchain fetch`` could not put a tool in the tool cache (a download failed, an
    archive's hash is not the pinned one, the archive lacks the tool); nothing was left half-written."""
