#!/usr/bin/env bash
# Set up if needed, then run the default training job (tiny model, CPU, local Ray).
# Any Hydra override can follow: scripts/run.sh max_steps=50 replay.max_staleness=4
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m asyncrl.train "$@"
