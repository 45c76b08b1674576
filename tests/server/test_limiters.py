"""The per-method concurrency limiters on a clock the test moves (brpc's rules; docs/server.md)."""

from __future__ import annotations

import math
import random

import pytest

from aiobrpc.errors import EINTERNAL, ELIMIT
from aiobrpc import limiters as L


class Clock:
    def __init__(self) -> None:
        self.us = 1_000_000

    def __call__(self) -> int:
        return self.us


def feed(lim, clock: Clock, n: int, latency_us: int, every_us: int, code: int = 0) -> None:
    for _ in range(n):
        clock.us += every_us
        lim.on_responded(code, latency_us)


def test_constant_and_settings():
    lim = L.make_limiter(4)
    assert [lim.on_requested(c) for c in (1, 4, 5)] == [True, True, False]
    assert L.make_limiter(0) is None and L.make_limiter("unlimited") is None
    assert isinstance(L.make_limiter("auto"), L.AutoLimiter)
    t = L.make_limiter({"timeout_ms": 50, "max_concurrency": 7})
    assert (t.timeout_ms, t.max_concurrency) == (50, 7)
    for bad in (-1, True, "fast", {"timeout_ms": 0}, {"other": 1}):
        with pytest.raises(ValueError, match="max_concurrency"):
            L.make_limiter(bad)


def test_auto_learns_littles_law_and_backs_off_when_latency_grows():
    clock = Clock()
    lim = L.AutoLimiter(clock=clock, rng=random.Random(1))
    assert lim.max_concurrency == 40
    # no load: 10 ms per call, 1000 calls/s (one response per ms, each sampled)
    feed(lim, clock, 200, 10_000, 1000)
    assert lim.min_latency_us == 10_000 and lim.ema_max_qps == pytest.approx(1000, rel=0.01)
    assert lim.max_concurrency == 13  # 10 ms x 1000/s x (1 + 0.3)
    # the same throughput but 3x the latency: queueing, so the headroom shrinks to its floor
    for _ in range(15):
        feed(lim, clock, 200, 30_000, 1000)
    assert lim.explore_ratio == pytest.approx(L.MIN_EXPLORE_RATIO)
    assert lim.max_concurrency == 10  # 10 ms x ~1000/s x 1.06
    assert lim.on_requested(10) and not lim.on_requested(11)


def test_auto_ignores_elimit_and_halves_without_successes():
    clock = Clock()
    lim = L.AutoLimiter(clock=clock, rng=random.Random(1))
    feed(lim, clock, 500, 1, 1000, code=ELIMIT)
    assert lim.max_concurrency == 40 and lim._window.samples == 0
    feed(lim, clock, 200, 5_000, 1000, code=EINTERNAL)
    assert lim.max_concurrency == 20
    # failures and short windows: a window of too few samples is dropped once it is old
    feed(lim, clock, 50, 5_000, 30_000)
    assert lim._window.samples < L.MIN_SAMPLE_COUNT


def test_auto_remeasures_the_no_load_latency():
    clock = Clock()
    lim = L.AutoLimiter(clock=clock, rng=random.Random(1))
    feed(lim, clock, 200, 10_000, 1000)
    clock.us = lim._remeasure_at_us
    feed(lim, clock, 201, 10_000, 1000)  # the first sample finds a stale window and restarts it
    assert lim._reset_latency_at_us > 0
    # ceil(peak QPS x no-load latency x 0.9): about 1000/s x 10 ms x 0.9
    assert lim.max_concurrency == math.ceil(lim.ema_max_qps * lim.min_latency_us / 1e6 * 0.9) in (9, 10)
    feed(lim, clock, 5, 99_000, 1)  # during the pause: ignored
    assert lim.min_latency_us == 10_000
    clock.us = lim._reset_latency_at_us
    feed(lim, clock, 201, 4_000, 1000)  # after it: learnt again from scratch
    assert lim.min_latency_us == 4_000


def test_auto_samples_at_most_one_response_per_tenth_of_a_millisecond():
    clock = Clock()
    lim = L.AutoLimiter(clock=clock)
    feed(lim, clock, 1000, 100, 10)  # 1000 responses in 10 ms
    assert lim._window.samples == 100 and lim._window.succ_requests == 1000


def test_timeout_limiter_admits_while_the_mean_latency_is_under_the_timeout():
    clock = Clock()
    lim = L.TimeoutLimiter(timeout_ms=20, max_concurrency=50, clock=clock)
    assert lim.on_requested(50) and not lim.on_requested(51)
    feed(lim, clock, 200, 30_000, 1000)  # 30 ms on average: over the 20 ms timeout
    assert lim.avg_latency_us == 30_000
    assert lim.on_requested(1) and not lim.on_requested(2)  # one is always let in
    assert lim.on_requested(2, timeout_ms=40)  # the request's own timeout counts
    feed(lim, clock, 200, 5_000, 1000, code=EINTERNAL)  # no success: the mean doubles
    assert lim.avg_latency_us == 60_000
