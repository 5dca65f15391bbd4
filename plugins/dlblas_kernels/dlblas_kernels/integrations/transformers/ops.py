"""How the integration calls an op: ``get_op``'s choice in eager, the public function under ``torch.compile``.

In eager, :func:`call` asks ``dlcore.get_op`` for the op on these inputs: the implementation
and config it selected (vendor libraries among the candidates: cuDNN attention, cuBLAS), held in
the dispatcher's memo, so a call with inputs of metadata seen before costs one key and a replay.
``torch.compile`` cannot trace the dispatcher, so a compiled model gets each op's public
function: one custom-op node, the heuristic config of the Triton kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dlcore.api import get_op


def call(name: str, public: Callable, *args: Any) -> Any:
    """Op ``name`` on ``args``, positional in the op's order; ``public`` is its public function."""
    if torch.compiler.is_compiling():
        return public(*args)
    return get_op(name, args)(*args)
