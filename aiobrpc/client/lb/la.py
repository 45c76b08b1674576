"""la: locality-aware load balancing, LALB (brpc's locality_aware_load_balancer.cpp, docs/cn/lalb.md).

Each server has a weight, about its QPS divided by its latency, so a server that answers
faster or handles more calls gets proportionally more of them; servers far away (higher
latency) get less. A selection draws a random "dice" in [0, total weight) and walks a complete
binary tree whose nodes hold each server's weight and the weight sum of their left subtree,
in O(log n).

>>> import random
>>> from aiobrpc.client.naming import ServerNode
>>> lb = LocalityAwareLoadBalancer(rng=random.Random(1))
>>> lb.set_servers([ServerNode("10.0.0.1", 80), ServerNode("10.0.0.2", 80)])
>>> lb.weight_of(lb.servers[0]) == WEIGHT_SCALE
True
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence

from ...errors import EHOSTDOWN, ENODATA, RpcError
from ..naming.base import ServerNode
from .base import LoadBalancer, always_available, int_params, rand_below, unique_nodes

logger = logging.getLogger(__name__)

# brpc's constants and gflags of the same meaning.
RECV_QUEUE_SIZE = 128  # latency samples kept per server
WEIGHT_SCALE = ((1 << 63) - 1) // 72_000_000 // (RECV_QUEUE_SIZE - 1)  # 1008680231
DEFAULT_QPS = 1
MIN_WEIGHT = 1000  # -min_weight
PUNISH_INFLIGHT_RATIO = 1.5  # -punish_inflight_ratio
PUNISH_ERROR_RATIO = 1.2  # -punish_error_ratio
MAX_SELECT_LOOPS = 10_000  # brpc's guard against a selection that never ends


def _monotonic_us() -> int:
    return time.monotonic_ns() // 1000


class ServerWeight:
    """The weight of one server and what it is computed from (brpc's LALB Weight).

    `samples` holds the last 128 successful calls as [cumulative latency, end time]; a failed
    call adds its "error latency" to the newest sample instead, so errors lower the server's
    QPS and raise its latency. `base_weight` = scaled QPS / average latency; `weight` is
    base_weight lowered while the calls in flight are older on average than 1.5 x the average
    latency, never below MIN_WEIGHT.
    """

    __slots__ = ("weight", "base_weight", "begin_time_sum", "begin_time_count", "avg_latency",
                 "samples")

    def __init__(self, initial_weight: int) -> None:
        self.weight = initial_weight
        self.base_weight = initial_weight
        self.begin_time_sum = 0  # start times (us) of the calls in flight, summed
        self.begin_time_count = 0
        self.avg_latency = 0
        self.samples: deque[list[int]] = deque(maxlen=RECV_QUEUE_SIZE)

    def reset_weight(self, now_us: int) -> int:
        """Recompute `weight` from `base_weight` and the age of the calls in flight; the change."""
        new_weight = self.base_weight
        if self.begin_time_count > 0:
            inflight_delay = now_us - self.begin_time_sum // self.begin_time_count
            punish_latency = int(self.avg_latency * PUNISH_INFLIGHT_RATIO)
            if inflight_delay >= punish_latency and self.avg_latency > 0:
                new_weight = new_weight * punish_latency // inflight_delay
        if new_weight < MIN_WEIGHT:
            new_weight = MIN_WEIGHT
        diff = new_weight - self.weight
        self.weight = new_weight
        return diff

    def add_inflight(self, now_us: int, dice: int) -> tuple[bool, int]:
        """(chosen, weight change): a call starts here unless the recomputed weight no longer
        covers the dice."""
        diff = self.reset_weight(now_us)
        if self.weight < dice:
            return False, diff
        self.begin_time_sum += now_us
        self.begin_time_count += 1
        return True, diff

    def mark_failed(self, avg_weight: int) -> int:
        """The server is unavailable: its base weight is lowered to the average; the change."""
        if self.base_weight <= avg_weight:
            return 0
        self.base_weight = avg_weight
        return self.reset_weight(0)

    def update(self, end_us: int, latency_us: int, error_code: int, timeout_ms: int,
               retried_count: int, max_retry: int) -> int:
        """A call started here ended; the weight change."""
        if self.begin_time_count > 0:
            self.begin_time_count -= 1
            self.begin_time_sum -= end_us - latency_us
            if self.begin_time_count == 0:
                self.begin_time_sum = 0  # no rounding drift left behind
        if latency_us <= 0:
            return 0
        samples = self.samples
        if error_code == 0:
            samples.append([latency_us + (samples[-1][0] if samples else 0), end_us])
        else:
            # The error latency mixes the real latency and the timeout: the fewer retries are
            # left, the more it weighs like the timeout (brpc's comment in Weight::Update).
            punished = int(latency_us * PUNISH_ERROR_RATIO)
            timeout_us = timeout_ms * 1000 if timeout_ms > 0 else punished
            ndone, nleft = 1, 0
            if max_retry > 0:
                ndone = min(retried_count, max_retry)
                nleft = max_retry - ndone
            err_latency = (nleft * punished + ndone * timeout_us) // (ndone + nleft)
            if samples:
                newest = samples[-1]
                newest[0] += err_latency
                newest[1] = end_us
            else:
                samples.append([max(err_latency, timeout_us), end_us])
        top_end_us = samples[0][1]
        n = len(samples)
        scaled_qps = DEFAULT_QPS * WEIGHT_SCALE
        if end_us > top_end_us:
            # QPS only once the samples span enough to be meaningful.
            if n == RECV_QUEUE_SIZE or end_us >= top_end_us + 1_000_000:
                scaled_qps = (n - 1) * 1_000_000 * WEIGHT_SCALE // (end_us - top_end_us)
                if scaled_qps < WEIGHT_SCALE:
                    scaled_qps = WEIGHT_SCALE
            self.avg_latency = (samples[-1][0] - samples[0][0]) // (n - 1)
        elif n == 1:
            self.avg_latency = samples[-1][0]
        else:
            return 0  # samples ending at the same microsecond: no meaningful QPS
        if self.avg_latency == 0:
            return 0
        self.base_weight = scaled_qps // self.avg_latency
        return self.reset_weight(end_us)


class LocalityAwareLoadBalancer(LoadBalancer):
    """brpc's LALB: servers chosen with probability proportional to a weight of about
    QPS / latency, learnt from every attempt's feedback (see ServerWeight).

    A new server starts at the average weight of the others (WEIGHT_SCALE for the first). A
    selection draws a dice in [0, total) and walks the weight tree to the server whose range
    holds it. An unavailable server met there has its base weight lowered to the average and
    the walk goes on (to the right, or to a redrawn dice on the left); a server taken records
    a call in flight, unless its weight recomputed with the calls in flight no longer covers
    the dice (then the dice is redrawn). An excluded server is taken only as the n-th try
    (last chance). EHOSTDOWN after n tries.

    A failed attempt's latency is punished: (nleft * latency * 1.2 + ndone * timeout) /
    (ndone + nleft) with ndone the retries made before it and nleft those left (max_retry 0:
    the timeout). Where the call has no deadline, the punished latency stands for the timeout.
    `rng` and `clock` (microseconds, monotonic) are injectable for tests.
    """

    name = "la"

    def __init__(self, *, rng: random.Random | None = None,
                 clock: Callable[[], int] = _monotonic_us) -> None:
        super().__init__()
        self._rng = rng if rng is not None else random.Random()
        self._clock = clock
        self._nodes: list[ServerNode] = []  # in tree order: the children of i are 2i+1, 2i+2
        self._weights: list[ServerWeight] = []
        self._left: list[int] = []  # weight sum of each node's left subtree
        self._index: dict[ServerNode, int] = {}
        self._total = 0

    @classmethod
    def from_params(cls, params: Mapping[str, str]) -> LocalityAwareLoadBalancer:
        """`la` takes no parameters (ValueError for any)."""
        int_params(cls.name, params, {})
        return cls()

    @property
    def total_weight(self) -> int:
        return self._total

    def weight_of(self, server: ServerNode) -> int | None:
        """The current weight of `server`, None if it is not listed."""
        index = self._index.get(server)
        return None if index is None else self._weights[index].weight

    def set_servers(self, servers: Sequence[ServerNode]) -> None:
        """Replace the list: servers kept keep what was learnt about them."""
        nodes = unique_nodes(servers)
        wanted = set(nodes)
        for server in [s for s in self._nodes if s not in wanted]:
            self._remove(server)
        for server in nodes:
            if server not in self._index:
                self._add(server)
        self._servers = nodes

    def _add(self, server: ServerNode) -> None:
        n = len(self._nodes)
        initial = self._total // n if n else WEIGHT_SCALE
        self._index[server] = n
        self._nodes.append(server)
        self._weights.append(ServerWeight(initial))
        self._left.append(0)
        self._update_parents(initial, n)
        self._total += initial

    def _remove(self, server: ServerNode) -> None:
        index = self._index.pop(server)
        removed = self._weights[index].weight
        self._update_parents(-removed, index)
        self._total -= removed
        last = len(self._nodes) - 1
        if index != last:  # the last node fills the hole, as in brpc
            moved_node, moved = self._nodes[last], self._weights[last]
            self._update_parents(-moved.weight, last)
            self._nodes[index], self._weights[index] = moved_node, moved
            self._index[moved_node] = index
            self._update_parents(moved.weight, index)
        self._nodes.pop()
        self._weights.pop()
        self._left.pop()  # a leaf's: 0

    def _update_parents(self, diff: int, index: int) -> None:
        left = self._left
        while index:
            parent = (index - 1) >> 1
            if 2 * parent + 1 == index:
                left[parent] += diff
            index = parent

    def _changed(self, index: int, diff: int) -> None:
        if diff:
            self._update_parents(diff, index)
            self._total += diff

    def select(self, *, excluded: Collection[ServerNode] = (),
               available: Callable[[ServerNode], bool] = always_available,
               request_code: int | None = None) -> ServerNode:
        nodes = self._nodes
        n = len(nodes)
        if n == 0:
            raise RpcError(ENODATA, "Fail to select server: la has an empty server list")
        rng = self._rng
        weights = self._weights
        left_sums = self._left
        now_us = self._clock()
        ntry = 0
        nloop = 0
        total = self._total
        dice = rand_below(rng, total)
        index = 0
        while total > 0:
            nloop += 1
            if nloop > MAX_SELECT_LOOPS:
                logger.error("la: a selection ran %d loops", MAX_SELECT_LOOPS)
                break
            weight = weights[index]
            left = left_sums[index]
            if dice < left:
                index = 2 * index + 1
                if index < n:
                    continue
            elif dice >= left + (own := weight.weight):
                dice -= left + own
                index = 2 * index + 2
                if index < n:
                    continue
            elif available(server := nodes[index]):
                if ntry + 1 == n or server not in excluded:
                    chosen, diff = weight.add_inflight(now_us, dice - left)
                    self._changed(index, diff)
                    if chosen:
                        return server
                ntry += 1
                if ntry >= n:
                    break
            else:
                diff = weight.mark_failed(total // n)
                self._changed(index, diff)
                if dice >= left + own + diff:
                    dice -= left + own + diff
                    index = 2 * index + 2
                else:
                    dice = rand_below(rng, left)  # the left subtree may hold available servers
                    index = 2 * index + 1
                if index < n:
                    continue
                ntry += 1
                if ntry >= n:
                    break
            total = self._total
            dice = rand_below(rng, total)
            index = 0
        raise RpcError(EHOSTDOWN, f"Fail to select server: none of the {n} servers of la "
                                  f"is available")

    def attempt_ended(self, server: ServerNode, error_code: int, latency_us: int,
                      timeout_ms: int, retried_count: int, max_retry: int) -> None:
        index = self._index.get(server)
        if index is None:
            return  # removed from the list since it was selected
        diff = self._weights[index].update(self._clock(), latency_us, error_code, timeout_ms,
                                           retried_count, max_retry)
        self._changed(index, diff)

    def feedback(self, server: ServerNode, error_code: int, latency_us: int) -> None:
        """An attempt of a call with no deadline and no retries ended (see attempt_ended)."""
        self.attempt_ended(server, error_code, latency_us, -1, 0, 0)
