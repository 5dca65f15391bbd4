"""Running one Ascend tool: the command, its exit status and output, and the error that names it.

Every stage of the npu pipeline runs an external executable (``triton-adapter-opt``,
``bishengir-compile``). None of them is trusted: a failure is a
:class:`~dlcore.errors.LoweringError` naming the tool, the stage and the end of the tool's
stderr; so is an exit status of 0 with nothing usable written.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from dlcore.compiler.toolchain import Found
from dlcore.errors import LoweringError

_MODULE = re.compile(r"^\s*module\b", re.MULTILINE)
# a crashing LLVM tool prints its stack after the message: the frames say nothing to a user
_STACK_FRAME = re.compile(r"^\s*#\d+ 0x[0-9a-f]+")
#: how much of a tool's stderr an error quotes (its last lines hold the diagnosis)
TAIL_LINES = 12


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
    start = time.perf_counter()
    try:
        done = subprocess.run([str(found.path), *args], capture_output=True, text=True, errors="replace",
                              cwd=cwd, env=env, check=False)
    except OSError as exc:
        where = f"the {stage} stage ({step})" if step else f"the {stage} stage"
        raise LoweringError(f"{found.tool.name} ({found.path}, found by {found.source.value}) could not be run "
                            f"for {where}: {exc}") from exc
    return ToolRun(found.tool.name, stage, done.returncode, done.stdout, done.stderr, time.perf_counter() - start,
                   step)


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
