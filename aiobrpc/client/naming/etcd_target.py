"""Where an `etcd://` URL points: the etcd endpoints and the key prefix; and the etcd client
(the `aetcd` package, gRPC) made for one endpoint.

`etcd://host[:port][,host[:port]...]/prefix`: the port defaults to 2379, an IPv6 address goes
in brackets, and the prefix is the path, which must not be empty; it always ends with "/" so
that `/services/echo` does not also take `/services/echo2/...`.

>>> t = EtcdTarget.parse("10.0.0.1:2379,[::1],etcd.local:32379/services/echo")
>>> t.endpoints
(('10.0.0.1', 2379), ('::1', 2379), ('etcd.local', 32379))
>>> t.prefix
'/services/echo/'
>>> t.url
'etcd://10.0.0.1:2379,[::1]:2379,etcd.local:32379/services/echo/'
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .base import ServerNode, parse_entry

if TYPE_CHECKING:
    import aetcd

DEFAULT_PORT = 2379
# Every unary call to etcd (range read, lease grant, keepalive, put) fails after this long:
# an etcd that stopped answering is then treated as gone.
CALL_TIMEOUT_S = 3.0
# gRPC settings of the connection to etcd: HTTP/2 pings find a peer that vanished without
# closing the connection (etcd refuses pings more often than every 5 s); each reconnection is
# a new channel of its own, tried at once, not after gRPC's backoff of a shared one.
GRPC_OPTIONS: dict[str, Any] = {
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.use_local_subchannel_pool": 1,
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 2_000,
}


@dataclass(frozen=True)
class EtcdTarget:
    """The endpoints of one etcd cluster and a key prefix in it."""

    endpoints: tuple[tuple[str, int], ...]
    prefix: str

    @classmethod
    def parse(cls, rest: str) -> EtcdTarget:
        """`rest` is the URL after "etcd://" (a full etcd:// URL is taken too); ValueError
        when it is malformed, ImportError when the aetcd package is not installed."""
        if not isinstance(rest, str):
            raise TypeError(f"an etcd target needs a str, got {type(rest).__name__}")
        if rest.startswith("etcd://"):
            rest = rest[len("etcd://"):]
        hosts, sep, path = rest.partition("/")
        prefix = "/" + path.strip("/") + "/"
        if not sep or prefix == "//":
            raise ValueError(f"etcd://{rest} needs a key prefix: etcd://host:port/prefix")
        endpoints = tuple(_endpoint(h.strip(), rest) for h in hosts.split(",") if h.strip())
        if not endpoints:
            raise ValueError(f"etcd://{rest} names no etcd endpoint")
        if importlib.util.find_spec("aetcd") is None:
            raise ImportError("etcd:// needs the aetcd package: pip install 'aiobrpc[etcd]'")
        return cls(endpoints, prefix)

    @property
    def url(self) -> str:
        hosts = ",".join(ServerNode(h, p).address for h, p in self.endpoints)
        return f"etcd://{hosts}{self.prefix}"

    def endpoint_text(self, index: int) -> str:
        host, port = self.endpoints[index % len(self.endpoints)]
        return ServerNode(host, port).address

    def client(self, index: int) -> aetcd.Client:
        """A new, not yet connected, client of endpoint `index` (modulo their number)."""
        import aetcd

        host, port = self.endpoints[index % len(self.endpoints)]
        return aetcd.Client(f"[{host}]" if ":" in host else host, port,
                            timeout=CALL_TIMEOUT_S, options=dict(GRPC_OPTIONS))


def _endpoint(text: str, rest: str) -> tuple[str, int]:
    port = text.rpartition(":")[2]
    has_port = port.isascii() and port.isdigit() and (not text.startswith("[") or "]:" in text)
    try:
        node = parse_entry(text if has_port else f"{text}:{DEFAULT_PORT}")
    except ValueError as e:
        raise ValueError(f"bad etcd endpoint {text!r} in etcd://{rest}: {e}") from None
    if node.tag:
        raise ValueError(f"bad etcd endpoint {text!r} in etcd://{rest}")
    return node.host, node.port
