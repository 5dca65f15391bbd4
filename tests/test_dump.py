"""The IR dump pass: ``DLC_DUMP_IR=1`` writes every stage of every kernel compiled, forces the
compile when Triton's cache holds it, and deletes or overwrites nothing that exists.

Compiling needs Triton's real compiler, so each case runs in a fresh process without
``TRITON_INTERPRET`` (the kernels target ``cuda:90``; no GPU is needed).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from isolated import run_json

from dlcore.compiler.dump import write_new

COMPILE = """
import json, os, torch
from triton.backends.compiler import GPUTarget
from dlcore.compiler.lowering import compile_call, target_profile
from dlcore.compiler.rewrite import apply_launch_passes
from dlcore.plugins.registry import registry
from dlcore.declarations.signature import make_signature
from dlcore.runtime.profile import device_profile, first_device

os.chdir({cwd!r})
reg = registry()
meta = torch.device("meta")
kernels = []
for name in ("silu_and_mul", "rms_norm"):
    op = reg.ops[name]
    impl = next(i for i in reg.implementations_of(name) if i.kind == "triton")
    args = op.example(op.example_sizes, torch.float16, meta, torch.Generator().manual_seed(0))
    plan = impl.plan(args, impl.default_config(make_signature(op, args, meta), None), device_profile(meta))
    # what a launch does first: apply the launch passes, which hooks the IR passes into Triton
    for call in apply_launch_passes(plan, target_profile("cuda:90")).calls:
        compile_call(call, GPUTarget("cuda", 90, 32))
        kernels.append(call.kernel.fn.__name__)
print(json.dumps(kernels))
"""

STAGES = ["01-ttir.ttir", "02-ttgir.ttgir", "03-llir.ll", "04-ptx.ptx", "05-cubin.cubin"]


def compile_kernels(cwd: Path, cache: Path, **env: str) -> list[str]:
    return run_json(COMPILE.format(cwd=str(cwd)), None, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(cache),
                    TRITON_DEFAULT_FP_FUSION="1", **env)


def folders(root: Path) -> dict[str, Path]:
    """kernel name -> its dump folder (one compile each)."""
    found = {}
    for folder in sorted(root.iterdir()):
        if folder.is_dir():
            kernel, _, digest = folder.name.rpartition("-")
            assert len(digest) == 16, folder.name
            found[kernel] = folder
    return found


@pytest.fixture(scope="module")
def first_dump(tmp_path_factory):
    """One process with DLC_DUMP_IR=1 and the default dump folder (./dlc_ir)."""
    cwd = tmp_path_factory.mktemp("work")
    cache = tmp_path_factory.mktemp("triton-cache")
    kernels = compile_kernels(cwd, cache, DLC_DUMP_IR="1")
    return cwd, cache, kernels


@pytest.mark.slow
def test_every_stage_of_every_kernel_is_dumped(first_dump):
    cwd, _, kernels = first_dump
    dumped = folders(cwd / "dlc_ir")
    assert sorted(dumped) == sorted(kernels) == ["rms_norm_kernel", "silu_and_mul_kernel"]
    for kernel, folder in dumped.items():
        assert sorted(p.name for p in folder.iterdir()) == STAGES
        ttir = (folder / "01-ttir.ttir").read_text()
        assert f"tt.func public @{kernel}" in ttir and "tt.return" in ttir
        assert "ttg.num-warps" in (folder / "02-ttgir.ttgir").read_text()
        assert f"define ptx_kernel void @{kernel}" in (folder / "03-llir.ll").read_text()
        assert f".entry {kernel}" in (folder / "04-ptx.ptx").read_text()
        assert (folder / "05-cubin.cubin").read_bytes()[:4] == b"\x7fELF"


@pytest.mark.slow
def test_a_cached_compile_is_dumped_and_nothing_is_overwritten(first_dump, tmp_path):
    cwd, cache, _ = first_dump
    root = tmp_path / "dumps"
    root.mkdir()
    (root / "notes.txt").write_text("mine")
    compile_kernels(cwd, cache, DLC_DUMP_IR="1", DLC_DUMP_DIR=str(root))
    dumped = folders(root)
    folder = dumped["rms_norm_kernel"]
    # Triton's cache holds these kernels from the first process: the dump forced a real compile
    assert sorted(p.name for p in folder.iterdir()) == STAGES
    (folder / "01-ttir.ttir").write_text("edited by hand")
    compile_kernels(cwd, cache, DLC_DUMP_IR="1", DLC_DUMP_DIR=str(root))
    assert (root / "notes.txt").read_text() == "mine"
    assert (folder / "01-ttir.ttir").read_text() == "edited by hand"
    assert "tt.func" in (folder / "01-ttir.1.ttir").read_text()
    assert not (folder / "02-ttgir.1.ttgir").exists()  # same content: written once


@pytest.mark.slow
def test_nothing_is_dumped_unless_asked(tmp_path):
    compile_kernels(tmp_path, tmp_path / "cache", DLC_DUMP_IR="0")
    assert not (tmp_path / "dlc_ir").exists()


def test_write_new_never_replaces_a_file(tmp_path):
    target = tmp_path / "01-ttir.ttir"
    assert write_new(target, "a") == target
    assert write_new(target, "a") == target  # same content: nothing new
    assert write_new(target, "b") == tmp_path / "01-ttir.1.ttir"
    assert write_new(target, b"c") == tmp_path / "01-ttir.2.ttir"
    assert target.read_text() == "a"
