"""asyncrl: asynchronous off-policy RL post-training of LLMs."""

import time as _time

# `python -m asyncrl.train` imports this package first, so this is the start of the run's
# own work; `startup_seconds` counts from here. Not the process's create time: a shell
# script that `exec`s Python (scripts/run.sh, after its set-up) keeps the shell's.
STARTED_AT = _time.time()

# Where the start-up went: seconds from STARTED_AT at each named point the driver passed
# (asyncrl.train writes them to summary.json as `startup_phases`).
STARTUP_MARKS: dict[str, float] = {}


def startup_mark(name: str, at: float | None = None) -> None:
    """Record that the driver's start-up reached ``name`` (the first time only), now
    or at unix time ``at``."""
    STARTUP_MARKS.setdefault(name, round((_time.time() if at is None else at) - STARTED_AT, 2))
