"""The Cambricon tools the mlu pipeline can drive, found as every backend's tools are.

Cambricon's Triton toolchain is not published: nothing of it is on the package index (the
``triton-shared`` found there is Microsoft's unrelated project). What is public:

- ``triton-linalg-opt``, TTIR -> linalg, as source only (github.com/Cambricon/triton-linalg, built
  together with the Triton it pins, so the TTIR of another Triton may not parse);
- ``cnas`` (MLISA assembly -> cnbin) and ``cnlink`` (cnbin -> cnfatbin), in Cambricon's Neuware
  toolkit (CNToolkit, under ``$NEUWARE_HOME/bin``).

What lies between, linalg -> MLISA, Cambricon's Triton backend runs inside its own ``libtriton``
(stages linalgopt, mluir, mluiropt, mlisa of its ``backend/compiler.py``, as FlagTree carries it
in ``third_party/cambricon``): no standalone tool does it, so no tool is declared for it; a
toolchain plugin that has one adds a stage driver (:mod:`dlc_mlu.stages`).

Each tool is found (:mod:`dlcore.compiler.toolchain`) by its variable, then ``PATH``, then the
tool cache.
"""

from __future__ import annotations

from dlcore.api import Found, Tool, Toolchain
from dlcore.api import find_tool as find_in_toolchain

TRITON_LINALG_OPT = Tool(
    name="triton-linalg-opt",
    variable="DLC_MLU_TRITON_LINALG_OPT",
    stage="linalg",
    how_to_get="not published as a binary: build it from source (github.com/Cambricon/triton-linalg, with the "
               "Triton it pins) and put it on PATH, or set DLC_MLU_TRITON_LINALG_OPT to its path",
)
CNAS = Tool(
    name="cnas",
    variable="DLC_MLU_CNAS",
    stage="cnbin",
    how_to_get="install Cambricon's Neuware toolkit (CNToolkit) and put $NEUWARE_HOME/bin on PATH, "
               "or set DLC_MLU_CNAS to its path",
)
CNLINK = Tool(
    name="cnlink",
    variable="DLC_MLU_CNLINK",
    stage="cnbin",
    how_to_get="install Cambricon's Neuware toolkit (CNToolkit) and put $NEUWARE_HOME/bin on PATH, "
               "or set DLC_MLU_CNLINK to its path",
)
TOOLCHAIN = Toolchain(name="mlu", backend="mlu", tools=(TRITON_LINALG_OPT, CNAS, CNLINK))


def find(name: str) -> Found | None:
    """Where MLU tool ``name`` is, or ``None`` (see :func:`dlcore.compiler.toolchain.find`)."""
    return find_in_toolchain(TOOLCHAIN, name)


def find_tool(tool: Tool) -> Found | None:
    """Where ``tool`` is, looked for as :data:`TOOLCHAIN`'s own are (its tool cache included): how a
    stage driver's tools, a plugin's among them, are found."""
    return find_in_toolchain(Toolchain(TOOLCHAIN.name, TOOLCHAIN.backend, (tool,)), tool.name)
