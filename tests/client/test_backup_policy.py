"""Backup request policies (brpc's docs/en/backup_request.md)."""

from __future__ import annotations

import math
import random

import pytest

from aiobrpc import errors
from aiobrpc.client.backup import (
    BackupRateLimiter, BackupRequestPolicy, LatencyQuantileBackupPolicy, RateLimitedBackupPolicy,
)
from aiobrpc.controller import Controller


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def ended(latency_ms: float, code: int = 0) -> Controller:
    cntl = Controller()
    cntl.latency_us = round(latency_ms * 1000)
    cntl.error_code = code
    return cntl


def test_policy_is_abstract_with_permissive_defaults():
    with pytest.raises(TypeError):
        BackupRequestPolicy()

    class Fixed(BackupRequestPolicy):
        def backup_request_ms(self, cntl):
            return 5

    policy = Fixed()
    assert policy.do_backup(Controller()) and policy.on_rpc_end(ended(1)) is None


def test_rate_limit_allows_backups_up_to_the_ratio():
    clock = FakeClock()
    policy = RateLimitedBackupPolicy(15, max_backup_ratio=0.1, window_s=10, clock=clock)
    assert policy.backup_request_ms(Controller()) == 15
    for _ in range(100):
        policy.on_rpc_end(ended(1))
    allowed = [policy.do_backup(Controller()) for _ in range(20)]
    # A backup is allowed while backups / calls < 0.1: for 100 calls, backups 0..9 pass.
    expected = math.ceil(0.1 * 100)
    assert allowed == [True] * expected + [False] * (20 - expected)
    for _ in range(10):  # 10 more ended calls: 10 / 110 < 0.1 again, for one more backup
        policy.on_rpc_end(ended(1))
    assert [policy.do_backup(Controller()) for _ in range(2)] == [True, False]


def test_rate_limit_window_slides():
    clock = FakeClock()
    policy = RateLimitedBackupPolicy(15, max_backup_ratio=0.5, window_s=10, clock=clock)
    for _ in range(2):
        policy.on_rpc_end(ended(1))
    assert policy.do_backup(Controller())
    assert not policy.do_backup(Controller())  # 1 / 2 is not < 0.5
    clock.now += 6
    for _ in range(4):
        policy.on_rpc_end(ended(1))
    assert policy.do_backup(Controller())  # 1 / 6 < 0.5
    assert policy.do_backup(Controller())  # 2 / 6
    assert not policy.do_backup(Controller())  # 3 / 6
    clock.now += 5  # the first second's 2 calls and 1 backup left the window: 2 / 4
    assert policy.limiter.calls == 4 and policy.limiter.backups == 2
    assert not policy.do_backup(Controller())
    clock.now += 10  # everything expired: a cold start allows
    assert policy.do_backup(Controller())
    assert (policy.limiter.calls, policy.limiter.backups) == (0, 1)
    # A backup sent with no call ended in the window yet: no more until calls end.
    assert not policy.do_backup(Controller())


def test_rate_limiter_memory_is_bounded():
    clock = FakeClock()
    limiter = BackupRateLimiter(0.1, window_s=10, buckets=20, clock=clock)
    for _ in range(10_000):
        clock.now += 0.01
        limiter.on_rpc_end()
    assert len(limiter._slices) <= 21
    assert limiter.calls == pytest.approx(1000, abs=60)  # about 10 s of calls at 100/s


@pytest.mark.parametrize("kwargs, match", [
    ({"backup_request_ms": -2}, "backup_request_ms"),
    ({"backup_request_ms": 1.5}, "backup_request_ms"),
    ({"backup_request_ms": 1, "max_backup_ratio": 0}, "max_backup_ratio"),
    ({"backup_request_ms": 1, "max_backup_ratio": 1.5}, "max_backup_ratio"),
    ({"backup_request_ms": 1, "window_s": 0}, "window_s"),
    ({"backup_request_ms": 1, "window_s": 3601}, "window_s"),
])
def test_rate_limit_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RateLimitedBackupPolicy(**kwargs)


def test_rate_limit_may_inherit_the_channel_delay():
    assert RateLimitedBackupPolicy(-1).backup_request_ms(Controller()) == -1


@pytest.mark.parametrize("quantile, expected_ms", [(0.5, 500), (0.9, 900), (0.99, 990)])
def test_quantile_of_a_known_distribution(quantile, expected_ms):
    # Latencies 1..1000 ms in random order: the nearest-rank q-quantile is q × 1000 ms.
    latencies = list(range(1, 1001))
    random.Random(3).shuffle(latencies)
    policy = LatencyQuantileBackupPolicy(quantile=quantile, window=1000, min_samples=32)
    for latency in latencies:
        policy.on_rpc_end(ended(latency))
    assert policy.latency_quantile_us == expected_ms * 1000
    assert policy.backup_request_ms(Controller()) == expected_ms


def test_quantile_follows_the_latest_window_and_memory_is_bounded():
    policy = LatencyQuantileBackupPolicy(quantile=0.9, window=64, min_samples=8)
    for _ in range(10_000):
        policy.on_rpc_end(ended(500))
    for _ in range(64):
        policy.on_rpc_end(ended(3))
    assert policy.sample_count == 64
    assert len(policy._arrival) == len(policy._sorted) == 64
    assert policy.backup_request_ms(Controller()) == 3


def test_sorted_window_matches_a_full_sort():
    rng = random.Random(9)
    policy = LatencyQuantileBackupPolicy(quantile=0.75, window=50, min_samples=1)
    for i in range(2000):
        policy.on_rpc_end(ended(rng.randint(1, 400) / 7))
        if i % 97 == 0:
            kept = sorted(policy._arrival)
            assert policy._sorted == kept
            assert policy.latency_quantile_us == kept[math.ceil(0.75 * len(kept)) - 1]


def test_fallback_until_min_samples():
    policy = LatencyQuantileBackupPolicy(min_samples=32)
    for _ in range(31):
        policy.on_rpc_end(ended(7))
    assert policy.backup_request_ms(Controller()) == -1  # the channel's backup_request_ms
    policy.on_rpc_end(ended(7))
    assert policy.backup_request_ms(Controller()) == 7
    other = LatencyQuantileBackupPolicy(min_samples=4, fallback_ms=50)
    assert other.backup_request_ms(Controller()) == 50


def test_failed_calls_are_not_sampled():
    policy = LatencyQuantileBackupPolicy(min_samples=2, window=10)
    policy.on_rpc_end(ended(900, errors.ERPCTIMEDOUT))
    policy.on_rpc_end(ended(1))
    assert policy.sample_count == 1 and policy.backup_request_ms(Controller()) == -1


def test_delay_is_rounded_up_and_clamped():
    def delay_for(latency_ms, **kwargs):
        policy = LatencyQuantileBackupPolicy(min_samples=1, **kwargs)
        policy.on_rpc_end(ended(latency_ms))
        return policy.backup_request_ms(Controller())

    assert delay_for(1.2) == 2
    assert delay_for(0.2, min_ms=5) == 5
    assert delay_for(800, max_ms=100) == 100
    assert delay_for(50, min_ms=5, max_ms=100) == 50


def test_quantile_policy_can_limit_the_backup_ratio():
    clock = FakeClock()
    policy = LatencyQuantileBackupPolicy(max_backup_ratio=0.2, clock=clock)
    for _ in range(10):
        policy.on_rpc_end(ended(1))
    assert [policy.do_backup(Controller()) for _ in range(3)] == [True, True, False]
    assert LatencyQuantileBackupPolicy().do_backup(Controller())  # unlimited by default


@pytest.mark.parametrize("kwargs, match", [
    ({"quantile": 0}, "quantile"), ({"quantile": 1}, "quantile"),
    ({"window": 0}, "window"), ({"window": 10, "min_samples": 11}, "min_samples"),
    ({"min_samples": 0}, "min_samples"), ({"min_ms": -1}, "min_ms"),
    ({"min_ms": 10, "max_ms": 5}, "max_ms"), ({"fallback_ms": 1.5}, "fallback_ms"),
    ({"max_backup_ratio": 0}, "max_backup_ratio"),
])
def test_quantile_policy_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LatencyQuantileBackupPolicy(**kwargs)
