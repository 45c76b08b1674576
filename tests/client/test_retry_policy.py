"""Retry policies and the retry throttle (brpc's docs/en/client.md, brpc's src/brpc/retry_policy.cpp)."""

from __future__ import annotations

import math
import random

import pytest

from aiobrpc import errors
from aiobrpc.client.retry import (
    NEVER_RETRIED, RETRYABLE_BY_DEFAULT, FixedBackoffRetryPolicy, JitteredBackoffRetryPolicy,
    RetryPolicy, RetryThrottle, retried_error_text, retry_allowed,
)
from aiobrpc.controller import Controller

# brpc's RpcRetryPolicy::DoRetry set (src/brpc/retry_policy.cpp), written out by name.
SPEC_RETRYABLE = {
    "EFAILEDSOCKET": 1009, "EEOF": 1014, "EHOSTDOWN": 112, "ELOGOFF": 2003, "ETIMEDOUT": 110,
    "ELIMIT": 2004, "ENOENT": 2, "EPIPE": 32, "ECONNREFUSED": 111, "ECONNRESET": 104,
    "ENODATA": 61, "EOVERCROWDED": 1011, "EH2RUNOUTSTREAMS": 1017,
}


def failed(code: int, retried_count: int = 1) -> Controller:
    cntl = Controller()
    cntl.error_code = code
    cntl.retried_count = retried_count
    return cntl


def test_default_set_is_exactly_the_spec_list():
    assert {getattr(errors, name) for name in SPEC_RETRYABLE} == set(SPEC_RETRYABLE.values())
    assert RETRYABLE_BY_DEFAULT == frozenset(SPEC_RETRYABLE.values())


@pytest.mark.parametrize("name", sorted(SPEC_RETRYABLE))
def test_default_policy_retries_every_listed_code(name):
    cntl = failed(getattr(errors, name))
    assert RetryPolicy().do_retry(cntl) and retry_allowed(RetryPolicy(), cntl)


@pytest.mark.parametrize("code", [
    0, errors.ERPCTIMEDOUT, errors.EREQUEST, errors.ECANCELED, errors.EBACKUPREQUEST,
    errors.EREJECT, errors.EINTERNAL, errors.ENOSERVICE, errors.ENOMETHOD, errors.EAGAIN,
    errors.EHTTP, errors.ENETUNREACH, errors.EHOSTUNREACH, errors.EINVAL, 1234,
])
def test_default_policy_does_not_retry_other_codes(code):
    assert not RetryPolicy().do_retry(failed(code))


class RetryEverything(RetryPolicy):
    def do_retry(self, cntl):
        return True


@pytest.mark.parametrize("code", sorted(NEVER_RETRIED))
def test_never_retried_codes_win_over_any_policy(code):
    assert not retry_allowed(RetryEverything(), failed(code))


def test_never_retried_covers_the_spec_cases():
    assert {errors.ERPCTIMEDOUT, errors.ECANCELED, errors.EREQUEST, errors.EBACKUPREQUEST,
            errors.EREJECT} <= NEVER_RETRIED
    assert not NEVER_RETRIED & RETRYABLE_BY_DEFAULT


def test_a_custom_policy_may_retry_success():
    assert retry_allowed(RetryEverything(), failed(0))


def test_retry_on_replaces_the_set():
    policy = RetryPolicy(retry_on=[errors.EINTERNAL])
    assert policy.do_retry(failed(errors.EINTERNAL)) and not policy.do_retry(failed(errors.EEOF))
    assert FixedBackoffRetryPolicy(1, 0, [errors.EHTTP]).do_retry(failed(errors.EHTTP))
    for bad in ([errors.ERPCTIMEDOUT], [0], [errors.EEOF, errors.ECANCELED]):
        with pytest.raises(ValueError, match="never retried"):
            RetryPolicy(retry_on=bad)


def test_default_policy_has_no_backoff():
    assert RetryPolicy().backoff_ms(failed(errors.EEOF), 1000) == 0


@pytest.mark.parametrize("remaining, expected", [
    (math.inf, 10), (100, 10), (30, 10),  # remaining == threshold still backs off
    (29.9, 0),  # below no_backoff_remaining_rpc_time_ms
])
def test_fixed_backoff_threshold(remaining, expected):
    policy = FixedBackoffRetryPolicy(10, no_backoff_remaining_rpc_time_ms=30)
    assert policy.backoff_ms(failed(errors.EEOF), remaining) == expected


def test_fixed_backoff_never_outlasts_the_deadline():
    policy = FixedBackoffRetryPolicy(50)
    assert policy.backoff_ms(failed(errors.EEOF), 50.1) == 50
    assert policy.backoff_ms(failed(errors.EEOF), 50) == 0
    assert policy.backoff_ms(failed(errors.EEOF), 10) == 0


def test_jittered_backoff_is_uniform_in_range_and_deterministic():
    policy = JitteredBackoffRetryPolicy(10, 20, 0, random.Random(42))
    reference = random.Random(42)
    draws = [policy.backoff_ms(failed(errors.EEOF), math.inf) for _ in range(500)]
    assert draws == [reference.uniform(10, 20) for _ in range(500)]
    assert 10 <= min(draws) < 11 and 19 < max(draws) <= 20


def test_jittered_backoff_threshold_and_deadline():
    policy = JitteredBackoffRetryPolicy(10, 20, no_backoff_remaining_rpc_time_ms=100,
                                        rng=random.Random(1))
    assert policy.backoff_ms(failed(errors.EEOF), 99) == 0
    assert 10 <= policy.backoff_ms(failed(errors.EEOF), 100) <= 20
    tight = JitteredBackoffRetryPolicy(10, 20, rng=random.Random(1))
    assert tight.backoff_ms(failed(errors.EEOF), 10) == 0  # any draw >= remaining time
    assert JitteredBackoffRetryPolicy(5, 5).backoff_ms(None, 6) == 5


@pytest.mark.parametrize("args, match", [
    ((-1,), "backoff_ms"), ((math.nan,), "backoff_ms"), ((1, -5), "no_backoff"),
    (("10",), "backoff_ms"),
])
def test_fixed_backoff_validation(args, match):
    with pytest.raises(ValueError, match=match):
        FixedBackoffRetryPolicy(*args)


def test_jittered_backoff_validation():
    with pytest.raises(ValueError, match="exceeds max_backoff_ms"):
        JitteredBackoffRetryPolicy(20, 10)
    with pytest.raises(ValueError, match="min_backoff_ms"):
        JitteredBackoffRetryPolicy(-1, 10)
    with pytest.raises(ValueError, match="max_backoff_ms"):
        JitteredBackoffRetryPolicy(1, math.inf)


def test_throttle_arithmetic():
    throttle = RetryThrottle(max_tokens=10, token_ratio=0.5)
    assert throttle.tokens == 10 and throttle.allow_retry()
    for _ in range(4):
        throttle.on_failure()
    assert throttle.tokens == 6 and throttle.allow_retry()  # 6 > 10 / 2
    throttle.on_failure()
    assert throttle.tokens == 5 and not throttle.allow_retry()  # 5 is not > 5
    throttle.on_success()
    assert throttle.tokens == 5.5 and throttle.allow_retry()
    for _ in range(100):
        throttle.on_failure()
    assert throttle.tokens == 0  # never below zero
    for _ in range(11):
        throttle.on_success()
    assert throttle.tokens == 5.5 and throttle.allow_retry()  # 11 successes × 0.5
    for _ in range(100):
        throttle.on_success()
    assert throttle.tokens == 10  # capped at max_tokens


def test_throttle_defaults_and_validation():
    throttle = RetryThrottle()
    assert (throttle.max_tokens, throttle.token_ratio) == (100, 0.1)
    for kwargs, match in [({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 1001}, "max_tokens"),
                          ({"token_ratio": 0}, "token_ratio"),
                          ({"max_tokens": 2, "token_ratio": 3}, "token_ratio")]:
        with pytest.raises(ValueError, match=match):
            RetryThrottle(**kwargs)


# -- the error text of a retried call -----------------------------------------------------------
@pytest.mark.parametrize("attempts,text", [
    ([(2004, "busy")], "busy"),  # one attempt: its text, as brpc
    ([(111, "refused"), (112, "down")], "[E111]refused [R1][E112]down"),  # brpc's form
    ([(111, "refused"), (112, "down"), (112, "down"), (112, "down")], "[E111]refused [R1-R3][E112]down"),
    ([(61, "none"), (61, "none"), (61, "none"), (61, "none")], "[E61]none [R1-R3] same"),
    ([(61, "none"), (61, "none")], "[E61]none [R1] same"),
    ([(1, "a"), (2, "b"), (2, "b"), (1, "a"), (3, "c")], "[E1]a [R1-R2][E2]b [R3][E1]a [R4][E3]c"),
    ([(2004, "busy"), (2001, "busy")], "[E2004]busy [R1][E2001]busy"),  # another code is another failure
])
def test_retries_that_failed_alike_are_told_once(attempts, text):
    assert retried_error_text(attempts) == text


def test_every_retry_is_counted_in_the_marks():
    attempts = [(1, "a")] + [(2, "b")] * 5 + [(3, "c")] * 2
    assert retried_error_text(attempts) == "[E1]a [R1-R5][E2]b [R6-R7][E3]c"
