"""The Ascend compilers: ``triton-adapter-opt``, ``bishengir-compile`` and ``hivmc``.

None of them is a Python dependency of dlc-ascend. They are found as every backend's tools are
(:mod:`dlcore.compiler.toolchain`): the variable ``DLC_ASCEND_ADAPTER_OPT``,
``DLC_ASCEND_BISHENGIR`` or ``DLC_ASCEND_HIVMC``; the ``ascendnpu-ir`` package
(``pip install 'dlc-ascend[tools]'``), which ships ``bishengir-compile``; an installed
triton-ascend (a real Ascend host), which ships the adapter inside its ``triton`` package;
``PATH``; the tool cache that ``dlcore toolchain fetch ascend`` fills.
"""

from __future__ import annotations

from dlcore.compiler import toolchain as tools
from dlcore.compiler.toolchain import Found, Tool, Toolchain

ADAPTER = Tool(
    name="triton-adapter-opt",
    variable="DLC_ASCEND_ADAPTER_OPT",
    stage="linalg",
    how_to_get="`dlcore toolchain fetch ascend` (takes the one binary out of the triton-ascend wheel; "
               "never installs triton-ascend), or set DLC_ASCEND_ADAPTER_OPT to its path",
    # triton-ascend replaces the `triton` package: its adapter sits inside it
    packages=(("triton", "backends/ascend/triton-adapter-opt"),),
)
BISHENGIR = Tool(
    name="bishengir-compile",
    variable="DLC_ASCEND_BISHENGIR",
    stage="hivm",
    how_to_get="`pip install 'dlc-ascend[tools]'` (the ascendnpu-ir package), or set DLC_ASCEND_BISHENGIR to its path",
    packages=(("ascendnpuir", "bin/bishengir-compile"),),
)
HIVMC = Tool(
    name="hivmc",
    variable="DLC_ASCEND_HIVMC",
    stage="bin",
    how_to_get="install Huawei CANN and source its set_env.sh (hivmc is not published apart from CANN), "
               "or set DLC_ASCEND_HIVMC to its path",
)
TOOLCHAIN = Toolchain(name="ascend", backend="npu", tools=(ADAPTER, BISHENGIR, HIVMC))
TOOLS: dict[str, Tool] = {t.name: t for t in TOOLCHAIN.tools}


def find(name: str) -> Found | None:
    """Where Ascend tool ``name`` is, or ``None`` (see :func:`dlcore.compiler.toolchain.find`)."""
    return tools.find(TOOLCHAIN, name)


def locate(name: str) -> Found:
    """Where Ascend tool ``name`` is, or :class:`~dlcore.errors.ToolchainMissingError` saying how to get it."""
    return tools.locate(TOOLCHAIN, name)
