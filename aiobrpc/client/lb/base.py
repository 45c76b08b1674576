"""The load-balancer interface and brpc's `name:key=value ...` LB names (brpc's docs/en/load_balancing.md).

>>> parse_lb_name("rr:min_working_instances=2 hold_seconds=5")
('rr', {'min_working_instances': '2', 'hold_seconds': '5'})
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Sequence

from ..naming.base import ServerNode


def always_available(server: ServerNode) -> bool:
    """The default `available` predicate of `select`: every server is usable."""
    return True


class LoadBalancer(ABC):
    """Picks a server for each attempt of a call.

    The channel feeds it the naming service's lists with `set_servers` (full replacement) and
    asks `select` per attempt, passing the servers earlier attempts of the call used
    (`excluded`) and a predicate telling whether a server is usable now (`available`: not
    failed, not logged off, no health check in flight). `select` raises RpcError(ENODATA) for an
    empty list and RpcError(EHOSTDOWN) when no server is available; both are retryable.
    """

    def __init__(self) -> None:
        self._servers: tuple[ServerNode, ...] = ()

    @property
    def servers(self) -> tuple[ServerNode, ...]:
        return self._servers

    def set_servers(self, servers: Sequence[ServerNode]) -> None:
        """Replace the server list; duplicates (address and tag) keep their first place."""
        for server in servers:
            if not isinstance(server, ServerNode):
                raise TypeError(f"set_servers needs ServerNode items, got {server!r}")
        self._servers = tuple(dict.fromkeys(servers))

    @abstractmethod
    def select(self, *, excluded: Collection[ServerNode] = (),
               available: Callable[[ServerNode], bool] = always_available,
               request_code: int | None = None) -> ServerNode:
        """The server for the next attempt."""

    def feedback(self, server: ServerNode, error_code: int, latency_us: int) -> None:
        """Result of one attempt on `server` (used by latency-aware LBs; default: ignored)."""


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
