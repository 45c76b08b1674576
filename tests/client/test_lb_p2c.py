"""p2c: power of two choices over peak-EWMA latency (brpc's p2c_ewma_load_balancer.cpp)."""

from __future__ import annotations

import collections
import logging
import math
import random

import pytest

from aiobrpc import errors
from aiobrpc.client.lb import P2CEwmaLoadBalancer, create_load_balancer
from aiobrpc.client.naming import ServerNode
from aiobrpc.errors import RpcError


class Clock:
    def __init__(self) -> None:
        self.us = 50_000_000

    def __call__(self) -> int:
        return self.us


def p2c(*tags: str, seed: int = 1, **kw) -> tuple[P2CEwmaLoadBalancer, Clock]:
    clock = Clock()
    lb = P2CEwmaLoadBalancer(rng=random.Random(seed), clock=clock, **kw)
    lb.set_servers([ServerNode("10.0.0.1", 1000 + i, tag) for i, tag in enumerate(tags)])
    return lb, clock


def measure(lb: P2CEwmaLoadBalancer, server: ServerNode, latency_us: int) -> None:
    """One call to `server` (the others excluded) that took `latency_us`."""
    assert lb.select(excluded=[s for s in lb.servers if s != server]) == server
    lb.attempt_ended(server, 0, latency_us, -1, 0, 0)


def test_score_is_decayed_ewma_times_load_over_weight():
    lb, clock = p2c("", "4")
    a, b = lb.servers
    assert lb.score(a, clock.us) == 1.0  # never measured: latency term 1, nothing in flight
    for server in (a, b):
        measure(lb, server, 8000)
    assert [lb.stat_of(s).inflight for s in lb.servers] == [0, 0]
    lb.select(excluded=[b])  # one call in flight on a
    assert lb.stat_of(a).inflight == 1
    clock.us += 10_000_000  # one tau later
    assert lb.score(a, clock.us) == pytest.approx(8000 * math.exp(-1) * 2)
    assert lb.score(b, clock.us) == pytest.approx(8000 * math.exp(-1) / 4)
    clock.us += 200_000_000
    assert lb.score(b, clock.us) == 1.0 / 4  # decayed below 1: floored


def test_a_peak_replaces_the_ewma_and_lower_samples_decay_into_it():
    lb, clock = p2c("")
    server = lb.servers[0]
    lb.attempt_ended(server, 0, 1000, -1, 0, 0)
    assert lb.stat_of(server).ewma_us == 1000
    clock.us += 5
    lb.attempt_ended(server, 0, 9000, -1, 0, 0)
    assert lb.stat_of(server).ewma_us == 9000  # peak: at once
    clock.us += 5_000_000  # half a tau
    lb.attempt_ended(server, 0, 1000, -1, 0, 0)
    w = math.exp(-0.5)
    assert lb.stat_of(server).ewma_us == int(9000 * w + 1000 * (1 - w))
    lb.attempt_ended(server, 0, 0, -1, 0, 0)  # no duration: ignored
    assert lb.stat_of(server).ewma_us == int(9000 * w + 1000 * (1 - w))


def test_errors_are_punished_and_the_punishment_is_capped():
    lb, clock = p2c("")
    server = lb.servers[0]
    lb.attempt_ended(server, 0, 1000, 500, 0, 0)
    lb.attempt_ended(server, errors.EEOF, 10, 500, 0, 0)  # max(10, 500 ms, 2 x 1000)
    assert lb.stat_of(server).ewma_us == 500_000
    for _ in range(6):
        lb.attempt_ended(server, errors.EEOF, 10, -1, 0, 0)  # doubles, up to 30 s
    assert lb.stat_of(server).ewma_us == 30_000_000
    capped, _ = p2c("", max_punish_ms=0)
    for _ in range(40):
        capped.attempt_ended(capped.servers[0], errors.EEOF, 10, -1, 0, 0)
    assert capped.stat_of(capped.servers[0]).ewma_us > 30_000_000  # 0: no cap


def test_the_lower_score_of_two_random_servers_wins():
    lb, clock = p2c("", "", "", "", seed=3)
    slow = lb.servers[0]
    for server in lb.servers:
        measure(lb, server, 50_000 if server == slow else 1000)
    counts = collections.Counter()
    for _ in range(600):
        server = lb.select()
        counts[server] += 1
        lb.attempt_ended(server, 0, 50_000 if server == slow else 1000, -1, 0, 0)
    assert slow not in counts  # it loses every pair it is in
    assert all(150 <= c <= 250 for c in counts.values()), counts


def test_in_flight_calls_spread_the_load_and_feedback_releases_them():
    lb, clock = p2c("", "", seed=5)
    chosen = [lb.select() for _ in range(10)]
    assert collections.Counter(chosen) == {lb.servers[0]: 5, lb.servers[1]: 5}
    for server in chosen:
        lb.attempt_ended(server, 0, 100, -1, 0, 0)
    assert [lb.stat_of(s).inflight for s in lb.servers] == [0, 0]


def test_weights_divide_the_score():
    lb, clock = p2c("1", "3")
    light, heavy = lb.servers
    for server in lb.servers:
        measure(lb, server, 1000)
    # Same latency: heavy wins until it has 3 calls in flight per call of light.
    picks = [lb.select() for _ in range(8)]
    assert picks.count(heavy) == 6 and picks.count(light) == 2


def test_samples_choices_distinct_servers_among_many():
    lb, clock = p2c(*[""] * 10, choices=3, seed=7)
    for i, server in enumerate(lb.servers):
        measure(lb, server, 1000 * (i + 1))
    counts = collections.Counter()
    for _ in range(3000):
        server = lb.select()
        counts[server] += 1
        lb.attempt_ended(server, 0, 1000 * (lb.servers.index(server) + 1), -1, 0, 0)
    # Server i wins when it is the best of the 3 sampled: never the two worst.
    assert lb.servers[-1] not in counts and lb.servers[-2] not in counts
    assert counts[lb.servers[0]] > counts[lb.servers[1]] > counts[lb.servers[2]]


def test_excluded_unavailable_and_last_chance():
    lb, clock = p2c("", "", "", seed=2)
    a, b, c = lb.servers
    assert {lb.select(excluded=[a], available=lambda s: s != b) for _ in range(20)} == {c}
    assert lb.select(excluded=[a, b, c]) == a  # all excluded: the first available
    assert lb.select(excluded=[a, b, c], available=lambda s: s != a) == b
    with pytest.raises(RpcError) as info:
        lb.select(available=lambda s: False)
    assert info.value.code == errors.EHOSTDOWN
    with pytest.raises(RpcError) as info:
        P2CEwmaLoadBalancer().select()
    assert info.value.code == errors.ENODATA


def test_stats_survive_list_changes_and_unknown_servers_are_ignored():
    lb, clock = p2c("", "")
    a, b = lb.servers
    lb.attempt_ended(a, 0, 777, -1, 0, 0)
    lb.set_servers([a, ServerNode("10.0.0.9", 1)])
    assert lb.stat_of(a).ewma_us == 777 and lb.stat_of(b) is None
    lb.attempt_ended(b, 0, 5, -1, 0, 0)


def test_parameters_and_tags(caplog):
    lb = create_load_balancer("p2c:choices=5 tau_ms=250")
    assert (lb.choices, lb.tau_us) == (5, 250_000)
    assert create_load_balancer("p2c").choices == 2
    for bad, match in [("p2c:choices=1", r"choices must be in 2..64"),
                       ("p2c:choices=65", r"choices must be in 2..64"),
                       ("p2c:tau_ms=0", "tau_ms must be >= 1"),
                       ("p2c:tau_ms=1.5", "integer"),
                       ("p2c:max_punish_ms=1", "unknown parameter")]:
        with pytest.raises(ValueError, match=match):
            create_load_balancer(bad)
    with caplog.at_level(logging.WARNING):
        lb, _ = p2c("", "x", "0", "7")
    assert lb._weights == [1, 1, 1, 7]
    assert caplog.text.count("invalid weight tag") == 2
    assert P2CEwmaLoadBalancer.wants_feedback
