"""A tool's answer time, as a search or code-execution service shows it: lognormal,
given by its median and its 99th percentile (the long tail a real service has).

    latency = median * exp(sigma * z),  z ~ N(0, 1),  sigma = ln(p99 / median) / Z99

so half the calls answer within ``median_ms`` and 99% within ``p99_ms`` (median 300 ms,
p99 2000 ms: sigma 0.82, mean 418 ms). ``median_ms`` 0: the tool answers at once.
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass

Z99 = 2.3263478740408408  # the standard normal's 99th percentile


@dataclass(frozen=True)
class ToolLatency:
    """``median_ms`` >= 0 (0: none) and ``p99_ms`` >= ``median_ms`` (equal: a fixed
    latency). ``key`` prefixes the names in error messages (e.g. ``env.tool_latency``)."""

    median_ms: float = 0.0
    p99_ms: float = 0.0
    key: str = "tool_latency"

    def __post_init__(self) -> None:
        for name, v in (("median_ms", self.median_ms), ("p99_ms", self.p99_ms)):
            if (
                isinstance(v, bool)
                or not isinstance(v, int | float)
                or not math.isfinite(v)
                or v < 0
            ):
                raise ValueError(f"{self.key}_{name}={v!r}: expected a number >= 0")
        if self.median_ms > 0 and self.p99_ms < self.median_ms:
            raise ValueError(
                f"{self.key}_p99_ms={self.p99_ms}: expected >= {self.key}_median_ms="
                f"{self.median_ms} (the 99th percentile is not below the median)"
            )

    @property
    def sigma(self) -> float:
        """The log-latency's standard deviation."""
        return math.log(self.p99_ms / self.median_ms) / Z99 if self.median_ms > 0 else 0.0

    def draw(self, rng: random.Random) -> float:
        """One call's latency in seconds (0.0 without latency; the rng is not used then)."""
        if self.median_ms <= 0:
            return 0.0
        return self.median_ms / 1000.0 * math.exp(self.sigma * rng.gauss(0.0, 1.0))

    async def wait(self, rng: random.Random) -> float:
        """Sleep one drawn latency (on the event loop: other episodes run meanwhile);
        returns the seconds drawn."""
        s = self.draw(rng)
        if s > 0:
            await asyncio.sleep(s)
        return s
