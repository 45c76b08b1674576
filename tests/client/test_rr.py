"""rr load balancer and LB names (brpc's docs/en/client.md)."""

from __future__ import annotations

import itertools
import logging
import math
import random

import pytest

from aiobrpc import errors
from aiobrpc.client.lb import (
    RoundRobinLoadBalancer, create_load_balancer, parse_lb_name, register_load_balancer,
)
from aiobrpc.client.lb.rr import STRIDE_PRIMES
from aiobrpc.client.naming import ServerNode
from aiobrpc.errors import RpcError


def servers(n: int) -> list[ServerNode]:
    return [ServerNode("10.0.0.1", 1000 + i) for i in range(n)]


def rr(n: int, seed: int = 1) -> RoundRobinLoadBalancer:
    lb = RoundRobinLoadBalancer(rng=random.Random(seed))
    lb.set_servers(servers(n))
    return lb


class FixedStride(random.Random):
    """An rng whose stride and start offset are chosen by the test."""

    def __init__(self, stride: int, offset: int) -> None:
        super().__init__(0)
        self.stride, self.offset = stride, offset

    def choice(self, seq):
        assert self.stride in seq
        return self.stride

    def randrange(self, *args):
        return self.offset


@pytest.mark.parametrize("n", [1, 2, 3, 7, 10, 64])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_every_server_once_per_n_selections_in_a_stride_order(n, seed):
    lb = rr(n, seed)
    picks = [lb.servers.index(lb.select()) for _ in range(3 * n)]
    for block in range(3):
        assert sorted(picks[block * n:(block + 1) * n]) == list(range(n))
    # Consecutive picks differ by the same step (the stride mod n): a stride permutation.
    assert len({(b - a) % n for a, b in itertools.pairwise(picks)}) == 1


def test_start_offset_and_stride_are_random():
    firsts = {rr(10, seed).select().port for seed in range(40)}
    steps = set()
    for seed in range(40):
        lb = rr(101, seed)
        a, b = lb.select().port, lb.select().port
        steps.add((b - a) % 101)
    assert len(firsts) > 5 and len(steps) > 5


def test_walk_follows_offset_plus_stride():
    lb = RoundRobinLoadBalancer(rng=FixedStride(36809, offset=4))
    lb.set_servers(servers(10))
    ports = [lb.select().port - 1000 for _ in range(4)]
    assert ports == [(4 + k * 36809) % 10 for k in range(1, 5)]


def test_stride_table_is_primes_coprime_with_realistic_sizes():
    assert len(STRIDE_PRIMES) > 400
    for p in STRIDE_PRIMES:
        assert all(p % d for d in range(2, math.isqrt(p) + 1))
    assert all(math.gcd(p, n) == 1 for p in STRIDE_PRIMES[::37] for n in range(1, 2000))


def test_a_server_count_divisible_by_the_stride_still_visits_everyone():
    stride = STRIDE_PRIMES[0]
    lb = RoundRobinLoadBalancer(rng=FixedStride(stride, offset=0))
    lb.set_servers([ServerNode("h", 1, str(i)) for i in range(stride)])
    assert [lb.select().tag for _ in range(3)] == ["1", "2", "3"]


def test_skips_unavailable_servers():
    lb = rr(5)
    down = set(lb.servers[:3])
    picks = [lb.select(available=lambda s: s not in down) for _ in range(20)]
    assert set(picks) == set(lb.servers[3:])
    assert picks.count(lb.servers[3]) == picks.count(lb.servers[4]) == 10


def test_excluded_servers_are_avoided():
    lb = rr(4)
    excluded = set(lb.servers[:2])
    for _ in range(20):
        assert lb.select(excluded=excluded) not in excluded


def test_last_chance_takes_an_excluded_server_at_the_last_step():
    lb = RoundRobinLoadBalancer(rng=FixedStride(36809, offset=0))
    lb.set_servers(servers(3))  # stride mod 3 == 2: the walk from 0 visits 2, 1, then 0
    assert lb.select(excluded=set(lb.servers)) == lb.servers[0]  # the 3rd step of the walk
    single = rr(1)
    assert single.select(excluded={single.servers[0]}) == single.servers[0]


def test_an_excluded_server_met_early_is_taken_when_nothing_else_is_available():
    lb = RoundRobinLoadBalancer(rng=FixedStride(36809, offset=0))
    lb.set_servers(servers(2))  # stride mod 2 == 1: the walk from 0 visits 1, then 0
    a, b = lb.servers
    # b is excluded and met first, a (the last step) is down: brpc would fail with
    # EHOSTDOWN on every retry; b is the last remaining candidate.
    for _ in range(3):
        assert lb.select(excluded={b}, available=lambda s: s is not a) == b
    # Whenever a non-excluded server is available it is preferred.
    assert lb.select(excluded={b}) == a


def test_an_excluded_server_is_used_only_when_it_is_the_last_candidate():
    lb = rr(6, seed=5)
    excluded = set(lb.servers[:3])
    up = {lb.servers[0], lb.servers[4]}
    assert {lb.select(excluded=excluded, available=up.__contains__)
            for _ in range(12)} == {lb.servers[4]}


def test_empty_list_is_enodata_and_nothing_available_is_ehostdown():
    lb = RoundRobinLoadBalancer(rng=random.Random(1))
    with pytest.raises(RpcError) as info:
        lb.select()
    assert info.value.code == errors.ENODATA
    lb.set_servers(servers(3))
    with pytest.raises(RpcError) as info:
        lb.select(available=lambda s: False)
    assert info.value.code == errors.EHOSTDOWN
    assert {errors.ENODATA, errors.EHOSTDOWN} <= errors.DEFAULT_RETRYABLE


def test_set_servers_replaces_and_dedups():
    lb = rr(3)
    lb.select()
    new = [ServerNode("b", 2), ServerNode("a", 1), ServerNode("b", 2), ServerNode("b", 2, "t")]
    lb.set_servers(new)
    assert lb.servers == (ServerNode("b", 2), ServerNode("a", 1), ServerNode("b", 2, "t"))
    assert {lb.select() for _ in range(3)} == set(lb.servers)
    lb.set_servers([])
    with pytest.raises(RpcError):
        lb.select()
    with pytest.raises(TypeError):
        lb.set_servers(["10.0.0.1:80"])


def test_request_code_and_feedback_are_accepted():
    lb = rr(2)
    lb.feedback(lb.servers[0], errors.EEOF, 100)
    assert lb.select(request_code=7) in lb.servers


def test_parse_lb_name():
    assert parse_lb_name("rr") == ("rr", {})
    assert parse_lb_name("rr:") == ("rr", {})
    assert parse_lb_name("c_murmurhash:a=1  b=x=y") == ("c_murmurhash", {"a": "1", "b": "x=y"})
    for bad, match in [("", "empty"), (":a=1", "empty"), ("rr:a", "key=value"),
                       ("rr:a=", "key=value"), ("rr:=1", "key=value"), ("rr:a=1 a=2", "twice")]:
        with pytest.raises(ValueError, match=match):
            parse_lb_name(bad)


def test_create_load_balancer_and_registry():
    assert isinstance(create_load_balancer("rr"), RoundRobinLoadBalancer)
    with pytest.raises(ValueError, match=r"unknown load balancer 'nope'; known: .*rr"):
        create_load_balancer("nope")
    register_load_balancer("rrtest", lambda params: RoundRobinLoadBalancer(**params))
    assert isinstance(create_load_balancer("rrtest"), RoundRobinLoadBalancer)
    with pytest.raises(ValueError):
        register_load_balancer("a:b", lambda params: RoundRobinLoadBalancer())


def test_rr_parameters():
    lb = create_load_balancer("rr:min_working_instances=2 hold_seconds=5")
    assert (lb.min_working_instances, lb.hold_seconds) == (2, 5)
    for bad, match in [("rr:min_working_instances=2", "both"),
                       ("rr:min_working_instances=0 hold_seconds=5", "> 0"),
                       ("rr:min_working_instances=x hold_seconds=5", "integer"),
                       ("rr:weight=3", "unknown parameter 'weight'")]:
        with pytest.raises(ValueError, match=match):
            create_load_balancer(bad)
