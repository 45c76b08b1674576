"""random: a uniformly random server (brpc's randomized_load_balancer.cpp).

>>> import random
>>> from aiobrpc.client.naming import ServerNode
>>> lb = RandomizedLoadBalancer(rng=random.Random(3))
>>> lb.set_servers([ServerNode("10.0.0.1", 80), ServerNode("10.0.0.2", 80)])
>>> lb.select() in lb.servers
True
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from ...errors import EHOSTDOWN, RpcError
from ..naming.base import ServerNode
from .base import always_available
from .recovery import RecoveringLoadBalancer
from .stride import random_stride


class RandomizedLoadBalancer(RecoveringLoadBalancer):
    """Takes the server at a random offset in [0, n) if it is available and not excluded;
    otherwise walks on with a random prime stride, at most n probes, the n-th probe ignoring
    `excluded` (last chance). EHOSTDOWN when the walk finds nothing.

    `min_working_instances` and `hold_seconds` turn on cluster recovery as for rr
    (aiobrpc.client.lb.recovery).
    """

    name = "random"


    def select(self, *, excluded: Collection[ServerNode] = (),
               available: Callable[[ServerNode], bool] = always_available,
               request_code: int | None = None) -> ServerNode:
        servers = self._servers_to_walk(available)
        n = len(servers)
        rng = self._rng
        offset = rng.randrange(n)
        stride = 0
        last = n - 1
        for i in range(n):
            server = servers[offset]
            if (i == last or server not in excluded) and available(server):
                return server
            if stride == 0:
                stride = random_stride(rng, n)
            offset = (offset + stride) % n
        if self._recovery is not None:
            self._recovery.start()
        raise RpcError(EHOSTDOWN, f"Fail to select server: none of the {n} servers of random "
                                  f"is available")
