"""The recent values of a server's numeric variables, for the plots of its builtin pages.

As brpc's bvar series: every variable is sampled once a second; the last 60 samples are kept,
and each minute's average of them is kept for the last 60 minutes. Bounded: at most
`MAX_SERIES` variables (the server's own: its methods' figures and its counters; past that,
new names are not tracked), 120 doubles each.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable

SECONDS = 60
MINUTES = 60
MAX_SERIES = 2048


class Series:
    """One variable's last `SECONDS` per-second samples and `MINUTES` per-minute averages."""

    __slots__ = ("seconds", "minutes", "_minute_sum", "_minute_n")

    def __init__(self) -> None:
        # Plain doubles (8 bytes a sample, not a float object each): ~1 KiB a variable when full.
        self.seconds = array("d")
        self.minutes = array("d")
        self._minute_sum = 0.0
        self._minute_n = 0

    def add(self, value: float) -> None:
        _push(self.seconds, value, SECONDS)
        self._minute_sum += value
        self._minute_n += 1
        if self._minute_n == 60:
            _push(self.minutes, self._minute_sum / 60, MINUTES)
            self._minute_sum, self._minute_n = 0.0, 0


def _push(samples: array, value: float, keep: int) -> None:
    if len(samples) >= keep:
        del samples[0]
    samples.append(value)


class SeriesTable:
    """The series of one server's variables, sampled by `sample` once a second."""

    def __init__(self, max_series: int = MAX_SERIES) -> None:
        self.max_series = max_series
        self.series: dict[str, Series] = {}
        self.samples = 0
        self._last = -math.inf

    def sample_if_due(self, now: float, variables: Iterable[tuple[str, object]] | None = None,
                      read=None) -> bool:
        """Take a sample if a second has passed since the last (`read()` gives the variables
        then, or `variables`); whether one was taken."""
        if now - self._last < 1.0:
            return False
        # A late tick (a busy loop) is one sample, not several: the plot shows what was seen.
        self._last = now if now - self._last > 2.0 else self._last + 1.0
        self.sample(variables if variables is not None else read())
        return True

    def sample(self, variables: Iterable[tuple[str, object]]) -> None:
        series = self.series
        for name, value in variables:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            s = series.get(name)
            if s is None:
                if len(series) >= self.max_series:
                    continue
                s = series[name] = Series()
            s.add(float(value))
        self.samples += 1

    def get(self, name: str) -> Series | None:
        return self.series.get(name)
