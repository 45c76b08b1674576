"""c_murmurhash, c_md5, c_ketama: consistent hashing on the request code (brpc's
consistent_hashing_load_balancer.cpp); a key goes to the server C++ brpc sends it to.

Each server is put on a ring of 32-bit hashes `replicas` times (default 100). Its virtual
node i hashes the text `"<ip>:<port>-<i>"` (`"<ip>:<port>-<i>-<tag>"` with
`server_tag_in_key=1`): c_murmurhash with MurmurHash3_x86_32 (seed 0), c_md5 with the first 4
bytes of MD5 read little-endian; c_ketama takes the 4 little-endian words of
MD5("<ip>:<port>-<i>") as 4 nodes, for i < replicas / 4. The ring is sorted by (hash, IPv4
address as its in-memory 32-bit value, port, tag). A call goes to the server of the first node
whose hash is >= its `Controller.request_code` (wrapping to the first node); past an excluded
or unavailable server, on to the next node clockwise, the last node taken whatever its
exclusion.

Host names are hashed as written (`"localhost:8000-0"`), where C++ brpc hashes the address
it resolved: list servers by IP address for both to agree. IPv6 addresses are written
`"[<address>]:<port>"` (compressed form).

>>> from aiobrpc.client.naming import ServerNode
>>> lb = ConsistentHashingLoadBalancer("murmurhash")
>>> lb.set_servers([ServerNode("10.0.0.1", 80), ServerNode("10.0.0.2", 80)])
>>> lb.select(request_code=12345) is lb.select(request_code=12345)
True
"""

from __future__ import annotations

import bisect
import ipaddress
from collections.abc import Callable, Collection, Mapping, Sequence

from ...errors import EHOSTDOWN, EINVAL, ENODATA, RpcError
from ..naming.base import ServerNode
from .base import LoadBalancer, always_available, int_params, unique_nodes
from .hashing import ketama_hashes, md5hash32, murmurhash32

DEFAULT_REPLICAS = 100  # brpc's -chash_num_replicas
MAX_REQUEST_CODE = 0xFFFFFFFF
KETAMA_POINTS_PER_HASH = 4

# The LB name of each kind of ring.
LB_NAMES = {"murmurhash": "c_murmurhash", "md5": "c_md5", "ketama": "c_ketama"}


def endpoint_text(server: ServerNode) -> str:
    """`ip:port` as brpc's endpoint2str writes it (`[v6]:port` for IPv6, a host name as is)."""
    try:
        ip = ipaddress.ip_address(server.host)
    except ValueError:
        return f"{server.host}:{server.port}"
    if ip.version == 6:
        return f"[{ip.compressed}]:{server.port}"
    return f"{ip}:{server.port}"


def endpoint_order(server: ServerNode) -> tuple:
    """How nodes of equal hash are ordered: IPv4 by the address's in-memory 32-bit value
    (network byte order read as a little-endian int, brpc's ip2int on x86), then port; other
    hosts after every IPv4 one, by text."""
    try:
        ip = ipaddress.IPv4Address(server.host)
    except ValueError:
        return (1, server.host, server.port)
    return (0, int.from_bytes(ip.packed, "little"), server.port)


def ring_nodes(servers: Sequence[ServerNode], kind: str, replicas: int,
               server_tag_in_key: bool = False) -> list[tuple[int, tuple, str, ServerNode]]:
    """The sorted ring of `servers`: (hash, endpoint order, tag, server) per virtual node."""
    nodes = []
    for server in servers:
        prefix = endpoint_text(server)
        suffix = f"-{server.tag}" if server_tag_in_key else ""
        order = endpoint_order(server)
        if kind == "ketama":
            for i in range(replicas // KETAMA_POINTS_PER_HASH):
                for point in ketama_hashes(f"{prefix}-{i}{suffix}".encode()):
                    nodes.append((point, order, server.tag, server))
        else:
            hash32 = murmurhash32 if kind == "murmurhash" else md5hash32
            for i in range(replicas):
                nodes.append((hash32(f"{prefix}-{i}{suffix}".encode()), order, server.tag, server))
    nodes.sort(key=lambda node: node[:3])
    return nodes


class ConsistentHashingLoadBalancer(LoadBalancer):
    """c_murmurhash (`kind="murmurhash"`), c_md5 (`"md5"`) or c_ketama (`"ketama"`); see the
    module. A call without `Controller.request_code`, or with one above 2**32-1, fails with
    EINVAL (not retried by the default retry policy)."""

    def __init__(self, kind: str, *, replicas: int = DEFAULT_REPLICAS,
                 server_tag_in_key: bool = False) -> None:
        super().__init__()
        if kind not in LB_NAMES:
            raise ValueError(f"unknown consistent hashing kind {kind!r}; known: "
                             f"{', '.join(LB_NAMES)}")
        self.name = LB_NAMES[kind]
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
            raise ValueError(f"{self.name}: replicas must be an int >= 1, got {replicas!r}")
        if kind == "ketama" and replicas % KETAMA_POINTS_PER_HASH:
            raise ValueError(f"c_ketama: replicas must be a multiple of "
                             f"{KETAMA_POINTS_PER_HASH}, got {replicas}")
        self.kind = kind
        self.replicas = replicas
        self.server_tag_in_key = bool(server_tag_in_key)
        self._hashes: list[int] = []
        self._owners: list[ServerNode] = []

    @classmethod
    def factory(cls, kind: str) -> Callable[[Mapping[str, str]], ConsistentHashingLoadBalancer]:
        """What builds a `c_<kind>:replicas=N server_tag_in_key=0|1` balancer from its parameters."""
        def from_params(params: Mapping[str, str]) -> ConsistentHashingLoadBalancer:
            values = int_params(LB_NAMES[kind], params, {"replicas": (1, None),
                                                         "server_tag_in_key": (0, 1)})
            return cls(kind, **values)
        return from_params

    def set_servers(self, servers: Sequence[ServerNode]) -> None:
        """Replace the list and rebuild the ring."""
        nodes = unique_nodes(servers)
        ring = ring_nodes(nodes, self.kind, self.replicas, self.server_tag_in_key)
        self._hashes = [node[0] for node in ring]
        self._owners = [node[3] for node in ring]
        self._servers = nodes

    def select(self, *, excluded: Collection[ServerNode] = (),
               available: Callable[[ServerNode], bool] = always_available,
               request_code: int | None = None) -> ServerNode:
        if request_code is None:
            raise RpcError(EINVAL, f"{self.name} needs Controller.request_code (an int in "
                                   f"0..{MAX_REQUEST_CODE}) to place the call")
        if not isinstance(request_code, int) or not 0 <= request_code <= MAX_REQUEST_CODE:
            raise RpcError(EINVAL, f"{self.name}: request_code must be an int in "
                                   f"0..{MAX_REQUEST_CODE} (32-bit), got {request_code!r}")
        hashes = self._hashes
        size = len(hashes)
        if size == 0:
            raise RpcError(ENODATA, f"Fail to select server: {self.name} has an empty server list")
        owners = self._owners
        i = bisect.bisect_left(hashes, request_code)
        if i == size:
            i = 0
        last = size - 1
        for k in range(size):
            server = owners[i]
            if (k == last or server not in excluded) and available(server):
                return server
            i += 1
            if i == size:
                i = 0
        raise RpcError(EHOSTDOWN, f"Fail to select server: none of the {len(self._servers)} "
                                  f"servers of {self.name} is available")
