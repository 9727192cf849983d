"""Running on a Ray cluster whose nodes share neither the driver's files nor its venv:
the code ships through Ray's runtime_env (``ship.py``); what a learner rank on another
node writes reaches the driver's run directory through a file sink pinned to the
driver's node (asyncrl/storage: ``sink.py``, ``remote.py``). docs/cluster.md has the commands."""
