#!/usr/bin/env bash
# One short check of the weight transport on a GPU machine (no vLLM needed there):
# the NCCL/CUDA checks of benchmarks/gpu_check.py, then the `gpu`-marked tests of the
# transport (they skip what needs two GPUs when only one is visible). Prints a summary;
# exit status 1 if anything failed. Run from the repository root:
#     bash benchmarks/gpu_check.sh            (PYTHON=... to pick the interpreter)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

echo "== benchmarks/gpu_check.py =="
timeout 300 "$PY" benchmarks/gpu_check.py
check_rc=$?

echo
echo "== pytest -m gpu (transport) =="
if "$PY" -c "import pytest" 2>/dev/null; then
    # Only the transport's test files: they import neither vLLM nor Ray.
    timeout 300 "$PY" -m pytest -m gpu -v -rs -p no:cacheprovider -o addopts="" \
        tests/test_transport_buckets.py tests/test_transport_broadcast.py tests/test_weight_sync_gpu.py
    tests_rc=$?
    [ "$tests_rc" -eq 5 ] && tests_rc=0  # 5: nothing collected (no CUDA): gpu_check.py says why
else
    echo "pytest is not installed here: skipped (gpu_check.py above covers the same paths)"
    tests_rc=0
fi

echo
echo "== summary =="
echo "gpu_check.py: $([ $check_rc -eq 0 ] && echo PASS || echo "FAIL (rc $check_rc)")"
echo "gpu tests:    $([ $tests_rc -eq 0 ] && echo PASS || echo "FAIL (rc $tests_rc)")"
[ $check_rc -eq 0 ] && [ $tests_rc -eq 0 ]
