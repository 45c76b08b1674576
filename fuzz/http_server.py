"""Harness: HTTP/1.1 on the shared port (routing, JSON / proto / proto-text bodies, gzip bodies,
builtin pages and their query strings, authentication), through the same ServerConnection as
baidu_server.

Input: a control byte (fuzz/_harness.control; bit 4: the server has an authenticator; bit 5: the
rest is *structured*), then the client's raw bytes, or a recipe decoded by `requests()`: 1-3
pipelined requests whose method, path, query, headers and body are picked and fuzzed.

    python -m fuzz.http_server fuzz/corpus/http_server -max_total_time=60
"""

from __future__ import annotations

import gzip
import json

from fuzz import _harness as H
from fuzz import _server

with H.instrumented():
    from aiobrpc._proto import interop_pb2

PATHS = ("/interop.EchoService/Echo", "/EchoService/Echo", "/interop.EchoService/StartStream",
         "/interop.EchoService", "/interop.EchoService/", "/grpc.health.v1.Health/Check",
         "/status", "/vars", "/vars/", "/flags", "/health", "/version", "/protobufs", "/connections",
         "/rpcz", "/brpc_metrics", "/index", "/", "/protobufs/interop.EchoRequest",
         "/..%2f..%2fetc/passwd", "/x/y/z", "*", "http://h/status")
METHODS = ("GET", "POST", "POST", "PUT", "HEAD", "DELETE", "OPTIONS", "PATCH", "CONNECT")
TYPES = ("application/json", "application/proto", "application/x-protobuf", "application/proto-text",
         "text/plain", "application/json; charset=utf-8", "APPLICATION/JSON", "")
QUERIES = ("", "?console=1", "?max_scan=3", "?seconds=1", "?expand", "?a=b&c=d", "?", "?%ZZ", "?x=" + "y" * 30)
GLOBS = ("*", "a*b", "*?*", "a;b;c", "a*" * 40, "[x]", "?*?")


def body_of(p: H._Provider, ctype: str) -> bytes:
    kind = p.byte() % 8
    if kind == 0:
        return p.blob(300)
    d: dict = {"message": p.blob(20).decode("utf-8", "replace")}
    flags = p.byte()
    if flags & 1:
        d["sleep_ms"] = p.int_in(0, 6)
    if flags & 2:
        d["fail_code"] = p.int_in(-2, 3000)
        d["fail_text"] = p.blob(10).decode("utf-8", "replace")
    if flags & 4:
        d["response_compress_type"] = p.int_in(0, 4)
    if flags & 8:
        d["payload"] = p.blob(20).hex() if p.bool() else "!!notbase64"
    if flags & 16:
        d["close_connection"] = p.bool()
    if flags & 32:
        d[p.pick(("message", "sleep_ms", "payload", "unknown", "echo_attachment"))] = \
            p.pick((None, [], {}, 1e400, -1, "x", True, 2 ** 70, "\ud800"))
    if flags & 64:
        d.pop("message")
    if "proto" in ctype and "text" not in ctype:
        try:
            m = interop_pb2.EchoRequest()
            from google.protobuf import json_format
            json_format.ParseDict(d, m, ignore_unknown_fields=True)
            return m.SerializePartialToString()
        except Exception:  # noqa: BLE001 - the recipe asked for a value proto cannot hold
            return p.blob(50)
    if "proto-text" in ctype:
        return f'message: "{d.get("message", "")}"'.encode("utf-8", "surrogatepass") if kind != 1 else p.blob(40)
    try:
        return json.dumps(d).encode("utf-8", "surrogatepass")
    except (ValueError, TypeError):
        return b"{"


def request(p: H._Provider) -> bytes:
    method = p.pick(METHODS)
    path = p.pick(PATHS)
    if path in ("/vars/", "/flags") and p.bool():
        path = path.rstrip("/") + "/" + p.pick(GLOBS)
    if p.byte() % 16 == 0:
        path += p.blob(20).decode("latin-1").replace(" ", "%20").replace("\r", "").replace("\n", "")
    path += p.pick(QUERIES)
    headers = [("Host", "fuzz")]
    ctype = p.pick(TYPES)
    flags = p.byte()
    hostile = p.byte()
    hostile = hostile | (p.byte() << 8) if hostile % 4 == 0 else 0  # rare: most requests are well-formed
    if ctype and not flags & 1:
        headers.append(("Content-Type", ctype))
    body = body_of(p, ctype) if method not in ("GET", "HEAD") or flags & 2 else b""
    if flags & 4:
        headers.append(("Content-Encoding", p.pick(("gzip", "deflate", "br", "GZIP"))))
        if p.byte() % 4:
            body = gzip.compress(body, mtime=0)
    if flags & 8:
        headers.append(("Authorization", p.pick(("secret", "async-secret", "wrong", "", "Basic c2VjcmV0"))))
    if flags & 16:
        headers.append(("Accept-Encoding", p.pick(("gzip", "*;q=0", "gzip;q=0.5", "x-gzip, br"))))
    if flags & 32:
        headers.append((p.pick(("log-id", "x-bd-trace-id", "x-bd-span-id", "timeout-ms", "x-user")),
                        p.blob(12).decode("latin-1")))
    if flags & 64:
        headers.append(("Connection", p.pick(("close", "keep-alive", "Upgrade"))))
    if hostile & 128:
        headers.append((p.blob(8).decode("latin-1"), p.blob(8).decode("latin-1")))  # any header, any bytes
    chunked = bool(flags & 128)
    if chunked:
        headers.append(("Transfer-Encoding", "chunked"))
        if hostile & 512:
            headers.append(("Content-Length", str(len(body))))
        pieces = []
        pos = 0
        while pos < len(body):
            n = p.int_in(1, 64)
            pieces.append(f"{n if not hostile & 1024 or p.byte() % 4 else n + 1:x}\r\n".encode() + body[pos:pos + n] + b"\r\n")
            pos += n
        body = b"".join(pieces) + b"0\r\n\r\n"
    elif body or method in ("POST", "PUT"):
        length = len(body) if not hostile & 2048 else p.int_in(0, 1 << 24)
        headers.append(("Content-Length", str(length)))
        if hostile & 4096:
            headers.append(("Content-Length", str(length + 1)))
    version = "HTTP/1.1" if not hostile & 8192 else p.pick(("HTTP/1.0", "HTTP/2.0", "HTTP/1.1x"))
    head = f"{method} {path} {version}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n"
    return head.encode("latin-1", "replace") + body


def requests(p: H._Provider) -> bytes:
    return b"".join(request(p) for _ in range(p.int_in(1, 3)))


def one_input(data: bytes) -> str:
    return _server.one_input(data, requests)


if __name__ == "__main__":
    H.fuzz_main(one_input)
