#!/usr/bin/env bash
# One device call: install, GPU tests (bf16 through the Triton kernels), then the benchmarks.
# Everything lands in $OUT (the device tool brings it back); run from the repository root.
# SKIP_TESTS / SKIP_ATTN / SKIP_DAN / SKIP_PROFILE=1 leave a part out; TESTS picks test files.
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
[ -n "${SKIP_TESTS:-}" ] || OPSMATH_TEST_DEVICE=cuda timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -x --tb=short \
    -p no:warnings ${TESTS:-tests/test_models.py tests/test_kernel_dropout_add_norm.py tests/test_kernel_attention.py} \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -25
[ -n "${SKIP_ATTN:-}" ] || (cd benchmarks && timeout ${BENCH_TIMEOUT:-200} python3 attention.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/attention.log" | tail -45)
[ -n "${SKIP_DAN:-}" ] || (cd benchmarks && timeout 120 python3 dropout_add_norm.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/dropout_add_norm.log" | tail -40)
[ -n "${SKIP_PROFILE:-}" ] || (cd benchmarks && timeout 60 python3 profile_dropout_add_norm.py 2>&1 | tee "$OUT/profile_dan.log" | tail -40)
[ -n "${SKIP_STEP:-}" ] || (cd benchmarks && timeout 150 python3 profile_step.py 2>&1 | tee "$OUT/profile_step.log" | tail -30)
