"""``env=browser``: a real headless Chromium as an environment (docs/envs.md).

actions.py (what the policy writes), tree.py (what it sees), sites.py (the web tasks,
their grading and scripted demonstrations), server.py (the loopback task server),
pool.py (the browsers), env.py (the env and ``task=browser``)."""

from asyncrl.envs.browser.env import BrowserEnv, BrowserTask
from asyncrl.envs.browser.pool import BrowserError, BrowserPool, PoolSettings

__all__ = ["BrowserEnv", "BrowserError", "BrowserPool", "BrowserTask", "PoolSettings"]
