"""wrr and wr: weights from server tags (brpc's weighted_round_robin_load_balancer.cpp,
weighted_randomized_load_balancer.cpp)."""

from __future__ import annotations

import collections
import itertools
import logging
import math
import random

import pytest

from aiobrpc import errors
from aiobrpc.client.lb import (
    WeightedRandomizedLoadBalancer, WeightedRoundRobinLoadBalancer, create_load_balancer,
)
from aiobrpc.client.lb.weights import tag_weight
from aiobrpc.client.lb.wrr import WRR_STRIDES, wrr_stride
from aiobrpc.client.naming import ServerNode
from aiobrpc.errors import RpcError


def weighted(*weights: int | str) -> list[ServerNode]:
    return [ServerNode("10.0.0.1", 1000 + i, str(w)) for i, w in enumerate(weights)]


def wrr(*weights, seed: int = 1, **kw) -> WeightedRoundRobinLoadBalancer:
    lb = WeightedRoundRobinLoadBalancer(rng=random.Random(seed), **kw)
    lb.set_servers(weighted(*weights))
    return lb


def wr(*weights, seed: int = 1, **kw) -> WeightedRandomizedLoadBalancer:
    lb = WeightedRandomizedLoadBalancer(rng=random.Random(seed), **kw)
    lb.set_servers(weighted(*weights))
    return lb


@pytest.mark.parametrize("weights", [(1, 2, 3), (5, 5), (1, 1, 1, 1), (7, 1, 100, 3, 12), (1,),
                                     (10, 20), (3, 6, 9)])
@pytest.mark.parametrize("seed", [1, 2])
def test_wrr_picks_each_server_exactly_its_weight_per_round(weights, seed):
    lb = wrr(*weights, seed=seed)
    total = sum(weights)
    picks = [lb.select().port - 1000 for _ in range(3 * total)]
    for r in range(3):
        assert collections.Counter(picks[r * total:(r + 1) * total]) == \
            {i: w for i, w in enumerate(weights)}


def test_wrr_scatters_picks_when_the_stride_allows():
    lb = wrr(1, 2, 3, 4)  # sum 10, stride 3: no server picked twice in a row more than needed
    picks = [lb.select().port for _ in range(10)]
    runs = max(len(list(g)) for _, g in itertools.groupby(picks))
    assert runs <= 2, picks


def test_wrr_stride_is_the_smallest_table_prime_coprime_with_the_weight_sum():
    for weight_sum in range(1, 400):
        for n in (1, 2, 3, 7):
            if n > weight_sum:
                continue
            stride = wrr_stride(weight_sum, n)
            assert weight_sum == 1 and stride == 1 or math.gcd(stride, weight_sum) == 1
            candidates = [p for p in WRR_STRIDES if p >= weight_sum // n and math.gcd(p, weight_sum) == 1]
            expected = candidates[0] % weight_sum if candidates[0] > weight_sum else candidates[0]
            assert stride == (1 if weight_sum == 1 else expected)


def test_wrr_skips_excluded_and_unavailable_servers_keeping_weights():
    lb = wrr(1, 2, 3, 4)
    down, excluded = lb.servers[3], [lb.servers[0]]
    counts = collections.Counter(
        lb.select(excluded=excluded, available=lambda s: s != down).port - 1000 for _ in range(500))
    # brpc redoes the walk with a stride over the remaining weight: each remaining server
    # keeps a share, not exactly in proportion to its weight.
    assert set(counts) == {1, 2} and min(counts.values()) >= 50


def test_wrr_last_chance_and_errors():
    lb = wrr(2, 3)
    assert lb.select(excluded=set(lb.servers)) in lb.servers
    # The only available server is excluded and met before the last (down) one: brpc fails
    # with EHOSTDOWN, on every retry alike; here it is taken.
    down = lb.servers[0]
    for _ in range(5):
        assert lb.select(excluded=[lb.servers[1]], available=lambda s: s != down) == lb.servers[1]
    with pytest.raises(RpcError) as info:
        lb.select(available=lambda s: False)
    assert info.value.code == errors.EHOSTDOWN
    with pytest.raises(RpcError) as info:
        WeightedRoundRobinLoadBalancer().select()
    assert info.value.code == errors.ENODATA


def test_wrr_follows_a_changed_list():
    lb = wrr(1, 2, 3)
    for _ in range(4):
        lb.select()
    lb.set_servers(weighted(1, 2, 3)[:2] + [ServerNode("10.0.0.9", 1, "5")])
    picks = collections.Counter(lb.select().port for _ in range(8 * 10))
    assert picks == {1000: 10, 1001: 20, 1: 50}


@pytest.mark.parametrize("cls", [WeightedRoundRobinLoadBalancer, WeightedRandomizedLoadBalancer])
def test_invalid_weight_tags_are_rejected_unless_a_default_weight_is_set(cls, caplog):
    nodes = weighted(2, "", "0", "x", "-1", "4294967296", " 3", "4294967295")
    with caplog.at_level(logging.ERROR):
        lb = cls()
        lb.set_servers(nodes)
    assert lb.servers == (nodes[0], nodes[7])
    assert caplog.text.count("invalid weight tag") == 6
    with pytest.raises(RpcError) as info:
        lb.set_servers(weighted("", "a")) or lb.select()
    assert info.value.code == errors.ENODATA
    lb = create_load_balancer(f"{cls.name}:default_weight=3")
    lb.set_servers(nodes)
    assert lb.servers == tuple(nodes)
    for bad, match in [(f"{cls.name}:default_weight=-1", "default_weight must be in 0.."),
                       (f"{cls.name}:default_weight=z", "integer"),
                       (f"{cls.name}:replicas=3", "unknown parameter 'replicas'")]:
        with pytest.raises(ValueError, match=match):
            create_load_balancer(bad)


def test_tag_weight():
    assert [tag_weight(t) for t in ("1", "007", "4294967295", "4294967296", "0", "", "1.5", "٣")] == \
        [1, 7, 4294967295, None, None, None, None, None]


def test_wr_frequencies_follow_weights():
    lb = wr(1, 2, 7)
    counts = collections.Counter(lb.select().port - 1000 for _ in range(10000))
    for i, w in enumerate((1, 2, 7)):
        assert abs(counts[i] - 1000 * w) < 300, counts  # ~ 6-7 sd of a binomial


def test_wr_draw_maps_to_the_first_inclusive_prefix_sum_above_it():
    class Draws(random.Random):  # Random's constructor takes the seed only (3.10 hashes its argument)
        draws: list

        def randrange(self, n):
            return self.draws.pop(0)

    rng = Draws(0)
    rng.draws = [0, 1, 2, 5, 6, 9]
    lb = WeightedRandomizedLoadBalancer(rng=rng)
    lb.set_servers(weighted(2, 4, 4))  # prefix sums 2, 6, 10
    assert [lb.select().port - 1000 for _ in range(6)] == [0, 0, 1, 1, 2, 2]


def test_wr_excluded_servers_are_avoided_and_taken_only_when_nothing_else_is_up():
    lb = wr(5, 1, 1)
    heavy = lb.servers[0]
    counts = collections.Counter(lb.select(excluded=[heavy]) for _ in range(1000))
    assert heavy not in counts and len(counts) == 2
    # Only the excluded server is available: wr takes it (brpc's probe keeps it).
    assert lb.select(excluded=[heavy], available=lambda s: s == heavy) == heavy
    down = set(lb.servers[1:])
    assert {lb.select(available=lambda s: s not in down) for _ in range(50)} == {heavy}
    with pytest.raises(RpcError) as info:
        lb.select(available=lambda s: False)
    assert info.value.code == errors.EHOSTDOWN
    with pytest.raises(RpcError) as info:
        WeightedRandomizedLoadBalancer().select()
    assert info.value.code == errors.ENODATA
