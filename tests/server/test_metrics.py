"""LatencyRecorder on a clock the test moves: windows, percentiles, totals, bounded memory."""

from __future__ import annotations

import random
import sys

import pytest

from aiobrpc.metrics import LatencyRecorder, MethodStatus, _bucket, _bucket_mid, underscored


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_qps_errors_and_mean_over_the_window():
    clock = Clock()
    r = LatencyRecorder(window=10, clock=clock)
    for second in range(12):
        for i in range(100):
            r.record(1000 + i, failed=i < 5)
        clock.t += 1
    # the last 10 whole seconds: 100 calls each, 5 failed
    assert r.qps() == 100 and r.eps() == 5
    assert r.latency() == 1049  # mean of 1000..1099
    assert r.count == 1200 and r.errors == 60  # all time, though slots were reused
    assert r.max_latency() == 1099


def test_a_young_recorder_divides_by_its_age_and_an_idle_one_reads_zero():
    clock = Clock()
    r = LatencyRecorder(window=10, clock=clock)
    for _ in range(2):
        for _ in range(50):
            r.record(10)
        clock.t += 1
    assert r.qps() == 50  # 100 calls over the 2 seconds it has lived
    clock.t += 30
    assert r.qps() == 0 and r.latency() == 0 and r.max_latency() == 0 and r.count == 100
    assert r.percentiles() == {50: 0, 90: 0, 99: 0, 999: 0, 9999: 0}


def test_percentiles_are_within_a_sixteenth_of_the_truth():
    clock = Clock()
    r = LatencyRecorder(window=10, clock=clock)
    rng = random.Random(5)
    values = [int(rng.lognormvariate(7, 1.2)) for _ in range(20000)]
    for i, v in enumerate(values):
        r.record(v)
        if i % 2000 == 1999:
            clock.t += 1  # ten whole seconds of 2000 calls: the window
    got = r.percentiles()
    values.sort()
    for p, frac in ((50, 0.5), (90, 0.9), (99, 0.99), (999, 0.999)):
        truth = values[int(frac * len(values)) - 1]
        assert abs(got[p] - truth) <= truth / 16 + 1, (p, got[p], truth)


def test_percentiles_never_exceed_the_largest_latency():
    # 44 us falls in a bucket whose midpoint is above it: the percentile is the max, not the midpoint
    clock = Clock()
    r = LatencyRecorder(clock=clock)
    for v in (40, 41, 44, 44):
        r.record(v)
    clock.t += 1
    got = r.percentiles()
    assert max(got.values()) <= r.max_latency() == 44
    assert got[50] <= got[99] <= got[9999]


def test_buckets_cover_every_latency_in_order():
    edges = [0, 1, 15, 16, 17, 31, 32, 1000, 10**6, 10**12, (1 << 63) - 1]
    idx = [_bucket(v) for v in edges]
    assert idx == sorted(idx) and max(idx) < 64 * 8 + 8
    for v in edges:
        mid = _bucket_mid(_bucket(v))
        assert abs(mid - v) <= v / 16 + 1


def test_latencies_out_of_range_are_clamped():
    clock = Clock()
    r = LatencyRecorder(clock=clock)
    r.record(-5)
    r.record(1 << 70)
    clock.t += 1
    assert r.max_latency() == (1 << 63) - 1 and r.count == 2


def test_memory_does_not_grow_with_calls():
    clock = Clock()
    r = LatencyRecorder(window=10, clock=clock)

    def size():
        return sum(sys.getsizeof(s.hist) for s in r._slots) + len(r._slots)

    rng = random.Random(1)
    sizes = []
    for _ in range(50):
        for _ in range(200):
            r.record(rng.randrange(10**9))
        clock.t += 1
        sizes.append(size())
    assert len(set(sizes[11:])) == 1 and max(sizes) == sizes[-1] and len(r._slots) == 11


def test_a_histogram_is_made_only_for_a_second_with_calls():
    clock = Clock()
    r = LatencyRecorder(window=10, clock=clock)
    assert all(s.hist is None for s in r._slots)
    for _ in range(1000):
        r.record(7)
    assert sum(s.hist is not None for s in r._slots) == 1
    clock.t += 5
    r.record(9)
    clock.t += 1
    assert sum(s.hist is not None for s in r._slots) == 2
    assert r.count == 1001 and r.percentiles((50,)) == {50: 7}


def test_window_must_be_positive():
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        LatencyRecorder(window=0)


def test_method_status_reads_as_brpc_names_it():
    s = MethodStatus()
    assert list(s.describe()) == ["count", "qps", "error", "eps", "latency", "latency_50", "latency_90",
                                  "latency_99", "latency_999", "latency_9999", "max_latency", "concurrency"]
    from aiobrpc.limiters import ConstantLimiter
    s.limiter = ConstantLimiter(8)
    assert s.describe()["max_concurrency"] == 8


@pytest.mark.parametrize("name,expected", [
    ("example.EchoService.Echo", "example_echo_service_echo"),
    ("interop.EchoService.StartStream", "interop_echo_service_start_stream"),
    ("HTTPServer", "httpserver"),
    ("a..b--c", "a_b_c"),
    ("rpc_server_8000", "rpc_server_8000"),
])
def test_underscored_names(name, expected):
    assert underscored(name) == expected
