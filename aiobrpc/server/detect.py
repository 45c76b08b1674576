"""Which protocol a new connection speaks, from its first bytes (brpc tries its parsers in turn).

A connection keeps the protocol its first bytes name. baidu_std frames start with `PRPC` or
`STRM`; HTTP/1.x with a method and a space; HTTP/2 (gRPC) with its client preface (h2c with
prior knowledge, or inside TLS); TLS with a handshake record (0x16 0x03), inside which the
protocol is detected again.
"""

from __future__ import annotations

BAIDU_STD = "baidu_std"
HTTP = "http"
TLS = "tls"
H2 = "h2"
UNKNOWN = "unknown"

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_STARTS = [(b"PRPC", BAIDU_STD), (b"STRM", BAIDU_STD), (H2_PREFACE, H2)] + [
    (m + b" ", HTTP) for m in (b"GET", b"POST", b"PUT", b"HEAD", b"DELETE", b"OPTIONS", b"PATCH", b"TRACE",
                               b"CONNECT")]
LONGEST = max(len(s) for s, _ in _STARTS)


def detect(head: bytes) -> str | None:
    """The protocol of a connection whose first bytes are `head` (up to LONGEST of them); None
    while they are the beginning of more than one possibility (wait for more)."""
    if not head:
        return None
    if head[0] == 0x16 and (len(head) < 2 or head[1] == 0x03):
        return TLS if len(head) >= 2 else None
    waiting = False
    for start, proto in _STARTS:
        if head.startswith(start):
            return proto
        if start.startswith(head):
            waiting = True
    return None if waiting else UNKNOWN
