"""The load generator behind `aiobrpc press` (brpc's rpc_press): calls one method over and
over, at a fixed rate or as fast as `concurrency` callers can, and keeps what it saw.

Pacing. With `qps` > 0 call k is due at `start + (k + skipped) / qps`: calls are started on
that absolute schedule, so a slow reply never slows the rate. At most `concurrency` calls are
in flight; a call due while they all are waits for one to end. A client that falls more than
`MAX_BEHIND_S` (100 ms) of calls behind the schedule (a stalled loop, or the concurrency limit
reached) gives up the calls it owes beyond that and counts them in `skipped`, so catching up
is a burst of at most 100 ms of calls. With `qps` = 0, `concurrency` callers each start their
next call as soon as the last one ended.

Latency is kept, for successful calls only as rpc_press does, in `LatencyHistogram`: 64
buckets per power of two of nanoseconds, so memory is fixed (3712 counters) whatever the
number of calls, and a percentile is within 0.8 % of the latency it reports.

>>> h = LatencyHistogram()
>>> for ns in (100_000, 200_000, 300_000): h.record(ns)
>>> h.count, h.max_ns, round(h.percentile(0.5) / 1000)
(3, 300000, 200)
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from google.protobuf.message import Message

from . import errors
from .cli_json import parse_request
from .cli_proto import ProtoError
from .errors import RpcError, describe

MAX_BEHIND_S = 0.1
PERCENTILES = (("p50", 0.50), ("p90", 0.90), ("p99", 0.99), ("p999", 0.999))

_SUB_BITS = 6  # 64 buckets per power of two: a bucket is at most 1/64 of its lower bound wide
_EXACT = 2 << _SUB_BITS  # under 128 ns, one bucket per nanosecond
_MAX_NS = (1 << 63) - 1

ERROR_NAMES: dict[int, str] = {v: k for k, v in vars(errors).items()
                               if k.startswith("E") and k.isupper() and type(v) is int}
"""brpc's name of each error code aiobrpc knows (`1008: "ERPCTIMEDOUT"`)."""


def _bucket(ns: int) -> int:
    if ns < _EXACT:
        return ns
    shift = ns.bit_length() - _SUB_BITS - 1
    return (shift << _SUB_BITS) + (ns >> shift)


def _bucket_bounds(i: int) -> tuple[int, int]:
    """The lowest latency of bucket `i` and its width, in nanoseconds."""
    if i < _EXACT:
        return i, 1
    shift = (i >> _SUB_BITS) - 1
    return ((i & ((1 << _SUB_BITS) - 1)) | (1 << _SUB_BITS)) << shift, 1 << shift


_BUCKETS = _bucket(_MAX_NS) + 1


class LatencyHistogram:
    """Latencies in nanoseconds, counted in fixed log-scale buckets (see the module's doc)."""

    __slots__ = ("counts", "count", "sum_ns", "min_ns", "max_ns")

    def __init__(self) -> None:
        self.counts = [0] * _BUCKETS
        self.count = 0
        self.sum_ns = 0
        self.min_ns = _MAX_NS
        self.max_ns = 0

    def record(self, ns: int) -> None:
        if ns < 0:
            ns = 0
        elif ns > _MAX_NS:
            ns = _MAX_NS
        self.counts[ns if ns < _EXACT else _bucket(ns)] += 1
        self.count += 1
        self.sum_ns += ns
        if ns > self.max_ns:
            self.max_ns = ns
        if ns < self.min_ns:
            self.min_ns = ns

    def percentile(self, q: float) -> float:
        """The latency (ns) that a fraction `q` of the calls did not exceed; nan when empty."""
        if not self.count:
            return math.nan
        rank = max(1, math.ceil(q * self.count))
        seen = 0
        for i, n in enumerate(self.counts):
            seen += n
            if seen >= rank:
                low, width = _bucket_bounds(i)
                return min(max(low + width / 2 if width > 1 else low, self.min_ns), self.max_ns)
        return float(self.max_ns)

    def buckets(self) -> list[tuple[int, int, int]]:
        """`(lowest ns, width ns, calls)` of each bucket holding calls, lowest first."""
        return [(*_bucket_bounds(i), n) for i, n in enumerate(self.counts) if n]


class PressStats:
    """What a press run saw: calls ended ok and failed, errors by code, latencies of the ok."""

    __slots__ = ("latency", "failed", "errors", "skipped", "elapsed_s")

    def __init__(self) -> None:
        self.latency = LatencyHistogram()
        self.failed = 0
        self.errors: dict[int, list] = {}  # code: [calls, text of the first]
        self.skipped = 0
        self.elapsed_s = 0.0

    @property
    def ok(self) -> int:
        return self.latency.count

    @property
    def calls(self) -> int:
        return self.latency.count + self.failed

    def fail(self, e: RpcError) -> None:
        self.failed += 1
        seen = self.errors.get(e.code)
        if seen is None:
            self.errors[e.code] = [1, " ".join(e.text.split())]
        else:
            seen[0] += 1

    def summary(self) -> dict:
        """The figures `--json` prints (field names in docs/cli.md); latencies in microseconds."""
        lat = self.latency
        latency: dict = dict.fromkeys(("mean", *(name for name, _ in PERCENTILES), "max"))
        if lat.count:
            latency["mean"] = round(lat.sum_ns / lat.count / 1000, 1)
            for name, q in PERCENTILES:
                latency[name] = round(lat.percentile(q) / 1000, 1)
            latency["max"] = round(lat.max_ns / 1000, 1)
        return {
            "calls": self.calls,
            "ok": self.ok,
            "failed": self.failed,
            "skipped": self.skipped,
            "elapsed_s": round(self.elapsed_s, 3),
            "qps": round(self.calls / self.elapsed_s, 1) if self.elapsed_s > 0 else 0.0,
            "latency_us": latency,
            "errors": [{"code": code, "name": ERROR_NAMES.get(code), "description": describe(code),
                        "count": n, "text": text}
                       for code, (n, text) in sorted(self.errors.items(), key=lambda kv: -kv[1][0])],
        }


class Press:
    """Calls `call(request)` with `requests` in turn (round robin) until `duration_s` passed
    or `count` calls were started (or `stop()`), at `qps` calls a second (0: as fast as
    possible) with at most `concurrency` in flight; `run()` returns the `PressStats`.

    `call` returns an awaitable that raises RpcError when the call fails.

    >>> async def call(request): ...
    >>> asyncio.run(Press(call, ["hi"], concurrency=2, count=10).run()).ok
    10
    """

    def __init__(self, call: Callable[[object], Awaitable], requests: Sequence, *, qps: float = 0,
                 concurrency: int = 64, duration_s: float | None = None, count: int | None = None) -> None:
        if not requests:
            raise ValueError("no request to send")
        if qps < 0 or concurrency < 1:
            raise ValueError(f"qps must be >= 0 and concurrency >= 1, got {qps} and {concurrency}")
        self.stats = PressStats()
        self.qps = qps
        self.concurrency = concurrency
        self.duration_s = duration_s
        self.count = count
        self._call = call
        self._requests = list(requests)
        self._started = 0  # calls started, or schedule slots claimed (qps > 0)
        self.start_time = 0.0
        """The loop time the run started at."""
        self._end = math.inf
        self._max_behind = max(1, int(qps * MAX_BEHIND_S))
        self._workers: list[asyncio.Task] = []

    async def run(self) -> PressStats:
        loop = asyncio.get_running_loop()
        self.start_time = loop.time()
        if self.duration_s is not None:
            self._end = self.start_time + self.duration_s
        self._workers = [loop.create_task(self._caller()) for _ in range(self.concurrency)]
        try:
            await asyncio.wait(self._workers)
        finally:
            for t in self._workers:
                t.cancel()
            done = await asyncio.gather(*self._workers, return_exceptions=True)
            self.stats.elapsed_s = loop.time() - self.start_time
        for outcome in done:
            if isinstance(outcome, Exception):
                raise outcome
        return self.stats

    def stop(self) -> None:
        """End the run now: the calls in flight are abandoned and not counted."""
        for t in self._workers:
            t.cancel()

    async def _caller(self) -> None:
        loop = asyncio.get_running_loop()
        clock = time.perf_counter_ns
        call = self._call
        requests = self._requests
        n = len(requests)
        stats = self.stats
        record = stats.latency.record
        count = self.count if self.count is not None else math.inf
        qps = self.qps
        start_time = self.start_time
        end = self._end
        while True:
            i = self._started
            if i >= count:
                return
            now = loop.time()
            if qps:
                behind = int((now - start_time) * qps) - (i + stats.skipped)
                if behind > self._max_behind:
                    stats.skipped += behind - self._max_behind
                due = start_time + (i + stats.skipped) / qps
                if due >= end:
                    return
                self._started = i + 1
                if due > now:
                    await asyncio.sleep(due - now)
            elif now >= end:
                return
            else:
                self._started = i + 1
            start = clock()
            try:
                await call(requests[i % n])
            except RpcError as e:
                stats.fail(e)
                continue
            record(clock() - start)


def read_requests(text: str, new_message: Callable[[], Message], source: str) -> list[Message]:
    """The requests of a JSON file: an array of objects, or objects one after another (JSON
    lines, or concatenated as rpc_press reads them), each filled into `new_message()`.

    ProtoError names `source`, the line of the request at fault and what is wrong with it.
    """
    decoder = json.JSONDecoder()
    pos = _skip_space(text, 0)
    in_array = text.startswith("[", pos)
    if in_array:
        pos = _skip_space(text, pos + 1)
    messages: list[Message] = []
    while pos < len(text) and not (in_array and text[pos] == "]" and not messages):
        line = text.count("\n", 0, pos) + 1
        try:
            _, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise ProtoError(f"{source}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
        message: Any = new_message()  # FindInitializationErrors is not in protobuf's stubs
        try:
            parse_request(text[pos:end], message)
        except ProtoError as e:
            raise ProtoError(f"{source}: line {line}: {e}") from None
        missing = message.FindInitializationErrors()
        if missing:
            raise ProtoError(f"{source}: line {line}: {message.DESCRIPTOR.full_name} lacks required fields: "
                             f"{', '.join(missing)}")
        messages.append(message)
        pos = _skip_space(text, end)
        if in_array and pos < len(text):
            if text[pos] == "]":
                break
            if text[pos] != ",":
                raise ProtoError(f"{source}: line {text.count(chr(10), 0, pos) + 1}: expected ',' or ']' "
                                 "after a request")
            pos = _skip_space(text, pos + 1)
    if in_array:
        if pos == len(text):
            raise ProtoError(f"{source}: the array of requests is not closed with ']'")
        pos = _skip_space(text, pos + 1)
        if pos < len(text):
            raise ProtoError(f"{source}: line {text.count(chr(10), 0, pos) + 1}: text after the array of requests")
    if not messages:
        raise ProtoError(f"{source}: no request in it")
    return messages


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def plot_marks(values: list[tuple[str, float]]) -> list[tuple[str, float]]:
    """The labelled lines of the plot from (name, microseconds), in order: names whose values
    print alike share one line and one label ("p999 = max 1,207 us"), which would otherwise
    be drawn over each other.

    >>> plot_marks([("p50", 98.2), ("p99", 1207.4), ("p999", 1206.9), ("max", 1900.0)])
    [('p50 98 us', 98.2), ('p99 = p999 1,207 us', 1207.4), ('max 1,900 us', 1900.0)]
    """
    groups: dict[str, tuple[list[str], float]] = {}
    for name, x in values:
        groups.setdefault(f"{x:,.0f}", ([], x))[0].append(name)
    return [(f"{' = '.join(names)} {shown} us", x) for shown, (names, x) in groups.items()]


def write_plot(stats: PressStats, path: str, title: str) -> None:
    """A PNG histogram of the latencies of the successful calls, p50/p99/p999 and max marked.

    Needs matplotlib (ImportError without it)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.subplots()
    lat = stats.latency
    # Eight bars per power of two: the 64 buckets of the histogram are too fine to read.
    bars: dict[int, list] = {}
    for low, width, n in lat.buckets():
        key = _bucket(low) >> 3
        bar = bars.setdefault(key, [low, 0, 0])
        bar[1] = low + width - bar[0]
        bar[2] += n
    if bars:
        lows = [b[0] / 1000 for b in bars.values()]
        widths = [b[1] / 1000 for b in bars.values()]
        ax.bar(lows, [b[2] for b in bars.values()], width=widths, align="edge", color="#4c72b0")
        ax.set_xscale("log")
        values = [(name, lat.percentile(q) / 1000) for name, q in (("p50", 0.5), ("p99", 0.99), ("p999", 0.999))]
        for label, x in plot_marks(values + [("max", lat.max_ns / 1000)]):
            ax.axvline(x, color="#c44e52", linestyle="--", linewidth=1)
            ax.annotate(label, (x, 1), xycoords=("data", "axes fraction"), rotation=90,
                        va="top", ha="right", fontsize=8)
    ax.set_xlabel("latency (us, log scale)")
    ax.set_ylabel("calls")
    ax.set_title(title, fontsize=10)
    fig.savefig(path, dpi=100)
