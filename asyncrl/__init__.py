"""asyncrl: asynchronous off-policy RL post-training of LLMs."""

import time as _time

# `python -m asyncrl.train` imports this package first, so this is the start of the run's
# own work; `startup_seconds` counts from here. Not the process's create time: a shell
# script that `exec`s Python (scripts/run.sh, after its set-up) keeps the shell's.
STARTED_AT = _time.time()
