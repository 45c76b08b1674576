"""c_murmurhash, c_md5, c_ketama place every key where C++ brpc does (consistent_hashing_load_balancer.cpp).

The rings here are built from brpc's rules written again independently of aiobrpc's code: a
pure-Python MurmurHash3_x86_32, hashlib's MD5 and the IPv4 address read from inet_aton.
"""

from __future__ import annotations

import bisect
import hashlib
import random
import socket
import struct

import pytest

from aiobrpc import errors
from aiobrpc.client.lb import ConsistentHashingLoadBalancer, consistent_hashing, create_load_balancer
from aiobrpc.client.lb.hashing import ketama_hashes, md5hash32, murmurhash32
from aiobrpc.client.naming import ServerNode
from aiobrpc.errors import RpcError

M32 = 0xFFFFFFFF


def reference_murmur3_32(data: bytes, seed: int = 0) -> int:
    """MurmurHash3_x86_32 as in Austin Appleby's MurmurHash3.cpp."""
    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (32 - r))) & M32

    c1, c2 = 0xCC9E2D51, 0x1B873593
    h = seed
    nblocks = len(data) // 4
    for i in range(nblocks):
        k = struct.unpack_from("<I", data, 4 * i)[0]
        k = rotl((k * c1) & M32, 15) * c2 & M32
        h = (rotl(h ^ k, 13) * 5 + 0xE6546B64) & M32
    tail = data[4 * nblocks:]
    k = 0
    for i in reversed(range(len(tail))):
        k = (k << 8) | tail[i]
    if tail:
        h ^= rotl((k * c1) & M32, 15) * c2 & M32
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def reference_ring(servers: list[ServerNode], kind: str, replicas: int,
                   tag_in_key: bool = False) -> list[tuple]:
    """(hash, ip as in-memory u32, port, tag, server) for every virtual node, sorted."""
    ring = []
    for server in servers:
        ip_u32 = struct.unpack("=I", socket.inet_aton(server.host))[0]
        keys = [f"{server.host}:{server.port}-{i}" + (f"-{server.tag}" if tag_in_key else "")
                for i in range(replicas if kind != "ketama" else replicas // 4)]
        for key in keys:
            data = key.encode()
            if kind == "murmurhash":
                hashes = [reference_murmur3_32(data)]
            elif kind == "md5":
                hashes = [struct.unpack("<I", hashlib.md5(data).digest()[:4])[0]]
            else:
                hashes = list(struct.unpack("<4I", hashlib.md5(data).digest()))
            ring += [(h, ip_u32, server.port, server.tag, server) for h in hashes]
    ring.sort(key=lambda node: node[:4])
    return ring


def reference_owner(ring: list[tuple], code: int) -> ServerNode:
    hashes = [node[0] for node in ring]
    i = bisect.bisect_left(hashes, code)
    return ring[i % len(ring)][4]


SERVERS = [
    ServerNode("10.0.0.1", 8000), ServerNode("10.0.0.1", 8001), ServerNode("10.0.0.2", 8000),
    ServerNode("192.168.1.20", 9000), ServerNode("127.0.0.1", 8000),
    # Same address as the first, another tag: the same virtual nodes, ordered after it by tag.
    ServerNode("10.0.0.1", 8000, "b"),
]


def keys_table(ring: list[tuple], count: int = 1200) -> list[int]:
    """Random codes plus the edges: 0, 2**32-1, and every 10th node's hash, hash-1, hash+1."""
    rng = random.Random(12)
    codes = [rng.randrange(1 << 32) for _ in range(count)] + [0, M32]
    for node in ring[::10]:
        codes += [node[0], max(node[0] - 1, 0), min(node[0] + 1, M32)]
    return codes


@pytest.mark.parametrize("name,kind", [("c_murmurhash", "murmurhash"), ("c_md5", "md5"),
                                       ("c_ketama", "ketama")])
@pytest.mark.parametrize("replicas", [100, 160])
def test_every_key_goes_to_the_owner_brpc_computes(name, kind, replicas):
    lb = create_load_balancer(f"{name}:replicas={replicas}")
    lb.set_servers(SERVERS)
    ring = reference_ring(SERVERS, kind, replicas)
    assert [node[0] for node in ring] == lb._hashes  # the same virtual nodes, in the same order
    codes = keys_table(ring)
    assert len(codes) >= 1000
    mismatches = [(code, lb.select(request_code=code), reference_owner(ring, code))
                  for code in codes if lb.select(request_code=code) != reference_owner(ring, code)]
    assert not mismatches
    # The tagged twin of 10.0.0.1:8000 sorts after it on every shared node: it never owns a key.
    assert ServerNode("10.0.0.1", 8000, "b") not in {lb.select(request_code=c) for c in codes}
    assert len({lb.select(request_code=c) for c in codes}) == 5


@pytest.mark.parametrize("kind", ["murmurhash", "md5", "ketama"])
def test_server_tag_in_key(kind):
    lb = ConsistentHashingLoadBalancer(kind, replicas=40, server_tag_in_key=True)
    lb.set_servers(SERVERS)
    ring = reference_ring(SERVERS, kind, 40, tag_in_key=True)
    codes = keys_table(ring, 1000)
    assert all(lb.select(request_code=c) == reference_owner(ring, c) for c in codes)
    # With the tag in the key the two servers of one address own different keys.
    assert ServerNode("10.0.0.1", 8000, "b") in {lb.select(request_code=c) for c in codes}


def test_hand_checked_hash_vectors():
    # Published MurmurHash3_x86_32 vectors (seed 0) and MD5("").
    assert murmurhash32(b"") == reference_murmur3_32(b"") == 0
    assert murmurhash32(b"hello") == reference_murmur3_32(b"hello") == 0x248BFA47
    fox = b"The quick brown fox jumps over the lazy dog"
    assert murmurhash32(fox) == reference_murmur3_32(fox) == 0x2E4FF723
    assert md5hash32(b"") == 0xD98C1DD4  # d41d8cd98f00b204e9800998ecf8427e, first 4 bytes LE
    assert ketama_hashes(b"") == (0xD98C1DD4, 0x04B2008F, 0x980980E9, 0x7E42F8EC)
    # A virtual node key of brpc's ring, each tail length of the murmur loop.
    assert murmurhash32(b"127.0.0.1:8000-0") == reference_murmur3_32(b"127.0.0.1:8000-0") == 2936034794
    for n in range(9):
        data = bytes(range(1, n + 1))
        assert murmurhash32(data) == reference_murmur3_32(data)


def test_a_request_code_equal_to_a_node_hash_goes_to_that_node_and_past_the_last_wraps():
    servers = [ServerNode("10.0.0.1", 80), ServerNode("10.0.0.2", 80)]
    lb = ConsistentHashingLoadBalancer("murmurhash", replicas=3)
    lb.set_servers(servers)
    ring = reference_ring(servers, "murmurhash", 3)
    for h, _, _, _, owner in ring:
        assert lb.select(request_code=h) == owner
    first, last = ring[0], ring[-1]
    assert lb.select(request_code=last[0] + 1) == first[4]
    assert lb.select(request_code=0) == first[4]


def test_equal_hashes_are_ordered_by_ip_as_in_memory_u32_then_port_then_tag(monkeypatch):
    monkeypatch.setattr(consistent_hashing, "murmurhash32", lambda data: 7)
    # In memory 2.0.0.1 is 0x01000002 and 1.0.0.2 is 0x02000001: 2.0.0.1 comes first.
    a, b = ServerNode("1.0.0.2", 80), ServerNode("2.0.0.1", 80)
    lb = ConsistentHashingLoadBalancer("murmurhash", replicas=1)
    lb.set_servers([a, b])
    assert lb.select(request_code=5) == b
    lb.set_servers([ServerNode("2.0.0.1", 81), ServerNode("2.0.0.1", 80, "z"),
                    ServerNode("2.0.0.1", 80, "a")])
    assert lb.select(request_code=5) == ServerNode("2.0.0.1", 80, "a")
    assert [s.tag or s.port for s in lb._owners] == ["a", "z", 81]


def test_excluded_and_unavailable_servers_are_passed_clockwise():
    lb = ConsistentHashingLoadBalancer("md5")
    lb.set_servers(SERVERS[:4])
    ring = reference_ring(SERVERS[:4], "md5", 100)
    for code in random.Random(3).sample(range(1 << 32), 200):
        owner = reference_owner(ring, code)
        i = bisect.bisect_left([n[0] for n in ring], code) % len(ring)
        nxt = next(ring[(i + k) % len(ring)][4] for k in range(len(ring))
                   if ring[(i + k) % len(ring)][4] != owner)
        assert lb.select(request_code=code, excluded=[owner]) == nxt
        assert lb.select(request_code=code, available=lambda s, o=owner: s != o) == nxt


def test_last_chance_and_errors():
    lb = ConsistentHashingLoadBalancer("ketama", replicas=8)
    with pytest.raises(RpcError) as info:
        lb.select(request_code=1)
    assert info.value.code == errors.ENODATA
    one = ServerNode("10.0.0.1", 80)
    lb.set_servers([one])
    assert lb.select(request_code=1, excluded=[one]) == one  # the last node is taken
    with pytest.raises(RpcError) as info:
        lb.select(request_code=1, available=lambda s: False)
    assert info.value.code == errors.EHOSTDOWN
    for code in (None, -1, 1 << 32, "7"):
        with pytest.raises(RpcError) as info:
            lb.select(request_code=code)
        assert info.value.code == errors.EINVAL and "request_code" in info.value.text


def test_replicas_parameter_and_hostnames():
    for bad, match in [("c_md5:replicas=0", "replicas must be >= 1"),
                       ("c_murmurhash:replicas=x", "integer"),
                       ("c_ketama:replicas=10", "multiple of 4"),
                       ("c_md5:weight=3", "unknown parameter 'weight'"),
                       ("c_md5:server_tag_in_key=2", "server_tag_in_key")]:
        with pytest.raises(ValueError, match=match):
            create_load_balancer(bad)
    assert create_load_balancer("c_murmurhash").replicas == 100
    lb = create_load_balancer("c_murmurhash:replicas=1")
    lb.set_servers([ServerNode("localhost", 8000), ServerNode("::1", 8000)])
    # Host names are hashed as written, IPv6 as [address]:port.
    assert sorted(lb._hashes) == sorted([murmurhash32(b"localhost:8000-0"),
                                         murmurhash32(b"[::1]:8000-0")])


def test_set_servers_rebuilds_and_keeps_most_keys_in_place():
    lb = ConsistentHashingLoadBalancer("murmurhash")
    lb.set_servers(SERVERS[:5])
    codes = random.Random(5).sample(range(1 << 32), 2000)
    before = {c: lb.select(request_code=c) for c in codes}
    lb.set_servers(SERVERS[:4])  # 127.0.0.1:8000 leaves: only its keys move
    moved = [c for c in codes if lb.select(request_code=c) != before[c]]
    assert moved and all(before[c] == SERVERS[4] for c in moved)
