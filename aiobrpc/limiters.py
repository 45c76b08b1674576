"""Per-method concurrency limiters, as brpc's: constant, "auto" (gradient) and "timeout".

A limiter is asked `on_requested(concurrency, timeout_ms)` with the method's requests in
flight counting this one (False: the request is answered ELIMIT and its handler never runs)
and told `on_responded(error_code, latency_us)` when each admitted request ends.

"auto" keeps the limit near peak throughput x no-load latency (Little's law), with headroom
that grows while latency stays near its minimum and shrinks when queueing shows, and
re-measures the no-load latency every 25-50 s by lowering the limit for a moment. "timeout"
admits while the recent mean latency is below the request's timeout. The constants are
brpc's defaults (its -auto_cl_* and -timeout_cl_* flags).
"""

from __future__ import annotations

import math
import random
import time
from abc import ABC, abstractmethod

from .errors import ELIMIT

SAMPLING_INTERVAL_US = 100       # at most one response sampled per 0.1 ms
MIN_SAMPLE_COUNT = 100           # a window with fewer samples is discarded ...
SAMPLE_WINDOW_US = 1_000_000     # ... once it is this old; it is submitted at this age
MAX_SAMPLE_COUNT = 200           # ... or with this many samples
FAIL_PUNISH_RATIO = 1.0          # a failure's latency counts this much against the mean
ALPHA = 0.1                      # EMA factor of the no-load latency (peak QPS: ALPHA / 10)
INITIAL_MAX_CONCURRENCY = 40
MAX_EXPLORE_RATIO = 0.3
MIN_EXPLORE_RATIO = 0.06
EXPLORE_STEP = 0.02
REDUCE_RATIO_WHILE_REMEASURE = 0.9
REMEASURE_INTERVAL_US = 50_000_000  # the next re-measure comes 25-50 s later
# brpc floors the limit at its worker threads (9 by default); one event loop runs aiobrpc's
# handlers, but a handler that awaits holds no worker: keep a few in flight whatever happens.
MIN_MAX_CONCURRENCY = 8
TIMEOUT_DEFAULT_MS = 500
TIMEOUT_MAX_CONCURRENCY = 100
TIMEOUT_INITIAL_AVG_LATENCY_US = 500


def _now_us() -> int:
    return time.monotonic_ns() // 1000


class ConstantLimiter:
    """Admit while at most `max_concurrency` requests of the method are in flight."""

    def __init__(self, max_concurrency: int) -> None:
        self.max_concurrency = max_concurrency

    def on_requested(self, concurrency: int, timeout_ms: int | None = None) -> bool:
        return concurrency <= self.max_concurrency

    def on_responded(self, error_code: int, latency_us: int) -> None:
        pass

    def describe(self) -> str:
        return str(self.max_concurrency)


class _Window:
    """Samples of responses: brpc's SampleWindow."""

    __slots__ = ("start_us", "succ_count", "succ_us", "failed_count", "failed_us", "succ_requests")

    def __init__(self) -> None:
        self.reset(0)

    def reset(self, start_us: int) -> None:
        self.start_us = start_us
        self.succ_count = self.succ_us = self.failed_count = self.failed_us = 0
        self.succ_requests = 0  # every success since the window started, sampled or not

    def add(self, error_code: int, latency_us: int) -> None:
        if error_code:
            self.failed_count += 1
            self.failed_us += latency_us
        else:
            self.succ_count += 1
            self.succ_us += latency_us

    @property
    def samples(self) -> int:
        return self.succ_count + self.failed_count

    def avg_latency(self) -> int:
        return math.ceil((self.failed_us * FAIL_PUNISH_RATIO + self.succ_us) / self.succ_count)


class _Sampler(ABC):
    """What both adaptive limiters share: sampling responses into windows, and when a window
    is complete (`_submit`)."""

    def __init__(self, clock) -> None:
        self._clock = clock
        self._window = _Window()
        self._last_sample_us = -SAMPLING_INTERVAL_US

    def on_responded(self, error_code: int, latency_us: int) -> None:
        if error_code == ELIMIT:
            return
        now = self._clock()
        if not error_code:
            self._window.succ_requests += 1
        if now - self._last_sample_us < SAMPLING_INTERVAL_US:
            return
        self._last_sample_us = now
        self._add_sample(error_code, latency_us, now)

    def _add_sample(self, error_code: int, latency_us: int, now: int) -> None:
        w = self._window
        if w.start_us == 0:
            w.start_us = now
        w.add(error_code, latency_us)
        if w.samples < MIN_SAMPLE_COUNT:
            if now - w.start_us >= SAMPLE_WINDOW_US:
                w.reset(now)  # too few in a whole window: nothing to learn from it
            return
        if now - w.start_us < SAMPLE_WINDOW_US and w.samples < MAX_SAMPLE_COUNT:
            return
        self._submit(w, now)
        w.reset(now)

    @abstractmethod
    def _submit(self, w: _Window, now: int) -> None:
        """Learn from a complete window (taken at `now`, us)."""


class AutoLimiter(_Sampler):
    """brpc's "auto" limiter (docs/server.md, "Per-method concurrency limits")."""

    def __init__(self, clock=_now_us, rng: random.Random | None = None) -> None:
        super().__init__(clock)
        self._rng = rng or random.Random()
        self.max_concurrency = INITIAL_MAX_CONCURRENCY
        self.min_latency_us = -1
        self.ema_max_qps = -1.0
        self.explore_ratio = MAX_EXPLORE_RATIO
        self._remeasure_at_us = self._next_remeasure(clock())
        self._reset_latency_at_us = 0  # > 0: a re-measure pause that ends then

    def on_requested(self, concurrency: int, timeout_ms: int | None = None) -> bool:
        return concurrency <= self.max_concurrency

    def _next_remeasure(self, now: int) -> int:
        half = REMEASURE_INTERVAL_US // 2
        return now + half + self._rng.randrange(half)

    def _add_sample(self, error_code: int, latency_us: int, now: int) -> None:
        if self._reset_latency_at_us:
            if self._reset_latency_at_us > now:
                return  # the limit was lowered to let queues drain: these latencies say nothing
            self.min_latency_us = -1  # re-learnt from the next window
            self._reset_latency_at_us = 0
            self._remeasure_at_us = self._next_remeasure(now)
            self._window.reset(now)
        super()._add_sample(error_code, latency_us, now)

    def _submit(self, w: _Window, now: int) -> None:
        if w.succ_count == 0:
            self.max_concurrency = max(MIN_MAX_CONCURRENCY, self.max_concurrency // 2)
            return
        avg = w.avg_latency()
        qps = 1e6 * w.succ_requests / max(1, now - w.start_us)
        if self.min_latency_us <= 0:
            self.min_latency_us = avg
        elif avg < self.min_latency_us:
            self.min_latency_us = avg * ALPHA + self.min_latency_us * (1 - ALPHA)
        if qps >= self.ema_max_qps:
            self.ema_max_qps = qps
        else:
            self.ema_max_qps = qps * (ALPHA / 10) + self.ema_max_qps * (1 - ALPHA / 10)
        if self._remeasure_at_us <= now:
            self._reset_latency_at_us = now + avg * 2
            limit = math.ceil(self.ema_max_qps * self.min_latency_us / 1e6 * REDUCE_RATIO_WHILE_REMEASURE)
        else:
            if (avg <= self.min_latency_us * (1 + MIN_EXPLORE_RATIO)
                    or qps <= self.ema_max_qps / (1 + MIN_EXPLORE_RATIO)):
                self.explore_ratio = min(MAX_EXPLORE_RATIO, self.explore_ratio + EXPLORE_STEP)
            else:
                self.explore_ratio = max(MIN_EXPLORE_RATIO, self.explore_ratio - EXPLORE_STEP)
            limit = int(self.min_latency_us * self.ema_max_qps / 1e6 * (1 + self.explore_ratio))
        self.max_concurrency = max(MIN_MAX_CONCURRENCY, limit)

    def describe(self) -> str:
        return f"auto (now {self.max_concurrency})"


class TimeoutLimiter(_Sampler):
    """brpc's "timeout" limiter: admit while the recent mean latency is
    below the request's timeout (or `timeout_ms`), at most `max_concurrency`."""

    def __init__(self, timeout_ms: int = TIMEOUT_DEFAULT_MS, max_concurrency: int = TIMEOUT_MAX_CONCURRENCY,
                 clock=_now_us) -> None:
        super().__init__(clock)
        self.timeout_ms = timeout_ms
        self.max_concurrency = max_concurrency
        self.avg_latency_us = TIMEOUT_INITIAL_AVG_LATENCY_US

    def on_requested(self, concurrency: int, timeout_ms: int | None = None) -> bool:
        if concurrency == 1:
            return True
        limit_ms = timeout_ms if timeout_ms is not None and timeout_ms > 0 else self.timeout_ms
        return concurrency <= self.max_concurrency and self.avg_latency_us < limit_ms * 1000

    def _submit(self, w: _Window, now: int) -> None:
        if w.succ_count == 0:
            self.avg_latency_us *= 2
        else:
            self.avg_latency_us = w.avg_latency()

    def describe(self) -> str:
        return f"timeout {self.timeout_ms} ms, at most {self.max_concurrency}"


def make_limiter(setting):
    """A limiter for a `max_concurrency` setting: 0 or "unlimited" (None: no limiter), an int
    N > 0, "auto", "timeout", or {"timeout_ms": T, "max_concurrency": N}."""
    if setting is None or setting == 0 or setting == "unlimited":
        return None
    if isinstance(setting, bool):
        raise ValueError(f"a method's max_concurrency cannot be a bool, got {setting!r}")
    if isinstance(setting, int):
        if setting < 0:
            raise ValueError(f"a method's max_concurrency must be >= 0, got {setting}")
        return ConstantLimiter(setting)
    if setting == "auto":
        return AutoLimiter()
    if setting == "timeout":
        return TimeoutLimiter()
    if isinstance(setting, dict) and set(setting) <= {"timeout_ms", "max_concurrency"}:
        t = setting.get("timeout_ms", TIMEOUT_DEFAULT_MS)
        n = setting.get("max_concurrency", TIMEOUT_MAX_CONCURRENCY)
        if not (isinstance(t, int) and t > 0 and isinstance(n, int) and n > 0):
            raise ValueError(f"a timeout limiter needs timeout_ms > 0 and max_concurrency > 0, got {setting!r}")
        return TimeoutLimiter(t, n)
    raise ValueError(f"a method's max_concurrency is 0, 'unlimited', an int > 0, 'auto', 'timeout' or "
                     f"{{'timeout_ms': T, 'max_concurrency': N}}; got {setting!r}")
