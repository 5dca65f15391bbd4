#!/usr/bin/env bash
# Issue #41's end-to-end benchmark on the GPU host (device tool), from the repository root, with .whl/ carried:
#   bash .ci/e2e_bench.sh [PRESET ...]        (default: llama3-8b qwen3-30b-a3b)
# E2E_ARGS: more options for each `dlcore bench-model` (e.g. "--columns eager,dlcore --layers 4").
# The host has Python 3.12, torch 2.11 and triton 3.6.0 and no network: transformers, Liger-Kernel and their
# dependencies come from .whl/ (pip download --only-binary=:all: --python-version 3.12 --platform
# manylinux2014_x86_64 --no-deps, one per distribution; wheels of other Pythons there are passed over), the five
# distributions from this tree, as .ci/gpu.sh installs them. Each preset runs every column of
# `dlcore bench-model` (eager, torch.compile, Liger-Kernel, grouped_mm experts, dlcore, dlcore + torch.compile)
# in a process of its own and writes $OUT/e2e/PRESET.json after every column; copy those to docs/results/e2e/
# and run `python3 docs/results/render.py`. Progress goes to stderr and $OUT/e2e_bench.log.
#
# Time: the whole script stays under E2E_SECONDS (default 525, under 9 minutes, installs included). Each
# preset gets an equal share of what is left when it starts; within it no column or phase starts after the
# share less E2E_MARGIN seconds (default 75: one torch.compile of a phase and the exit), and the process is
# interrupted at the end of its share (what it finished is already written). Columns run uncompiled first,
# so a spent share costs the compiled columns, which are recorded as skipped.
set -o pipefail
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
export OUT=${OUT:-/tmp/out}
E2E_SECONDS=${E2E_SECONDS:-525}
E2E_MARGIN=${E2E_MARGIN:-75}
SITE=${SITE:-/tmp/site}
presets=("$@")
[ ${#presets[@]} -eq 0 ] && presets=(llama3-8b qwen3-30b-a3b)
mkdir -p "$OUT/e2e"
log="$OUT/e2e_bench.log"

# transformers' runtime dependencies, Liger-Kernel, and dlcore's own (pluggy where the host lacks it);
# torch, triton and numpy are the host's
wheels=(transformers huggingface_hub tokenizers safetensors regex pyyaml tqdm packaging typer click shellingham rich
        markdown-it-py mdurl pygments hf-xet kernels tomlkit httpx2 httpcore2 anyio h11 idna truststore pydantic
        pydantic-core annotated-types annotated-doc typing-inspection liger-kernel stevedore hyperopt diskcache)
# torch's own dependencies: installed only where the host has none (its versions serve transformers too)
python3 - filelock fsspec typing-extensions pluggy > /tmp/e2e_missing <<'EOF' || exit 1
import sys
from importlib import metadata
for name in sys.argv[1:]:
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        print(name)
EOF
mapfile -t missing < /tmp/e2e_missing
if [ -z "$GPU_INSTALLED" ]; then  # as in .ci/gpu.sh: a first run installs, later ones may skip it
  echo "installing ${#wheels[@]} wheels from .whl/ (and of torch's dependencies: ${missing[*]:-none}) and the five distributions" >&2
  python3 -m pip install -q --no-index --find-links .whl --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "${wheels[@]}" "${missing[@]}" || exit 1
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target "$SITE" \
      . plugins/dlc_cuda plugins/dlc_ascend plugins/dlc_mlu plugins/dlblas_kernels || exit 1
fi
export PYTHONPATH=$SITE DLCORE_CACHE_DIR=/tmp/dlcore-cache
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  python3 -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__,
              'triton', triton.__version__, 'transformers', transformers.__version__)"
  echo "installed after ${SECONDS} s"
} 2>&1 | tee "$OUT/versions.txt"

status=0
for i in "${!presets[@]}"; do
  left=$(( E2E_SECONDS - SECONDS ))
  share=$(( left / (${#presets[@]} - i) ))
  budget=$(( share - E2E_MARGIN ))
  if [ "$budget" -lt 30 ]; then
    echo "== ${presets[$i]}: not run (${left} s left of E2E_SECONDS=${E2E_SECONDS})" | tee -a "$log"
    status=1
    continue
  fi
  echo "== ${presets[$i]}: ${share} s, no column or phase started after ${budget} s (at ${SECONDS} s)" | tee -a "$log" >&2
  timeout -s INT -k 15 "$share" python3 -m dlcore.cli bench-model --preset "${presets[$i]}" --budget "$budget" \
      --out "$OUT/e2e" $E2E_ARGS 2>&1 | tee -a "$log" || status=1
done
echo "done after ${SECONDS} s; results: $(ls "$OUT"/e2e/*.json 2>/dev/null | tr '\n' ' ')" | tee -a "$log"
exit $status
