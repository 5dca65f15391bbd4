"""The one error hierarchy of dlcore.

Every message says what was given, what was expected, and what to do next.
"""

from __future__ import annotations


class DlcoreError(Exception):
    """Base of every error dlcore raises on purpose."""


class UnknownOpError(DlcoreError, LookupError):
    """No op of that name is registered."""

    def __init__(self, name: str, known: list[str], closest: list[str]):
        self.name = name
        self.closest = closest
        hint = f" Did you mean {', '.join(repr(c) for c in closest)}?" if closest else ""
        listing = ", ".join(sorted(known)) or "none (is dlblas-kernels installed?)"
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
