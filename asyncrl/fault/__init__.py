"""Fault tolerance: dead rollout actors and engines come back (``actors.py``), a dead
learner restarts the run from its newest checkpoint (``learner.py``). Settings:
``fault.*`` (``settings.py``, conf/fault/default.yaml)."""
