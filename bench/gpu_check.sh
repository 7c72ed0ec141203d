#!/bin/bash
# One device call (see CONTRIBUTING / the device tool): install the carried wheels (.whl/: depyf,
# expecttest and their needs) and torch_ext, then
#   bash bench/gpu_check.sh tests   the GPU-marked tests, then the CPU suite on this torch (2.11)
#   bash bench/gpu_check.sh bench   python bench/decode.py (extra args go to it)
# Logs go to $OUT (or /tmp/torch_ext_gpu).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/torch_ext_gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
what=${1:-tests}; shift
case "$what" in
  tests)
    timeout 420 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_cudagraph_gpu.py 2>&1 | tee "$OUT/gpu_tests.log"
    timeout 150 python3 -m pytest -q -p no:cacheprovider -n 12 -m "not slow and not gpu" tests 2>&1 | tail -40 | tee "$OUT/cpu_suite.log"
    ;;
  bench)
    python3 bench/decode.py "$@" 2>&1 | tee "$OUT/decode.log"
    ;;
esac
