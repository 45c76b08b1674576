"""wrr: weighted round robin, weights from server tags (brpc's weighted_round_robin_load_balancer.cpp).

>>> import random
>>> from aiobrpc.client.naming import ServerNode
>>> lb = WeightedRoundRobinLoadBalancer(rng=random.Random(1))
>>> lb.set_servers([ServerNode("10.0.0.1", 80, "1"), ServerNode("10.0.0.2", 80, "3")])
>>> sorted(lb.select().host for _ in range(4))
['10.0.0.1', '10.0.0.2', '10.0.0.2', '10.0.0.2']
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable, Collection, Mapping, Sequence

from ...errors import EHOSTDOWN, ENODATA, RpcError
from ..naming.base import ServerNode
from .base import LoadBalancer, always_available, int_params, unique_nodes
from .weights import DEFAULT_WEIGHT_OF_WLB, MAX_WEIGHT, weighted_servers

# brpc's prime_stride table (weighted_round_robin_load_balancer.cpp).
WRR_STRIDES = (
    2, 3, 5, 11, 17, 29, 47, 71, 107, 137, 163, 251, 307, 379, 569, 683, 857, 1289, 1543, 1949,
    2617, 2927, 3407, 4391, 6599, 9901, 14867, 22303, 33457, 50207, 75323, 112997, 169501,
    254257, 381389, 572087, 849083, 1273637, 1910471, 2865727, 4298629, 6447943, 9671923,
    14507903, 21761863, 32642861, 48964297, 73446469, 110169743, 165254623, 247881989,
    371822987, 557734537, 836601847, 1254902827, 1882354259, 2823531397, 4235297173,
    6352945771, 9529418671,
)


def wrr_stride(weight_sum: int, n: int) -> int:
    """The smallest stride of the table >= weight_sum // n that is coprime with weight_sum,
    taken mod weight_sum when larger; 1 when weight_sum is 1.

    >>> wrr_stride(100, 3), wrr_stride(10, 2), wrr_stride(4, 4)
    (47, 1, 3)
    """
    if weight_sum == 1:
        return 1
    i = bisect.bisect_left(WRR_STRIDES, (weight_sum // n) & 0xFFFFFFFF)
    while math.gcd(weight_sum, WRR_STRIDES[i]) != 1:
        i += 1  # ends: the table's last primes are larger than any uint32 average weight
    stride = WRR_STRIDES[i]
    return stride % weight_sum if stride > weight_sum else stride


class WeightedRoundRobinLoadBalancer(LoadBalancer):
    """Picks servers in proportion to their weights (the server tag, a decimal uint32 >= 1),
    scattered rather than in runs.

    Each selection walks `stride` units of weight around the list from the current position:
    the leftover weight of the server picked last is consumed first (picked again if it
    covers the stride), then whole weights are skipped until a server's weight exceeds what is
    left of the stride (the leftover kept for the next selection) or equals it. The stride is
    coprime with the weight sum, so over weight_sum selections each server is picked exactly
    its weight's times. A server excluded or unavailable is filtered out and the walk redone
    from the same state with a stride for the remaining weight; the last remaining server is
    taken even if excluded (last chance). Where brpc then fails with EHOSTDOWN although an
    excluded server met earlier is available (the last one is down), and would fail the same
    way on every retry since a failed selection leaves the state unchanged, the first such
    server is taken instead; whenever brpc finds a server, the choice is the same. EHOSTDOWN
    when no server is available.

    A server whose tag is not a weight is not used (logged) unless `default_weight` > 0, the
    weight it then gets (brpc's -default_weight_of_wlb, default 0).
    """

    name = "wrr"

    def __init__(self, *, default_weight: int = DEFAULT_WEIGHT_OF_WLB,
                 rng: random.Random | None = None) -> None:
        super().__init__()
        if not isinstance(default_weight, int) or not 0 <= default_weight <= MAX_WEIGHT:
            raise ValueError(f"wrr: default_weight must be an int in 0..{MAX_WEIGHT}, "
                             f"got {default_weight!r}")
        self.default_weight = default_weight
        self._rng = rng if rng is not None else random.Random()
        self._nodes: list[ServerNode] = []
        self._weights: list[int] = []
        self._weight_of: dict[ServerNode, int] = {}
        self._weight_sum = 0
        # brpc's per-thread state: the list shape the stride was computed for, the position,
        # and the server picked last with its leftover weight.
        self._seen: tuple[int, int] = (0, 0)
        self._stride = 0
        self._position = 0
        self._remain_server: ServerNode | None = None
        self._remain_weight = 0

    @classmethod
    def from_params(cls, params: Mapping[str, str]) -> WeightedRoundRobinLoadBalancer:
        """Build from parsed `wrr:default_weight=N` parameters."""
        return cls(**int_params(cls.name, params, {"default_weight": (0, MAX_WEIGHT)}))

    def set_servers(self, servers: Sequence[ServerNode]) -> None:
        """Replace the list; servers without a valid weight tag are left out (see the class)."""
        weighted = weighted_servers(self.name, unique_nodes(servers), self.default_weight)
        self._servers = tuple(server for server, _ in weighted)
        self._nodes = list(self._servers)
        self._weights = [weight for _, weight in weighted]
        self._weight_of = dict(weighted)
        self._weight_sum = sum(self._weights)

    def select(self, *, excluded: Collection[ServerNode] = (),
               available: Callable[[ServerNode], bool] = always_available,
               request_code: int | None = None) -> ServerNode:
        nodes = self._nodes
        n = len(nodes)
        if n == 0:
            raise RpcError(ENODATA, "Fail to select server: wrr has no server with a weight")
        weight_sum = self._weight_sum
        if self._seen != (weight_sum, n):
            self._seen = (weight_sum, n)
            if self._stride == 0:
                self._position = self._rng.randrange(n)
            self._stride = wrr_stride(weight_sum, n)
        self._position %= n
        if self._remain_weight > 0 and self._remain_server is not nodes[self._position]:
            self._remain_weight = 0  # the server picked last left the list
        filtered: set[int] = set()
        stride = self._stride
        remain_sum = weight_sum
        remaining = n
        fallback = None  # the first available excluded server met, with the state after it
        while True:
            index, position, remain_weight = self._next_in_stride(filtered, stride)
            server = nodes[index]
            if remaining == 1 or server not in excluded:
                if available(server):
                    return self._picked(server, position, remain_weight)
            elif fallback is None and available(server):
                fallback = (server, position, remain_weight)
            remaining -= 1
            if remaining == 0:
                break
            filtered.add(index)
            remain_sum -= self._weights[index]
            stride = wrr_stride(remain_sum, remaining)
        if fallback is not None:
            return self._picked(*fallback)
        raise RpcError(EHOSTDOWN, f"Fail to select server: none of the {n} servers of wrr "
                                  f"is available")

    def _picked(self, server: ServerNode, position: int, remain_weight: int) -> ServerNode:
        self._position = position
        self._remain_server = self._nodes[position] if remain_weight else None
        self._remain_weight = remain_weight
        return server

    def _next_in_stride(self, filtered: set[int], stride: int) -> tuple[int, int, int]:
        """brpc's GetServerInNextStride from the saved state: (index picked, new position,
        leftover weight of the pick, 0 when it was used up)."""
        weights = self._weights
        n = len(weights)
        position = self._position
        picked = -1
        if self._remain_weight > 0:
            if position not in filtered:
                picked = position
                if self._remain_weight > stride:
                    return picked, position, self._remain_weight - stride
                stride -= self._remain_weight
            position = (position + 1) % n
        while stride > 0:
            picked = position
            if position not in filtered:
                weight = weights[position]
                if weight > stride:
                    return picked, position, weight - stride
                stride -= weight
            position = (position + 1) % n
        return picked, position, 0
