"""`dlcore bench`: shapes and presets, the report's numbers on a fake timer, alternation, skipped
baselines, JSON and plot output, and one real run of rms_norm through the command line."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
import statistics
import time

import pytest
import torch

from dlcore.bench import harness
from dlcore.bench.harness import run_bench, time_round_robin
from dlcore.bench.presets import GEMM_TOKENS, MODELS, PRESETS, TOKENS, Shape, canonical, shapes_for
from dlcore.bench.report import OWN, Report, ShapeResult, bound_of, geomean
from dlcore.cli import main
from dlcore.declarations.implementation import ReferenceImplementation, TorchImplementation
from dlcore.declarations.op import Op, TensorArg
from dlcore.plugins.registry import registry

ROTARY_SIZES = {"batch": 2, "seq": 8, "heads": 4, "kv_heads": 2, "head_dim": 16}
MLA_SIZES = {"tokens": 4, "heads": 2, "nope_dim": 8, "rope_dim": 4, "v_dim": 8}


# -- shapes ----------------------------------------------------------------------------------------

def test_a_model_preset_varies_tokens_and_takes_the_model_dimensions():
    shapes, notes = shapes_for({"tokens": 37, "hidden": 256}, "llama3-8b")
    assert [s.sizes for s in shapes] == [{"tokens": t, "hidden": 4096} for t in TOKENS]
    assert all(s.models == ("llama3-8b",) for s in shapes) and notes == []


def test_the_all_preset_merges_models_of_equal_shapes():
    shapes, _ = shapes_for({"tokens": 37, "hidden": 256}, None)
    assert len(shapes) == 6 * len(TOKENS)  # DeepSeek-V3's experts share its hidden size
    assert {s.sizes["hidden"] for s in shapes} == {4096, 8192, 3584, 5120, 2048, 7168}
    assert shapes[-1].models == ("deepseek-v3", "deepseek-v3-moe", "deepseek-v3-shared")
    inter = {s.sizes["inter"] for s in shapes_for({"tokens": 37, "inter": 128}, "all")[0]}
    assert inter == {14336, 28672, 18944, 12288, 10944, 18432, 2048}


GEMM_DIMS = [(4096, 14336), (8192, 28672), (3584, 18944), (7168, 2048)]  # (hidden, inter) of issue #13


def test_the_gemm_preset_has_the_mlp_shapes_at_its_own_token_counts():
    example = {"tokens": 37, "hidden": 256, "inter": 96}
    shapes, notes = shapes_for(example, "gemm")
    assert GEMM_TOKENS == (1, 16, 128, 1024, 4096, 16384) and notes == []
    assert [tuple(s.sizes.values()) for s in shapes] == [(t, h, i) for h, i in GEMM_DIMS for t in GEMM_TOKENS]
    assert [s.models for s in shapes[::len(GEMM_TOKENS)]] == [
        ("llama3-8b",), ("llama3-70b",), ("qwen2.5-7b",), ("deepseek-v3-shared",)]
    # --tokens replaces every preset's counts; a model preset keeps the general ones
    assert {s.sizes["tokens"] for s in shapes_for(example, "gemm", tokens=(2, 3))[0]} == {2, 3}
    assert [s.sizes["tokens"] for s in shapes_for(example, "llama3-8b")[0]] == list(TOKENS)


def test_a_down_variant_swaps_hidden_and_inter():
    """gemm-down is matmul's down projection: K = the model's inter, N = its hidden."""
    example = {"tokens": 37, "hidden": 256, "inter": 96}
    down, notes = shapes_for(example, "gemm-down", tokens=(16,))
    assert [(s.sizes["hidden"], s.sizes["inter"]) for s in down] == [(i, h) for h, i in GEMM_DIMS] and notes == []
    assert down[0].models == ("llama3-8b (down)",)
    both, _ = shapes_for(example, "gemm,gemm-down", tokens=(16,))
    assert len(both) == 8, "the up and down shapes of a model stay apart"
    assert shapes_for(example, "llama3-70b-down", tokens=(1,))[0][0].sizes == {"tokens": 1, "hidden": 28672,
                                                                                "inter": 8192}
    # a model without both sizes is left out with a note
    shapes, notes = shapes_for(example, "all-down", tokens=(1,))
    assert len(shapes) == 7 and notes == []  # deepseek-v3-moe and -shared merge
    with pytest.raises(ValueError, match="neither a preset"):
        shapes_for(example, "gemm-up")


def test_rotary_sizes_get_heads_and_batch_one():
    shapes, notes = shapes_for(ROTARY_SIZES, "llama3-8b,deepseek-v3-moe", tokens=(1, 4096))
    assert [s.sizes for s in shapes] == [
        {"batch": 1, "seq": 1, "heads": 32, "kv_heads": 8, "head_dim": 128},
        {"batch": 1, "seq": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128},
    ]
    assert notes == ["deepseek-v3-moe has no heads, kv_heads, head_dim: left out"]


def test_mla_sizes_come_from_deepseek_only():
    shapes, notes = shapes_for(MLA_SIZES, "all", tokens=(16,))
    mla = {"nope_dim": 128, "rope_dim": 64, "v_dim": 128}
    assert [(s.sizes, s.models) for s in shapes] == [
        ({"tokens": 16, "heads": 128, **mla}, ("deepseek-v2", "deepseek-v3")),
        ({"tokens": 16, "heads": 16, **mla}, ("deepseek-v2-lite",)),
    ]
    assert sum("left out" in n for n in notes) == len(MODELS) - 3
    assert shapes_for(MLA_SIZES, "mla", tokens=(16,))[0] == shapes


def test_the_gqa_preset_holds_llama_and_qwen():
    shapes, notes = shapes_for(ROTARY_SIZES, "gqa", tokens=(1,))
    assert [(s.sizes["heads"], s.sizes["kv_heads"], s.sizes["head_dim"]) for s in shapes] == [
        (32, 8, 128), (64, 8, 128), (28, 4, 128)]
    assert notes == []


ATTENTION_SIZES = {"batch": 2, "seq": 37, "kv_seq": 0, "heads": 4, "kv_heads": 2, "head_dim": 64, "causal": 0}


def test_the_attention_preset_has_issue_14s_anchor_shapes():
    """B 2, H 16, D 128, S 2048 to 16384, causal and not: setups, not models."""
    shapes, notes = shapes_for(ATTENTION_SIZES, "attention")
    anchor = {"batch": 2, "kv_seq": 0, "heads": 16, "kv_heads": 16, "head_dim": 128}
    assert [s.sizes for s in shapes] == [{**anchor, "seq": seq, "causal": causal}
                                         for causal in (0, 1) for seq in (2048, 4096, 8192, 16384)]
    assert [s.sizes["seq"] for s in shapes_for(ATTENTION_SIZES, "attention", tokens=(8192,))[0]] == [8192, 8192]
    assert shapes[0].models == ("attention-b2-h16-d128",) and notes == []
    assert "attention-b2-h16-d128" not in PRESETS["all"]  # setups are no models
    # an op without the setup's dimensions gets nothing from it
    with pytest.raises(ValueError, match="attention-b2-h16-d128 has no hidden: left out"):
        shapes_for({"tokens": 37, "hidden": 256}, "attention")


def test_the_moe_fp8_preset_sets_fp8_weights():
    """The moe-fp8 setups are the moe preset's experts with fp8 weights; the moe preset keeps the
    op's example value (16-bit weights), with no note."""
    moe_sizes = {"tokens": 37, "hidden": 64, "inter": 96, "experts": 6, "topk": 2, "fp8": 0}
    fp8, notes = shapes_for(moe_sizes, "moe-fp8", tokens=(4096,))
    plain, plain_notes = shapes_for(moe_sizes, "moe", tokens=(4096,))
    assert [s.sizes["fp8"] for s in fp8] == [1, 1] and notes == [] == plain_notes
    assert [{**s.sizes, "fp8": 1} for s in plain] == [s.sizes for s in fp8]
    assert [s.sizes["fp8"] for s in plain] == [0, 0]


def test_the_decode_preset_puts_its_counts_on_the_kv_length():
    shapes, notes = shapes_for(ATTENTION_SIZES, "decode")
    assert [s.sizes["kv_seq"] for s in shapes] == [1024, 2048, 4096, 8192, 16384, 32768, 65536] and notes == []
    assert all(s.sizes == {"batch": 1, "seq": 1, "kv_seq": s.sizes["kv_seq"], "heads": 32, "kv_heads": 8,
                           "head_dim": 128, "causal": 0} for s in shapes)
    # an op with no kv length: one shape
    assert len(shapes_for({"batch": 1, "seq": 1, "heads": 4}, "decode")[0]) == 1


def test_kv_length_and_causal_are_optional_dimensions():
    """Models set neither: the op's example values (kv_seq 0 = the query length), no note."""
    assert canonical("seq_k") == canonical("kv_seq") == "kv_tokens" and canonical("is_causal") == "causal"
    shapes, notes = shapes_for(ATTENTION_SIZES, "llama3-8b", tokens=(4096,))
    assert [s.sizes for s in shapes] == [{"batch": 1, "seq": 4096, "kv_seq": 0, "heads": 32, "kv_heads": 8,
                                          "head_dim": 128, "causal": 0}] and notes == []


def test_unknown_size_names_keep_their_example_value():
    shapes, notes = shapes_for({"tokens": 5, "experts_of_mine": 100}, "qwen2.5-7b", tokens=(1, 2))
    assert [s.sizes for s in shapes] == [{"tokens": 1, "experts_of_mine": 100}, {"tokens": 2, "experts_of_mine": 100}]
    assert "experts_of_mine is not a model dimension" in notes[0]


def test_the_lm_head_preset_gives_the_vocabulary_and_others_keep_the_example_s():
    example = {"tokens": 37, "hidden": 64, "vocab": 500}
    shapes, _ = shapes_for(example, "lm-head")
    assert {(s.sizes["tokens"], s.sizes["hidden"], s.sizes["vocab"]) for s in shapes} == {
        (4096, 4096, 128256), (16384, 4096, 128256), (4096, 3584, 152064), (16384, 3584, 152064)}
    shapes, _ = shapes_for({"tokens": 5, "vocab": 100}, "deepseek-v3", tokens=(1,))
    assert [s.sizes for s in shapes] == [{"tokens": 1, "vocab": 100}]  # a model without one: the example's


def test_explicit_named_and_positional_sizes():
    example = {"tokens": 37, "hidden": 256}
    shapes, _ = shapes_for(example, "tokens=4096,hidden=4096; tokens=1")
    assert [s.sizes for s in shapes] == [{"tokens": 4096, "hidden": 4096}, {"tokens": 1, "hidden": 256}]
    shapes, _ = shapes_for(example, "4096x4096,1x4096,8")
    assert [s.sizes for s in shapes] == [{"tokens": 4096, "hidden": 4096}, {"tokens": 1, "hidden": 4096},
                                         {"tokens": 8, "hidden": 256}]
    assert shapes[0].label() == "tokens=4096,hidden=4096" and shapes[0].models == ()


@pytest.mark.parametrize("text, message", [
    ("tokn=3", "has no size 'tokn'; its sizes are tokens, hidden"),
    ("tokens=x", "expected NAME=INTEGER"),
    ("1x2x3", "gives 3 sizes; the op has 2"),
    ("llama-3", "neither a preset"),
])
def test_bad_shapes_say_what_is_expected(text, message):
    with pytest.raises(ValueError, match=message):
        shapes_for({"tokens": 37, "hidden": 256}, text)


# -- the numbers -----------------------------------------------------------------------------------

def test_rates_speedups_and_geomean():
    result = ShapeResult(Shape({"tokens": 1}), nbytes=2 * 10**9, flops=10**9,
                         rounds={OWN: [2.0, 1.0, 9.0], "torch": [3.0, 3.0, 3.0]})
    assert result.ms(OWN) == 2.0  # the median of the rounds
    assert result.gbps(OWN) == pytest.approx(1000.0) and result.tflops(OWN) == pytest.approx(0.5)
    assert result.copy_fraction(OWN, 4000.0) == pytest.approx(0.25)
    assert result.speedup("torch") == pytest.approx(1.5) and result.speedup("liger") is None
    assert geomean([2.0, 8.0]) == pytest.approx(4.0) and geomean([]) is None
    assert bound_of(100, 10**5) == "compute" and bound_of(100, 100) == "memory" and bound_of(None, 5) is None
    compute = ShapeResult(Shape({}), nbytes=10, flops=10**6, rounds={OWN: [1.0]})
    assert compute.copy_fraction(OWN, 4000.0) is None


def test_round_robin_alternates_and_rotates_the_start():
    order = []
    work = {name: (lambda name=name: order.append(name)) for name in "abc"}
    times, failed = time_round_robin(work, lambda fn: fn() or 1.0, rounds=3)
    assert order == list("abc" "bca" "cab")
    assert times == {n: [1.0] * 3 for n in "abc"} and failed == {}


def test_round_robin_drops_what_raises():
    def broken():
        raise RuntimeError("out of memory\nmore")

    times, failed = time_round_robin({"a": lambda: None, "b": broken}, lambda fn: fn() or 1.0, rounds=2)
    assert times == {"a": [1.0, 1.0]} and failed == {"b": "RuntimeError: out of memory"}


# -- a fake op, timed by a fake timer ---------------------------------------------------------------

COPY_BYTES = 2**20
COPY_GBPS = 2000.0
#: per shape (tokens) and implementation: the milliseconds the fake timer reports
FAKE_MS = {1: {OWN: 1.0, "torch": 2.0, "compile": 4.0, "peer": 3.0},
           2: {OWN: 1.0, "torch": 8.0, "compile": 1.0, "peer": 3.0}}


class Log:
    """What ran, in order: each implementation appends its name and the inputs it got."""

    def __init__(self):
        self.calls: list[tuple[str, tuple]] = []

    def logged(self, name, fn):
        def run(*args):
            self.calls.append((name, args))
            return fn(*args)
        return run

    def timer(self, timed: list[str]):
        def timer(fn):
            before = len(self.calls)
            fn()
            if "copy_bandwidth" in fn.__qualname__:
                return 2 * COPY_BYTES / COPY_GBPS / 1e6
            if "copy_ms" in fn.__qualname__:  # the same-size copy: half the op's first-shape time
                return 0.5
            if len(self.calls) == before:  # a backward alone: no forward ran
                return 1.0
            name, args = self.calls[before]
            timed.append(name)
            return FAKE_MS[args[0].shape[0]][name]
        return timer


def scale(x, s):
    """The fake op: x * s, differentiable in x only."""
    return x * s.detach()


def fake_op(log: Log, baselines=None, cost=True, differentiable=True, s_differentiable=False) -> Op:
    def example(sizes, dtype, device, generator):
        x = torch.randn(sizes["tokens"], sizes["hidden"], generator=generator)
        return x.to(device=device, dtype=dtype), torch.full((sizes["hidden"],), 2.0, dtype=dtype, device=device)

    def fake_cost(args, mode="fwd"):
        return (10**9 if mode == "fwd" else 3 * 10**9), 10

    differentiated = times if s_differentiable else scale
    reference = differentiated if differentiable else (lambda x, s: scale(x, s).detach())
    if baselines is None:
        baselines = {"torch": lambda: log.logged("torch", scale), "liger": lambda: None}
    return Op(
        name="fake",
        args=(TensorArg("x", (torch.float32,)),
              TensorArg("s", (torch.float32,), max_rank=1, differentiable=s_differentiable)),
        reference=log.logged(OWN, reference),
        example=example,
        example_sizes={"tokens": 1, "hidden": 8},
        cost=fake_cost if cost else None,
        baselines=baselines,
    )


@pytest.fixture
def log(monkeypatch):
    """A fresh log; ``torch.compile`` replaced by a logging wrapper, counted per call."""
    log = Log()
    log.compiles = 0
    resets = []

    def fake_compile(fn, dynamic):
        log.compiles += 1
        assert dynamic is False and resets, "compiled without resetting Dynamo"
        resets.clear()
        return log.logged("compile", fn)

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1))
    # The fake op's cost claims gigabytes; the same-size copy is timed by the fake timer, so a small
    # one serves (allocating the claimed bytes made each test seconds slower).
    log.copied = []
    copy_ms = harness.copy_ms
    monkeypatch.setattr(harness, "copy_ms", lambda device, timer, moved: log.copied.append(moved)
                        or copy_ms(device, timer, min(moved, COPY_BYTES)))
    return log


def register(monkeypatch, op: Op) -> Op:
    reg = registry()
    # the fake timers of these tests stand for a device's: bench then rates copies as on hardware
    monkeypatch.setattr(type(reg.backends["cpu"]), "hardware_timings", True)
    monkeypatch.setitem(reg.ops, op.name, op)
    monkeypatch.setitem(reg.implementations, op.name, [ReferenceImplementation(op)])
    return op


def bench(op, log, timed=None, mode="fwd", baselines=("torch", "compile", "liger"), tokens=(1, 2)):
    shapes = [Shape({"tokens": t, "hidden": 8}) for t in tokens]
    return run_bench(op, shapes, dtype=torch.float32, device="cpu", mode=mode, baselines=baselines,
                     timer=log.timer([] if timed is None else timed), timer_name="fake", rounds=3,
                     copy_bytes=COPY_BYTES)


def test_report_numbers_on_a_fake_timer(monkeypatch, log):
    op = register(monkeypatch, fake_op(log))
    report = bench(op, log)
    assert report.baselines == ["torch", "compile"]  # liger is not installed: no column
    assert report.copy_bandwidth == pytest.approx(COPY_GBPS) and len(report.copy_gbps) == 2
    first, second = report.shapes
    assert first.ms(OWN) == 1.0 and first.gbps(OWN) == pytest.approx(1000.0)
    assert first.copy_fraction(OWN, report.copy_bandwidth) == pytest.approx(0.5)
    assert first.copy_ms == 0.5 and first.same_size_copy_fraction(OWN) == pytest.approx(0.5)
    assert first.same_size_copy_fraction("torch") == pytest.approx(0.25)
    assert first.speedup("torch") == 2.0 and second.speedup("torch") == 8.0
    assert report.geomean("torch") == pytest.approx(4.0) and report.worst("torch") == 2.0
    assert report.geomean("compile") == pytest.approx(2.0) and report.worst("compile") == 1.0
    assert log.compiles == 2  # compiled once per shape
    assert log.copied == [10**9, 10**9]  # a same-size copy of each shape's bytes
    table = report.table()
    assert "1000 GB/s" in table and "50%" in table and "4.00x" in table and "%copy same size" in table
    assert len(report.host_us) == 2 and re.search(r"host: [\d.]+ and [\d.]+ us a small torch op", table)
    assert "note: liger: not installed here; skipped" in table


def test_implementations_alternate_on_the_same_inputs(monkeypatch, log):
    op = register(monkeypatch, fake_op(log))
    timed = []
    bench(op, log, timed, tokens=(1,))
    assert timed == [OWN, "torch", "compile", "torch", "compile", OWN, "compile", OWN, "torch"]
    inputs = {tuple(id(a) for a in args) for _, args in log.calls}
    assert len(inputs) == 1, "every implementation gets the very same tensors"


def test_missing_and_failing_baselines_are_skipped_with_a_note(monkeypatch, log):
    def broken():
        raise ImportError("No module named 'liger_kernel'")

    def wrong_shape(x, s):
        return x[:1]

    op = register(monkeypatch, fake_op(log, baselines={"liger": broken, "peer": lambda: wrong_shape}))
    report = bench(op, log, baselines=("torch", "compile", "liger", "peer"), tokens=(1, 2))
    assert report.baselines == ["peer"]
    assert report.notes == [
        "torch: fake declares no 'torch' baseline; skipped",
        "compile: needs the op's 'torch' baseline, which is not available; skipped",
        "liger: failed to load (ImportError: No module named 'liger_kernel'); skipped",
    ]
    # tokens=1: one row either way; tokens=2: the result has another shape, so it is left out
    assert report.shapes[1].ms("peer") is None and "peer: its results do not have the shapes" in report.table()
    assert all(r.ms(OWN) for r in report.shapes) and log.compiles == 0


def test_a_compile_failure_is_a_note(monkeypatch, log):
    def broken(*args):
        raise RuntimeError("inductor: no C++ compiler")

    monkeypatch.setattr(torch, "compile", lambda fn, dynamic: broken)
    op = register(monkeypatch, fake_op(log))
    report = bench(op, log, baselines=("torch", "compile"), tokens=(1,))
    assert report.shapes[0].ms("compile") is None and report.shapes[0].ms("torch") == 2.0
    assert "compile: failed (RuntimeError: inductor: no C++ compiler); left out" in report.shapes[0].notes


def test_unknown_baseline_is_an_error(monkeypatch, log):
    op = register(monkeypatch, fake_op(log))
    with pytest.raises(ValueError, match="unknown baseline 'ligre'; fake can be compared with torch, compile, liger"):
        bench(op, log, baselines=("ligre",))


def register_with(monkeypatch, op: Op, *impls) -> Op:
    reg = registry()
    monkeypatch.setitem(reg.ops, op.name, op)
    monkeypatch.setitem(reg.implementations, op.name, [ReferenceImplementation(op), *impls])
    return op


def test_implementations_alone_get_columns_and_the_choice_is_named(monkeypatch, log):
    """--impls: each implementation through get_op(impl=...) in a dlcore[NAME] column, every dlcore
    column against every baseline, and 'best': the fastest of those columns over get_op's."""
    op = dataclasses.replace(fake_op(log), name="fake_impls")
    alt = TorchImplementation("fake_impls", "alt", log.logged("alt", scale))
    register_with(monkeypatch, op, alt)
    monkeypatch.setitem(FAKE_MS[1], "alt", 0.5)
    monkeypatch.setitem(FAKE_MS[2], "alt", 0.5)
    timed = []
    report = run_bench(op, [Shape({"tokens": t, "hidden": 8}) for t in (1, 2)], dtype=torch.float32, device="cpu",
                       baselines=("torch",), impls=("reference", "torch", "nothing"),
                       timer=log.timer(timed), timer_name="fake", rounds=3, copy_bytes=COPY_BYTES)
    assert report.impls == ["dlcore[reference]"] and report.implementations == [OWN, "dlcore[reference]", "torch"]
    assert [n for n in report.notes if n.startswith("dlcore[")] == [
        "dlcore[torch]: fake_impls has several implementations of kind 'torch' (reference, alt) (it has "
        "reference (torch), alt (torch)); skipped",
        "dlcore[nothing]: fake_impls has no implementation or kind 'nothing' (it has reference (torch), "
        "alt (torch)); skipped"]
    first = report.shapes[0]
    assert first.impl == "alt" and first.ms(OWN) == 0.5 and first.ms("dlcore[reference]") == 1.0
    assert timed.count(OWN) == 6, "the reference alone: 3 rounds per shape"
    assert first.speedup("torch") == 4.0 and first.speedup("torch", of="dlcore[reference]") == 2.0
    assert first.speedup_vs_best(report.impls) == 2.0
    assert report.geomean("best") == 2.0 and report.geomean("torch", of="dlcore[reference]") == 4.0
    table = report.table()
    for words in ("chosen", "dlcore[reference] ms", "dlcore[reference] vs torch", "vs best", "alt"):
        assert words in table, table
    data = report.to_json()
    assert data["dlcore_columns"] == ["dlcore[reference]"] and data["baselines"] == ["torch"]
    assert data["shapes"][0]["chosen_impl"] == "alt" and data["shapes"][0]["speedup_vs_best"] == 2.0
    # why get_op chose it (the reference is the oracle, a candidate only where no other accepts the inputs)
    assert data["shapes"][0]["selection"] == {
        "how": "only candidate", "measured": {}, "failed": {},
        "declined": {"reference": "fallback only; a dedicated implementation accepts these inputs"}}
    assert data["shapes"][0]["speedup_of"] == {"dlcore[reference]": {"torch": 2.0}}
    assert data["geomean_speedup_of"] == {OWN: {"torch": pytest.approx(8.0), "best": 2.0},
                                          "dlcore[reference]": {"torch": pytest.approx(4.0)}}
    assert data["baseline_docs"]["torch"].endswith("Log.logged.<locals>.run")


def test_the_op_may_declare_what_compile_compiles_and_what_is_prepared_once(monkeypatch, log):
    """ffn's compile baseline is a composite over [w1; w3] concatenated once per shape, outside the
    timing: the op's own 'compile' baseline, with prepare(args)."""
    prepared = []

    def prepare(args):
        x, s = args
        prepared.append(x.requires_grad)
        return x, s * 1

    def composite(x, s):
        """x times s, s prepared."""
        return scale(x, s)

    composite.prepare = prepare
    op = register(monkeypatch, fake_op(log, baselines={"torch": lambda: scale, "compile": lambda: composite}))
    report = bench(op, log, baselines=("compile",), tokens=(1, 2))
    assert log.compiles == 2 and prepared == [False, False], "compiled and prepared once per shape"
    compiled_args = [args for name, args in log.calls if name == "compile"]
    assert compiled_args and all(args[1] is not op_args[1] for args in compiled_args
                                 for name, op_args in log.calls if name == OWN)
    assert report.shapes[0].ms("compile") == 4.0 and report.shapes[0].max_abs_diff == {"compile": 0.0}
    assert report.baseline_docs["compile"].startswith("torch.compile of ") and "x times s, s prepared." in \
        report.baseline_docs["compile"] and "(prepared once per shape, untimed: " in report.baseline_docs["compile"]
    # in a backward, the forward (untimed) prepares: its gradients reach the op's own inputs
    prepared.clear()
    report = bench(op, log, mode="bwd", baselines=("compile",), tokens=(1,))
    assert prepared == [True] and report.shapes[0].max_abs_diff == {"compile": 0.0}
    assert "(prepared in the untimed forward: " in report.baseline_docs["compile"]
    # forward and backward timed together: prepared in each call (a warm-up and 3 rounds)
    prepared.clear()
    report = bench(op, log, mode="fwd+bwd", baselines=("compile",), tokens=(1,))
    assert prepared == [True] * 4 and report.shapes[0].ms("compile") == 4.0
    # without a 'compile' baseline of its own, the op's torch baseline is compiled
    op = register(monkeypatch, fake_op(log, baselines={"compile": lambda: None}))
    report = bench(op, log, baselines=("compile",), tokens=(1,))
    assert report.baselines == [] and report.notes == [
        "compile: the op's function to compile: not installed here; skipped"]


def test_compute_bound_results_summarize_small_and_large_token_counts():
    shapes = [ShapeResult(Shape({"tokens": t, "hidden": 8}), nbytes=10, flops=10**6,
                          rounds={OWN: [1.0], "torch": [speedup]}) for t, speedup in ((16, 0.5), (128, 2.0),
                                                                                       (512, 3.0), (4096, 4.0))]
    report = Report("fake", "fwd", torch.float32, {}, ["torch"], COPY_BYTES, shapes=shapes)
    groups = report.token_groups()
    assert [[r.shape.sizes["tokens"] for r in g] for g in groups.values()] == [[16, 128], [4096]]
    assert report.to_json()["geomean_speedup_by_tokens"] == {"tokens <= 128": {OWN: {"torch": 1.0}},
                                                            "tokens >= 1024": {OWN: {"torch": 4.0}}}
    assert "geomean tokens >= 1024" in report.table()
    memory = Report("fake", "fwd", torch.float32, {}, ["torch"], COPY_BYTES,
                    shapes=[dataclasses.replace(r, flops=1) for r in shapes])
    assert memory.token_groups() == {} and "tokens <=" not in memory.table()


def test_backward_times_the_backward_alone(monkeypatch, log):
    op = register(monkeypatch, fake_op(log))
    seen = []
    monkeypatch.setitem(op.baselines, "torch", lambda: lambda x, s: seen.append((x.requires_grad, s.requires_grad))
                        or scale(x, s))
    report = bench(op, log, mode="bwd", baselines=("torch",), tokens=(1,))
    calls = [name for name, _ in log.calls]
    assert calls == [OWN, OWN], "one forward to see it has a backward, one to keep the graph; none timed"
    assert seen == [(True, False)], "only the inputs the op declares differentiable require grad"
    result = report.shapes[0]
    assert len(result.rounds[OWN]) == 3 and len(result.rounds["torch"]) == 3
    assert result.nbytes == 3 * 10**9 and result.max_abs_diff == {"torch": 0.0}


def times(x, s):
    return x * s


def test_backward_asks_every_implementation_for_the_declared_gradients_only(monkeypatch, log):
    asked = []
    grad = torch.autograd.grad

    def spy(outputs, inputs, *args, **kwargs):
        asked.append(tuple(tuple(t.shape) for t in inputs))
        return grad(outputs, inputs, *args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", spy)
    for declared, wanted in ((False, {((1, 8),)}), (True, {((1, 8), (8,))})):
        asked.clear()
        op = fake_op(log, s_differentiable=declared, baselines={"torch": lambda: times})
        op = register(monkeypatch, dataclasses.replace(op, name=f"fake_{declared}"))
        report = bench(op, log, mode="bwd", baselines=("torch",), tokens=(1,))
        assert set(report.shapes[0].rounds) == {OWN, "torch"}, report.table()
        assert set(asked) == wanted and len(asked) == 2 * (1 + 3), "a warm-up and 3 rounds each, same inputs"


class InPlaceBackward(torch.autograd.Function):
    """x * s whose backward writes into its grad_output, as Liger's do."""

    @staticmethod
    def forward(ctx, x, s):
        ctx.save_for_backward(s)
        return x * s

    @staticmethod
    def backward(ctx, grad):
        (s,) = ctx.saved_tensors
        return grad.mul_(s), None


def test_a_backward_writing_into_grad_output_does_not_change_the_others(monkeypatch, log):
    op = register(monkeypatch, fake_op(log, baselines={"peer": lambda: InPlaceBackward.apply,
                                                       "torch": lambda: scale}))
    report = bench(op, log, mode="bwd", baselines=("peer", "torch"), tokens=(1,))
    assert report.shapes[0].max_abs_diff == {"peer": 0.0, "torch": 0.0}
    assert any(n.startswith("peer: writes into its output gradients (in place)") for n in report.notes), report.notes
    assert not any(n.startswith("torch: writes") for n in report.notes)


def test_a_forward_writing_into_its_inputs_is_noted_and_undone_for_the_next(monkeypatch, log):
    """Liger's rope rotates q and k in place: the report says so, and the implementations checked
    after it get the inputs as they were."""
    op = register(monkeypatch, fake_op(log, baselines={"peer": lambda: lambda x, s: x.mul_(s),
                                                       "torch": lambda: scale}))
    report = bench(op, log, baselines=("peer", "torch"), tokens=(2,))
    assert report.shapes[0].max_abs_diff == {"peer": 0.0, "torch": 0.0}, report.table()
    assert [n for n in report.notes if "in place" in n] == [
        "peer: writes into its inputs (in place), so each timed call moves fewer bytes than a functional one; "
        "they were restored before the next implementation's check"]
    assert "writes into its inputs" in report.table()


def test_forward_and_backward_are_timed_together(monkeypatch, log):
    op = register(monkeypatch, fake_op(log))
    report = bench(op, log, mode="fwd+bwd", baselines=(), tokens=(1,))
    assert [name for name, _ in log.calls].count(OWN) == 2 + 3  # probe, warm-up, then one per round
    assert report.shapes[0].nbytes == 4 * 10**9


def test_an_op_without_backward_skips_the_mode(monkeypatch, log):
    op = register(monkeypatch, fake_op(log, differentiable=False))
    report = bench(op, log, mode="bwd", baselines=("torch",), tokens=(1,))
    assert report.shapes[0].rounds == {}
    assert "dlcore: fake has no backward (its outputs carry no autograd graph); bwd skipped" in report.table()


def test_an_op_without_cost_reports_times_only(monkeypatch, log):
    op = register(monkeypatch, fake_op(log, cost=False))
    report = bench(op, log, baselines=("torch",), tokens=(1,))
    assert report.shapes[0].gbps(OWN) is None and report.shapes[0].speedup("torch") == 2.0
    assert report.notes == ["fake declares no cost: no GB/s, TFLOP/s or copy fraction"]


def test_json_holds_everything(monkeypatch, log, tmp_path):
    op = register(monkeypatch, fake_op(log))
    data = bench(op, log).to_json()
    json.dumps(data)  # serialisable as it is
    assert data["op"] == "fake" and data["dtype"] == "float32" and data["mode"] == "fwd"
    assert data["versions"]["torch"] == torch.__version__ and "triton" in data["versions"]
    assert data["date"] and data["gpu"] is None and data["device"]["backend"] == "cpu"
    assert data["environment"].get("TRITON_INTERPRET") == "1"
    assert data["copy_bandwidth_gbps"] == pytest.approx(COPY_GBPS)
    # the host probe at the run's start and end, beside the copies
    assert len(data["host_call_us"]) == 2 and all(0 < t < 10**4 for t in data["host_call_us"])
    first = data["shapes"][0]
    assert first["sizes"] == {"tokens": 1, "hidden": 8} and first["bound"] == "memory"
    assert first["results"][OWN]["rounds_ms"] == [1.0, 1.0, 1.0]
    assert first["results"][OWN]["copy_fraction"] == pytest.approx(0.5)
    assert first["speedup"] == {"torch": 2.0, "compile": 4.0}
    assert first["chosen"].startswith("reference")
    assert math.isclose(data["geomean_speedup"]["torch"], 4.0) and data["min_speedup"]["compile"] == 1.0


def test_plot_draws_each_implementation(monkeypatch, log, tmp_path):
    pytest.importorskip("matplotlib")
    from dlcore.bench.plot import plot

    op = register(monkeypatch, fake_op(log))
    path = tmp_path / "bench.png"
    plot(bench(op, log), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- the command line ------------------------------------------------------------------------------

def test_cli_writes_json_with_the_command(monkeypatch, log, tmp_path, capsys):
    monkeypatch.setattr(harness, "default_copy_bytes", lambda device: COPY_BYTES)
    register(monkeypatch, fake_op(log))
    out = tmp_path / "fake.json"
    assert main(["bench", "fake", "--shapes", "3x8", "--vs", "torch,liger", "--dtype", "fp32",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["command"] == ("dlcore bench fake --shapes 3x8 --dtype fp32 --mode fwd --vs torch,liger "
                               "--device cpu --rounds 3 --warmup 10 --rep 40 --timer do_bench --seed 0")
    assert data["shapes"][0]["sizes"] == {"tokens": 3, "hidden": 8}
    assert data["shapes"][0]["results"]["torch"]["ms"] > 0
    captured = capsys.readouterr()
    assert "[1/1] tokens=3,hidden=8: dlcore" in captured.err and "liger: not installed here" in captured.out


ROTARY_OPS = {
    "apply_rotary_pos_emb": "tokens=5,heads=4,kv_heads=2,head_dim=16",
    "partial_rotary_emb": "tokens=3,heads=2,nope_dim=8,rope_dim=4,v_dim=8",
    "rms_norm": "tokens=3,hidden=64",
    "add_rms_norm": "tokens=3,hidden=64",
    "silu_and_mul": "tokens=3,inter=64",
    "softmax": "tokens=3,vocab=70",
}


@pytest.mark.parametrize("mode", ["fwd", "bwd"])
@pytest.mark.parametrize("name", list(ROTARY_OPS))
def test_every_kernel_op_benches_in_the_interpreter(name, mode, monkeypatch, tmp_path, capsys):
    """Each op and mode end to end through the command line; the backward asks dlcore and torch for
    the gradients of the declared differentiable inputs only (never rotary's cos and sin)."""
    op = registry().op(name)
    if "inter" in ROTARY_OPS[name] and "inter" not in op.example_sizes:
        pytest.skip(f"{name} has no size 'inter'")
    asked = []
    grad = torch.autograd.grad

    def spy(outputs, inputs, *args, **kwargs):
        asked.append(len(inputs))
        return grad(outputs, inputs, *args, **kwargs)

    monkeypatch.setattr(harness, "default_copy_bytes", lambda device: 2**16)
    monkeypatch.setattr(torch.autograd, "grad", spy)
    out = tmp_path / "bench.json"
    assert main(["bench", name, "--shapes", ROTARY_OPS[name], "--vs", "torch", "--dtype", "fp32", "--mode", mode,
                 "--rounds", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    (shape,) = data["shapes"]
    assert shape["chosen"].startswith("triton") and shape["results"][OWN]["ms"] > 0
    assert shape["results"]["torch"]["ms"] > 0 and shape["max_abs_diff_vs_dlcore"]["torch"] < 1e-4
    assert f"{name} {mode} float32" in capsys.readouterr().out
    if mode == "bwd":
        assert asked and set(asked) == {len(op.differentiable())}


def test_matmul_benches_the_triton_implementation_alone_through_the_command_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(harness, "default_copy_bytes", lambda device: 2**16)
    out = tmp_path / "matmul.json"
    assert main(["bench", "matmul", "--shapes", "tokens=3,hidden=40,inter=24", "--vs", "torch", "--impls",
                 "triton", "--dtype", "fp32", "--rounds", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    (shape,) = data["shapes"]
    assert data["command"].endswith("--impls triton") and data["dlcore_columns"] == ["dlcore[triton]"]
    assert shape["results"]["dlcore[triton]"]["ms"] > 0 and shape["speedup_of"]["dlcore[triton]"]["torch"] > 0
    assert shape["max_abs_diff_vs_dlcore"]["dlcore[triton]"] < 1e-4
    assert "dlcore[triton] vs torch" in capsys.readouterr().out


def test_cli_errors_are_one_line(capsys):
    assert main(["bench", "rms_norm", "--shapes", "tokens=1,hiden=4"]) == 2
    assert "dlcore bench: error: --shapes: the op has no size 'hiden'" in capsys.readouterr().err


def test_rms_norm_end_to_end_in_the_interpreter(tmp_path, capsys):
    op = registry().op("rms_norm")
    out = tmp_path / "rms_norm.json"
    assert main(["bench", "rms_norm", "--shapes", "tokens=3,hidden=64", "--vs", "torch", "--dtype", "fp32",
                 "--json", str(out)]) == 0
    table = capsys.readouterr().out
    data = json.loads(out.read_text())
    (shape,) = data["shapes"]
    assert shape["sizes"] == {"tokens": 3, "hidden": 64} and "tokens=3,hidden=64" in table
    assert shape["chosen"].startswith("triton"), "the Triton kernel ran, in the interpreter"
    # each figure follows from the rounds timed: a median of 3 positive times, rates and ratios of it
    own = shape["results"][OWN]
    assert len(own["rounds_ms"]) == 3 and min(own["rounds_ms"]) > 0
    assert own["ms"] == statistics.median(own["rounds_ms"])
    # the interpreter's times say nothing of bandwidth: no copy is measured, no fraction reported
    assert data["copy_bandwidth_gbps"] is None and data["copy_bandwidth_runs_gbps"] == []
    assert data["host_call_us"] == []
    if "torch" in op.baselines:
        torch_ms = shape["results"]["torch"]["ms"]
        assert torch_ms > 0 and shape["max_abs_diff_vs_dlcore"]["torch"] < 1e-4
        assert shape["speedup"]["torch"] == pytest.approx(torch_ms / own["ms"])
        assert data["geomean_speedup"]["torch"] == pytest.approx(shape["speedup"]["torch"])  # one shape
    else:
        assert "torch: rms_norm declares no 'torch' baseline; skipped" in table
    if op.cost is not None:
        assert shape["bytes"] >= 2 * 3 * 64 * 4
        assert own["gbps"] == pytest.approx(shape["bytes"] / own["ms"] / 1e6)


def test_timers_are_named():
    from dlcore.plugins.registry import registry

    backend = registry().backend_for(torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown timer 'wall'; use one of do_bench, cudagraph"):
        harness.default_timer(torch.device("cpu"), backend, kind="wall")
    timer, name = harness.default_timer(torch.device("cpu"), backend, kind="cudagraph")
    assert "cpu" in name  # CUDA graphs exist on CUDA only: the backend's timer
    calls = []
    # a call that sleeps 5 ms: timed in milliseconds, each call timed alone (the median, not the sum)
    ms = timer(lambda: calls.append(time.sleep(0.005)))
    assert len(calls) > 1 and 5 <= ms < 5 * len(calls), (ms, len(calls))


def test_graph_timer_runs_shapes_on_its_stream_and_copies_with_do_bench(monkeypatch, log):
    """The CUDA part needs a GPU (tests/test_gpu.py); here: what run_bench does with a GraphTimer."""
    op = register(monkeypatch, fake_op(log))
    streams, copies = [], []

    class Timer(harness.GraphTimer):
        def __init__(self):
            self.stream = "side stream"
            self.copy_timer = lambda fn: copies.append(fn.__qualname__) or 0.5

        def __call__(self, fn):
            fn()
            return 1.0

    monkeypatch.setattr(torch.cuda, "stream", lambda s: streams.append(s) or contextlib.nullcontext())
    report = run_bench(op, [Shape({"tokens": 1, "hidden": 8})], dtype=torch.float32, device="cpu",
                       baselines=("torch",), timer=Timer(), timer_name="graph", rounds=1, copy_bytes=COPY_BYTES)
    assert streams == ["side stream"]
    assert len(copies) == 3 and all("copy" in c for c in copies)  # bandwidth before and after, the same-size copy
    assert report.shapes[0].copy_ms == 0.5 and report.shapes[0].ms(OWN) == 1.0


def test_interpreted_timings_give_no_copy_fractions(monkeypatch, log):
    op = register(monkeypatch, fake_op(log))
    monkeypatch.setattr(type(registry().backends["cpu"]), "hardware_timings", False)
    report = bench(op, log)
    assert report.copy_gbps == [] and report.host_us == [] and all(r.copy_ms is None for r in report.shapes)
    table = report.table()
    assert "copy bandwidth: not measured" in table and not re.search(r"\d%", table) and "host:" not in table
    assert any("runs Triton kernels in the interpreter" in n for n in report.notes)


def test_max_abs_diff_works_in_slices(monkeypatch):
    """The largest difference over slices of the flattened tensors, as over the whole."""
    from dlcore.bench import harness

    monkeypatch.setattr(harness, "DIFF_SLICE", 7)
    a = torch.zeros(5, 9, dtype=torch.bfloat16)
    b = a.clone()
    b[4, 8] = 3.0  # in the last, partial slice
    c = torch.ones(3, dtype=torch.float16)
    assert harness._max_abs_diff((a, c), (b, c)) == 3.0
    assert harness._max_abs_diff((a.T,), (b.T,)) == 3.0  # non-contiguous
    assert harness._max_abs_diff((a,), (b[:4],)) is None
