"""When each request of a `bench --request-rate` level is sent: a Poisson process, as `vllm bench
serve --request-rate` sends them.

At R requests/s the gaps between consecutive requests are independent exponential draws with mean
1/R (the first request goes at 0), seeded so that every method of a run meets the same arrival
pattern; `inf` sends every request at once. A server's latency under load depends on how requests
arrive, not only on how many are in flight: a closed loop (`--concurrency N`) refills the moment
one answer ends, an open one keeps arriving whether or not the server keeps up, so queueing shows
in TTFT.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from specctl.errors import UsageError


def arrival_offsets(n: int, rate: float, seed: int | Sequence[int]) -> list[float]:
    """Seconds from the level's start at which each of `n` requests is sent (non-decreasing):
    0 for the first, then cumulative exponential gaps of mean 1/rate; all 0 when rate is inf.
    `seed` may be several ints (numpy's SeedSequence mixes them): one pattern per pass and group."""
    if not rate > 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(list(seed) if isinstance(seed, Sequence) else seed)
    gaps = rng.exponential(1.0 / rate, size=n - 1)  # [n-1]
    return [0.0, *np.cumsum(gaps).tolist()]


def rate_label(rate: float) -> str:
    """How a rate is written on the command line, in tables and as a JSON key: `4`, `0.5`, `inf`."""
    return "inf" if math.isinf(rate) else f"{rate:g}"


def parse_rate_list(text: str, flag: str = "--request-rate") -> list[float]:
    """`1,4,inf` -> [1.0, 4.0, inf], ascending and deduplicated; anything else a usage error."""
    rates = set()
    for part in text.split(","):
        try:
            rate = float(part.strip())
        except ValueError:
            rate = math.nan
        if not rate > 0:  # also refuses nan
            raise UsageError(
                f"{flag} {text!r}: expected requests/s > 0 or inf, comma-separated (e.g. 1,4,inf)"
            )
        rates.add(rate)
    return sorted(rates)
