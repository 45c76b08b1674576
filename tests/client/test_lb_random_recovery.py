"""random, and cluster recovery of rr and random (brpc's randomized_load_balancer.cpp,
cluster_recover_policy.cpp)."""

from __future__ import annotations

import collections
import random

import pytest

from aiobrpc import errors
from aiobrpc.client.lb import RandomizedLoadBalancer, RoundRobinLoadBalancer, create_load_balancer
from aiobrpc.client.lb.recovery import ClusterRecovery
from aiobrpc.client.naming import ServerNode
from aiobrpc.errors import RpcError


def servers(n: int) -> list[ServerNode]:
    return [ServerNode("10.0.0.1", 1000 + i) for i in range(n)]


def randomized(n: int, seed: int = 1, **kw) -> RandomizedLoadBalancer:
    lb = RandomizedLoadBalancer(rng=random.Random(seed), **kw)
    lb.set_servers(servers(n))
    return lb


def test_random_is_uniform():
    lb = randomized(4)
    counts = collections.Counter(lb.select() for _ in range(8000))
    assert set(counts) == set(lb.servers)
    assert all(1850 <= c <= 2150 for c in counts.values()), counts  # 2000 +- 7 sd


def test_random_skips_unavailable_and_excluded_servers_evenly():
    lb = randomized(5)
    down, excluded = set(lb.servers[:2]), [lb.servers[2]]
    counts = collections.Counter(lb.select(excluded=excluded, available=lambda s: s not in down)
                                 for _ in range(4000))
    assert set(counts) == set(lb.servers[3:])
    assert abs(counts[lb.servers[3]] - counts[lb.servers[4]]) < 400


def test_random_last_chance_and_errors():
    lb = randomized(3)
    assert lb.select(excluded=set(lb.servers)) in lb.servers  # the n-th probe ignores exclusion
    with pytest.raises(RpcError) as info:
        lb.select(available=lambda s: False)
    assert info.value.code == errors.EHOSTDOWN
    with pytest.raises(RpcError) as info:
        RandomizedLoadBalancer().select()
    assert info.value.code == errors.ENODATA


def test_random_walks_with_a_prime_stride_from_a_random_offset():
    class Scripted(random.Random):
        def randrange(self, n):
            return 1  # offset 1

        def choice(self, seq):
            return 36809  # stride 36809 % 7 == 3

    lb = RandomizedLoadBalancer(rng=Scripted())
    lb.set_servers(servers(7))
    seen = []

    def available(s):
        seen.append(lb.servers.index(s))
        return False

    with pytest.raises(RpcError):
        lb.select(available=available)
    assert seen == [1, 4, 0, 3, 6, 2, 5]


class FakeClock:
    def __init__(self) -> None:
        self.ms = 1000

    def __call__(self) -> int:
        return self.ms


class ScriptedDraws(random.Random):
    """randrange(M) answers from `draws` when given; other draws are seeded random."""

    def __init__(self) -> None:
        super().__init__(3)
        self.draws: list[int] = []

    def randrange(self, *args):
        if self.draws and args == (4,):
            return self.draws.pop(0)
        return super().randrange(*args)


@pytest.mark.parametrize("cls", [RoundRobinLoadBalancer, RandomizedLoadBalancer])
def test_recovery_rejects_with_probability_one_minus_usable_over_min_working(cls):
    clock, rng = FakeClock(), ScriptedDraws()
    lb = cls(min_working_instances=4, hold_seconds=2, rng=rng, recovery_clock=clock)
    lb.set_servers(servers(6))
    up: set[ServerNode] = set()
    available = up.__contains__
    assert not lb.recovering
    with pytest.raises(RpcError) as info:
        lb.select(available=available)
    assert info.value.code == errors.EHOSTDOWN and lb.recovering
    up.add(lb.servers[0])  # q = 1 of M = 4: draws 0 pass, 1..3 are rejected
    rng.draws = [0, 1, 3]
    assert lb.select(available=available) == lb.servers[0]
    for _ in range(2):
        with pytest.raises(RpcError) as info:
            lb.select(available=available)
        assert info.value.code == errors.EREJECT
        assert "1 of min_working_instances=4" in info.value.text
    assert errors.EREJECT not in errors.DEFAULT_RETRYABLE
    # Statistically: 3 of 4 rejected.
    clock.ms += 20
    outcomes = collections.Counter()
    for _ in range(4000):
        try:
            lb.select(available=available)
            outcomes["ok"] += 1
        except RpcError as e:
            outcomes[e.code] += 1
    assert 2800 <= outcomes[errors.EREJECT] <= 3200, outcomes
    # q = 4 >= M: nothing is rejected (once the 10 ms count is refreshed).
    up.update(lb.servers[1:4])
    clock.ms += 10
    assert all(lb.select(available=available) for _ in range(200))
    assert lb.recovering
    # Recovery ends when q stayed non-zero and unchanged for more than hold_seconds.
    clock.ms += 2000
    lb.select(available=available)
    assert lb.recovering
    clock.ms += 1
    lb.select(available=available)
    assert not lb.recovering


def test_usable_servers_are_counted_at_most_every_10_ms():
    clock = FakeClock()
    recovery = ClusterRecovery(3, 1, clock=clock, rng=random.Random(1))
    nodes = servers(3)
    up = {nodes[0]}
    recovery.start()
    recovery.rejects(nodes, up.__contains__)
    assert recovery.usable_count(clock.ms, nodes, up.__contains__) == 1
    up.update(nodes)
    clock.ms += 9
    assert recovery.usable_count(clock.ms, nodes, up.__contains__) == 1  # cached
    clock.ms += 1
    assert recovery.usable_count(clock.ms, nodes, up.__contains__) == 3


def test_a_change_of_usable_servers_restarts_the_hold():
    clock = FakeClock()
    recovery = ClusterRecovery(10, 1, clock=clock, rng=random.Random(1))
    nodes = servers(3)
    up = {nodes[0]}
    recovery.start()
    recovery.rejects(nodes, up.__contains__)  # q = 1 since t = 1000
    clock.ms += 800
    up.add(nodes[1])
    recovery.rejects(nodes, up.__contains__)  # q = 2 since t = 1800
    clock.ms += 700  # 1.5 s after q first became 1, 0.7 s after it changed
    recovery.rejects(nodes, up.__contains__)
    assert recovery.recovering
    clock.ms += 301
    recovery.rejects(nodes, up.__contains__)
    assert not recovery.recovering


def test_no_usable_server_never_ends_recovery():
    clock = FakeClock()
    recovery = ClusterRecovery(2, 1, clock=clock, rng=random.Random(1))
    recovery.start()
    for _ in range(5):
        clock.ms += 5000
        assert recovery.rejects(servers(2), lambda s: False)
    assert recovery.recovering


def test_recovery_parameters():
    for name in ("rr", "random"):
        lb = create_load_balancer(f"{name}:min_working_instances=2 hold_seconds=5")
        assert (lb.min_working_instances, lb.hold_seconds) == (2, 5)
        assert lb._recovery is not None and not lb.recovering
        assert create_load_balancer(name)._recovery is None
        for bad, match in [(f"{name}:min_working_instances=2", "both"),
                           (f"{name}:hold_seconds=2", "both"),
                           (f"{name}:min_working_instances=0 hold_seconds=5", "> 0"),
                           (f"{name}:min_working_instances=2 hold_seconds=-1", "> 0"),
                           (f"{name}:min_working_instances=x hold_seconds=5", "integer"),
                           (f"{name}:weight=3", "unknown parameter 'weight'")]:
            with pytest.raises(ValueError, match=match) as info:
                create_load_balancer(bad)
            assert str(info.value).startswith(f"{name}: ")
