"""Search spaces narrowed for Cambricon MLUs: what the mlu backend's ``dlcore_refine_space`` does.

MLU kernels want few programs, each a big block: about one program per core, each taking its
whole share of the data in blocks as large as the core's NRAM holds. Cambricon's Triton tutorials
do exactly that (``02-fused-softmax.py`` of Cambricon's Triton, as FlagTree carries it in
``third_party/cambricon``: "We split all rows into TOTAL_CORE_NUM parts evenly", grid
``TOTAL_CORE_NUM // num_warps``, ``BLOCK_M = ceil(M / TOTAL_CORE_NUM)`` or the most rows NRAM holds,
``MAX_NRAM_SIZE // 4 // (2 * BLOCK_N + 1)``). The rules below only narrow a space; one that would
leave no config, or whose number the profile lacks, is skipped.

The tile is the product of the space's ``BLOCK_*`` parameters. A space with ``BLOCK_M``,
``BLOCK_N`` and ``BLOCK_K`` is a GEMM's: its programs are output tiles, which this rule set cannot
count from the inputs alone, so only rule 1 applies to it.

1. **num_warps is a task type.** Cambricon's compiler takes ``num_warps`` 1 (a Block task: the
   program runs on one core) or 4 (a Union1 task: on the four cores of a cluster; its launcher
   multiplies the grid by ``num_warps``); it compiles 2 as 1 and more than 4 as 4, with a warning
   (``MLUOptions`` in FlagTree's ``third_party/cambricon/backend/compiler.py``). Other declared
   values would time the same binary again: the space keeps 1 and 4 where it declares them.
2. **The tile fits NRAM.** A program holds its input and output tiles in float32 in the NRAM of
   each core it runs on (the tutorial's ``4 * (2 * BLOCK_N + 1)`` bytes per row):
   ``2 x 4 x tile <= NRAM x cores per program``, NRAM being the profile's
   ``shared_memory_per_program``.
3. **Few programs, big blocks.** The call's work (the elements of its first tensor) split over the
   device's programs (``cores x programs_per_core / num_warps``) gives each program its share: the
   tile is at least that share, or the largest tile the space admits when none is that large.
"""

from __future__ import annotations

import math

from dlcore.api import Config, Constraint, DeviceProfile, SearchSpace, Signature

#: num_warps values Cambricon's compiler keeps: a Block task and a Union1 task
TASK_WARPS = (1, 4)
FLOAT32_BYTES = 4
#: tiles a program holds in NRAM: its input and its output
TILES = 2
GEMM_TILE = ("BLOCK_M", "BLOCK_N", "BLOCK_K")


def refine(space: SearchSpace, signature: Signature, profile: DeviceProfile) -> SearchSpace:
    """``space`` narrowed by the rules of the module doc for ``profile``'s device."""
    space = task_warps(space)
    if set(GEMM_TILE) <= set(space.names):
        return space
    tile = [n for n in space.names if n.startswith("BLOCK_")]
    if not tile:
        return space
    space = fits_nram(space, tile, profile.shared_memory_per_program)
    work = math.prod(signature.tensors[0][1].shape)
    return big_blocks(space, tile, work, profile.cores * profile.programs_per_core)


def task_warps(space: SearchSpace) -> SearchSpace:
    """Rule 1."""
    if "num_warps" not in space.names:
        return space
    values = next(p.values for p in space.params if p.name == "num_warps")
    kept = [v for v in values if v in TASK_WARPS]
    return space.restrict(num_warps=kept) if kept else space


def _elements(c: Config, tile: list[str]) -> int:
    return math.prod(c[n] for n in tile)


def _cores_per_program(c: Config) -> int:
    return c.get("num_warps", 1)


def fits_nram(space: SearchSpace, tile: list[str], nram: int) -> SearchSpace:
    """Rule 2."""
    if not nram:
        return space
    product = " * ".join(tile)
    return constrain(space, Constraint(
        f"{TILES} * {FLOAT32_BYTES} * {product} bytes <= {nram} * num_warps (input and output tiles in float32 fit "
        f"the NRAM of the cores a program runs on)",
        lambda c: TILES * FLOAT32_BYTES * _elements(c, tile) <= nram * _cores_per_program(c),
    ))


def big_blocks(space: SearchSpace, tile: list[str], work: int, cores: int) -> SearchSpace:
    """Rule 3: per task type, the tile takes at least each program's share of ``work`` (or is the
    largest the space admits)."""
    largest: dict[int, int] = {}
    for c in space.configs():
        warps = _cores_per_program(c)
        largest[warps] = max(largest.get(warps, 0), _elements(c, tile))
    if not largest:
        return space
    floor = {warps: min(math.ceil(work * warps / cores), most) for warps, most in largest.items()}
    product = " * ".join(tile)
    return constrain(space, Constraint(
        f"{product} >= min({work} elements / ({cores} cores / num_warps), the largest tile) (about one program per "
        f"core, each a big block)",
        lambda c: _elements(c, tile) >= floor.get(_cores_per_program(c), 0),
    ))


def constrain(space: SearchSpace, constraint: Constraint) -> SearchSpace:
    """``space`` with ``constraint`` added, unless that leaves no config."""
    narrowed = space.with_constraints(constraint)
    return narrowed if narrowed.size() else space
