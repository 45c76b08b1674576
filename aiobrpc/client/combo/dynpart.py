"""_dynpart: the load balancer of DynamicPartitionChannel, which picks a partitioning at
random in proportion to its capacity (brpc's policy/dynpart_load_balancer.cpp).

>>> import random
>>> weights = {ServerNode("a", 1): 1, ServerNode("b", 1): 3}
>>> lb = DynPartLoadBalancer(weights.get, rng=random.Random(1))
>>> lb.set_servers(list(weights))
>>> picks = [lb.select().host for _ in range(400)]
>>> 250 < picks.count("b") < 350
True
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable, Collection

from ...errors import EHOSTDOWN, ENODATA, RpcError
from ..lb.base import LoadBalancer, always_available
from ..naming.base import ServerNode


class DynPartLoadBalancer(LoadBalancer):
    """Weighted random choice among the available, not excluded servers (sub-channels), each
    weighted by `weight_of(server)` read at every selection; the excluded ones are taken only
    when no other is available. When every candidate weighs 0 the choice is uniform (brpc
    then fails with EHOSTDOWN unless there is a single candidate; a call to an incomplete
    partitioning still reaches the partitions it has, and fail_limit decides)."""

    name = "_dynpart"

    def __init__(self, weight_of: Callable[[ServerNode], int], *, rng: random.Random | None = None) -> None:
        super().__init__()
        if not callable(weight_of):
            raise TypeError(f"weight_of must be callable, got {type(weight_of).__name__}")
        self._weight_of = weight_of
        self._rng = rng if rng is not None else random.Random()

    def select(self, *, excluded: Collection[ServerNode] = (),
               available: Callable[[ServerNode], bool] = always_available,
               request_code: int | None = None) -> ServerNode:
        servers = self._servers
        if not servers:
            raise RpcError(ENODATA, "Fail to select server: _dynpart has no partitioning")
        candidates = [s for s in servers if s not in excluded and available(s)]
        if not candidates:
            candidates = [s for s in servers if s in excluded and available(s)]
        if not candidates:
            raise RpcError(EHOSTDOWN, f"Fail to select server: none of the {len(servers)} partitionings "
                                      f"of _dynpart is available")
        sums = []
        total = 0
        for s in candidates:
            total += max(0, int(self._weight_of(s)))
            sums.append(total)
        if total == 0:
            return self._rng.choice(candidates)
        return candidates[bisect.bisect_right(sums, self._rng.randrange(total))]
