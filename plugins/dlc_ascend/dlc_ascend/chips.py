"""The Ascend parts dlc-ascend knows: what lowering sizes grids for when no NPU is present.

Each row is read from CANN's platform files (``<cann>/<arch>-linux/data/platform_config/<chip>.ini``,
section ``[SoCInfo]``: ``cube_core_cnt``, ``vector_core_cnt``, ``memory_size``, ``l2_size``;
``[AICoreSpec]``: ``ub_size``, ``l0_c_size``). On a real NPU the driver's counts win (see the backend's profile).

An A2/A3 AI core pairs one cube core (``tl.dot``) with two vector cores (everything else): a
vector-only kernel runs on the vector cores, a mixed kernel on the cube cores with their vector
pairs. ``bishengir-compile --target`` takes these names; ``Ascend910B`` (the family) means
:data:`DEFAULT`.
"""

from __future__ import annotations

from dataclasses import dataclass

from dlcore.api import LoweringError

GiB = 2**30
MiB = 2**20
KiB = 2**10


@dataclass(frozen=True)
class Chip:
    name: str
    #: AI cube cores (matrix units): what a kernel with ``tl.dot`` is scheduled on
    cube_cores: int
    #: AI vector cores: what a vector-only kernel is scheduled on
    vector_cores: int
    memory_bytes: int
    l2_bytes: int
    #: the unified buffer of one vector core (on-chip memory a program's tiles live in)
    ub_bytes: int
    #: the cube unit's L0C buffer, where a ``tl.dot``'s float32 accumulator lives (the same on every
    #: A2/A3 AI core, which all the parts below have)
    l0c_bytes: int = 128 * KiB


_A2_A3_UB = 192 * KiB

CHIPS: dict[str, Chip] = {c.name: c for c in (
    Chip("Ascend910B1", 24, 48, 64 * GiB, 192 * MiB, _A2_A3_UB),
    Chip("Ascend910B2", 24, 48, 64 * GiB, 192 * MiB, _A2_A3_UB),
    Chip("Ascend910B3", 20, 40, 64 * GiB, 192 * MiB, _A2_A3_UB),
    Chip("Ascend910B4", 20, 40, 32 * GiB, 96 * MiB, _A2_A3_UB),
    Chip("Ascend910_9382", 24, 48, 64 * GiB, 192 * MiB, _A2_A3_UB),
    Chip("Ascend910_9392", 24, 48, 64 * GiB, 192 * MiB, _A2_A3_UB),
)}

#: what a family name without a part number means
ALIASES = {"Ascend910B": "Ascend910B2", "Ascend910_93": "Ascend910_9392"}
DEFAULT = "Ascend910B2"


def find(name: str) -> Chip | None:
    """The part named ``name`` (a family name maps through :data:`ALIASES`), or ``None``."""
    return CHIPS.get(ALIASES.get(name, name))


def chip(name: str) -> Chip:
    """The part named ``name`` (a family name maps through :data:`ALIASES`).

    :raises LoweringError: an unknown name, with the known ones.
    """
    found = find(name)
    if found is None:
        known = ", ".join([*CHIPS, *ALIASES])
        raise LoweringError(f"unknown Ascend part {name!r}; known: {known}")
    return found
