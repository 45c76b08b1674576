"""Cluster recovery throttling of rr and random (brpc's cluster_recover_policy.cpp).

After a selection found no available server, the cluster is "recovering": each selection
rejects its call with EREJECT with probability 1 - q/M, q being the servers usable now
(counted at most every 10 ms) and M `min_working_instances`, so the first servers back are not
flooded by the whole cluster's traffic. Recovery ends once q has been non-zero and unchanged
for more than `hold_seconds`.

>>> recovery = ClusterRecovery(2, 5)
>>> recovery.rejects((), lambda server: True)  # not recovering: never rejects
False
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence

from ...errors import ENODATA, EREJECT, RpcError
from ..naming.base import ServerNode
from .base import LoadBalancer, decimal_int

# brpc's -detect_available_server_interval_ms: how long a count of usable servers is reused.
DETECT_AVAILABLE_SERVER_INTERVAL_MS = 10

RECOVERY_PARAMS = ("min_working_instances", "hold_seconds")


def _monotonic_ms() -> int:
    return time.monotonic_ns() // 1_000_000


class ClusterRecovery:
    """The recovery state of one load balancer.

    `clock` returns milliseconds (monotonic); `rng` draws the rejections. Both are injectable
    for tests.
    """

    def __init__(self, min_working_instances: int, hold_seconds: int, *,
                 clock: Callable[[], int] = _monotonic_ms,
                 rng: random.Random | None = None) -> None:
        for key, value in (("min_working_instances", min_working_instances),
                           ("hold_seconds", hold_seconds)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{key} must be an int > 0, got {value!r}")
        self.min_working_instances = min_working_instances
        self.hold_seconds = hold_seconds
        self._clock = clock
        self._rng = rng if rng is not None else random.Random()
        self.recovering = False
        self._last_usable = 0
        self._last_usable_change_ms: int | None = None
        self._usable_cache = 0
        self._usable_cache_ms: int | None = None  # None: never counted

    def start(self) -> None:
        """A selection found no available server."""
        self.recovering = True

    def rejects(self, servers: Sequence[ServerNode],
                available: Callable[[ServerNode], bool]) -> bool:
        """Whether this selection is rejected (EREJECT); ends the recovery when it is over."""
        if not self.recovering:
            return False
        now_ms = self._clock()
        if (self._last_usable_change_ms is not None and self._last_usable != 0
                and now_ms - self._last_usable_change_ms > self.hold_seconds * 1000):
            self.recovering = False
            self._last_usable = 0
            self._last_usable_change_ms = None
            return False
        usable = self.usable_count(now_ms, servers, available)
        if usable != self._last_usable:
            self._last_usable = usable
            self._last_usable_change_ms = now_ms
        return self._rng.randrange(self.min_working_instances) >= usable

    def usable_count(self, now_ms: int, servers: Sequence[ServerNode],
                     available: Callable[[ServerNode], bool]) -> int:
        """Servers available now, counted again once the last count is 10 ms old."""
        if (self._usable_cache_ms is not None
                and now_ms - self._usable_cache_ms < DETECT_AVAILABLE_SERVER_INTERVAL_MS):
            return self._usable_cache
        self._usable_cache = sum(1 for server in servers if available(server))
        self._usable_cache_ms = now_ms
        return self._usable_cache

    def reject_error(self, lb_name: str) -> RpcError:
        """The EREJECT of a rejected selection."""
        return RpcError(EREJECT, f"Rejected by {lb_name}: the cluster is recovering with "
                                 f"{self._usable_cache} of min_working_instances="
                                 f"{self.min_working_instances} servers usable")


def make_recovery(lb_name: str, min_working_instances: int | None, hold_seconds: int | None,
                  rng: random.Random, clock: Callable[[], int] | None) -> ClusterRecovery | None:
    """The ClusterRecovery of rr or random, None when neither parameter is given; ValueError
    naming `lb_name` for one without the other or a value that is not an int > 0."""
    if min_working_instances is None and hold_seconds is None:
        return None
    if min_working_instances is None or hold_seconds is None:
        raise ValueError(f"{lb_name}: give both min_working_instances and hold_seconds, or neither")
    try:
        return ClusterRecovery(min_working_instances, hold_seconds, rng=rng,
                               clock=clock if clock is not None else _monotonic_ms)
    except ValueError as e:
        raise ValueError(f"{lb_name}: {e}") from None


def recovery_from_params(lb_name: str, params: Mapping[str, str]) -> dict[str, int]:
    """`min_working_instances` and `hold_seconds` of `lb_name:...` as ints; ValueError for an
    unknown key, a value that is not an integer, or only one of the two given."""
    values: dict[str, int] = {}
    for key, text in params.items():
        if key not in RECOVERY_PARAMS:
            raise ValueError(f"{lb_name}: unknown parameter {key!r}; known: "
                             f"{', '.join(RECOVERY_PARAMS)}")
        value = decimal_int(text)
        if value is None:
            raise ValueError(f"{lb_name}: {key} must be an integer, got {text!r}")
        values[key] = value
    if values and len(values) != len(RECOVERY_PARAMS):
        raise ValueError(f"{lb_name}: give both min_working_instances and hold_seconds, or neither")
    return values


class RecoveringLoadBalancer(LoadBalancer):
    """Base of rr and random, the balancers with cluster recovery: its parameters
    (`min_working_instances`, `hold_seconds`, from `name:key=value ...` too), the rng both draw
    from, and the opening of their `select`."""

    name = ""

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
    def from_params(cls, params: Mapping[str, str]):
        """Build from parsed `name:key=value ...` parameters; ValueError for unknown keys."""
        return cls(**recovery_from_params(cls.name, params))

    @property
    def recovering(self) -> bool:
        """Whether cluster recovery is rejecting calls now (always False without it)."""
        return self._recovery is not None and self._recovery.recovering

    def _servers_to_walk(self, available: Callable[[ServerNode], bool]) -> tuple[ServerNode, ...]:
        """The servers to select from: ENODATA for none, EREJECT while recovery sheds the call."""
        servers = self._servers
        if not servers:
            raise RpcError(ENODATA, f"Fail to select server: {self.name} has an empty server list")
        recovery = self._recovery
        if recovery is not None and recovery.rejects(servers, available):
            raise recovery.reject_error(self.name)
        return servers
