"""Backup request policies (brpc's docs/en/backup_request.md).

A policy decides the backup delay per call (`backup_request_ms`: −1 = the channel's value,
other negatives = no backup, ≥ 0 = delay), whether to send the backup when its timer fires
(`do_backup`), and learns from every finished call (`on_rpc_end`).

`RateLimitedBackupPolicy` is brpc's: a fixed delay, and no backup while backups exceed a ratio
of the calls in a sliding window. `LatencyQuantileBackupPolicy` derives the delay from the
observed latency quantile of recent successful calls (the request of apache/brpc#2695:
"set the backup time from a latency quantile, with a threshold above which no backup is
sent"; brpc answered with the pluggable policy this implements).

>>> from aiobrpc.controller import Controller
>>> policy = RateLimitedBackupPolicy(20, max_backup_ratio=0.1)
>>> policy.backup_request_ms(Controller()), policy.do_backup(Controller())
(20, True)
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable
from typing import Any


class BackupRequestPolicy(ABC):
    """Decides when (and whether) a call sends its backup request (brpc's
    BackupRequestPolicy). Subclass and implement `backup_request_ms`."""

    @abstractmethod
    def backup_request_ms(self, cntl: Any) -> int:
        """Backup delay for this call: −1 = the channel's value, other negatives = no backup,
        ≥ 0 = delay in milliseconds. Asked when the call starts."""

    def do_backup(self, cntl: Any) -> bool:
        """Asked when the backup timer fires (attempt still pending): send the backup?"""
        return True

    def on_rpc_end(self, cntl: Any) -> None:
        """Called for every finished call (`latency_us`, `error_code` are set)."""


class BackupRateLimiter:
    """Counts calls and backups in a sliding time window and allows a backup only while
    backups / calls < `max_backup_ratio`.

    Like brpc, a backup is counted when it is allowed (fast feedback during a latency spike)
    and a call when it ends; backups with no ended call in the window are denied. The window
    is kept as `buckets` slices of `window_s / buckets` seconds (memory is constant).

    >>> now = [0.0]
    >>> limiter = BackupRateLimiter(0.5, window_s=10, clock=lambda: now[0])
    >>> limiter.on_rpc_end(); limiter.on_rpc_end()
    >>> limiter.allow(), limiter.allow()
    (True, False)
    """

    def __init__(self, max_backup_ratio: float = 0.1, window_s: float = 10, *,
                 buckets: int = 20, clock: Callable[[], float] = time.monotonic) -> None:
        if not (isinstance(max_backup_ratio, (int, float)) and 0 < max_backup_ratio <= 1):
            raise ValueError(f"max_backup_ratio must be in (0, 1], got {max_backup_ratio!r}")
        if not (isinstance(window_s, (int, float)) and 0 < window_s <= 3600):
            raise ValueError(f"window_s must be in (0, 3600] seconds, got {window_s!r}")
        if not (isinstance(buckets, int) and buckets >= 1):
            raise ValueError(f"buckets must be an int >= 1, got {buckets!r}")
        self.max_backup_ratio = float(max_backup_ratio)
        self.window_s = float(window_s)
        self._width = self.window_s / buckets
        self._nbuckets = buckets
        self._clock = clock
        # [slice index, calls, backups], oldest first; totals kept alongside.
        self._slices: deque[list[int]] = deque()
        self._calls = 0
        self._backups = 0

    @property
    def calls(self) -> int:
        """Calls ended in the window."""
        self._expire()
        return self._calls

    @property
    def backups(self) -> int:
        """Backups allowed in the window."""
        self._expire()
        return self._backups

    def allow(self) -> bool:
        """True (and counted as a backup) if one more backup keeps within the ratio."""
        current = self._current()
        if self._calls:
            allowed = self._backups / self._calls < self.max_backup_ratio
        else:
            allowed = self._backups == 0  # cold start allows; backups without ended calls don't
        if allowed:
            current[2] += 1
            self._backups += 1
        return allowed

    def on_rpc_end(self) -> None:
        self._current()[1] += 1
        self._calls += 1

    def _expire(self) -> int:
        index = math.floor(self._clock() / self._width)
        slices = self._slices
        while slices and slices[0][0] <= index - self._nbuckets:
            _, calls, backups = slices.popleft()
            self._calls -= calls
            self._backups -= backups
        return index

    def _current(self) -> list[int]:
        index = self._expire()
        slices = self._slices
        if not slices or slices[-1][0] != index:
            slices.append([index, 0, 0])
        return slices[-1]


class RateLimitedBackupPolicy(BackupRequestPolicy):
    """A fixed backup delay, with no backup while the backups sent in the last `window_s`
    seconds reach `max_backup_ratio` of the calls ended in them (brpc's
    CreateRateLimitedBackupPolicy; defaults ratio 0.1, window 10 s).

    `backup_request_ms` −1 means the channel's `backup_request_ms`.
    """

    def __init__(self, backup_request_ms: int, max_backup_ratio: float = 0.1,
                 window_s: float = 10, clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(backup_request_ms, int) or backup_request_ms < -1:
            raise ValueError(f"backup_request_ms must be an int >= -1 (-1: the channel's "
                             f"value), got {backup_request_ms!r}")
        self._backup_request_ms = backup_request_ms
        self.limiter = BackupRateLimiter(max_backup_ratio, window_s, clock=clock)

    def backup_request_ms(self, cntl: Any) -> int:
        return self._backup_request_ms

    def do_backup(self, cntl: Any) -> bool:
        return self.limiter.allow()

    def on_rpc_end(self, cntl: Any) -> None:
        self.limiter.on_rpc_end()


class LatencyQuantileBackupPolicy(BackupRequestPolicy):
    """Backup delay = the `quantile` of the latencies of the last `window` successful calls,
    rounded up to whole milliseconds and clamped to [min_ms, max_ms].

    Until `min_samples` successes are seen the delay is `fallback_ms` (−1: the channel's
    value). With `max_backup_ratio`, backups are also rate limited as in
    RateLimitedBackupPolicy. Latencies are whole-call latencies (`cntl.latency_us`), including
    calls that sent a backup: leaving those out would hide the slow tail and pull the delay
    down. Memory is bounded by `window`; each call costs a bisect and a list shift.

    >>> from aiobrpc.controller import Controller
    >>> policy = LatencyQuantileBackupPolicy(quantile=0.5, window=4, min_samples=4)
    >>> for latency_ms in (1, 2, 3, 40):
    ...     cntl = Controller(); cntl.latency_us = latency_ms * 1000
    ...     policy.on_rpc_end(cntl)
    >>> policy.backup_request_ms(Controller())
    2
    """

    def __init__(self, quantile: float = 0.9, window: int = 1024, min_samples: int = 32,
                 min_ms: int = 0, max_ms: int | None = None, fallback_ms: int = -1,
                 max_backup_ratio: float | None = None, ratio_window_s: float = 10,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not (isinstance(quantile, (int, float)) and 0 < quantile < 1):
            raise ValueError(f"quantile must be in (0, 1), got {quantile!r}")
        if not (isinstance(window, int) and window >= 1):
            raise ValueError(f"window must be an int >= 1 (latest successful calls kept), "
                             f"got {window!r}")
        if not (isinstance(min_samples, int) and 1 <= min_samples <= window):
            raise ValueError(f"min_samples must be an int in 1..window ({window}), "
                             f"got {min_samples!r}")
        if not (isinstance(min_ms, int) and min_ms >= 0):
            raise ValueError(f"min_ms must be an int >= 0, got {min_ms!r}")
        if max_ms is not None and not (isinstance(max_ms, int) and max_ms >= min_ms):
            raise ValueError(f"max_ms must be None or an int >= min_ms ({min_ms}), "
                             f"got {max_ms!r}")
        if not isinstance(fallback_ms, int):
            raise ValueError(f"fallback_ms must be an int (-1: the channel's value), "
                             f"got {fallback_ms!r}")
        self.quantile = float(quantile)
        self.window = window
        self.min_samples = min_samples
        self.min_ms = min_ms
        self.max_ms = max_ms
        self.fallback_ms = fallback_ms
        self.limiter = (None if max_backup_ratio is None else
                        BackupRateLimiter(max_backup_ratio, ratio_window_s, clock=clock))
        self._arrival: deque[int] = deque()  # samples in arrival order, for eviction
        self._sorted: list[int] = []

    @property
    def sample_count(self) -> int:
        return len(self._sorted)

    @property
    def latency_quantile_us(self) -> int | None:
        """The quantile of the kept latencies (nearest rank), None before `min_samples`."""
        n = len(self._sorted)
        if n < self.min_samples:
            return None
        return self._sorted[max(0, math.ceil(self.quantile * n) - 1)]

    def backup_request_ms(self, cntl: Any) -> int:
        latency_us = self.latency_quantile_us
        if latency_us is None:
            return self.fallback_ms
        delay = max(self.min_ms, math.ceil(latency_us / 1000))
        return delay if self.max_ms is None else min(delay, self.max_ms)

    def do_backup(self, cntl: Any) -> bool:
        return self.limiter is None or self.limiter.allow()

    def on_rpc_end(self, cntl: Any) -> None:
        if self.limiter is not None:
            self.limiter.on_rpc_end()
        if cntl.error_code == 0:
            self._add(int(cntl.latency_us))

    def _add(self, latency_us: int) -> None:
        if len(self._arrival) == self.window:
            oldest = self._arrival.popleft()
            del self._sorted[bisect_left(self._sorted, oldest)]
        self._arrival.append(latency_us)
        insort(self._sorted, latency_us)
