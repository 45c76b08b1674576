"""rr: round robin in a random stride-permutation order (brpc's docs/en/load_balancing.md).

>>> import random
>>> from aiobrpc.client.naming import ServerNode
>>> lb = RoundRobinLoadBalancer(rng=random.Random(7))
>>> lb.set_servers([ServerNode("10.0.0.1", 80), ServerNode("10.0.0.2", 80)])
>>> picks = {lb.select().host for _ in range(2)}
>>> sorted(picks)
['10.0.0.1', '10.0.0.2']
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Collection, Mapping

from ...errors import EHOSTDOWN, ENODATA, RpcError
from ..naming.base import ServerNode
from .base import LoadBalancer, always_available

logger = logging.getLogger(__name__)


def _primes_between(low: int, high: int) -> tuple[int, ...]:
    sieve = bytearray([1]) * (high + 1)
    sieve[:2] = b"\0\0"
    for d in range(2, int(high ** 0.5) + 1):
        if sieve[d]:
            sieve[d * d::d] = bytes(len(range(d * d, high + 1, d)))
    return tuple(n for n in range(low, high + 1) if sieve[n])


# brpc draws the stride from a fixed table of the primes in this range
# (bthread/offset_inl.list): large enough to be coprime with any realistic server count.
STRIDE_PRIMES = _primes_between(36809, 41579)


class RoundRobinLoadBalancer(LoadBalancer):
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

    `min_working_instances` and `hold_seconds` (cluster recovery, brpc's docs/en/client.md) are
    validated as brpc does and kept, but the recovery throttling itself is not implemented.
    """

    name = "rr"

    def __init__(self, *, min_working_instances: int | None = None,
                 hold_seconds: int | None = None, rng: random.Random | None = None) -> None:
        super().__init__()
        if (min_working_instances is None) != (hold_seconds is None):
            raise ValueError("rr: give both min_working_instances and hold_seconds, or neither")
        for key, value in (("min_working_instances", min_working_instances),
                           ("hold_seconds", hold_seconds)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value <= 0):
                raise ValueError(f"rr: {key} must be an int > 0, got {value!r}")
        if min_working_instances is not None:
            logger.warning("rr: cluster recovery (min_working_instances=%d hold_seconds=%d) "
                           "is accepted but not implemented", min_working_instances,
                           hold_seconds)
        self.min_working_instances = min_working_instances
        self.hold_seconds = hold_seconds
        self._rng = rng if rng is not None else random.Random()
        self._stride = 0  # 0: not drawn yet (drawn on first selection, as brpc does per thread)
        self._offset = 0

    @classmethod
    def from_params(cls, params: Mapping[str, str]) -> RoundRobinLoadBalancer:
        """Build from parsed `rr:key=value ...` parameters; ValueError for unknown keys."""
        values: dict[str, int] = {}
        for key, text in params.items():
            if key not in ("min_working_instances", "hold_seconds"):
                raise ValueError(f"rr: unknown parameter {key!r}; known: "
                                 f"min_working_instances, hold_seconds")
            try:
                values[key] = int(text)
            except ValueError:
                raise ValueError(f"rr: {key} must be an integer, got {text!r}") from None
        return cls(**values)

    def select(self, *, excluded: Collection[ServerNode] = (),
               available: Callable[[ServerNode], bool] = always_available,
               request_code: int | None = None) -> ServerNode:
        servers = self._servers
        n = len(servers)
        if n == 0:
            raise RpcError(ENODATA, "Fail to select server: rr has an empty server list")
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
        raise RpcError(EHOSTDOWN, f"Fail to select server: none of the {n} servers of rr "
                                  f"is available")
