"""Per-server circuit breaker (brpc's docs/en/circuit_breaker.md, src/brpc/circuit_breaker.cpp).

Every attempt on a server reports (error_code, latency_us). Two recorders, a long and a short
window, keep an exponential moving average of the successful latency and of the "error cost"
(the latency of failed calls, capped at `max_failed_latency_multiple` × the average). A
recorder is unhealthy when its error cost exceeds the cost of `error_percent` % of `window`
average calls. Until a recorder has seen `window` samples it counts errors instead. When
either is unhealthy the server is isolated; the caller revives it after
`isolation_duration_ms` (the health check) and then calls `reset()`.

>>> now = [0.0]
>>> breaker = CircuitBreaker(long_window=20, short_window=10, clock=lambda: now[0])
>>> breaker.on_call_end(0, 1000)
True
>>> breaker.on_call_end(1009, 1000)   # 10 % of 10 = 1 error allowed while initializing
True
>>> breaker.on_call_end(1009, 1000)
False
>>> breaker.broken, breaker.isolation_duration_ms
(True, 100)
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..errors import ELIMIT
from ..options import circuit_breaker_settings


class _EmaErrorRecorder:
    """One window of the breaker (brpc's EmaErrorRecorder)."""

    __slots__ = ("window", "error_percent", "_smooth", "_epsilon", "_min_error_cost_us",
                 "_max_failed_latency_multiple", "samples_when_initializing",
                 "errors_when_initializing", "ema_error_cost", "ema_latency")

    def __init__(self, window: int, error_percent: int, epsilon: float,
                 min_error_cost_us: float, max_failed_latency_multiple: float) -> None:
        self.window = window
        self.error_percent = error_percent
        self._smooth = epsilon ** (1.0 / window)
        self._epsilon = epsilon
        self._min_error_cost_us = min_error_cost_us
        self._max_failed_latency_multiple = max_failed_latency_multiple
        self.samples_when_initializing = 0
        self.errors_when_initializing = 0
        self.ema_error_cost = 0.0
        self.ema_latency = 0.0

    def on_call_end(self, error_code: int, latency_us: int) -> bool:
        """True while healthy."""
        if error_code == 0:
            self._update_latency(latency_us)
            healthy = self._update_error_cost(0.0)
        else:
            healthy = self._update_error_cost(float(latency_us))
        if self.samples_when_initializing < self.window:
            # Too few samples for the averages: judge by the error count.
            self.samples_when_initializing += 1
            if error_code != 0:
                previous_errors = self.errors_when_initializing
                self.errors_when_initializing += 1
                return previous_errors < self.window * self.error_percent // 100
            return True
        return healthy

    def reset(self) -> None:
        if self.samples_when_initializing < self.window:
            self.samples_when_initializing = 0
            self.errors_when_initializing = 0
            self.ema_latency = 0.0
        self.ema_error_cost = 0.0

    def _update_latency(self, latency_us: float) -> None:
        if self.ema_latency == 0:
            self.ema_latency = float(latency_us)
        else:
            self.ema_latency = self.ema_latency * self._smooth + latency_us * (1 - self._smooth)

    def _update_error_cost(self, error_cost: float) -> bool:
        if self.ema_latency != 0:
            error_cost = min(self.ema_latency * self._max_failed_latency_multiple, error_cost)
        if error_cost != 0:
            self.ema_error_cost += error_cost
            max_error_cost = (self.ema_latency * self.window * (self.error_percent / 100)
                              * (1 + self._epsilon))
            return self.ema_error_cost <= max_error_cost
        # A success (or a zero-latency failure): the error cost decays.
        if self.ema_error_cost < self._min_error_cost_us:
            self.ema_error_cost = 0.0
        else:
            self.ema_error_cost *= self._smooth
        return True


class CircuitBreaker:
    """Decides when a server is isolated and for how long.

    * `on_call_end(error_code, latency_us)` per attempt; False means "isolate the server now"
      and is returned once per trip: while broken, reports are ignored (True). ELIMIT reports
      are always ignored (an overloaded cluster must not lose servers).
    * `mark_as_broken()` when the server fails for any other reason (a broken connection):
      every isolation updates `isolation_duration_ms`, the delay before its health check.
      It doubles (up to `max_isolation_ms`) when the previous revival was less than
      `max_isolation_ms` ago, else it restarts at `min_isolation_ms`.
    * `reset()` on revival: error costs are cleared (and the counts of a recorder still
      initializing). With `half_open_window` N > 0, the next N calls after a revival must all
      succeed: the first failure among them isolates the server again.
    """

    def __init__(self, *, long_window: int = 3000, long_error_percent: int = 5,
                 short_window: int = 1500, short_error_percent: int = 10,
                 epsilon: float = 0.02, min_error_cost_us: float = 500,
                 max_failed_latency_multiple: float = 2.0, min_isolation_ms: int = 100,
                 max_isolation_ms: int = 30000, half_open_window: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        circuit_breaker_settings({  # the checks ChannelOptions runs on circuit_breaker_options too
            "long_window": long_window, "long_error_percent": long_error_percent,
            "short_window": short_window, "short_error_percent": short_error_percent,
            "epsilon": epsilon, "min_error_cost_us": min_error_cost_us,
            "max_failed_latency_multiple": max_failed_latency_multiple,
            "min_isolation_ms": min_isolation_ms, "max_isolation_ms": max_isolation_ms,
            "half_open_window": half_open_window})
        recorder_args = (epsilon, min_error_cost_us, max_failed_latency_multiple)
        self._long = _EmaErrorRecorder(long_window, long_error_percent, *recorder_args)
        self._short = _EmaErrorRecorder(short_window, short_error_percent, *recorder_args)
        self._min_isolation_ms = min_isolation_ms
        self._max_isolation_ms = max_isolation_ms
        self._half_open_window = half_open_window
        self._clock = clock
        self._isolation_duration_ms = min_isolation_ms
        self._isolated_times = 0
        self._broken = False
        self._last_reset_ms: float | None = None  # never revived yet
        self._half_open = False
        self._half_open_successes = 0

    @property
    def isolation_duration_ms(self) -> int:
        """How long the current (or next) isolation lasts before the health check."""
        return self._isolation_duration_ms

    @property
    def isolated_times(self) -> int:
        return self._isolated_times

    @property
    def broken(self) -> bool:
        return self._broken

    def on_call_end(self, error_code: int, latency_us: int) -> bool:
        """Record one attempt; False exactly when the server must be isolated now."""
        if error_code == ELIMIT or self._broken:
            return True
        if self._half_open:
            if error_code != 0:
                self.mark_as_broken()
                return False
            self._half_open_successes += 1
            if self._half_open_successes == self._half_open_window:
                self._half_open = False
                self._half_open_successes = 0
        # Like brpc, the short window is not told when the long one already tripped.
        if self._long.on_call_end(error_code, latency_us) \
                and self._short.on_call_end(error_code, latency_us):
            return True
        self.mark_as_broken()
        return False

    def mark_as_broken(self) -> None:
        """Isolate the server (no-op while already broken)."""
        if self._broken:
            return
        self._broken = True
        self._isolated_times += 1
        now_ms = self._clock() * 1000
        if self._last_reset_ms is not None \
                and now_ms - self._last_reset_ms < self._max_isolation_ms:
            self._isolation_duration_ms = min(self._isolation_duration_ms * 2,
                                              self._max_isolation_ms)
        else:
            self._isolation_duration_ms = self._min_isolation_ms

    def reset(self) -> None:
        """The server was revived."""
        self._long.reset()
        self._short.reset()
        self._last_reset_ms = self._clock() * 1000
        self._broken = False
        if self._half_open_window > 0:
            self._half_open = True
            self._half_open_successes = 0

    def __repr__(self) -> str:
        state = "broken" if self._broken else "half-open" if self._half_open else "closed"
        return (f"<CircuitBreaker {state} isolated {self._isolated_times}x "
                f"next {self._isolation_duration_ms}ms>")

