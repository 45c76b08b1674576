"""Metrics as brpc's bvar keeps them: a few integer operations per call, aggregated when read.

`LatencyRecorder.record(us, failed)` adds a call to the current second's slot (count, sum,
max, errors and a log-scale histogram); reading one sums the slots of the last `window`
seconds into QPS, error rate, mean, percentiles and max. A slot is a fixed-size list: a
recorder's memory does not grow with the calls it sees.

Histogram buckets: latencies under 16 us exactly, above that 8 buckets per power of two, so
a percentile is within 1/16 (6.25 %) of the latency it reports.
"""

from __future__ import annotations

import time

WINDOW_S = 10  # bvar's default window (-bvar_dump_interval and LatencyRecorder's window)
_BUCKETS = 64 * 8 + 8
_MAX_US = (1 << 63) - 1
PERCENTILES = (50, 90, 99, 999, 9999)  # brpc's names: latency_50 .. latency_9999


def _bucket(us: int) -> int:
    b = us.bit_length()
    return us if b <= 4 else (b << 3) | ((us >> (b - 4)) & 7)


def _bucket_mid(i: int) -> int:
    if i < 16:
        return i
    b, sub = i >> 3, i & 7
    low = (8 | sub) << (b - 4)
    return low + ((1 << (b - 4)) >> 1)


class _Second:
    __slots__ = ("second", "count", "errors", "sum", "max", "hist")

    def __init__(self) -> None:
        self.second = -1
        self.count = self.errors = self.sum = self.max = 0
        self.hist = None  # made when the slot is first used: a recorder called in few seconds is small

    def reset(self, second: int) -> None:
        self.second = second
        self.count = self.errors = self.sum = self.max = 0
        if self.hist is None:
            self.hist = [0] * _BUCKETS
        else:
            self.hist[:] = _ZEROS


_ZEROS = [0] * _BUCKETS


class LatencyRecorder:
    """Calls and their latencies (microseconds), over all time and over the last `window` s."""

    __slots__ = ("window", "_slots", "_cur", "_old_count", "_old_errors", "_old_sum", "_max_ever", "_born",
                 "_clock")

    def __init__(self, window: int = WINDOW_S, clock=time.monotonic) -> None:
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int >= 1 (seconds), got {window!r}")
        self.window = window
        self._slots = [_Second() for _ in range(window + 1)]  # the window plus the second now
        self._cur = self._slots[0]
        self._old_count = self._old_errors = self._old_sum = 0  # of slots reused since
        self._max_ever = 0
        self._clock = clock  # seconds, monotonic (tests pass their own)
        self._born = clock()

    def record(self, us: int, failed: bool = False) -> None:
        """One call that took `us` microseconds (clamped to 0..2^63-1); `failed`: it ended in error."""
        sec = int(self._clock())
        cur = self._cur
        if cur.second != sec:
            cur = self._advance(sec)
        if us < 0:
            us = 0
        elif us > _MAX_US:
            us = _MAX_US
        b = us.bit_length()
        u = us
        cur.count += 1
        cur.sum += u
        if u > cur.max:
            cur.max = u
        if failed:
            cur.errors += 1
        cur.hist[u if b <= 4 else (b << 3) | ((u >> (b - 4)) & 7)] += 1  # _bucket(u), inline: this runs for every call

    def _advance(self, sec: int) -> _Second:
        slot = self._slots[sec % len(self._slots)]
        if slot.second != sec:
            self._old_count += slot.count
            self._old_errors += slot.errors
            self._old_sum += slot.sum
            if slot.max > self._max_ever:
                self._max_ever = slot.max
            slot.reset(sec)
        self._cur = slot
        return slot

    # -- reading -------------------------------------------------------------------------------
    def _recent(self) -> list[_Second]:
        """The slots of the last `window` whole seconds (the second now is not yet whole)."""
        now = int(self._clock())
        return [s for s in self._slots if now - self.window <= s.second < now]

    def _seconds(self) -> float:
        """Seconds the window covers: less while the recorder is younger than the window."""
        age = self._clock() - self._born
        return float(max(1, min(self.window, int(age))))

    @property
    def count(self) -> int:
        """Calls recorded since the recorder was made."""
        return self._old_count + sum(s.count for s in self._slots)

    @property
    def errors(self) -> int:
        """Failed calls recorded since the recorder was made."""
        return self._old_errors + sum(s.errors for s in self._slots)

    def qps(self) -> float:
        return sum(s.count for s in self._recent()) / self._seconds()

    def eps(self) -> float:
        """Errors per second over the window."""
        return sum(s.errors for s in self._recent()) / self._seconds()

    def latency(self) -> int:
        """Mean latency (us) over the window; 0 without calls."""
        recent = self._recent()
        n = sum(s.count for s in recent)
        return sum(s.sum for s in recent) // n if n else 0

    def max_latency(self) -> int:
        """The largest latency (us) in the window."""
        return max((s.max for s in self._recent()), default=0)

    def percentiles(self, per: tuple = PERCENTILES) -> dict:
        """{50: us, 90: us, ...} over the window; `per` in brpc's notation (999 = 99.9 %)."""
        recent = self._recent()
        hist = [0] * _BUCKETS
        for s in recent:
            for i, v in enumerate(s.hist):
                if v:
                    hist[i] += v
        total = sum(hist)
        # A bucket's midpoint may lie above the largest latency seen: a percentile never exceeds it.
        top = max((s.max for s in recent), default=0)
        out = {}
        for p in per:
            if not total:
                out[p] = 0
                continue
            frac = p / 10 ** len(str(p))
            rank = min(total, max(1, int(frac * total + 0.999999)))
            seen = 0
            for i, v in enumerate(hist):
                seen += v
                if seen >= rank:
                    out[p] = min(_bucket_mid(i), top)
                    break
        return out


class MethodStatus:
    """What a server keeps per method: its calls (`latency`), requests running now, its limiter."""

    __slots__ = ("latency", "concurrency", "limiter")

    def __init__(self) -> None:
        self.latency = LatencyRecorder()
        self.concurrency = 0
        self.limiter = None  # the method's concurrency limiter (aiobrpc/limiters.py), if any

    def admits(self, timeout_ms: int | None = None) -> bool:
        """Whether the method's limiter lets one more request in (True without a limiter)."""
        limiter = self.limiter
        return limiter is None or limiter.on_requested(self.concurrency + 1, timeout_ms)

    def ended(self, us: int, error_code: int) -> None:
        """A request counted in `concurrency` ended after `us` microseconds with `error_code`."""
        self.concurrency -= 1
        self.latency.record(us, error_code != 0)
        if self.limiter is not None:
            self.limiter.on_responded(error_code, us)

    def describe(self) -> dict:
        """The method's figures by brpc's names (count, qps, error, eps, latency, latency_50...)."""
        d = figures(self.latency)
        d["concurrency"] = self.concurrency
        if self.limiter is not None:
            d["max_concurrency"] = self.limiter.max_concurrency
        return d


def figures(r: LatencyRecorder) -> dict:
    """A recorder's figures by brpc's names: count, qps, error, eps, latency (the window's mean),
    latency_50 .. latency_9999, max_latency (latencies in microseconds)."""
    d = {"count": r.count, "qps": round(r.qps(), 3), "error": r.errors, "eps": round(r.eps(), 3),
         "latency": r.latency()}
    for p, v in r.percentiles().items():
        d[f"latency_{p}"] = v
    d["max_latency"] = r.max_latency()
    return d


_FOLDED = frozenset({"latency", "max_latency"} | {f"latency_{p}" for p in PERCENTILES})


def prometheus_lines(base: str, figs: dict) -> list[str]:
    """A method's `figs` (from `figures`, plus any other numbers) in Prometheus' text format: the
    latencies as the summary `<base>_latency` (max_latency as quantile 1), every other figure
    as the gauge `<base>_<name>`."""
    m = f"{base}_latency"
    out = [f"# HELP {m}", f"# TYPE {m} summary"]
    for p in PERCENTILES:
        q = p / 10 ** len(str(p))
        out.append(f'{m}{{quantile="{q:g}"}} {figs[f"latency_{p}"]}')
    out.append(f'{m}{{quantile="1"}} {figs["max_latency"]}')
    out.append(f"{m}_sum {figs['latency'] * figs['count']}")
    out.append(f"{m}_count {figs['count']}")
    for k, v in figs.items():
        if k not in _FOLDED:
            out += [f"# HELP {base}_{k}", f"# TYPE {base}_{k} gauge", f"{base}_{k} {v}"]
    return out


def underscored(name: str) -> str:
    """A bvar name as brpc exposes it: CamelCase split by underscores and lowered, every run
    of other characters one underscore ("example.EchoService.Echo" -> "example_echo_service_echo")."""
    out: list[str] = []
    prev = ""
    for ch in name:
        if ch.isascii() and ch.isalpha():
            if ch.isupper():
                if out and not prev.isupper() and out[-1] != "_":
                    out.append("_")
                out.append(ch.lower())
            else:
                out.append(ch)
        elif ch.isascii() and ch.isdigit():
            out.append(ch)
        elif out and out[-1] != "_":
            out.append("_")
        prev = ch
    return "".join(out)
