"""fused_moe's tiles: the heuristic config by the mean rows per expert, the search space, and the
fit of the tiles to shared memory and to an npu's unified buffer.
"""

from __future__ import annotations

from dlblas_kernels.blocks.npu import on_npu
from dlcore.api import Choice, Config, Constraint, DeviceProfile, PowerOfTwo, SearchSpace, num_stages, num_warps

# Mean rows per expert up to which a call counts as decoding: 16-row blocks, weights streamed.
DECODE_ROWS = 16
# Mean rows per expert from which fp8 weights' gate/up GEMM runs 16 warps (its two 128 x 128 float32
# accumulators and each K step's scaled products in 128 registers a thread, where 8 warps spill).
FP8_WIDE_ROWS = 512
# Few large experts (Mixtral's 8), many rows each: the GEMMs through the copy engine (blocks/grouped_tma.py)
# where the device has it, the rows gathered once into expert order. Not taken by default, nor by the
# tuner (TMA 0 only in the space): at Mixtral's 4096 tokens on an H100 its output is wrong in some calls
# and right in others (946 to 987 of 4096 token rows off the grouped_mm composite in the first calls of
# new plans in two runs of .ci/probe_moe_tma.py, none in a third run nor in 23 calls in other processes;
# the pointer kernels none; docs/performance.md, fused_moe), with 16-bit and fp8 weights alike. The tests
# at small sizes, in the interpreter and on the GPU, do not reproduce it. A config may ask for it
# (test_fused_moe's GPU case at Mixtral's size is an expected failure until it is found).
TMA_BY_DEFAULT = False
TMA_MAX_EXPERTS, TMA_ROWS = 16, 256
# Declared for 16-bit inputs; a float32 config that overflows shared memory fails to compile and the
# tuner records it as failed.
SPACE_ELEMENT_BYTES = 2
# On npu a program's tiles live in the AI core's unified buffer. What bishengir-compile 1.2 asks of it
# for grouped_gemm_kernel, per element (fp16 and fp32 alike; measured on the Ascend 910B2's 192 KiB
# by lowering every power-of-two tile of 32 to 128 rows, 64 to 256 columns and 32 to 128 K steps):
# the gathered rows of a [BLOCK_M, BLOCK_K] step (128 x 64 asked 1712128 bits of 1572864), the
# gate/up pair's [BLOCK_M, BLOCK_N] accumulators and SwiGLU, and the down GEMM's accumulator.
UB_BYTES_PER_ROW_STEP_ELEMENT = 48
UB_BYTES_PER_PAIR_ELEMENT = 24
UB_BYTES_PER_DOWN_ELEMENT = 6


def tile_config(block_m: int, up: tuple[int, int, int, int], down: tuple[int, int, int, int]) -> Config:
    """A config from the row block and each GEMM's ``(BLOCK_N, BLOCK_K, warps, stages)``."""
    return {"BLOCK_M": block_m, "BLOCK_N": up[0], "BLOCK_K": up[1], "GROUP_M": 8, "num_warps": up[2],
            "num_stages": up[3], "DOWN_BLOCK_N": down[0], "DOWN_BLOCK_K": down[1], "DOWN_WARPS": down[2],
            "DOWN_STAGES": down[3], "TMA": 0}


def _up_bytes(c: Config, element_size: int = SPACE_ELEMENT_BYTES) -> int:
    return c["num_stages"] * (c["BLOCK_M"] + 2 * c["BLOCK_N"]) * c["BLOCK_K"] * element_size


def _down_bytes(c: Config, element_size: int = SPACE_ELEMENT_BYTES) -> int:
    return c["DOWN_STAGES"] * (c["BLOCK_M"] + c["DOWN_BLOCK_N"]) * c["DOWN_BLOCK_K"] * element_size


def heuristic(tokens: int, experts: int, topk: int, element_size: int, profile: DeviceProfile | None,
              fp8: bool = False) -> Config:
    """By the mean rows per expert ``tokens * k / E``, from sweeps of Mixtral-8x7B's and
    DeepSeek-V3's experts (bf16, ``.ci/bench_fused_moe.py``; docs/performance.md, fused_moe):

    - up to DECODE_ROWS (decoding): 16-row blocks, 64-column tiles, K steps of 128 (256, 3 stages,
      at one row per expert or fewer): the weights of each activated expert stream through many
      programs once, near the copy bandwidth; 128-column tiles are slower;
    - up to 64: 64-row blocks, 64 columns per gate/up accumulator, 128 for the down GEMM;
    - more: 128-row blocks, 128 x 128 per gate/up accumulator (8 warps, 3 stages), 128 x 256 down
      tiles in 4 stages; 4 gate/up stages with 128-column down tiles, 64-column gate/up tiles, K
      steps of 128 and 64-row blocks are slower. Where TMA_BY_DEFAULT (off: see it), with at
      most TMA_MAX_EXPERTS experts and TMA_ROWS rows each (Mixtral's prefill), 16-bit: the same
      tiles through the copy engine (``TMA`` 1, :mod:`dlblas_kernels.blocks.grouped_tma`; the
      down GEMM in 3 stages), which the plan takes where the device and the weights allow.

    float32 halves the K step; pipelining stages are dropped while the tiles overflow the device's
    shared memory (no bound where the profile knows none).

    fp8 weights (``fp8``; ``element_size`` that of the fp8 tiles, 1): 128-column gate/up tiles (the
    SwiGLU output's 1x128 groups quantised in the epilogue) and K steps of 128 (one scale block),
    16-row blocks when decoding, 64 up to 64 rows per expert, else 128 rows with 8 warps and 4
    stages for both GEMMs (``fused_moe``'s ``fp8_tiles`` then fits the tiles to I); 64-row blocks or 64-column
    gate/up tiles, which spill no registers where 128 x 128 spills 24 bytes, are slower. From
    FP8_WIDE_ROWS rows per expert the gate/up GEMM runs 16 warps and 3 stages (128 registers, no
    spill); with fewer rows per expert, and for the down GEMM, 16 warps are slower."""
    rows = tokens * topk / max(experts, 1)
    if fp8:
        if rows <= DECODE_ROWS:
            config = tile_config(16, (128, 128, 4, 4), (64, 128, 4, 4))
        elif rows <= 64:
            config = tile_config(64, (128, 128, 4, 4), (128, 128, 4, 4))
        elif rows < FP8_WIDE_ROWS:
            config = tile_config(128, (128, 128, 8, 4), (128, 128, 8, 4))
        else:
            config = tile_config(128, (128, 128, 16, 3), (128, 128, 8, 4))
    elif rows <= 1:
        config = tile_config(16, (64, 256, 4, 3), (64, 256, 4, 3))
    elif rows <= DECODE_ROWS:
        config = tile_config(16, (64, 128, 4, 4), (64, 128, 4, 4))
    elif rows <= 64:
        config = tile_config(64, (64, 64, 4, 4), (128, 64, 4, 4))
    else:
        config = tile_config(128, (128, 64, 8, 3), (256, 64, 8, 4))
        if TMA_BY_DEFAULT and experts <= TMA_MAX_EXPERTS and rows >= TMA_ROWS and element_size == 2:
            config = {**config, "DOWN_STAGES": 3, "TMA": 1}
    if element_size > 2:
        config["BLOCK_K"] //= 2
        config["DOWN_BLOCK_K"] //= 2
    limit = profile.shared_memory_per_program if profile is not None else 0
    while limit and config["num_stages"] > 2 and _up_bytes(config, element_size) > limit:
        config["num_stages"] -= 1
    while limit and config["DOWN_STAGES"] > 2 and _down_bytes(config, element_size) > limit:
        config["DOWN_STAGES"] -= 1
    if on_npu(profile) and limit:
        fit_unified_buffer(config, limit)
    return config


def overflows_unified_buffer(c: Config, buffer: int) -> bool:
    """Whether grouped_gemm_kernel's tiles of ``c`` ask more of an npu's unified buffer (``buffer``
    bytes) than it has (the ``UB_BYTES_PER_*`` measures)."""
    return (c["BLOCK_M"] * max(c["BLOCK_K"], c["DOWN_BLOCK_K"]) * UB_BYTES_PER_ROW_STEP_ELEMENT > buffer
            or c["BLOCK_M"] * c["BLOCK_N"] * UB_BYTES_PER_PAIR_ELEMENT > buffer
            or c["BLOCK_M"] * c["DOWN_BLOCK_N"] * UB_BYTES_PER_DOWN_ELEMENT > buffer)


def fit_unified_buffer(c: Config, buffer: int) -> Config:
    """``c``'s tiles narrowed in place until they fit an npu's unified buffer: row blocks to 64,
    then each GEMM's K step, then its column tile (to 32), then the row block to 16. The prefill's
    128-row blocks (128 x 128 gate/up, 128 x 256 down, K steps of 64) take 64-row ones on the
    Ascend 910B; decoding's 16-row blocks fit as they are."""
    def halve(key: str, floor: int, too_big) -> None:
        while c[key] > floor and too_big():
            c[key] //= 2

    halve("BLOCK_M", 64, lambda: overflows_unified_buffer(c, buffer))
    halve("BLOCK_K", 32, lambda: c["BLOCK_M"] * c["BLOCK_K"] * UB_BYTES_PER_ROW_STEP_ELEMENT > buffer)
    halve("DOWN_BLOCK_K", 32, lambda: c["BLOCK_M"] * c["DOWN_BLOCK_K"] * UB_BYTES_PER_ROW_STEP_ELEMENT > buffer)
    halve("BLOCK_N", 32, lambda: c["BLOCK_M"] * c["BLOCK_N"] * UB_BYTES_PER_PAIR_ELEMENT > buffer)
    halve("DOWN_BLOCK_N", 32, lambda: c["BLOCK_M"] * c["DOWN_BLOCK_N"] * UB_BYTES_PER_DOWN_ELEMENT > buffer)
    halve("BLOCK_M", 16, lambda: overflows_unified_buffer(c, buffer))
    return c


def space(profile: DeviceProfile) -> SearchSpace:
    """The row block (shared by both GEMMs: the alignment pads to it), each GEMM's column tile, K
    step, warps and pipelining depth, the grouped program order; the pipelined tiles within the
    shared memory a program may use on the device (no bound where the profile knows none)."""
    shared = profile.shared_memory_per_program
    fits = [
        Constraint(f"num_stages * (BLOCK_M + 2 * BLOCK_N) * BLOCK_K * {SPACE_ELEMENT_BYTES} bytes <= {shared} "
                   f"(the gate/up GEMM's tiles fit in shared memory)", lambda c: _up_bytes(c) <= shared),
        Constraint(f"DOWN_STAGES * (BLOCK_M + DOWN_BLOCK_N) * DOWN_BLOCK_K * {SPACE_ELEMENT_BYTES} bytes <= "
                   f"{shared} (the down GEMM's tiles fit in shared memory)", lambda c: _down_bytes(c) <= shared),
    ] if shared else []
    if on_npu(profile) and shared:
        fits = [*fits, Constraint(
            f"BLOCK_M * max(BLOCK_K, DOWN_BLOCK_K) * {UB_BYTES_PER_ROW_STEP_ELEMENT}, BLOCK_M * BLOCK_N * "
            f"{UB_BYTES_PER_PAIR_ELEMENT} and BLOCK_M * DOWN_BLOCK_N * {UB_BYTES_PER_DOWN_ELEMENT} bytes <= {shared} "
            "(the tiles fit the unified buffer)", lambda c: not overflows_unified_buffer(c, shared))]
    return SearchSpace(
        [
            PowerOfTwo("BLOCK_M", 16, 128),
            PowerOfTwo("BLOCK_N", 32, 256),
            PowerOfTwo("BLOCK_K", 32, 256),
            Choice("GROUP_M", (1, 8)),
            num_warps(4, 8, 16),
            num_stages(2, 3, 4, 5),
            PowerOfTwo("DOWN_BLOCK_N", 32, 256),
            PowerOfTwo("DOWN_BLOCK_K", 32, 256),
            Choice("DOWN_WARPS", (4, 8)),
            Choice("DOWN_STAGES", (2, 3, 4, 5)),
            Choice("TMA", (0,)),
        ],
        [
            *fits,
            Constraint("2 * BLOCK_M * BLOCK_N / (32 * num_warps) <= 128 (both float32 accumulators fit in registers)",
                       lambda c: 2 * c["BLOCK_M"] * c["BLOCK_N"] / (32 * c["num_warps"]) <= 128),
            Constraint("BLOCK_M * DOWN_BLOCK_N / (32 * DOWN_WARPS) <= 128 (the down accumulator fits in registers)",
                       lambda c: c["BLOCK_M"] * c["DOWN_BLOCK_N"] / (32 * c["DOWN_WARPS"]) <= 128),
        ],
    )
