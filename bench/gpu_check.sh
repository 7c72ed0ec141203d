#!/bin/bash
# One device call (see CONTRIBUTING / the device tool): install the carried wheels (.whl/: depyf,
# expecttest and their needs) and torch_ext, then
#   bash bench/gpu_check.sh tests   the GPU-marked tests, then the whole CPU suite on this torch (2.11)
#   bash bench/gpu_check.sh bench   python bench/decode.py (extra args go to it)
#   bash bench/gpu_check.sh profile python bench/dev/decode_profile.py (where a step's time goes), then the benchmark
#   bash bench/gpu_check.sh all     the GPU tests, the benchmark, then the CPU suite (shorter timeouts)
#   bash bench/gpu_check.sh gpu     the GPU tests only
#   bash bench/gpu_check.sh tp      python bench/tp_decode.py (2 GPUs; extra args go to it)
#   bash bench/gpu_check.sh hf      python bench/hf_decode.py (extra args go to it)
#   bash bench/gpu_check.sh hfgen   python bench/hf_generate.py (cold/warm process ready time; extra args go to it)
#   bash bench/gpu_check.sh warm    issue 49: the warm-start fidelity GPU test (cold vs warm kernels, printed), then
#                                   python bench/hf_generate.py (extra args go to it)
#   bash bench/gpu_check.sh hfprofile  python bench/dev/hf_decode_profile.py (extra args go to it)
#   bash bench/gpu_check.sh floor   python bench/inference_floor.py (extra args go to it)
#   bash bench/gpu_check.sh attn    python bench/dev/decode_attention_op.py, then the decode-attention GPU tests
#   bash bench/gpu_check.sh train   python bench/checkpoint_training.py --device cuda (extra args go to it)
#   bash bench/gpu_check.sh prefetch  python bench/experiments/l2_prefetch.py (extra args go to it)
#   bash bench/gpu_check.sh pdl     python bench/experiments/pdl_gemv.py (extra args go to it)
#   bash bench/gpu_check.sh linear  python bench/dev/decode_linear_op.py (extra args go to it), then the decode-linear GPU tests
#   bash bench/gpu_check.sh mma     the CUDA decode-linear path's GPU tests (stop at the first failure), then
#                                   python bench/dev/decode_linear_op.py (extra args go to it)
#   bash bench/gpu_check.sh regional  python bench/dev/regional_cudagraphs.py (extra args go to it), then the GPU tests
#   bash bench/gpu_check.sh memory  python bench/dev/memory_held.py (what compiled decode holds; extra args go to it)
#   bash bench/gpu_check.sh run CMD...  any command after the install (one call, several steps)
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
what=${1:-all}; shift
gpu_tests() {
  timeout "$1" python3 -m pytest -q -s -p no:cacheprovider -p no:logging -m gpu tests/*_gpu.py \
    2>&1 | tee "$OUT/gpu_tests.log"
}
cpu_suite() {  # the CPU suite on this machine's torch (2.11), slow tests too (CI runs them on 2.15 and 2.9.1): 14 workers
  timeout "$1" python3 -m pytest -v -p no:cacheprovider -n 14 -rf --tb=short -m "not gpu" tests >"$OUT/cpu_suite.log" 2>&1
  grep -E "(FAILED|ERROR) |passed|failed" "$OUT/cpu_suite.log" | grep -v "^E " | tail -40
}
case "$what" in
  tests) gpu_tests 200; cpu_suite 380 ;;
  gpu) gpu_tests "${GPU_TESTS_TIMEOUT:-240}" ;;
  tp) timeout "${TP_TIMEOUT:-420}" python3 bench/tp_decode.py "$@" 2>&1 | tee "$OUT/tp_decode.log" ;;
  hf) timeout "${HF_TIMEOUT:-420}" python3 bench/hf_decode.py "$@" 2>&1 | tee "$OUT/hf_decode.log" ;;
  train) timeout "${TRAIN_TIMEOUT:-560}" python3 bench/checkpoint_training.py --device cuda "$@" 2>&1 | tee "$OUT/checkpoint_training.log" ;;
  floor) timeout "${FLOOR_TIMEOUT:-560}" python3 bench/inference_floor.py "$@" 2>&1 | grep -v "GuardFree\|_guarded_call" \
           | tee "$OUT/inference_floor.log" ;;
  attn) timeout 120 python3 bench/dev/decode_attention_op.py "$@" 2>&1 | tee "$OUT/decode_attention_op.log"
        timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_decode_attention_gpu.py 2>&1 \
          | tee "$OUT/decode_attention_gpu_tests.log" | tail -5 ;;
  regional) timeout 300 python3 bench/dev/regional_cudagraphs.py "$@" 2>&1 | tee "$OUT/regional_cudagraphs.log"
            gpu_tests "${GPU_TESTS_TIMEOUT:-240}" | tail -3 ;;
  prefetch) timeout "${PREFETCH_TIMEOUT:-400}" python3 bench/experiments/l2_prefetch.py "$@" 2>&1 | tee "$OUT/l2_prefetch.log" ;;
  pdl) timeout "${PDL_TIMEOUT:-300}" python3 bench/experiments/pdl_gemv.py "$@" 2>&1 | tee "$OUT/pdl_gemv.log" ;;
  linear) timeout 200 python3 bench/dev/decode_linear_op.py "$@" 2>&1 | tee "$OUT/decode_linear_op.log"
          timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_decode_linear_gpu.py 2>&1 \
            | tee "$OUT/decode_linear_gpu_tests.log" | tail -15 ;;
  mma) timeout 240 python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/test_decode_linear_mma_gpu.py 2>&1 \
         | tee "$OUT/decode_linear_mma_gpu_tests.log" | tail -15
       timeout "${MMA_TIMEOUT:-300}" python3 bench/dev/decode_linear_op.py "$@" 2>&1 | tee "$OUT/decode_linear_op.log" ;;
  memory) timeout "${MEMORY_TIMEOUT:-400}" python3 bench/dev/memory_held.py "$@" 2>&1 | tee "$OUT/memory_held.log" ;;
  run) "$@" ;;
  hfgen) timeout "${HF_TIMEOUT:-540}" python3 bench/hf_generate.py "$@" 2>&1 | tee "$OUT/hf_generate.log" ;;
  warm) timeout 300 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_warm_start_fidelity_gpu.py 2>&1 \
          | tee "$OUT/warm_start_fidelity_gpu.log" | tail -60
        timeout "${HF_TIMEOUT:-290}" python3 bench/hf_generate.py "$@" 2>&1 | tee "$OUT/hf_generate.log" ;;
  hfprofile) timeout "${HF_TIMEOUT:-420}" python3 bench/dev/hf_decode_profile.py "$@" 2>&1 | tee "$OUT/hf_profile.log" ;;
  profile) timeout 250 python3 bench/dev/decode_profile.py 2>&1 | tee "$OUT/profile.log"
           timeout 300 python3 bench/decode.py "$@" 2>&1 | tee "$OUT/decode.log" ;;
  bench) timeout "${BENCH_TIMEOUT:-560}" python3 bench/decode.py "$@" 2>&1 | tee "$OUT/decode.log" ;;
  all) gpu_tests 90; timeout 330 python3 bench/decode.py "$@" 2>&1 | tee "$OUT/decode.log"; cpu_suite 170 ;;
esac
