"""Search spaces narrowed for Ascend AI cores: what the npu backend's ``dlcore_refine_space`` does.

A kernel declares one space for every device (dlblas_kernels' spaces are written with GPUs in
mind). On an Ascend AI core part of it means nothing and part of it cannot use the hardware well.
The rules below only narrow a space. A rule that would leave no config is skipped, and so is one
whose number the profile lacks: triton-ascend compiles any tile, so these rules are about speed,
not correctness, and a space must stay searchable.

Which parameter is which follows the names the kernels use: a space with ``BLOCK_M``, ``BLOCK_N``
and ``BLOCK_K`` tiles a ``tl.dot`` (an ``M x K`` by ``K x N`` GEMM, on the cube unit); any other
space's ``BLOCK_*`` parameters tile a vector kernel, ``BLOCK_N`` being its contiguous (last)
dimension. The element size is that of the call's first tensor.

1. **Vector unit: 32-byte blocks.** The vector unit and its unified buffer move data in blocks of
   32 bytes (CANN's Ascend C: ``DataCopy`` lengths are whole 32-byte blocks), and triton-ascend pads
   rows that are not (triton-ascend 3.2.0, ``triton/runtime/utils.py``: "npu 32 bytes align"): the
   last dimension of a vector tile, ``BLOCK_N x element size``, is a multiple of 32 bytes.
2. **Cube unit: fractals.** The cube unit multiplies 16 x 16 x 16 fractals of fp16/bf16, each
   operand fractal 16 rows of 32 bytes (16 x 8 for fp32, 16 x 32 for int8: CANN's fractal ``NZ``
   format): ``BLOCK_M`` and ``BLOCK_N`` are multiples of 16 and ``BLOCK_K x element size`` is a
   multiple of 32 bytes.
3. **On-chip memory.** A vector program's tiles live in its vector core's unified buffer (the
   profile's ``shared_memory_per_program``: 192 KiB on A2/A3, CANN's ``ub_size``), and bishengir's
   automatic double buffering (``--enable-auto-multi-buffer``, on in triton-ascend's pipeline)
   keeps two copies of each buffer: a vector tile, held at least once in float32 (the kernels
   compute in float32), takes at most half the unified buffer. A GEMM's float32
   ``BLOCK_M x BLOCK_N`` accumulator lives in the cube unit's L0C (CANN's ``l0_c_size``, 128 KiB on
   A2/A3: :attr:`dlc_ascend.chips.Chip.l0c_bytes`) and must fit it.
4. **Launch options.** triton-ascend compiles in its SIMD mode unless told otherwise, and there
   ``num_warps`` is not used (only its SIMT mode passes ``--num-warps`` on) while ``num_stages`` is
   never passed on (bishengir buffers by itself): triton-ascend 3.2.0, ``backends/ascend/compiler.py``,
   ``NPUOptions`` and ``ttir_to_npubin``. Searching them would time one binary several times, so
   each tile keeps one value of each: the first declared under which the kernel's constraints admit
   the tile (the constraints a kernel ties to them are about GPU warps and registers; fixing one
   value for the whole space would lose the tiles only other values admit).

Grids are not a space's business on this backend: the ``grid_folding`` launch pass, on by default
for npu, folds every launch onto ``cores x programs_per_core`` programs (see
:mod:`dlc_ascend.runtime` for what those count).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from dlc_ascend import chips
from dlcore.api import Constraint, DeviceProfile, SearchSpace, Signature

#: the vector unit's data block and the cube fractal's row, bytes
BLOCK_BYTES = 32
#: rows (and columns) of a cube fractal
FRACTAL = 16
FLOAT32_BYTES = 4
#: copies of each buffer that double buffering keeps
BUFFERS = 2
GEMM_TILE = ("BLOCK_M", "BLOCK_N", "BLOCK_K")
LAUNCH_OPTIONS = ("num_warps", "num_stages")


def refine(space: SearchSpace, signature: Signature, profile: DeviceProfile) -> SearchSpace:
    """``space`` narrowed by the rules of the module doc for ``profile``'s device."""
    itemsize = signature.dtype.itemsize
    if set(GEMM_TILE) <= set(space.names):
        space = gemm_rules(space, itemsize, chips.find(profile.arch))
    else:
        space = vector_rules(space, itemsize, profile.shared_memory_per_program)
    return launch_options_once(space)


def vector_rules(space: SearchSpace, itemsize: int, ub_bytes: int) -> SearchSpace:
    """Rules 1 and 3 for a vector kernel's tile."""
    space = keep(space, "BLOCK_N", lambda v: v * itemsize % BLOCK_BYTES == 0)
    tile = [n for n in space.names if n.startswith("BLOCK_")]
    if not tile or not ub_bytes:
        return space
    budget = ub_bytes // BUFFERS
    return constrain(space, Constraint(
        f"{' * '.join(tile)} * {FLOAT32_BYTES} bytes <= {budget} (the float32 tile fits half the unified buffer, "
        f"double buffered)",
        lambda c: math.prod(c[n] for n in tile) * FLOAT32_BYTES <= budget,
    ))


def gemm_rules(space: SearchSpace, itemsize: int, part: chips.Chip | None) -> SearchSpace:
    """Rules 2 and 3 for a GEMM's tile."""
    space = keep(space, "BLOCK_M", lambda v: v % FRACTAL == 0)
    space = keep(space, "BLOCK_N", lambda v: v % FRACTAL == 0)
    space = keep(space, "BLOCK_K", lambda v: v * itemsize % BLOCK_BYTES == 0)
    if part is None:
        return space
    l0c = part.l0c_bytes
    return constrain(space, Constraint(
        f"BLOCK_M * BLOCK_N * {FLOAT32_BYTES} bytes <= {l0c} (the float32 accumulator fits the cube unit's L0C)",
        lambda c: c["BLOCK_M"] * c["BLOCK_N"] * FLOAT32_BYTES <= l0c,
    ))


def launch_options_once(space: SearchSpace) -> SearchSpace:
    """Rule 4: each tile (the values of every other parameter) with one ``num_warps`` and one
    ``num_stages``, the first declared that the space admits with it."""
    options = [n for n in LAUNCH_OPTIONS if n in space.names]
    if not options:
        return space
    others = [n for n in space.names if n not in options]
    first: dict[tuple, tuple] = {}
    for c in space.configs():  # declaration order: a tile's launch options in the order declared
        first.setdefault(tuple(c[n] for n in others), tuple(c[n] for n in options))
    return constrain(space, Constraint(
        f"{' and '.join(options)}: the first declared value that admits the tile (triton-ascend's SIMD mode "
        f"uses neither: one binary per tile)",
        lambda c: first.get(tuple(c[n] for n in others)) == tuple(c[n] for n in options),
    ))


def keep(space: SearchSpace, name: str, rule: Callable[[int], bool]) -> SearchSpace:
    """``space`` with parameter ``name`` keeping the values ``rule`` accepts; unchanged when it has no
    such parameter or the rule accepts none of its values."""
    if name not in space.names:
        return space
    values = next(p.values for p in space.params if p.name == name)
    kept = [v for v in values if rule(v)]
    return space.restrict(**{name: kept}) if kept else space


def constrain(space: SearchSpace, constraint: Constraint) -> SearchSpace:
    """``space`` with ``constraint`` added, unless that leaves no config."""
    narrowed = space.with_constraints(constraint)
    return narrowed if narrowed.size() else space
