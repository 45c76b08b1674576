"""wr: weighted random, weights from server tags (brpc's weighted_randomized_load_balancer.cpp).

>>> import random
>>> from aiobrpc.client.naming import ServerNode
>>> lb = WeightedRandomizedLoadBalancer(rng=random.Random(1))
>>> lb.set_servers([ServerNode("10.0.0.1", 80, "1"), ServerNode("10.0.0.2", 80, "99")])
>>> [lb.select().host for _ in range(3)]
['10.0.0.2', '10.0.0.2', '10.0.0.2']
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Callable, Collection, Mapping, Sequence

from ...errors import EHOSTDOWN, ENODATA, RpcError
from ..naming.base import ServerNode
from .base import LoadBalancer, always_available, int_params, unique_nodes
from .stride import random_stride
from .weights import DEFAULT_WEIGHT_OF_WLB, MAX_WEIGHT, weighted_servers


class WeightedRandomizedLoadBalancer(LoadBalancer):
    """Picks a server at random with probability weight / weight_sum (the weight is the server
    tag, a decimal uint32 >= 1).

    Up to n draws: a random r in [0, weight_sum) picks the first server whose inclusive prefix
    sum of weights exceeds r; an excluded server is skipped, an available one taken. Then the
    servers not drawn are probed from a random offset with a random prime stride and the first
    available one that is not excluded is taken. When only excluded servers are available,
    brpc returns the last of them the probe met; so does this. EHOSTDOWN otherwise.

    A server whose tag is not a weight is not used (logged) unless `default_weight` > 0, the
    weight it then gets (brpc's -default_weight_of_wlb, default 0).
    """

    name = "wr"

    def __init__(self, *, default_weight: int = DEFAULT_WEIGHT_OF_WLB,
                 rng: random.Random | None = None) -> None:
        super().__init__()
        if not isinstance(default_weight, int) or not 0 <= default_weight <= MAX_WEIGHT:
            raise ValueError(f"wr: default_weight must be an int in 0..{MAX_WEIGHT}, "
                             f"got {default_weight!r}")
        self.default_weight = default_weight
        self._rng = rng if rng is not None else random.Random()
        self._prefix_sums: list[int] = []

    @classmethod
    def from_params(cls, params: Mapping[str, str]) -> WeightedRandomizedLoadBalancer:
        """Build from parsed `wr:default_weight=N` parameters."""
        return cls(**int_params(cls.name, params, {"default_weight": (0, MAX_WEIGHT)}))

    def set_servers(self, servers: Sequence[ServerNode]) -> None:
        """Replace the list; servers without a valid weight tag are left out (see the class)."""
        weighted = weighted_servers(self.name, unique_nodes(servers), self.default_weight)
        self._servers = tuple(server for server, _ in weighted)
        self._prefix_sums = list(itertools.accumulate(weight for _, weight in weighted))

    def select(self, *, excluded: Collection[ServerNode] = (),
               available: Callable[[ServerNode], bool] = always_available,
               request_code: int | None = None) -> ServerNode:
        servers = self._servers
        n = len(servers)
        if n == 0:
            raise RpcError(ENODATA, "Fail to select server: wr has no server with a weight")
        rng = self._rng
        prefix_sums = self._prefix_sums
        weight_sum = prefix_sums[-1]
        drawn: set[int] = set()
        for _ in range(n):
            index = bisect.bisect_right(prefix_sums, rng.randrange(weight_sum))
            server = servers[index]
            if server in excluded:
                continue
            drawn.add(index)
            if available(server):
                return server
        fallback = None
        if len(drawn) < n:
            offset = rng.randrange(n)
            stride = random_stride(rng, n)
            for _ in range(n):
                offset = (offset + stride) % n
                if offset in drawn:
                    continue
                server = servers[offset]
                if available(server):
                    if server not in excluded:
                        return server
                    fallback = server
        if fallback is not None:
            return fallback
        raise RpcError(EHOSTDOWN, f"Fail to select server: none of the {n} servers of wr "
                                  f"is available")
