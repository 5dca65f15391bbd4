#!/usr/bin/env bash
# Run on the GPU host (device tool): install the five distributions as real installs next to the
# wheels carried in .whl/ (stevedore, diskcache, hyperopt), then run the suite natively on CUDA
# (bfloat16 included) and once more the CPU path (interpreter), writing logs under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site \
    . plugins/dlc_cuda plugins/dlc_ascend plugins/dlc_mlu plugins/dlblas_kernels || exit 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
} | tee "$OUT/versions.txt"
python3 -m dlcore.cli plugins | tee "$OUT/plugins.txt"
python3 -m dlcore.cli check ffn --shape tokens=515,hidden=4096,inter=11008 --dtype bfloat16 --device cuda | tee "$OUT/check_ffn.txt"
python3 -m pytest -q -p no:cacheprovider -rs tests/kernels tests/test_gpu.py tests/test_compile.py tests/test_backends.py \
    2>&1 | tee "$OUT/native.log" | tail -15
TRITON_INTERPRET=1 python3 -m pytest -q -p no:cacheprovider tests --ignore=tests/test_gpu.py 2>&1 | tee "$OUT/interpreter.log" | tail -5
