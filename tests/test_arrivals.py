"""bench --request-rate: the arrival times of a level (a seeded Poisson process) and the rate list."""

from __future__ import annotations

import math
import random

import pytest

from specctl.bench.arrivals import arrival_offsets, parse_rate_list, rate_label
from specctl.errors import UsageError


def test_arrivals_are_a_seeded_poisson_process():
    rate, n = 4.0, 20000
    times = arrival_offsets(n, rate, seed=7)
    assert len(times) == n and times[0] == 0.0
    assert times == arrival_offsets(n, rate, seed=7)  # seeded: every method meets the same arrivals
    assert times != arrival_offsets(n, rate, seed=8)
    gaps = sorted(b - a for a, b in zip(times, times[1:], strict=False))
    assert min(gaps) >= 0
    # Kolmogorov-Smirnov against the exponential CDF 1 - exp(-rate t): the gaps' largest distance
    # stays under the 99.9% critical value 1.95 / sqrt(m)
    m = len(gaps)
    ks = max(
        max((i + 1) / m - (1 - math.exp(-rate * g)), (1 - math.exp(-rate * g)) - i / m)
        for i, g in enumerate(gaps)
    )
    assert ks < 1.95 / math.sqrt(m)
    assert abs(sum(gaps) / m - 1 / rate) < 0.03 / rate  # mean gap 1/rate (sd of the mean ~0.007/rate)


def test_arrivals_count_in_a_window_is_poisson():
    """The brute-force reference: count arrivals per one-second window over many seeds and compare
    the mean and variance with a Poisson law's (both = rate)."""
    rate = 3.0
    counts = []
    for seed in range(400):
        times = arrival_offsets(60, rate, seed)  # 60 requests reach well past t = 11 s
        counts += [sum(k <= t < k + 1 for t in times[1:]) for k in range(1, 11)]
    mean = sum(counts) / len(counts)
    var = sum((c - mean) ** 2 for c in counts) / (len(counts) - 1)
    assert abs(mean - rate) < 0.1 and abs(var - rate) < 0.3
    # the same windows counted from a process built by hand with the standard library
    rng, brute = random.Random(0), []
    for _ in range(400):
        t, times = 0.0, [0.0]
        while len(times) < 60:
            t += rng.expovariate(rate)
            times.append(t)
        brute += [sum(k <= t < k + 1 for t in times[1:]) for k in range(1, 11)]
    assert abs(mean - sum(brute) / len(brute)) < 0.15


def test_infinite_rate_sends_everything_at_once():
    assert arrival_offsets(5, math.inf, seed=0) == [0.0] * 5
    assert arrival_offsets(0, 2.0, seed=0) == []
    assert arrival_offsets(1, 2.0, seed=0) == [0.0]
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0, seed=0)


def test_parse_rate_list():
    assert parse_rate_list("4,1,inf,1") == [1.0, 4.0, math.inf]
    assert parse_rate_list("0.5") == [0.5]
    assert [rate_label(r) for r in parse_rate_list("1,0.5,inf")] == ["0.5", "1", "inf"]
    for bad in ("0", "-1", "nan", "fast", "1,,2"):
        with pytest.raises(UsageError, match="--request-rate"):
            parse_rate_list(bad)
