"""Offline tools over a run's directory: ``asyncrl-inspect`` (tables and an HTML report)
and ``asyncrl-replay`` (the learner's steps again, from a checkpoint)."""
