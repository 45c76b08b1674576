"""Circuit breaker (brpc's docs/en/circuit_breaker.md, src/brpc/circuit_breaker.cpp)."""

from __future__ import annotations

import math

import pytest

from aiobrpc import errors
from aiobrpc.client.circuit_breaker import CircuitBreaker

FAIL = errors.EFAILEDSOCKET
L = 1000  # latency of successful calls, µs
SLOW = 10 * L  # latency of failed calls: above the cap, so each costs multiple × L


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def errors_allowed_while_initializing(window: int, percent: int) -> int:
    """Errors a recorder tolerates before it has seen `window` samples (integer arithmetic)."""
    return window * percent // 100


def failures_to_trip(window: int, percent: int, cost: float, epsilon: float = 0.02) -> int:
    """Consecutive failures (after a steady latency L, no error cost) that make a recorder
    unhealthy: the smallest k with k × cost > L × window × percent/100 × (1 + epsilon)."""
    budget = L * window * (percent / 100) * (1 + epsilon)
    return math.floor(budget / cost) + 1


def warm_up(breaker: CircuitBreaker, samples: int) -> None:
    for _ in range(samples):
        assert breaker.on_call_end(0, L)


def count_until_trip(breaker: CircuitBreaker, code: int, latency: int, limit: int) -> int:
    for k in range(1, limit + 1):
        if not breaker.on_call_end(code, latency):
            return k
    raise AssertionError(f"no trip after {limit} reports")


def test_init_phase_trips_after_the_error_count_with_defaults():
    expected = 1 + min(errors_allowed_while_initializing(3000, 5),
                       errors_allowed_while_initializing(1500, 10))
    assert expected == 151
    breaker = CircuitBreaker()
    assert count_until_trip(breaker, FAIL, L, 1000) == expected
    assert breaker.broken and breaker.isolated_times == 1


@pytest.mark.parametrize("long, short", [((1000, 5), (100, 10)), ((100, 3), (1000, 10)),
                                         ((50, 0), (40, 10))])
def test_init_phase_the_stricter_recorder_decides(long, short):
    breaker = CircuitBreaker(long_window=long[0], long_error_percent=long[1],
                             short_window=short[0], short_error_percent=short[1])
    warm_up(breaker, 20)  # successes count as samples but not as errors
    expected = 1 + min(errors_allowed_while_initializing(*long),
                       errors_allowed_while_initializing(*short))
    assert count_until_trip(breaker, FAIL, L, 100) == expected


@pytest.mark.parametrize("long, short, fail_latency", [
    ((3000, 5), (1500, 10), SLOW),  # defaults
    ((400, 5), (200, 5), SLOW),     # the short window trips first
    ((400, 5), (200, 20), SLOW),    # the long window trips first
    ((3000, 5), (1500, 10), 700),   # failures faster than the cap cost their latency
])
def test_ema_trip_after_the_init_phase(long, short, fail_latency):
    multiple = 2.0
    breaker = CircuitBreaker(long_window=long[0], long_error_percent=long[1],
                             short_window=short[0], short_error_percent=short[1],
                             max_failed_latency_multiple=multiple)
    warm_up(breaker, max(long[0], short[0]))  # both recorders leave the init phase
    cost = min(multiple * L, fail_latency)
    expected = min(failures_to_trip(*long, cost), failures_to_trip(*short, cost))
    assert count_until_trip(breaker, FAIL, fail_latency, 10_000) == expected


def test_steady_error_rate_below_the_budget_never_trips():
    breaker = CircuitBreaker()
    warm_up(breaker, 3000)
    gap = 20  # one failure every 20 calls: 5 %
    # Between failures gap-1 successes multiply the error cost by smooth each; the cost right
    # after a failure converges to cost / (1 - smooth^(gap-1)), which must stay in budget.
    for window, percent in ((3000, 5), (1500, 10)):
        smooth = 0.02 ** (1 / window)
        steady = 2 * L / (1 - smooth ** (gap - 1))
        assert steady < L * window * percent / 100 * 1.02
    for i in range(20_000):
        assert breaker.on_call_end(FAIL if i % gap == 0 else 0, SLOW if i % gap == 0 else L)


def test_elimit_is_ignored():
    breaker = CircuitBreaker()
    for _ in range(10_000):
        assert breaker.on_call_end(errors.ELIMIT, L)
    # ELIMIT did not count as samples or errors: the init phase still allows 150 errors.
    assert count_until_trip(breaker, FAIL, L, 1000) == 151


def test_trip_is_reported_once_and_reports_are_ignored_while_broken():
    breaker = CircuitBreaker(long_window=20, short_window=20)
    expected = 1 + min(errors_allowed_while_initializing(20, 5),
                       errors_allowed_while_initializing(20, 10))
    assert count_until_trip(breaker, FAIL, L, 10) == expected
    assert all(breaker.on_call_end(FAIL, L) for _ in range(100))
    assert breaker.on_call_end(0, L)
    breaker.mark_as_broken()
    assert breaker.isolated_times == 1


def test_isolation_duration_doubles_while_revivals_are_recent_and_resets_after():
    clock = FakeClock()
    breaker = CircuitBreaker(clock=clock)
    assert breaker.isolation_duration_ms == 100
    breaker.mark_as_broken()  # never revived before: the minimum
    durations = [breaker.isolation_duration_ms]
    for _ in range(11):
        clock.now += 0.1
        breaker.reset()
        clock.now += 1  # fails again 1 s after the revival (< 30 s)
        breaker.mark_as_broken()
        durations.append(breaker.isolation_duration_ms)
    assert durations == [min(100 * 2 ** i, 30000) for i in range(12)]
    assert durations[-2:] == [30000, 30000]
    breaker.reset()
    clock.now += 30  # 30 s after the revival is not "less than 30 s ago"
    assert count_until_trip(breaker, FAIL, L, 1000) == 151  # a breaker trip counts too
    assert breaker.isolation_duration_ms == 100
    assert breaker.isolated_times == 13


def test_isolation_bounds_are_configurable():
    clock = FakeClock()
    breaker = CircuitBreaker(min_isolation_ms=10, max_isolation_ms=25, clock=clock)
    seen = []
    for _ in range(3):
        breaker.mark_as_broken()
        seen.append(breaker.isolation_duration_ms)
        breaker.reset()
    assert seen == [10, 20, 25]


def test_reset_restarts_the_count_of_an_initializing_recorder():
    breaker = CircuitBreaker()
    assert count_until_trip(breaker, FAIL, L, 1000) == 151
    breaker.reset()
    assert not breaker.broken
    assert count_until_trip(breaker, FAIL, L, 1000) == 151


def test_reset_clears_the_error_cost_but_keeps_the_latency_average():
    breaker = CircuitBreaker()
    warm_up(breaker, 3000)
    expected = failures_to_trip(1500, 10, 2 * L)
    for _ in range(expected - 1):
        assert breaker.on_call_end(FAIL, SLOW)
    breaker.reset()  # without it the next failure would trip
    for _ in range(expected - 1):
        assert breaker.on_call_end(FAIL, SLOW)
    assert not breaker.on_call_end(FAIL, SLOW)  # EMA mode still: not the init-phase count


def test_successes_decay_the_error_cost():
    breaker = CircuitBreaker()
    warm_up(breaker, 3000)
    expected = failures_to_trip(1500, 10, 2 * L)
    for _ in range(expected - 1):
        assert breaker.on_call_end(FAIL, SLOW)
    warm_up(breaker, 10_000)  # smooth^10000 of the cost is left, then < 500 µs is zeroed
    for _ in range(expected - 1):
        assert breaker.on_call_end(FAIL, SLOW)


def test_half_open_window():
    clock = FakeClock()
    breaker = CircuitBreaker(half_open_window=3, clock=clock)
    breaker.mark_as_broken()
    breaker.reset()
    assert not breaker.on_call_end(FAIL, L)  # the first failure after revival isolates
    assert breaker.broken and breaker.isolated_times == 2
    assert breaker.isolation_duration_ms == 200  # revived less than 30 s before
    breaker.reset()
    assert breaker.on_call_end(0, L) and breaker.on_call_end(0, L)
    assert not breaker.on_call_end(FAIL, L)  # 2 of 3 successes are not enough
    breaker.reset()
    warm_up(breaker, 3)  # the window passed: back to normal judgement
    assert breaker.on_call_end(FAIL, L)
    assert not breaker.broken


def test_half_open_is_off_by_default():
    breaker = CircuitBreaker()
    breaker.mark_as_broken()
    breaker.reset()
    assert breaker.on_call_end(FAIL, L)


@pytest.mark.parametrize("kwargs, match", [
    ({"long_window": 0}, "long_window"), ({"short_window": 1.5}, "short_window"),
    ({"long_error_percent": 101}, "long_error_percent"),
    ({"short_error_percent": -1}, "short_error_percent"),
    ({"epsilon": 0}, "epsilon"), ({"epsilon": 1}, "epsilon"),
    ({"min_error_cost_us": -1}, "min_error_cost_us"),
    ({"max_failed_latency_multiple": 0}, "max_failed_latency_multiple"),
    ({"min_isolation_ms": 0}, "min_isolation_ms"),
    ({"min_isolation_ms": 200, "max_isolation_ms": 100}, "max_isolation_ms"),
    ({"half_open_window": -1}, "half_open_window"),
])
def test_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CircuitBreaker(**kwargs)
