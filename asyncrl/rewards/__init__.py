"""Rewards: the contract (base.py), the built-in components, the combination of several
(combine.py) and the pool of reward workers off the generation path (pool.py)."""
