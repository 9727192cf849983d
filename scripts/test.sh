#!/usr/bin/env bash
# Set up if needed, then run the tests, listing the 25 slowest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export ASYNCRL_CACHE=${ASYNCRL_CACHE:-$PWD/.cache/asyncrl}
exec .venv/bin/python -m pytest --durations=25 "$@"
