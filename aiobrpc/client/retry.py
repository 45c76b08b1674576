"""Retry policies (brpc's docs/en/client.md) and a gRPC-style retry throttle.

A policy answers two questions about a failed attempt: retry it (`do_retry`), and how long to
wait first (`backoff_ms`). Codes in NEVER_RETRIED end the call whatever a policy says; use
`retry_allowed(policy, cntl)` to ask with that rule applied.

>>> from aiobrpc.controller import Controller
>>> from aiobrpc import errors
>>> cntl = Controller()
>>> cntl.error_code = errors.EEOF
>>> RetryPolicy().do_retry(cntl)
True
>>> cntl.error_code = errors.ERPCTIMEDOUT
>>> retry_allowed(RetryPolicy(retry_on={errors.EEOF, errors.EINTERNAL}), cntl)
False
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from typing import Any

from .. import errors
from ..options import RetryThrottle  # noqa: F401  (its home is options.py: ChannelOptions makes the default one)

# brpc's RpcRetryPolicy::DoRetry set (brpc's src/brpc/retry_policy.cpp).
RETRYABLE_BY_DEFAULT: frozenset[int] = errors.DEFAULT_RETRYABLE

# Codes that end the call whatever the policy says:
# ERPCTIMEDOUT: the deadline covers all attempts, nothing is left to retry in (brpc asserts);
# ECANCELED: the user ended the call (brpc asserts);
# EBACKUPREQUEST: the backup timer's marker, not an attempt failure;
# EREQUEST: the request could not be built or parsed; the same bytes fail the same way again
#   (brpc lets a custom policy retry a server-side EREQUEST; we do not);
# EREJECT: the client's own cluster-recovery throttle shed the call (brpc's docs/en/client.md).
NEVER_RETRIED: frozenset[int] = frozenset({
    errors.ERPCTIMEDOUT, errors.ECANCELED, errors.EBACKUPREQUEST, errors.EREQUEST,
    errors.EREJECT,
})


class RetryPolicy:
    """brpc's default policy: retry the codes of RETRYABLE_BY_DEFAULT, no backoff.

    RETRYABLE_BY_DEFAULT is brpc's set: EFAILEDSOCKET, EEOF, EHOSTDOWN, ELOGOFF, ETIMEDOUT,
    ELIMIT, ENOENT, EPIPE, ECONNREFUSED, ECONNRESET, ENODATA, EOVERCROWDED, EH2RUNOUTSTREAMS.
    NEVER_RETRIED codes end the call whatever a policy says: ERPCTIMEDOUT, ECANCELED,
    EBACKUPREQUEST, EREQUEST, EREJECT. A retry also needs `max_retry` left, time before the
    deadline, tokens in the retry throttle, and an idempotent method or a request that
    cannot have run (docs/client_resilience.md).

    `retry_on` replaces the retried set (it may not contain NEVER_RETRIED codes or 0).
    Subclass and override `do_retry` for other rules; a success (error_code 0) may be retried
    by an override (the response is then discarded).
    """

    def __init__(self, *, retry_on: Iterable[int] | None = None) -> None:
        if retry_on is None:
            self.retry_on = RETRYABLE_BY_DEFAULT
        else:
            codes = frozenset(retry_on)
            bad = sorted(codes & (NEVER_RETRIED | {0}))
            if bad:
                raise ValueError(f"retry_on may not contain {bad}: these codes are never "
                                 f"retried (0 is success)")
            self.retry_on = codes

    def do_retry(self, cntl: Any) -> bool:
        """True if the attempt that failed with `cntl.error_code` should be retried."""
        return cntl.error_code in self.retry_on

    def backoff_ms(self, cntl: Any, remaining_ms: float) -> float:
        """Milliseconds to wait before the retry; `remaining_ms` is the time left to the
        deadline (math.inf without one). 0 means retry at once."""
        return 0.0

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class FixedBackoffRetryPolicy(RetryPolicy):
    """Wait `backoff_ms` before each retry (brpc's RpcRetryPolicyWithFixedBackoff).

    No backoff when less than `no_backoff_remaining_rpc_time_ms` is left, nor when the
    backoff would not end before the deadline.

    >>> FixedBackoffRetryPolicy(10, 30).backoff_ms(None, remaining_ms=100)
    10.0
    >>> FixedBackoffRetryPolicy(10, 30).backoff_ms(None, remaining_ms=20)
    0.0
    """

    def __init__(self, backoff_ms: float, no_backoff_remaining_rpc_time_ms: float = 0,
                 retry_on: Iterable[int] | None = None) -> None:
        super().__init__(retry_on=retry_on)
        _check_ms("backoff_ms", backoff_ms)
        _check_ms("no_backoff_remaining_rpc_time_ms", no_backoff_remaining_rpc_time_ms)
        self._backoff_ms = float(backoff_ms)
        self.no_backoff_remaining_rpc_time_ms = float(no_backoff_remaining_rpc_time_ms)

    def backoff_ms(self, cntl: Any, remaining_ms: float) -> float:
        return _bounded(self._backoff_ms, remaining_ms, self.no_backoff_remaining_rpc_time_ms)

    def __repr__(self) -> str:
        return (f"FixedBackoffRetryPolicy({self._backoff_ms:g}, "
                f"{self.no_backoff_remaining_rpc_time_ms:g})")


class JitteredBackoffRetryPolicy(RetryPolicy):
    """Wait a uniform random time in [min_backoff_ms, max_backoff_ms] before each retry
    (brpc's RpcRetryPolicyWithJitteredBackoff), with the same remaining-time rules as
    FixedBackoffRetryPolicy.

    >>> p = JitteredBackoffRetryPolicy(10, 20, rng=random.Random(1))
    >>> 10 <= p.backoff_ms(None, remaining_ms=math.inf) <= 20
    True
    """

    def __init__(self, min_backoff_ms: float, max_backoff_ms: float,
                 no_backoff_remaining_rpc_time_ms: float = 0,
                 rng: random.Random | None = None, *,
                 retry_on: Iterable[int] | None = None) -> None:
        super().__init__(retry_on=retry_on)
        _check_ms("min_backoff_ms", min_backoff_ms)
        _check_ms("max_backoff_ms", max_backoff_ms)
        _check_ms("no_backoff_remaining_rpc_time_ms", no_backoff_remaining_rpc_time_ms)
        if min_backoff_ms > max_backoff_ms:
            raise ValueError(f"min_backoff_ms {min_backoff_ms} exceeds max_backoff_ms "
                             f"{max_backoff_ms}")
        self.min_backoff_ms = float(min_backoff_ms)
        self.max_backoff_ms = float(max_backoff_ms)
        self.no_backoff_remaining_rpc_time_ms = float(no_backoff_remaining_rpc_time_ms)
        self._rng = rng if rng is not None else random.Random()

    def backoff_ms(self, cntl: Any, remaining_ms: float) -> float:
        if remaining_ms < self.no_backoff_remaining_rpc_time_ms:
            return 0.0  # don't draw: keeps an injected rng's sequence tied to real backoffs
        backoff = self._rng.uniform(self.min_backoff_ms, self.max_backoff_ms)
        return _bounded(backoff, remaining_ms, self.no_backoff_remaining_rpc_time_ms)

    def __repr__(self) -> str:
        return (f"JitteredBackoffRetryPolicy({self.min_backoff_ms:g}, {self.max_backoff_ms:g}, "
                f"{self.no_backoff_remaining_rpc_time_ms:g})")


def retry_allowed(policy: RetryPolicy, cntl: Any) -> bool:
    """`policy.do_retry(cntl)`, except that NEVER_RETRIED codes are never retried.

    The caller still checks `retried_count < max_retry` and the deadline.
    """
    return cntl.error_code not in NEVER_RETRIED and bool(policy.do_retry(cntl))


def retried_error_text(errors: list[tuple[int, str]]) -> str:
    """The error text of a call from its attempts' (code, text), first attempt first.

    One attempt: its text. More: brpc's `[E<code>]<text>` of the first, then its ` [R<n>]`
    marks, except that a run of retries that failed alike (same code, same text) is told once,
    as ` [R<a>-R<b>][E<code>]<text>`, and a run that failed as the attempt before it did as
    ` [R<a>-R<b>] same` (docs/client_resilience.md).

    >>> retried_error_text([(111, "refused"), (112, "down"), (112, "down"), (112, "down")])
    '[E111]refused [R1-R3][E112]down'
    >>> retried_error_text([(61, "no server"), (61, "no server"), (61, "no server")])
    '[E61]no server [R1-R2] same'
    """
    first_code, first_text = errors[0]
    if len(errors) == 1:
        return first_text
    parts = [f"[E{first_code}]{first_text}"]
    previous, first = errors[0], 1
    for n in range(1, len(errors) + 1):
        if n < len(errors) and errors[n] == errors[first]:
            continue  # the run goes on
        marks = f"[R{first}]" if n - 1 == first else f"[R{first}-R{n - 1}]"
        code, text = errors[first]
        parts.append(f" {marks} same" if errors[first] == previous else f" {marks}[E{code}]{text}")
        previous, first = errors[first], n
    return "".join(parts)


def _check_ms(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0 <= value < math.inf:
        raise ValueError(f"{name} must be a finite number of milliseconds >= 0, got {value!r}")


def _bounded(backoff_ms: float, remaining_ms: float, no_backoff_below_ms: float) -> float:
    # brpc: no backoff when little time is left, nor one that would outlast the deadline.
    if remaining_ms < no_backoff_below_ms or backoff_ms >= remaining_ms:
        return 0.0
    return backoff_ms
