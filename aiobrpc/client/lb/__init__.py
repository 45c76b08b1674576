"""Load balancers by brpc name (brpc's docs/en/load_balancing.md).

>>> create_load_balancer("rr").name
'rr'
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from .base import LoadBalancer, parse_lb_name
from .rr import RoundRobinLoadBalancer

__all__ = [
    "LoadBalancer", "RoundRobinLoadBalancer", "create_load_balancer", "parse_lb_name",
    "register_load_balancer",
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
