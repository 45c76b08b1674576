"""la: locality-aware load balancing (brpc's locality_aware_load_balancer.cpp)."""

from __future__ import annotations

import collections
import random

import pytest

from aiobrpc import errors
from aiobrpc.client.lb import LocalityAwareLoadBalancer, create_load_balancer
from aiobrpc.client.lb.la import MIN_WEIGHT, WEIGHT_SCALE, ServerWeight
from aiobrpc.client.naming import ServerNode
from aiobrpc.errors import RpcError


class Clock:
    def __init__(self) -> None:
        self.us = 10_000_000

    def __call__(self) -> int:
        return self.us


def servers(n: int) -> list[ServerNode]:
    return [ServerNode("10.0.0.1", 1000 + i) for i in range(n)]


def la(n: int, seed: int = 1) -> tuple[LocalityAwareLoadBalancer, Clock]:
    clock = Clock()
    lb = LocalityAwareLoadBalancer(rng=random.Random(seed), clock=clock)
    lb.set_servers(servers(n))
    return lb, clock


def check_tree(lb: LocalityAwareLoadBalancer) -> None:
    """Every node's left sum is its left subtree's weight; the total is the weights' sum."""
    weights = [w.weight for w in lb._weights]
    n = len(weights)

    def subtree(i: int) -> int:
        return 0 if i >= n else weights[i] + subtree(2 * i + 1) + subtree(2 * i + 2)

    assert lb._left == [subtree(2 * i + 1) for i in range(n)]
    assert lb.total_weight == sum(weights)
    assert [lb._index[s] for s in lb._nodes] == list(range(n))


def feed(lb, clock, server, latency_us: int, count: int, every_us: int, error: int = 0) -> None:
    """`count` calls of `server` ending every `every_us`, each taking `latency_us`."""
    for _ in range(count):
        clock.us += every_us
        lb.attempt_ended(server, error, latency_us, 1000, 0, 0)


def test_weight_is_scaled_qps_over_average_latency():
    lb, clock = la(1)
    server = lb.servers[0]
    feed(lb, clock, server, 2000, 128, every_us=500)  # 2000 QPS, 2 ms
    qps = 127 * 1_000_000 * WEIGHT_SCALE // (127 * 500)
    assert lb.weight_of(server) == qps // 2000
    feed(lb, clock, server, 4000, 128, every_us=500)  # the ring now holds only 4 ms samples
    assert lb.weight_of(server) == qps // 4000
    check_tree(lb)


def test_qps_counts_only_once_the_samples_span_a_second_or_fill_the_ring():
    lb, clock = la(1)
    server = lb.servers[0]
    feed(lb, clock, server, 1000, 10, every_us=1000)  # 10 samples over 9 ms: QPS not counted
    assert lb.weight_of(server) == WEIGHT_SCALE // 1000
    clock.us += 1_000_000
    lb.attempt_ended(server, 0, 1000, 1000, 0, 0)  # spans > 1 s: 10 calls in 1.009 s
    assert lb.weight_of(server) == max(10 * 1_000_000 * WEIGHT_SCALE // 1_009_000, WEIGHT_SCALE) // 1000


def test_selection_is_proportional_to_weights():
    lb, clock = la(3)
    for server, latency in zip(lb.servers, (1000, 2000, 4000)):
        feed(lb, clock, server, latency, 128, every_us=1000)
    weights = [lb.weight_of(s) for s in lb.servers]
    assert weights == [WEIGHT_SCALE, WEIGHT_SCALE // 2, WEIGHT_SCALE // 4]  # same QPS: 1 / latency
    check_tree(lb)
    counts = collections.Counter(lb.select() for _ in range(7000))  # frozen clock: no punishment
    expected = (4000, 2000, 1000)
    for server, want in zip(lb.servers, expected):
        assert abs(counts[server] - want) < 250, counts
    check_tree(lb)


def test_calls_in_flight_for_too_long_lower_the_weight():
    weight = ServerWeight(WEIGHT_SCALE)
    t0 = 10_000_000
    for i in range(1, 129):  # 1000 QPS of 1 ms calls
        weight.update(t0 + 1000 * i, 1000, 0, 1000, 0, 0)
    t0 += 128_000
    base = weight.weight
    assert weight.avg_latency == 1000 and base == WEIGHT_SCALE
    assert weight.add_inflight(t0, 0) == (True, 0)
    assert weight.reset_weight(t0 + 1499) == 0  # younger than 1.5 x the average latency
    weight.reset_weight(t0 + 3000)  # in flight for 3000 us: scaled by 1500 / 3000
    assert weight.weight == base * 1500 // 3000
    assert weight.add_inflight(t0 + 3000, base) == (False, 0)  # no longer covers the dice
    assert weight.begin_time_count == 1
    weight.update(t0 + 3000, 3000, 0, 1000, 0, 0)  # it ended: nothing in flight
    assert (weight.begin_time_count, weight.begin_time_sum) == (0, 0)
    assert weight.weight == weight.base_weight


def test_a_punished_server_loses_selections_to_its_peers():
    lb, clock = la(2)
    a, b = lb.servers
    for server in (a, b):
        feed(lb, clock, server, 1000, 128, every_us=1000)
    for _ in range(10):  # calls to a, never answered (b's, through last chance, answered)
        if lb.select(excluded=[b]) == b:
            lb.attempt_ended(b, 0, 1000, 1000, 0, 0)
    assert lb._weights[1].begin_time_count == 0
    clock.us += 20_000  # 20 x the average latency
    # Each call sent to a now makes its calls in flight younger on average: a regains
    # weight as it is chosen again, so only the first selections show the punishment.
    counts = collections.Counter(lb.select() for _ in range(40))
    assert counts[a] <= 8, counts
    check_tree(lb)


def test_error_latency_mixes_latency_and_timeout():
    def weight_after_error(retried: int, max_retry: int) -> int:
        lb, clock = la(1)
        server = lb.servers[0]
        feed(lb, clock, server, 1000, 2, every_us=1000)  # latency sums 1000, 2000
        clock.us += 1000
        lb.attempt_ended(server, errors.EEOF, 1000, 100, retried, max_retry)
        return lb._weights[0].avg_latency

    # Two samples: the newest gets the error latency added, over 1 interval.
    assert weight_after_error(0, 0) == 1000 + 100_000  # max_retry 0: the timeout (100 ms)
    assert weight_after_error(0, 2) == 1000 + 1200  # nothing retried yet: latency x 1.2
    assert weight_after_error(1, 2) == 1000 + (1200 + 100_000) // 2
    assert weight_after_error(2, 2) == 1000 + 100_000


def test_a_first_sample_that_is_an_error_counts_at_least_the_timeout():
    lb, clock = la(1)
    lb.attempt_ended(lb.servers[0], errors.EEOF, 500, 50, 0, 3)
    assert lb._weights[0].avg_latency == 50_000
    lb2, _ = la(1)
    lb2.attempt_ended(lb2.servers[0], errors.EEOF, 500, -1, 0, 0)  # no deadline: 1.2 x latency
    assert lb2._weights[0].avg_latency == 600


def test_unavailable_server_is_lowered_to_the_average_and_skipped():
    lb, clock = la(3)
    heavy = lb.servers[0]
    feed(lb, clock, heavy, 100, 128, every_us=100)  # far heavier than the others
    assert lb.weight_of(heavy) == 100 * WEIGHT_SCALE
    picks = collections.Counter(lb.select(available=lambda s: s != heavy) for _ in range(300))
    assert heavy not in picks and len(picks) == 2
    assert lb._weights[0].base_weight <= lb.total_weight  # lowered to an average
    check_tree(lb)


def test_excluded_servers_and_last_chance():
    lb, _ = la(3)
    a, b, c = lb.servers
    # An excluded server is taken only at the n-th try: c is hit in 1/3 + 2/9 + 1/9 = 19/27 of
    # the selections with the weights equal (never answered calls age nothing: frozen clock).
    counts = collections.Counter(lb.select(excluded=[a, b]) for _ in range(2700))
    assert 1750 <= counts[c] <= 2050, counts
    assert lb.select(excluded=[a, b, c]) in (a, b, c)
    one, _ = la(1)
    assert one.select(excluded=[one.servers[0]]) == one.servers[0]
    with pytest.raises(RpcError) as info:
        lb.select(available=lambda s: False)
    assert info.value.code == errors.EHOSTDOWN
    with pytest.raises(RpcError) as info:
        LocalityAwareLoadBalancer().select()
    assert info.value.code == errors.ENODATA


def test_new_servers_start_at_the_average_and_the_tree_survives_changes():
    lb, clock = la(2)
    feed(lb, clock, lb.servers[0], 1000, 128, every_us=1000)
    average = lb.total_weight // 2
    lb.set_servers(servers(3))
    assert lb.weight_of(lb.servers[2]) == average
    rng = random.Random(4)
    pool = [ServerNode("10.0.1.1", p) for p in range(1, 40)]
    for _ in range(60):
        chosen = rng.sample(pool, rng.randrange(1, 20))
        lb.set_servers(chosen)
        assert set(lb.servers) == set(chosen)
        check_tree(lb)
        for server in rng.sample(chosen, min(3, len(chosen))):
            clock.us += 300
            lb.attempt_ended(server, 0, rng.randrange(100, 5000), 1000, 0, 0)
        check_tree(lb)
        assert lb.select() in chosen


def test_every_selection_is_paired_with_its_feedback():
    lb, clock = la(3)
    chosen = [lb.select() for _ in range(50)]
    assert sum(w.begin_time_count for w in lb._weights) == 50
    for server in chosen:
        clock.us += 100
        lb.attempt_ended(server, 0, 100, 1000, 0, 0)
    assert [(w.begin_time_count, w.begin_time_sum) for w in lb._weights] == [(0, 0)] * 3
    lb.attempt_ended(ServerNode("9.9.9.9", 1), 0, 100, 1000, 0, 0)  # not listed: ignored
    assert lb.weight_of(ServerNode("9.9.9.9", 1)) is None


def test_weights_never_fall_below_the_minimum():
    lb, clock = la(1)
    feed(lb, clock, lb.servers[0], 2_000_000, 2, every_us=2_000_000)  # QPS floored at 1: SCALE / 2e6
    assert lb.weight_of(lb.servers[0]) == MIN_WEIGHT


def test_la_takes_no_parameters():
    assert isinstance(create_load_balancer("la"), LocalityAwareLoadBalancer)
    with pytest.raises(ValueError, match="la: unknown parameter 'x'"):
        create_load_balancer("la:x=1")
    assert LocalityAwareLoadBalancer.wants_feedback
