"""Running one Ascend tool: the command, its exit status and output, and the error that names it.

Every stage of the npu pipeline runs an external executable (``triton-adapter-opt``,
``bishengir-compile``). None of them is trusted: a failure is a
:class:`~dlcore.errors.LoweringError` naming the tool, the stage and the end of the tool's
stderr; so is an exit status of 0 with nothing usable written.

Some failures come and go: run again on the same input, the tool passes. Both tools die of a
signal now and then (triton-adapter-opt 3.2: SIGABRT in ``--triton-to-unstructure`` on ffn's GEMM once
in 150 runs, SIGSEGV on flash attention's folded decode kernel; another run of the same input
passes), and bishengir-compile prints messages known to come and go. Whether a run fails follows
the process's memory addresses (with address randomisation off, one input always fails or always
passes), so such a run is retried, up to :data:`ATTEMPTS` runs (:func:`comes_and_goes`); every other
failure stops at once.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from dlcore.api import Found, LoweringError

_MODULE = re.compile(r"^\s*module\b", re.MULTILINE)
# a crashing LLVM tool prints its stack after the message: the frames say nothing to a user
_STACK_FRAME = re.compile(r"^\s*#\d+ 0x[0-9a-f]+")
#: how much of a tool's stderr an error quotes (its last lines hold the diagnosis)
TAIL_LINES = 12
#: the signals a crashing tool dies of: a bad memory access, a failed assertion
CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT})
#: runs of one input at most while its failures come and go: at a failure rate of a third, eight
#: runs fail about one lowering in 5000
ATTEMPTS = 8
#: seconds a tool run may take before it is stopped and the lowering fails (``DLC_ASCEND_TOOL_TIMEOUT``
#: overrides it): every kernel of dlblas-kernels lowers in a few seconds a stage, but bishengir-compile
#: 1.2 has run for over ten minutes on a tile at the edge of the unified buffer
TIMEOUT_VARIABLE = "DLC_ASCEND_TOOL_TIMEOUT"
DEFAULT_TIMEOUT = 300.0


def timeout() -> float:
    """The seconds a tool run may take: ``DLC_ASCEND_TOOL_TIMEOUT``, else :data:`DEFAULT_TIMEOUT`.

    :raises LoweringError: the variable is not a positive number.
    """
    text = os.environ.get(TIMEOUT_VARIABLE, "").strip()
    if not text:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise LoweringError(f"{TIMEOUT_VARIABLE}={text!r} is not a positive number of seconds")
    return seconds


@dataclass(frozen=True)
class ToolRun:
    """One finished run of a tool."""

    tool: str
    stage: str
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    #: what within the stage it ran for (an adapter pass), or empty
    step: str = ""

    @property
    def where(self) -> str:
        return f"the {self.stage} stage ({self.step})" if self.step else f"the {self.stage} stage"

    def tail(self) -> str:
        """The last lines of stderr (of stdout when stderr is empty), indented for an error message."""
        text = (self.stderr.strip() or self.stdout.strip())
        lines = [line for line in text.splitlines() if not _STACK_FRAME.match(line)][-TAIL_LINES:]
        return "\n".join(f"    {line}" for line in lines) if lines else "    (it printed nothing)"

    @property
    def crashed(self) -> bool:
        """The tool died of one of :data:`CRASH_SIGNALS` (directly, or as a shell reports it: 128 + signal)."""
        code = -self.returncode if self.returncode < 0 else self.returncode - 128
        return code in CRASH_SIGNALS

    def failure(self, what: str) -> LoweringError:
        """The error for this run: ``what`` went wrong, with the stderr tail."""
        return LoweringError(f"{self.tool} failed in {self.where}: {what} (exit status {self.returncode}); "
                             f"its output ends:\n{self.tail()}")


def run(found: Found, args: Sequence[str], stage: str, *, step: str = "", cwd: Path | None = None,
        path_prefix: Sequence[Path] = ()) -> ToolRun:
    """Run ``found`` with ``args`` for ``stage`` and wait for it.

    :param path_prefix: folders put before ``PATH`` for the tool (``bishengir-compile`` runs ``hivmc``
        from ``PATH``).
    :raises LoweringError: the executable could not be started.
    """
    env: Mapping[str, str] | None = None
    if path_prefix:
        env = {**os.environ, "PATH": os.pathsep.join([*map(str, path_prefix), os.environ.get("PATH", "")])}
    limit = timeout()
    start = time.perf_counter()
    try:
        done = subprocess.run([str(found.path), *args], capture_output=True, text=True, errors="replace",
                              cwd=cwd, env=env, check=False, timeout=limit)
    except subprocess.TimeoutExpired as exc:  # subprocess.run has killed the tool
        def text(out: bytes | str | None) -> str:
            return out.decode(errors="replace") if isinstance(out, bytes) else out or ""

        stopped = ToolRun(found.tool.name, stage, -signal.SIGKILL, text(exc.stdout), text(exc.stderr), limit, step)
        raise LoweringError(f"{found.tool.name} did not finish {stopped.where} within {limit:g} s and was stopped "
                            f"(set {TIMEOUT_VARIABLE} to allow longer); its output ends:\n{stopped.tail()}") from exc
    except OSError as exc:
        where = f"the {stage} stage ({step})" if step else f"the {stage} stage"
        raise LoweringError(f"{found.tool.name} ({found.path}, found by {found.source.value}) could not be run "
                            f"for {where}: {exc}") from exc
    return ToolRun(found.tool.name, stage, done.returncode, done.stdout, done.stderr, time.perf_counter() - start,
                   step)


def comes_and_goes(run_: ToolRun, messages: Sequence[str] = ()) -> bool:
    """``run_`` failed in a way another run of the same input need not repeat: it crashed
    (:attr:`ToolRun.crashed`) or printed one of ``messages``."""
    return run_.returncode != 0 and (run_.crashed or any(message in run_.stderr for message in messages))


def gave_up(run_: ToolRun, messages: Sequence[str] = ()) -> LoweringError:
    """The error once :data:`ATTEMPTS` runs all failed in ways that come and go; ``run_`` the last."""
    known = f" or with messages known to come and go ({'; '.join(messages)})" if messages else ""
    return run_.failure(f"{ATTEMPTS} runs failed, each by a crash{known}")


def read_module(path: Path, run_: ToolRun) -> str:
    """The MLIR module ``run_`` wrote at ``path``.

    :raises LoweringError: the tool failed, or exited 0 without writing a module there.
    """
    if run_.returncode != 0:
        raise run_.failure("it exited with an error")
    text = path.read_text(errors="replace") if path.is_file() else ""
    if not _MODULE.search(text):
        said = "wrote nothing" if not text.strip() else f"wrote no MLIR module (it starts {text.strip()[:60]!r})"
        raise LoweringError(f"{run_.tool} exited 0 in {run_.where} but {said} at {path.name}; "
                            f"its output ends:\n{run_.tail()}")
    return text
