"""The Ascend compilers: ``triton-adapter-opt``, ``bishengir-compile`` and ``hivmc``.

None of them is a Python dependency of dlc-ascend. They are found as every backend's tools are
(:mod:`dlcore.compiler.toolchain`): the variable ``DLC_ASCEND_ADAPTER_OPT``,
``DLC_ASCEND_BISHENGIR`` or ``DLC_ASCEND_HIVMC``; the ``ascendnpu-ir`` package
(``pip install 'dlc-ascend[tools]'``), which ships ``bishengir-compile``; an installed
triton-ascend (a real Ascend host), which ships the adapter inside its ``triton`` package;
``PATH``; the tool cache that ``dlcore toolchain fetch ascend`` fills (:func:`fetch`).

Each found tool is run once with ``--version`` before use (:func:`dlcore.compiler.toolchain.check`):
``bishengir-compile 1.2.0 (...)``; the adapter, an LLVM tool, says only ``LLVM version 20.0.0git``,
and the cache's manifest says which triton-ascend it came from.
"""

from __future__ import annotations

import platform

from dlcore.api import (
    Fetched,
    FetchRequest,
    Found,
    PinnedWheel,
    Probe,
    Tool,
    Toolchain,
    ToolFetchError,
    find_tool,
    locate_tool,
    take_tool,
)

ADAPTER = Tool(
    name="triton-adapter-opt",
    variable="DLC_ASCEND_ADAPTER_OPT",
    stage="linalg",
    how_to_get="`dlcore toolchain fetch ascend` (takes the one binary out of the triton-ascend wheel; "
               "never installs triton-ascend), or set DLC_ASCEND_ADAPTER_OPT to its path",
    # triton-ascend replaces the `triton` package: its adapter sits inside it
    packages=(("triton", "backends/ascend/triton-adapter-opt"),),
    probe=Probe(r"LLVM version (?P<version>\S+)"),
)
BISHENGIR = Tool(
    name="bishengir-compile",
    variable="DLC_ASCEND_BISHENGIR",
    stage="hivm",
    how_to_get="`pip install 'dlc-ascend[tools]'` (the ascendnpu-ir package), or set DLC_ASCEND_BISHENGIR to its path",
    packages=(("ascendnpuir", "bin/bishengir-compile"),),
    probe=Probe(r"(?m)^bishengir-compile (?P<version>\S+)"),
)
HIVMC = Tool(
    name="hivmc",
    variable="DLC_ASCEND_HIVMC",
    stage="bin",
    how_to_get="install Huawei CANN and source its set_env.sh (hivmc is not published apart from CANN), "
               "or set DLC_ASCEND_HIVMC to its path",
)

#: triton-ascend replaces the ``triton`` package wholesale, so it is never installed beside upstream
#: Triton; but its wheel carries the adapter, a self-contained binary (it links only the C and C++
#: runtimes and zlib) that lowers upstream Triton 3.6's TTIR, from any Python. The cp311 wheels, by
#: the sha256 PyPI publishes for them.
ADAPTER_VERSION = "3.2.0"
ADAPTER_MEMBER = "triton/backends/ascend/triton-adapter-opt"
ADAPTER_WHEELS = {
    "x86_64": PinnedWheel(
        package="triton-ascend", version=ADAPTER_VERSION, member=ADAPTER_MEMBER,
        filename="triton_ascend-3.2.0-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl",
        sha256="17c8d7161eed1e96a286281963fe04d3113ee85affaa5d82c7dd0c35803962f0",
        platform="manylinux_2_28_x86_64", python="3.11",
    ),
    "aarch64": PinnedWheel(
        package="triton-ascend", version=ADAPTER_VERSION, member=ADAPTER_MEMBER,
        filename="triton_ascend-3.2.0-cp311-cp311-manylinux_2_27_aarch64.manylinux_2_28_aarch64.whl",
        sha256="69a9aecd6fa8b0beb798d16989bb24bc8a1ad61ded71526d6099d4179c428043",
        platform="manylinux_2_28_aarch64", python="3.11",
    ),
}


def adapter_wheel(system: str | None = None, machine: str | None = None) -> PinnedWheel:
    """The pinned triton-ascend wheel for this host (or for ``system`` and ``machine``)."""
    system = system or platform.system()
    machine = {"arm64": "aarch64", "AMD64": "x86_64"}.get(machine or platform.machine(), machine or platform.machine())
    if system != "Linux" or machine not in ADAPTER_WHEELS:
        raise ToolFetchError(f"triton-ascend {ADAPTER_VERSION} publishes no wheel for {system} {machine}; it has "
                             f"Linux {' and '.join(ADAPTER_WHEELS)}: take triton-adapter-opt from one on such a "
                             "host and set DLC_ASCEND_ADAPTER_OPT to its path")
    return ADAPTER_WHEELS[machine]


def fetch(toolchain: Toolchain, request: FetchRequest) -> tuple[Fetched, ...]:
    """``dlcore toolchain fetch ascend``: the adapter out of this host's triton-ascend wheel, into the
    tool cache. bishengir-compile comes with ``pip install 'dlc-ascend[tools]'``; hivmc with CANN."""
    return (take_tool(toolchain, ADAPTER.name, adapter_wheel(), request),)


TOOLCHAIN = Toolchain(
    name="ascend", backend="npu", tools=(ADAPTER, BISHENGIR, HIVMC), fetch=fetch,
    fetches=f"triton-adapter-opt, out of the triton-ascend {ADAPTER_VERSION} wheel (never installed); "
            "bishengir-compile comes with `pip install 'dlc-ascend[tools]'`, hivmc with Huawei CANN",
)
TOOLS: dict[str, Tool] = {t.name: t for t in TOOLCHAIN.tools}


def find(name: str) -> Found | None:
    """Where Ascend tool ``name`` is, or ``None`` (see :func:`dlcore.compiler.toolchain.find`)."""
    return find_tool(TOOLCHAIN, name)


def locate(name: str) -> Found:
    """Where Ascend tool ``name`` is, or :class:`~dlcore.errors.ToolchainMissingError` saying how to get it."""
    return locate_tool(TOOLCHAIN, name)
