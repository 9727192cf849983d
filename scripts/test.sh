#!/usr/bin/env bash
# Set up if needed, then run the tests on two pytest-xdist workers (ASYNCRL_TEST_WORKERS;
# 0: one process), listing the 25 slowest. Each test file runs whole on one worker, with
# the files that share a session fixture (tests/conftest.py). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export ASYNCRL_CACHE=${ASYNCRL_CACHE:-$PWD/.cache/asyncrl}
workers=${ASYNCRL_TEST_WORKERS:-2}
parallel=()
if [ "$workers" != 0 ]; then
  parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
fi
exec .venv/bin/python -m pytest --durations=25 "${parallel[@]}" "$@"
