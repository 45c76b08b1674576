"""rr: round robin in a random stride-permutation order (brpc's round_robin_load_balancer.cpp).

>>> import random
>>> from aiobrpc.client.naming import ServerNode
>>> lb = RoundRobinLoadBalancer(rng=random.Random(7))
>>> lb.set_servers([ServerNode("10.0.0.1", 80), ServerNode("10.0.0.2", 80)])
>>> picks = {lb.select().host for _ in range(2)}
>>> sorted(picks)
['10.0.0.1', '10.0.0.2']
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from ...errors import EHOSTDOWN, RpcError
from ..naming.base import ServerNode
from .base import always_available
from .recovery import RecoveringLoadBalancer
from .stride import STRIDE_PRIMES

__all__ = ["STRIDE_PRIMES", "RoundRobinLoadBalancer"]


class RoundRobinLoadBalancer(RecoveringLoadBalancer):
    """Cycles through all servers, each once per n selections, starting at a random server.

    The first selection draws a random offset in [0, n) and a random prime stride; every
    selection then steps `offset = (offset + stride) % n` and takes the server there if it is
    available and not excluded, walking at most n steps (a walk visits every server once).
    Like brpc, the n-th step ignores `excluded` ("last chance"). brpc gives no chance to an
    excluded server met earlier in the walk: when every later server is unavailable it fails
    with EHOSTDOWN, and since a full walk ends where it started, every retry of the call
    repeats that walk and fails again although an excluded server is up. Here the first
    available excluded server of the walk is taken in that case instead; whenever brpc finds
    a server, the choice is the same.

    `min_working_instances` and `hold_seconds` (both > 0, or neither) turn on cluster recovery
    (aiobrpc.client.lb.recovery): after a selection found no available server, selections are
    rejected with EREJECT with probability 1 - usable/min_working_instances until the number
    of usable servers has held for `hold_seconds`.
    """

    name = "rr"

    def __init__(self, **recovery) -> None:
        super().__init__(**recovery)
        self._stride = 0  # 0: not drawn yet (drawn on first selection, as brpc does per thread)
        self._offset = 0

    def select(self, *, excluded: Collection[ServerNode] = (),
               available: Callable[[ServerNode], bool] = always_available,
               request_code: int | None = None) -> ServerNode:
        servers = self._servers_to_walk(available)
        n = len(servers)
        if self._stride == 0:
            self._stride = self._rng.choice(STRIDE_PRIMES)
            self._offset = self._rng.randrange(n)
        # A prime stride is coprime with n unless it divides n (n >= 36809).
        stride = self._stride if n % self._stride else 1
        offset = self._offset
        fallback = -1  # offset of the first available excluded server of the walk
        for step in range(1, n + 1):
            offset = (offset + stride) % n
            server = servers[offset]
            if step == n or server not in excluded:
                if available(server):
                    self._offset = offset
                    return server
            elif fallback < 0 and available(server):
                fallback = offset
        if fallback >= 0:
            self._offset = fallback
            return servers[fallback]
        self._offset = offset
        if self._recovery is not None:
            self._recovery.start()
        raise RpcError(EHOSTDOWN, f"Fail to select server: none of the {n} servers of rr "
                                  f"is available")

