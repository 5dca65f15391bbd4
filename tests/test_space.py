"""SearchSpace: enumeration order, constraints, refinement, validity reasons and sampling."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import random

import pytest

from dlcore.declarations.space import (
    Choice,
    Constraint,
    IntRange,
    PowerOfTwo,
    SearchSpace,
    num_stages,
    num_warps,
)

FITS_SMEM = Constraint("tile fits shared memory", lambda c: c["BLOCK_M"] * c["BLOCK_K"] <= 8192)


def matmul_space() -> SearchSpace:
    return SearchSpace(
        [PowerOfTwo("BLOCK_M", 16, 256), PowerOfTwo("BLOCK_K", 16, 128), num_warps(4, 8)],
        [FITS_SMEM],
        fixed={"GROUP_M": 8},
    )


# --- parameters -------------------------------------------------------------------------------


def test_power_of_two_covers_every_power_in_the_closed_interval():
    assert PowerOfTwo("B", 16, 128).values == (16, 32, 64, 128)
    assert PowerOfTwo("B", 10, 100).values == (16, 32, 64)
    assert PowerOfTwo("B", 1, 1).values == (1,)


@pytest.mark.parametrize(
    "make",
    [
        lambda: PowerOfTwo("B", 5, 7),
        lambda: PowerOfTwo("B", 0, 8),
        lambda: PowerOfTwo("B", 64, 16),
        lambda: IntRange("S", 3, 2),
        lambda: IntRange("S", 1, 4, step=0),
        lambda: Choice("C", ()),
        lambda: Choice("C", (1, 2, 1)),
    ],
)
def test_an_empty_or_malformed_domain_is_refused(make):
    with pytest.raises(ValueError):
        make()


def test_int_range_includes_high_when_the_step_lands_on_it():
    assert IntRange("S", 1, 7, step=2).values == (1, 3, 5, 7)
    assert IntRange("S", 1, 8, step=2).values == (1, 3, 5, 7)


def test_triton_launch_options_are_ordinary_choices():
    assert num_warps(2, 4) == Choice("num_warps", (2, 4))
    assert num_stages(3) == Choice("num_stages", (3,))


# --- enumeration --------------------------------------------------------------------------------


def test_configs_are_the_product_in_declaration_order_last_param_fastest():
    space = SearchSpace([Choice("a", (1, 2)), Choice("b", ("x", "y", "z"))])
    assert list(space.configs()) == [
        {"a": 1, "b": "x"},
        {"a": 1, "b": "y"},
        {"a": 1, "b": "z"},
        {"a": 2, "b": "x"},
        {"a": 2, "b": "y"},
        {"a": 2, "b": "z"},
    ]
    assert space.size() == 6


def test_constraints_filter_the_product_and_fixed_entries_are_merged():
    space = matmul_space()
    configs = list(space.configs())
    expected = [
        {"BLOCK_M": m, "BLOCK_K": k, "num_warps": w, "GROUP_M": 8}
        for m, k, w in itertools.product((16, 32, 64, 128, 256), (16, 32, 64, 128), (4, 8))
        if m * k <= 8192
    ]
    assert configs == expected
    assert space.size() == len(expected) == 34
    assert all(list(c) == ["BLOCK_M", "BLOCK_K", "num_warps", "GROUP_M"] for c in configs)


def test_configs_hands_out_copies():
    space = matmul_space()
    next(space.configs())["BLOCK_M"] = 999
    assert next(space.configs())["BLOCK_M"] == 16


def test_a_space_without_params_has_its_fixed_config_only():
    assert list(SearchSpace([], fixed={"num_warps": 4}).configs()) == [{"num_warps": 4}]


def test_an_unsatisfiable_space_is_empty():
    space = matmul_space().with_constraints(Constraint("never", lambda c: False))
    assert space.size() == 0
    assert list(space.configs()) == []


@pytest.mark.parametrize(
    "params, fixed",
    [
        ([Choice("a", (1,)), Choice("a", (2,))], {}),
        ([Choice("a", (1,))], {"a": 1}),
    ],
)
def test_a_name_declared_twice_is_refused(params, fixed):
    with pytest.raises(ValueError, match="'a'"):
        SearchSpace(params, fixed=fixed)


# --- validity -----------------------------------------------------------------------------------


def test_is_valid_accepts_every_enumerated_config_with_or_without_fixed_entries():
    space = matmul_space()
    for config in space.configs():
        assert space.is_valid(config) is None
        assert space.is_valid({k: v for k, v in config.items() if k != "GROUP_M"}) is None


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"BLOCK_M": 48}, "BLOCK_M=48 is not a power of two in [16, 256]"),
        ({"num_warps": 2}, "num_warps=2 is not one of (4, 8)"),
        ({"GROUP_M": 4}, "GROUP_M=4, but the space fixes GROUP_M=8"),
        ({"BLOCK_N": 64}, "unknown parameters ['BLOCK_N']"),
        ({"BLOCK_M": 256, "BLOCK_K": 64}, "tile fits shared memory"),
    ],
)
def test_is_valid_says_what_is_wrong(change, reason):
    config = {"BLOCK_M": 64, "BLOCK_K": 32, "num_warps": 4, "GROUP_M": 8, **change}
    assert reason in matmul_space().is_valid(config)


def test_is_valid_reports_a_missing_parameter():
    assert matmul_space().is_valid({"BLOCK_M": 64, "num_warps": 4}) == "missing parameter 'BLOCK_K'"


def test_constraints_see_fixed_entries():
    space = SearchSpace(
        [PowerOfTwo("BLOCK", 16, 256)],
        [Constraint("block covers a group", lambda c: c["BLOCK"] >= c["GROUP"])],
        fixed={"GROUP": 64},
    )
    assert [c["BLOCK"] for c in space.configs()] == [64, 128, 256]
    assert space.is_valid({"BLOCK": 32}) == "block covers a group"


# --- sampling -----------------------------------------------------------------------------------


def test_sample_is_valid_reproducible_and_uniform():
    space = matmul_space()
    draws = [space.sample(random.Random(7)) for _ in range(3)]
    assert draws[0] == draws[1] == draws[2]

    rng = random.Random(0)
    expected = 200
    counts = collections.Counter(json.dumps(space.sample(rng), sort_keys=True) for _ in range(expected * space.size()))
    assert all(space.is_valid(json.loads(key)) is None for key in counts)
    assert len(counts) == space.size()
    # Pearson's chi-square with size-1 = 33 degrees of freedom: about 33 +- 8 when uniform; a
    # sampler biased towards the configs that pass the constraints easily lands in the hundreds.
    chi_square = sum((n - expected) ** 2 / expected for n in counts.values())
    assert chi_square < 70


def test_sample_falls_back_to_enumeration_when_constraints_reject_nearly_everything():
    space = SearchSpace(
        [IntRange("a", 0, 99), IntRange("b", 0, 99)],
        [Constraint("the one corner", lambda c: c["a"] == 99 and c["b"] == 98)],
    )
    assert space.sample(random.Random(0)) == {"a": 99, "b": 98}


def test_sampling_an_empty_space_is_an_error():
    space = SearchSpace([Choice("a", (1, 2))], [Constraint("never", lambda c: False)])
    with pytest.raises(ValueError, match="no valid config"):
        space.sample(random.Random(0))


# --- refinement ---------------------------------------------------------------------------------


def test_restrict_keeps_the_declared_order_and_leaves_the_original_alone():
    space = matmul_space()
    narrow = space.restrict(BLOCK_M=(128, 32), num_warps=[8])
    assert [p.values for p in narrow.params] == [(32, 128), (16, 32, 64, 128), (8,)]
    assert narrow.constraints == space.constraints
    assert dict(narrow.fixed) == {"GROUP_M": 8}
    assert narrow.size() == 4 + 3  # BLOCK_M=32: K up to 128; BLOCK_M=128: K up to 64
    assert space.size() == 34


@pytest.mark.parametrize(
    "subsets, message",
    [({"BLOCK_N": (16,)}, "BLOCK_N"), ({"BLOCK_M": (48,)}, "48"), ({"GROUP_M": (8,)}, "GROUP_M")],
)
def test_restrict_refuses_unknown_names_and_values(subsets, message):
    with pytest.raises(ValueError, match=message):
        matmul_space().restrict(**subsets)


def test_with_constraints_refines_for_a_chip():
    # Ascend wants tiles aligned to 512 bytes: with fp32, BLOCK_K * 4 a multiple of 512.
    aligned = Constraint("BLOCK_K * 4 bytes is a multiple of 512", lambda c: c["BLOCK_K"] * 4 % 512 == 0)
    space = matmul_space()
    refined = space.with_constraints(aligned)
    assert {c["BLOCK_K"] for c in refined.configs()} == {128}
    assert refined.is_valid({"BLOCK_M": 16, "BLOCK_K": 64, "num_warps": 4}) == aligned.description
    assert space.size() == 34


def test_spaces_are_immutable():
    params = [Choice("a", (1, 2))]
    fixed = {"b": 3}
    space = SearchSpace(params, fixed=fixed)
    params.append(Choice("c", (4,)))
    fixed["b"] = 4
    assert space.names == ("a",)
    assert dict(space.fixed) == {"b": 3}
    with pytest.raises(dataclasses.FrozenInstanceError):
        space.params = ()
    with pytest.raises(TypeError):
        space.fixed["b"] = 5


def test_to_dict_is_json_ready():
    described = json.loads(json.dumps(matmul_space().to_dict()))
    assert described == {
        "params": [
            {"name": "BLOCK_M", "kind": "power_of_two", "low": 16, "high": 256},
            {"name": "BLOCK_K", "kind": "power_of_two", "low": 16, "high": 128},
            {"name": "num_warps", "kind": "choice", "values": [4, 8]},
        ],
        "constraints": ["tile fits shared memory"],
        "fixed": {"GROUP_M": 8},
        "size": 34,
    }


def test_a_value_of_another_type_is_not_in_the_space():
    """16.0 == 16 and True == 1 in Python; a kernel takes neither: a config read from a tampered
    cache with them is not in the space."""
    space = SearchSpace([PowerOfTwo("BLOCK", 16, 64), num_warps(1, 2, 4)])
    assert space.is_valid({"BLOCK": 16, "num_warps": 1}) is None
    assert "BLOCK=16.0" in space.is_valid({"BLOCK": 16.0, "num_warps": 1})
    assert "num_warps=True" in space.is_valid({"BLOCK": 16, "num_warps": True})
