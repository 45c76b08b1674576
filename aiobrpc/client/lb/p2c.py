"""p2c: power of two choices over peak-EWMA latency (brpc's p2c_ewma_load_balancer.cpp).

>>> import random
>>> from aiobrpc.client.naming import ServerNode
>>> lb = P2CEwmaLoadBalancer(rng=random.Random(1))
>>> lb.set_servers([ServerNode("10.0.0.1", 80), ServerNode("10.0.0.2", 80)])
>>> lb.attempt_ended(lb.servers[0], 0, 5000, -1, 0, 0)  # a slow reply: it scores worse
>>> {lb.select() for _ in range(3)} == {lb.servers[1]}
True
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

from ...errors import EHOSTDOWN, ENODATA, RpcError
from ..naming.base import ServerNode
from .base import LoadBalancer, always_available, int_params, unique_nodes
from .weights import tag_weight

logger = logging.getLogger(__name__)

# brpc's gflags of the same meaning.
DEFAULT_CHOICES = 2  # -p2c_default_choices
MAX_CHOICES = 64
DEFAULT_TAU_MS = 10_000  # -p2c_default_tau_ms
MAX_PUNISH_MS = 30_000  # -p2c_max_punish_ms (0: no cap)
MIN_LATENCY_TERM_US = 1.0  # lets in-flight counts break ties between servers never measured


def _monotonic_us() -> int:
    return time.monotonic_ns() // 1000


class NodeStat:
    """What p2c knows of one server: calls in flight and the peak-EWMA latency (0: none yet)."""

    __slots__ = ("inflight", "ewma_us", "stamp_us")

    def __init__(self) -> None:
        self.inflight = 0
        self.ewma_us = 0
        self.stamp_us = 0  # when ewma_us was last updated


def p2c_weight(tag: str) -> int:
    """The weight of a server for p2c: its tag as a uint32 >= 1; 1 for an empty or invalid tag."""
    if not tag:
        return 1
    weight = tag_weight(tag)
    if weight is None:
        logger.warning("p2c: invalid weight tag %r, using weight=1", tag)
        return 1
    return weight


def load_score(stat: NodeStat, weight: int, now_us: int, tau_us: int) -> float:
    """`max(ewma * exp(-(now - stamp) / tau), 1) * max(inflight + 1, 1) / weight`."""
    latency_term = MIN_LATENCY_TERM_US
    ewma = stat.ewma_us
    if ewma > 0:
        elapsed = now_us - stat.stamp_us
        decayed = ewma * math.exp(-elapsed / tau_us) if elapsed > 0 else float(ewma)
        if decayed > latency_term:
            latency_term = decayed
    inflight = stat.inflight
    return latency_term * (inflight + 1 if inflight >= 0 else 1) / weight


class P2CEwmaLoadBalancer(LoadBalancer):
    """Samples `choices` distinct random servers (all of them, from a random start, when
    there are no more) and takes the one of lowest score
    `max(ewma * exp(-(now - stamp) / tau), 1) * (inflight + 1) / weight`, skipping excluded
    and unavailable ones; if no sampled server qualifies, every server is scored; if none
    qualifies (all excluded), the first available one is taken (last chance). EHOSTDOWN when
    none is available.

    Feedback: the server's in-flight count drops; a failed attempt counts as
    max(latency, timeout, 2 x ewma) capped at `max_punish_ms`; a sample above the EWMA
    replaces it at once (peak), a lower one decays into it with weight exp(-elapsed / tau).
    The weight is the server tag (1 when empty or invalid). `rng` and `clock` (microseconds,
    monotonic) are injectable for tests.
    """

    name = "p2c"

    def __init__(self, *, choices: int = DEFAULT_CHOICES, tau_ms: int = DEFAULT_TAU_MS,
                 max_punish_ms: int = MAX_PUNISH_MS, rng: random.Random | None = None,
                 clock: Callable[[], int] = _monotonic_us) -> None:
        super().__init__()
        for key, value, low, high in (("choices", choices, 2, MAX_CHOICES),
                                      ("tau_ms", tau_ms, 1, None),
                                      ("max_punish_ms", max_punish_ms, 0, None)):
            if (not isinstance(value, int) or isinstance(value, bool) or value < low
                    or (high is not None and value > high)):
                wanted = f">= {low}" if high is None else f"in {low}..{high}"
                raise ValueError(f"p2c: {key} must be an int {wanted}, got {value!r}")
        self.choices = choices
        self.tau_us = tau_ms * 1000
        self.max_punish_us = max_punish_ms * 1000
        self._rng = rng if rng is not None else random.Random()
        self._clock = clock
        self._weights: list[int] = []
        self._stat_list: list[NodeStat] = []  # in the order of self._servers
        self._stats: dict[ServerNode, NodeStat] = {}

    @classmethod
    def from_params(cls, params: Mapping[str, str]) -> P2CEwmaLoadBalancer:
        """Build from parsed `p2c:choices=N tau_ms=T` parameters."""
        return cls(**int_params(cls.name, params, {"choices": (2, MAX_CHOICES),
                                                   "tau_ms": (1, None)}))

    def set_servers(self, servers: Sequence[ServerNode]) -> None:
        """Replace the list: servers kept keep their statistics."""
        nodes = unique_nodes(servers)
        old = self._stats
        self._stats = {server: old.get(server) or NodeStat() for server in nodes}
        self._stat_list = list(self._stats.values())
        self._weights = [p2c_weight(server.tag) for server in nodes]
        self._servers = nodes

    def stat_of(self, server: ServerNode) -> NodeStat | None:
        """What p2c knows of `server`, None if it is not listed."""
        return self._stats.get(server)

    def score(self, server: ServerNode, now_us: int) -> float:
        """The load score of `server` at `now_us` (lower is better)."""
        index = self._servers.index(server)
        return load_score(self._stat_list[index], self._weights[index], now_us, self.tau_us)

    def _lowest_score(self, candidates: Iterable[int], excluded: Collection[ServerNode],
                      available: Callable[[ServerNode], bool], now_us: int) -> int:
        """The index of the lowest score among `candidates` neither excluded nor unavailable
        (the first of equal ones), -1 if none."""
        servers, stats, weights, tau_us = self._servers, self._stat_list, self._weights, self.tau_us
        best = -1
        best_score = 0.0
        for index in candidates:
            server = servers[index]
            if server in excluded or not available(server):
                continue
            score = load_score(stats[index], weights[index], now_us, tau_us)
            if best < 0 or score < best_score:
                best, best_score = index, score
        return best

    def select(self, *, excluded: Collection[ServerNode] = (),
               available: Callable[[ServerNode], bool] = always_available,
               request_code: int | None = None) -> ServerNode:
        servers = self._servers
        n = len(servers)
        if n == 0:
            raise RpcError(ENODATA, "Fail to select server: p2c has an empty server list")
        rng = self._rng
        choices = min(self.choices, n)
        if choices >= n:
            start = rng.randrange(n)  # equal scores must not herd every client to server 0
            candidates: Sequence[int] = [(start + i) % n for i in range(n)]
        else:
            candidates = []
            for _ in range(4 * choices + 8):
                if len(candidates) >= choices:
                    break
                index = rng.randrange(n)
                if index not in candidates:
                    candidates.append(index)
        now_us = self._clock()
        best = self._lowest_score(candidates, excluded, available, now_us)
        if best < 0 and choices < n:
            best = self._lowest_score(range(n), excluded, available, now_us)
        if best < 0:
            for i in range(n):
                if available(servers[i]):
                    best = i
                    break
            else:
                raise RpcError(EHOSTDOWN, f"Fail to select server: none of the {n} servers of "
                                          f"p2c is available")
        self._stat_list[best].inflight += 1
        return servers[best]

    def attempt_ended(self, server: ServerNode, error_code: int, latency_us: int,
                      timeout_ms: int, retried_count: int, max_retry: int) -> None:
        stat = self._stats.get(server)
        if stat is None:
            return  # removed from the list since it was selected
        stat.inflight -= 1
        if latency_us <= 0:
            return
        now_us = self._clock()
        if error_code:
            # A failing server must keep losing comparisons even when it fails fast.
            latency_us = max(latency_us, timeout_ms * 1000, 2 * stat.ewma_us)
            if 0 < self.max_punish_us < latency_us:
                latency_us = self.max_punish_us
        ewma = stat.ewma_us
        new_ewma = latency_us
        if 0 < ewma and latency_us < ewma:
            elapsed = now_us - stat.stamp_us
            w = math.exp(-elapsed / self.tau_us) if elapsed > 0 else 1.0
            new_ewma = int(ewma * w + latency_us * (1.0 - w))
        stat.ewma_us = new_ewma
        stat.stamp_us = now_us

    def feedback(self, server: ServerNode, error_code: int, latency_us: int) -> None:
        """An attempt of a call with no deadline ended (see attempt_ended)."""
        self.attempt_ended(server, error_code, latency_us, -1, 0, 0)
