"""random: a uniformly random server (brpc's randomized_load_balancer.cpp).

>>> import random
>>> from aiobrpc.client.naming import ServerNode
>>> lb = RandomizedLoadBalancer(rng=random.Random(3))
>>> lb.set_servers([ServerNode("10.0.0.1", 80), ServerNode("10.0.0.2", 80)])
>>> lb.select() in lb.servers
True
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Mapping

from ...errors import EHOSTDOWN, ENODATA, RpcError
from ..naming.base import ServerNode
from .base import LoadBalancer, always_available
from .recovery import make_recovery, recovery_from_params
from .stride import random_stride


class RandomizedLoadBalancer(LoadBalancer):
    """Takes the server at a random offset in [0, n) if it is available and not excluded;
    otherwise walks on with a random prime stride, at most n probes, the n-th probe ignoring
    `excluded` (last chance). EHOSTDOWN when the walk finds nothing.

    `min_working_instances` and `hold_seconds` turn on cluster recovery as for rr
    (aiobrpc.client.lb.recovery).
    """

    name = "random"

    def __init__(self, *, min_working_instances: int | None = None,
                 hold_seconds: int | None = None, rng: random.Random | None = None,
                 recovery_clock: Callable[[], int] | None = None) -> None:
        super().__init__()
        self._rng = rng if rng is not None else random.Random()
        self._recovery = make_recovery(self.name, min_working_instances, hold_seconds,
                                       self._rng, recovery_clock)
        self.min_working_instances = min_working_instances
        self.hold_seconds = hold_seconds

    @classmethod
    def from_params(cls, params: Mapping[str, str]) -> RandomizedLoadBalancer:
        """Build from parsed `random:key=value ...` parameters."""
        return cls(**recovery_from_params(cls.name, params))

    @property
    def recovering(self) -> bool:
        """Whether cluster recovery is rejecting calls now (always False without it)."""
        return self._recovery is not None and self._recovery.recovering

    def select(self, *, excluded: Collection[ServerNode] = (),
               available: Callable[[ServerNode], bool] = always_available,
               request_code: int | None = None) -> ServerNode:
        servers = self._servers
        n = len(servers)
        if n == 0:
            raise RpcError(ENODATA, "Fail to select server: random has an empty server list")
        recovery = self._recovery
        if recovery is not None and recovery.rejects(servers, available):
            raise recovery.reject_error(self.name)
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
        if recovery is not None:
            recovery.start()
        raise RpcError(EHOSTDOWN, f"Fail to select server: none of the {n} servers of random "
                                  f"is available")
