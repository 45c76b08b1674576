"""Load balancers by brpc name (brpc's docs/en/load_balancing.md, docs/load_balancers.md).

| name | module | picks |
|---|---|---|
| `rr` | rr | each server in turn, in a random stride order |
| `random` | randomized | a uniformly random server |
| `wrr` | wrr | servers in proportion to their weight tags, in turn |
| `wr` | wr | a random server with probability proportional to its weight tag |
| `la` | la | locality-aware: weight ~ QPS / latency, learnt from feedback |
| `p2c` | p2c | the less loaded of 2 random servers (peak-EWMA latency x in-flight) |
| `c_murmurhash`, `c_md5`, `c_ketama` | consistent_hashing | the owner of `Controller.request_code` on a hash ring |

>>> create_load_balancer("rr").name
'rr'
>>> create_load_balancer("c_ketama:replicas=160").replicas
160
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from .base import LoadBalancer, parse_lb_name
from .consistent_hashing import ConsistentHashingLoadBalancer
from .la import LocalityAwareLoadBalancer
from .p2c import P2CEwmaLoadBalancer
from .randomized import RandomizedLoadBalancer
from .rr import RoundRobinLoadBalancer
from .wr import WeightedRandomizedLoadBalancer
from .wrr import WeightedRoundRobinLoadBalancer

__all__ = [
    "ConsistentHashingLoadBalancer", "LoadBalancer", "LocalityAwareLoadBalancer",
    "P2CEwmaLoadBalancer", "RandomizedLoadBalancer", "RoundRobinLoadBalancer",
    "WeightedRandomizedLoadBalancer", "WeightedRoundRobinLoadBalancer", "create_load_balancer",
    "parse_lb_name", "register_load_balancer",
]

# name -> factory taking the parsed `name:key=value ...` parameters.
_REGISTRY: dict[str, Callable[[Mapping[str, str]], LoadBalancer]] = {}


def register_load_balancer(name: str,
                           factory: Callable[[Mapping[str, str]], LoadBalancer]) -> None:
    """Make `create_load_balancer("name[:params]")` return `factory(params)`."""
    if not name or ":" in name or name != name.strip():
        raise ValueError(f"bad load balancer name {name!r}")
    _REGISTRY[name] = factory


def create_load_balancer(name: str) -> LoadBalancer:
    """A new load balancer for `name` (`"rr"`, `"rr:min_working_instances=2 hold_seconds=5"`).

    ValueError for an unknown name (listing the known ones) or bad parameters.
    """
    lb_name, params = parse_lb_name(name)
    factory = _REGISTRY.get(lb_name)
    if factory is None:
        raise ValueError(f"unknown load balancer {lb_name!r}; known: "
                         f"{', '.join(sorted(_REGISTRY))}")
    return factory(params)


register_load_balancer("rr", RoundRobinLoadBalancer.from_params)
register_load_balancer("random", RandomizedLoadBalancer.from_params)
register_load_balancer("wrr", WeightedRoundRobinLoadBalancer.from_params)
register_load_balancer("wr", WeightedRandomizedLoadBalancer.from_params)
register_load_balancer("la", LocalityAwareLoadBalancer.from_params)
register_load_balancer("p2c", P2CEwmaLoadBalancer.from_params)
register_load_balancer("c_murmurhash", ConsistentHashingLoadBalancer.factory("murmurhash"))
register_load_balancer("c_md5", ConsistentHashingLoadBalancer.factory("md5"))
register_load_balancer("c_ketama", ConsistentHashingLoadBalancer.factory("ketama"))
