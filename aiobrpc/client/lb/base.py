"""The load-balancer interface and brpc's `name:key=value ...` LB names (brpc's docs/en/load_balancing.md).

>>> parse_lb_name("rr:min_working_instances=2 hold_seconds=5")
('rr', {'min_working_instances': '2', 'hold_seconds': '5'})
"""

from __future__ import annotations

import random
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import ClassVar

from ..naming.base import ServerNode


def always_available(server: ServerNode) -> bool:
    """The default `available` predicate of `select`: every server is usable."""
    return True


def rand_below(rng: random.Random, n: int) -> int:
    """A random int in [0, n), 0 when n <= 0 (butil::fast_rand_less_than(0) is 0)."""
    return rng.randrange(n) if n > 0 else 0


class LoadBalancer(ABC):
    """Picks a server for each attempt of a call.

    The channel feeds it the naming service's lists with `set_servers` (full replacement) and
    asks `select` per attempt, passing the servers earlier attempts of the call used
    (`excluded`), a predicate telling whether a server is usable now (`available`: not
    failed, not logged off, no health check in flight) and the call's
    `Controller.request_code` (None when not set). `select` raises RpcError(ENODATA) for an
    empty list and RpcError(EHOSTDOWN) when no server is available; both are retryable.

    Feedback: when `wants_feedback` is true, the channel reports the end of every attempt
    that `select` chose a server for, exactly once, with `attempt_ended` (an attempt dropped
    because another one won, the deadline passed or the call was cancelled included). The
    default `attempt_ended` calls `feedback(server, error_code, latency_us)`. A subclass that
    defines `feedback` or `attempt_ended` wants feedback unless it sets `wants_feedback`
    itself; other balancers cost the call path nothing for it.
    """

    name = ""
    wants_feedback: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "wants_feedback" not in cls.__dict__ and (
                "feedback" in cls.__dict__ or "attempt_ended" in cls.__dict__):
            cls.wants_feedback = True

    def __init__(self) -> None:
        self._servers: tuple[ServerNode, ...] = ()

    @property
    def servers(self) -> tuple[ServerNode, ...]:
        return self._servers

    def set_servers(self, servers: Sequence[ServerNode]) -> None:
        """Replace the server list; duplicates (address and tag) keep their first place."""
        self._servers = unique_nodes(servers)

    @abstractmethod
    def select(self, *, excluded: Collection[ServerNode] = (),
               available: Callable[[ServerNode], bool] = always_available,
               request_code: int | None = None) -> ServerNode:
        """The server for the next attempt."""

    def feedback(self, server: ServerNode, error_code: int, latency_us: int) -> None:
        """Result of one attempt on `server`: its error code (0: success) and how long it took."""

    def attempt_ended(self, server: ServerNode, error_code: int, latency_us: int,
                      timeout_ms: int, retried_count: int, max_retry: int) -> None:
        """What the channel calls when an attempt ends (see the class): the attempt's result,
        with the call's `timeout_ms` (-1: none), the retries made before this attempt and the
        call's `max_retry`. The default passes the result to `feedback`."""
        self.feedback(server, error_code, latency_us)


def unique_nodes(servers: Iterable[ServerNode]) -> tuple[ServerNode, ...]:
    """`servers` without repeats (first place kept); TypeError for an item that is not a ServerNode."""
    nodes = tuple(dict.fromkeys(servers))
    for server in nodes:
        if not isinstance(server, ServerNode):
            raise TypeError(f"set_servers needs ServerNode items, got {server!r}")
    return nodes


def parse_lb_name(name: str) -> tuple[str, dict[str, str]]:
    """Split `"name"` or `"name:key1=v1 key2=v2"` into the name and its parameters.

    Like brpc (load_balancer.cpp), the name ends at the first colon and the parameters are
    blank-separated `key=value` pairs. ValueError for an empty name, a pair without a value,
    or a key given twice.

    >>> parse_lb_name("rr")
    ('rr', {})
    """
    if not isinstance(name, str):
        raise TypeError(f"load balancer name must be a str, got {type(name).__name__}")
    lb_name, _, param_text = name.partition(":")
    lb_name = lb_name.strip()
    if not lb_name:
        raise ValueError(f"empty load balancer name in {name!r}")
    params: dict[str, str] = {}
    for pair in param_text.split():
        key, _, value = pair.partition("=")
        if not key or not value:
            raise ValueError(f"load balancer parameter {pair!r} in {name!r} is not key=value")
        if key in params:
            raise ValueError(f"load balancer parameter {key!r} given twice in {name!r}")
        params[key] = value
    return lb_name, params


_DECIMAL = re.compile(r"[+-]?[0-9]+")


def decimal_int(text: str) -> int | None:
    """`text` as a decimal integer (ASCII digits, an optional sign), else None.

    >>> decimal_int("-12"), decimal_int("1_000"), decimal_int(" 5")
    (-12, None, None)
    """
    return int(text) if _DECIMAL.fullmatch(text) else None


def int_params(lb_name: str, params: Mapping[str, str],
               bounds: Mapping[str, tuple[int, int | None]]) -> dict[str, int]:
    """The integer parameters of `lb_name:key=value ...`, each checked against its
    (minimum, maximum or None) in `bounds`. ValueError naming the LB and the key for an unknown
    key, a value that is not a decimal integer, or one out of bounds.

    >>> int_params("p2c", {"choices": "3"}, {"choices": (2, 64), "tau_ms": (1, None)})
    {'choices': 3}
    """
    values: dict[str, int] = {}
    for key, text in params.items():
        if key not in bounds:
            raise ValueError(f"{lb_name}: unknown parameter {key!r}; known: {', '.join(bounds)}")
        value = decimal_int(text)
        if value is None:
            raise ValueError(f"{lb_name}: {key} must be an integer, got {text!r}")
        low, high = bounds[key]
        if value < low or (high is not None and value > high):
            wanted = f">= {low}" if high is None else f"in {low}..{high}"
            raise ValueError(f"{lb_name}: {key} must be {wanted}, got {value}")
        values[key] = value
    return values
