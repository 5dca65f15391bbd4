"""Run `dlcore bench` for several op/mode specs in one process, one JSON each, skipping those already there.

    python3 .ci/bench_group.py DIR TARBALL SPEC...      SPEC = OP:MODE:SHAPES:TOKENS:VS[:IMPLS]

TOKENS, VS and IMPLS may be empty; IMPLS: `dlcore bench --impls`, implementations timed alone beside
what get_op chooses (e.g. triton,vendor).

BENCH_ROUNDS (default 2): `dlcore bench --rounds`. After each spec DIR is tarred into TARBALL, so
what is done survives a time-out.
"""

import os
import subprocess
import sys
import time

from dlcore.cli import main

out_dir, tarball, specs = sys.argv[1], sys.argv[2], sys.argv[3:]
os.makedirs(out_dir, exist_ok=True)
for spec in specs:
    op, mode, shapes, tokens, vs, *rest = spec.split(":")
    impls = rest[0] if rest else ""
    path = os.path.join(out_dir, f"{op}_{mode}.json")
    if os.path.exists(path):
        print(f"== {op} {mode}: already there", flush=True)
        continue
    start = time.time()
    args = ["bench", op, "--mode", mode, "--dtype", "bf16", "--shapes", shapes,
            "--rounds", os.environ.get("BENCH_ROUNDS", "2"), "--timer", "do_bench", "--json", path]
    if tokens:
        args += ["--tokens", tokens]
    if vs:
        args += ["--vs", vs]
    if impls:
        args += ["--impls", impls]
    if os.environ.get("BENCH_DEVICE"):
        args += ["--device", os.environ["BENCH_DEVICE"]]
    try:
        rc = main(args)
    except Exception as exc:  # noqa: BLE001 - one failing op must not stop the others
        rc = f"{type(exc).__name__}: {exc}"
    print(f"== {op} {mode}: rc {rc}, {time.time() - start:.0f} s", flush=True)
    subprocess.run(["tar", "czf", tarball, "-C", out_dir, "."], check=False)
