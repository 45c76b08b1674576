"""HTTP/1.1 on the server's port: detection from the first bytes, protobuf methods as JSON or
binary, errors as brpc maps them, and the H rows of docs/hostile_inputs.md."""

from __future__ import annotations

import asyncio
import base64
import gzip
import http.client
import json

import pytest
import pytest_asyncio

import aiobrpc
from aiobrpc._proto import interop_pb2
from aiobrpc.protocol import baidu_std
from tests.helpers.interop_server import InteropEcho
from tests.helpers.peers import raw_exchange
from tests.helpers.wire import frame, rpc_meta

MIB = 1 << 20
Req, Resp = interop_pb2.EchoRequest, interop_pb2.EchoResponse
SVC = "interop.EchoService"


@pytest_asyncio.fixture
async def server():
    srv = aiobrpc.Server(aiobrpc.ServerOptions(max_body_size=MIB, first_frame_timeout_sec=0.5,
                                               server_tag="127.0.0.1:9110"))
    srv.add_service(InteropEcho())
    await srv.start("127.0.0.1:0")
    yield srv
    # a fresh connection is still served, over both protocols
    status, _, body = await fetch(srv, "GET", "/health")
    assert (status, body) == (200, b"OK")
    got, _ = await raw_exchange(srv.port, req_frame(cid=99), want=1)
    assert [e.meta.correlation_id for e in responses(got)] == [99]
    await srv.stop()
    await srv.join(timeout=2)
    assert not srv.connections and srv.concurrency == 0


def req_frame(cid=1, message="x"):
    return frame(rpc_meta(service=SVC, correlation_id=cid), Req(message=message).SerializeToString())


def responses(data: bytes) -> list:
    dec = baidu_std.Decoder(baidu_std.CLIENT)
    dec.feed(data)
    return dec.events()


async def fetch(srv, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """(status, headers as a list of (name, value), body) from an ordinary HTTP client."""
    def go():
        c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
        try:
            c.request(method, path, body=body, headers=headers or {})
            r = c.getresponse()
            return r.status, r.getheaders(), r.read()
        finally:
            c.close()
    return await asyncio.to_thread(go)


def header(headers: list, name: str):
    found = [v for k, v in headers if k.lower() == name.lower()]
    return found[0] if found else None


# -- H1: one port, every protocol ----------------------------------------------------------------
async def test_http_and_baidu_std_share_the_port(server):
    got, _ = await raw_exchange(server.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", want=40)
    assert got.startswith(b"HTTP/1.1 200 OK\r\n") and got.endswith(b"\r\n\r\nOK")
    got, _ = await raw_exchange(server.port, req_frame(cid=7, message="over prpc"), want=1)
    (ev,) = responses(got)
    assert ev.meta.correlation_id == 7 and Resp.FromString(bytes(ev.data)).message == "over prpc"


@pytest.mark.parametrize("data", [
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(32),  # a TLS ClientHello: TLS is not enabled
    b"XXXX" + bytes(8),                                            # nothing known
    b"GETX / HTTP/1.1\r\n\r\n",                                    # not quite a method
])
async def test_bytes_no_protocol_takes_close_the_connection(server, data):
    got, closed = await raw_exchange(server.port, data)
    assert closed and got == b""
    assert server.stats.closed["unknown_protocol"] == 1


async def test_a_method_split_over_reads_is_still_detected(server):
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    for piece in (b"G", b"E", b"T /health HTTP/1.1\r\n", b"Host: x\r\n\r\n"):
        writer.write(piece)
        await writer.drain()
        await asyncio.sleep(0.01)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)
    assert head.startswith(b"HTTP/1.1 200")
    writer.close()


# -- methods over HTTP -----------------------------------------------------------------------------
async def test_json_in_json_out_as_brpc_answers(server):
    status, headers, body = await fetch(server, "POST", "/interop.EchoService/Echo", b'{"message":"hi"}')
    assert status == 200 and header(headers, "Content-Type") is None  # none asked, none written
    resp = json.loads(body)
    assert resp["message"] == "hi" and resp["calls_served"] == 1 and isinstance(resp["log_id"], int)
    status, headers, body = await fetch(server, "PUT", "/EchoService/Echo", b'{"message":"short","unknown":1}',
                                        {"Content-Type": "application/json", "log-id": "12345678901"})
    assert status == 200 and header(headers, "Content-Type") == "application/json"
    resp = json.loads(body)
    assert resp["message"] == "short" and resp["log_id"] == 12345678901  # int64 as a number, as brpc


async def test_binary_protobuf_and_bytes_fields(server):
    req = Req(message="bin", payload=b"\x00\xffpayload")
    status, headers, body = await fetch(server, "POST", f"/{SVC}/Echo", req.SerializeToString(),
                                        {"Content-Type": "application/proto"})
    assert status == 200 and header(headers, "Content-Type") == "application/proto"
    resp = Resp.FromString(body)
    assert resp.message == "bin" and resp.payload_size == 9
    payload = base64.b64encode(b"\x01\x02").decode()
    status, _, body = await fetch(server, "POST", f"/{SVC}/Echo",
                                  json.dumps({"message": "b64", "payload": payload}).encode())
    assert status == 200 and json.loads(body)["payload_size"] == 2


async def test_canonical_json_and_text_format(server):
    status, headers, body = await fetch(server, "POST", f"/{SVC}/Echo", b'{"message":"c","sleepMs":"x"}',
                                        {"Content-Type": "application/proto-json"})
    assert status == 400  # a bad value for a known field is an error, not ignored
    status, headers, body = await fetch(server, "POST", f"/{SVC}/Echo", b'{"message":"c","other":1}',
                                        {"Content-Type": "application/proto-json"})
    assert status == 200 and json.loads(body)["serverTimeoutMs"] == "-1"  # canonical: int64 as a string
    status, headers, body = await fetch(server, "POST", f"/{SVC}/Echo", b'message: "t"',
                                        {"Content-Type": "application/proto-text"})
    assert status == 200 and b'message: "t"' in body


async def test_a_gzipped_body_is_inflated_first(server):
    body = gzip.compress(json.dumps({"message": "zipped", "payload": base64.b64encode(b"p" * 3000).decode()}).encode())
    status, _, got = await fetch(server, "POST", f"/{SVC}/Echo", body, {"Content-Encoding": "gzip"})
    assert status == 200 and json.loads(got)["message"] == "zipped" and json.loads(got)["payload_size"] == 3000
    req = Req(message="bin-zipped").SerializeToString()
    status, _, got = await fetch(server, "POST", f"/{SVC}/Echo", gzip.compress(req),
                                 {"Content-Encoding": "GZIP", "Content-Type": "application/proto"})
    assert status == 200 and Resp.FromString(got).message == "bin-zipped"


@pytest.mark.parametrize("encoding,body,text", [
    ("gzip", b"\x1f\x8bnot really gzip", "Fail to gunzip the body"),
    ("gzip", gzip.compress(b'{"message":"cut"}')[:-6], "Fail to gunzip the body"),
    ("br", b'{"message":"m"}', "Content-Encoding 'br' is not supported"),
])
async def test_a_body_that_cannot_be_inflated_is_400(server, encoding, body, text):
    status, headers, got = await fetch(server, "POST", f"/{SVC}/Echo", body, {"Content-Encoding": encoding})
    assert status == 400 and header(headers, "x-bd-error-code") == "1003" and text in got.decode()


async def test_a_gzip_bomb_is_refused_within_max_decompressed_size():
    srv = aiobrpc.Server(aiobrpc.ServerOptions(max_decompressed_size=MIB))
    srv.add_service(InteropEcho())
    await srv.start("127.0.0.1:0")
    bomb = gzip.compress(b"{" + b" " * (8 * MIB) + b"}")  # 8 KiB on the wire
    status, _, got = await fetch(srv, "POST", f"/{SVC}/Echo", bomb, {"Content-Encoding": "gzip"})
    assert status == 400 and b"max_decompressed_size=1048576" in got
    # the trailer's declared size can lie: inflating still stops at the cap
    lying = bomb[:-4] + (100).to_bytes(4, "little")
    status, _, got = await fetch(srv, "POST", f"/{SVC}/Echo", lying, {"Content-Encoding": "gzip"})
    assert status == 400 and b"max_decompressed_size=1048576" in got
    await srv.stop()
    await srv.join(timeout=2)


@pytest.mark.parametrize("message,accept,zipped", [
    ("m" * 600, "gzip", True),
    ("m" * 600, "deflate, gzip;q=0.5", True),
    ("m" * 600, "*", True),
    ("m" * 600, "gzip;q=0", False),
    ("m" * 600, None, False),
    ("m" * 100, "gzip", False),  # under brpc's 512-byte threshold
])
async def test_a_reply_is_gzipped_as_brpc_does(server, message, accept, zipped):
    headers = {"Accept-Encoding": accept} if accept else {}
    status, got_headers, got = await fetch(server, "POST", f"/{SVC}/Echo",
                                           json.dumps({"message": message, "response_compress_type": 2}).encode(),
                                           headers)
    assert status == 200 and header(got_headers, "Content-Encoding") == ("gzip" if zipped else None)
    assert json.loads(gzip.decompress(got) if zipped else got)["message"] == message
    assert int(header(got_headers, "Content-Length")) == len(got)


async def test_a_reply_is_not_gzipped_unless_the_handler_asks(server):
    status, got_headers, got = await fetch(server, "POST", f"/{SVC}/Echo",
                                           json.dumps({"message": "m" * 600}).encode(), {"Accept-Encoding": "gzip"})
    assert status == 200 and header(got_headers, "Content-Encoding") is None and json.loads(got)["message"]


@pytest.mark.parametrize("path,body,status,code,text", [
    (f"/{SVC}/Foo", b"", 404, 1002, f"Fail to find method on `/{SVC}/Foo'"),
    (f"/{SVC}", b"", 404, 1002, "rpc Echo (EchoRequest) returns (EchoResponse);"),
    ("/nope.Service/Echo", b"", 404, None, "Fail to find service"),
    (f"/{SVC}/Echo", b"", 400, 1003, "interop.EchoRequest needs to be created from a non-empty json"),
    (f"/{SVC}/Echo", b"{not json", 400, 1003, "Fail to parse the body"),
    (f"/{SVC}/Echo", b'{"message":"m","fail_code":1234,"fail_text":"user failure"}', 500, 1234,
     "[127.0.0.1:9110][E1234]user failure"),
    (f"/{SVC}/Echo", b'{"message":"m","fail_code":2004}', 503, 2004, "[E2004]"),
    (f"/{SVC}/Echo", b'{"message":"m","fail_code":1008}', 504, 1008, "[E1008]"),
])
async def test_errors_map_to_statuses_as_brpc_does(server, path, body, status, code, text):
    got_status, headers, got = await fetch(server, "POST", path, body)
    assert got_status == status and text in got.decode()
    assert header(headers, "Content-Type") == "text/plain"
    if code is not None:
        assert header(headers, "x-bd-error-code") == str(code)


@pytest.mark.parametrize("content_type, read_as", [
    (None, "JSON"),
    ("application/json", "JSON"),
    # what `curl -d` sends: read as JSON, as brpc does, and the error says so
    ("application/x-www-form-urlencoded", "JSON (a Content-Type of application/x-www-form-urlencoded is read as JSON)"),
    ("application/proto-json", "proto-json"),
])
async def test_a_body_that_is_not_json_is_told_as_such(server, content_type, read_as):
    headers = {"Content-Type": content_type} if content_type else {}
    status, got_headers, got = await fetch(server, "POST", f"/{SVC}/Echo", b"hello there", headers)
    assert status == 400 and header(got_headers, "x-bd-error-code") == "1003"
    assert f"[E1003]Fail to parse the body as {read_as} into interop.EchoRequest: Failed to load JSON: " \
           in got.decode(), got


async def test_max_concurrency_answers_503_elimit(server):
    server.options.max_concurrency = 1
    slow = asyncio.ensure_future(fetch(server, "POST", f"/{SVC}/Echo", b'{"message":"s","sleep_ms":300}'))
    await asyncio.sleep(0.1)
    status, headers, body = await fetch(server, "POST", f"/{SVC}/Echo", b'{"message":"fast"}')
    assert status == 503 and header(headers, "x-bd-error-code") == "2004"
    assert b"max_concurrency=1" in body
    assert (await slow)[0] == 200
    server.options.max_concurrency = 0


async def test_a_handler_closing_the_connection_answers_nothing(server):
    body = b'{"message":"m","close_connection":true}'
    got, closed = await raw_exchange(server.port, b"POST /interop.EchoService/Echo HTTP/1.1\r\nHost: x\r\n"
                                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body), read_timeout=2)
    assert closed and got == b""


async def test_the_same_calls_are_counted_for_both_protocols(server):
    await fetch(server, "POST", f"/{SVC}/Echo", b'{"message":"a"}')
    await fetch(server, "POST", f"/{SVC}/Echo", b'{"message":"a","fail_code":1234}')
    await raw_exchange(server.port, req_frame(cid=3), want=1)
    figures = server.registry.services[SVC]["Echo"].status.describe()
    assert figures["count"] == 3 and figures["error"] == 1 and figures["concurrency"] == 0


# -- H3-H11 --------------------------------------------------------------------------------------
@pytest.mark.parametrize("data,status", [
    (b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),  # H3
    (b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 10\r\n\r\nhello", 400),  # H4
    (b"GET /x HTTP/1.1\r\nHo\x00st: x\r\n\r\n", 400),  # H5 NUL in a name
    (b"GET /x HTTP/1.1\r\nHost: x\r\nBad Name: y\r\n\r\n", 400),  # H5 a space in a name
    (b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding:\r\n chunked\r\n\r\n0\r\n\r\n", 400),  # H5 obs-fold on TE
    (b"GET /x HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n\tmore\r\n\r\n", 400),  # H5 obs-fold by a tab
    (b"GET /x HTTP/1.1\nHost: x\n\n", 400),  # H5 bare LF line ends
    (b"GET /x HTTP/1.1\r\nHost: x\r\n\n", 400),  # H5 a bare LF ends the head
    (b"GET /x HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n", 400),  # H5 / issue 29 R4: NUL in a value
    (b"GET /x HTTP/1.1\r\nHost: x\r\nX-A: a\rb\r\n\r\n", 400),  # a bare CR in a value
    (b"GET /x HTTP/1.1\r\nHost: x\r\nX-A: a\x01b\r\n\r\n", 400),  # other controls in a value
    (b"GET /x HTTP/1.1\r\nHost: x\r\nX-A: a\x7fb\r\n\r\n", 400),
    (b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n-5\r\n", 400),  # H6 a sign
    (b"GET /x HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 100_000 + b"\r\n\r\n", 431),  # H7
    (b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (MIB + 1), 413),  # H8
    (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
])
async def test_malformed_or_oversized_requests_are_answered_then_closed(server, data, status):
    got, closed = await raw_exchange(server.port, data, read_timeout=2)
    assert got.startswith(b"HTTP/1.1 %d " % status) and b"Connection: close" in got
    assert closed
    assert server.stats.closed["bad_http"] == 1


async def test_a_header_value_with_a_control_character_never_reaches_the_handler(server):
    """Issue 29 R4: refused before any handler runs; tabs and obs-text stay allowed."""
    servicer = server.registry.services[SVC]["Echo"]
    before = servicer.status.describe()["count"]
    body = json.dumps({"message": "hi"}).encode()
    for value in (b"a\x00b", b"a\rb", b"a\x01b"):
        got, closed = await raw_exchange(server.port, b"POST /%s/Echo HTTP/1.1\r\nHost: x\r\nX-Field: " % SVC.encode()
                                         + value + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                                         % len(body) + body, read_timeout=2)
        assert got.startswith(b"HTTP/1.1 400 ") and closed
    assert servicer.status.describe()["count"] == before
    status, _, _ = await fetch(server, "POST", f"/{SVC}/Echo", body,
                               {"Content-Type": "application/json", "X-Field": "a\tb \x80"})
    assert status == 200


async def test_a_content_type_with_obs_text_is_answered_and_echoed(server):
    """fuzz/http_server finding: the reply echoes the request's Content-Type, read as latin-1;
    h11 encoded it as ASCII, the answer raised, and the connection stayed busy for ever."""
    body = json.dumps({"message": "hi"}).encode()
    ctype = b"application/js\x8f\x93on"
    got, closed = await raw_exchange(server.port, b"POST /%s/Echo HTTP/1.1\r\nHost: x\r\nContent-Type: %s\r\n"
                                     b"Content-Length: %d\r\n\r\n" % (SVC.encode(), ctype, len(body)) + body
                                     + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", read_timeout=1)
    assert got.startswith(b"HTTP/1.1 200 OK\r\n") and b"Content-Type: " + ctype + b"\r\n" in got
    assert got.endswith(b"\r\n\r\nOK") and not closed  # the next request on the connection answered


async def test_ids_of_unicode_digits_are_ignored_not_raised(server):
    """fuzz/http_server finding: a Log-Id of latin-1 superscript digits ("\xb9" reads as "¹",
    which str.isdigit accepts and int refuses) raised in the answer: a traceback, no reply."""
    body = json.dumps({"message": "hi"}).encode()
    for header in (b"Log-Id", b"X-Bd-Trace-Id", b"X-Bd-Span-Id"):
        got, closed = await raw_exchange(server.port, b"POST /%s/Echo HTTP/1.1\r\nHost: x\r\n%s: \xb9\xb9\xb9\r\n"
                                         b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                                         % (SVC.encode(), header, len(body)) + body, read_timeout=1)
        assert got.startswith(b"HTTP/1.1 200 OK\r\n") and b'{"message":"hi","log_id":0,' in got, (header, got)


async def test_a_chunked_body_over_the_limit_is_refused_before_it_is_all_read(server):
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"POST /interop.EchoService/Echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk = b"%x\r\n" % (256 * 1024) + b"a" * (256 * 1024) + b"\r\n"
    closed = False
    try:
        for _ in range(8):  # 2 MiB offered, 1 MiB allowed
            writer.write(chunk)
            await writer.drain()
    except ConnectionError:
        closed = True
    try:
        got = await asyncio.wait_for(reader.read(), 2)
    except ConnectionResetError:  # closed with our chunks unread: the kernel resets
        got, closed = b"", True
    assert got.startswith(b"HTTP/1.1 413 ") or closed
    assert server.stats.closed["bad_http"] == 1
    writer.close()


async def test_a_huge_chunk_size_is_no_overflow_and_still_bounded(server):  # H6
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"POST /interop.EchoService/Echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                 b"fffffffffffffffffff\r\n")
    closed = False
    try:
        for _ in range(8):  # the chunk it announced is never allowed past max_body_size
            writer.write(b"a" * (256 * 1024))
            await writer.drain()
        got = await asyncio.wait_for(reader.read(), 2)
    except ConnectionResetError:
        got, closed = b"", True
    assert got.startswith(b"HTTP/1.1 413 ") or closed
    writer.close()


async def test_pipelined_requests_are_answered_in_order(server):  # H9
    first = b'{"message":"first","sleep_ms":9}'
    second = b'{"message":"second"}'
    data = (b"POST /interop.EchoService/Echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
            b"POST /interop.EchoService/Echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
            % (len(first), first, len(second), second))
    got, _ = await raw_exchange(server.port, data, read_timeout=10, until=lambda got: got.count(b"HTTP/1.1 ") >= 2
                                and got.rstrip().endswith(b"}"))
    assert got.count(b"HTTP/1.1 200 OK") == 2
    assert got.index(b'"first"') < got.index(b'"second"')


async def test_a_pipelined_head_after_a_body_is_checked_too(server):  # H5 on the second request
    first = b'{"message":"first\\n\\n x"}'  # LF and a leading space in a body are no head's
    data = (b"POST /interop.EchoService/Echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
            b"GET /health HTTP/1.1\r\nHost: x\r\nX: 1\r\n folded\r\n\r\n" % (len(first), first))
    got, closed = await raw_exchange(server.port, data, read_timeout=2)
    assert got.startswith(b"HTTP/1.1 200 OK") and b"HTTP/1.1 400 " in got and closed
    assert b"obs-fold" in got


async def test_a_head_sent_a_byte_at_a_time_is_still_checked(server):
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    for b in b"GET /health HTTP/1.1\r\nHost: x\n":  # refused at that LF, before the head ends
        writer.write(bytes([b]))
        await writer.drain()
    got = await asyncio.wait_for(reader.read(), 2)
    assert got.startswith(b"HTTP/1.1 400 ") and b"bare LF" in got
    writer.close()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    for b in b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n":  # and a good one passes
        writer.write(bytes([b]))
        await writer.drain()
    got = await asyncio.wait_for(reader.readuntil(b"OK"), 2)
    assert got.startswith(b"HTTP/1.1 200 OK")
    writer.close()


async def test_slow_headers_are_closed_at_the_head_timeout(server):  # H10
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /health HTTP/1.1\r\n")
    await writer.drain()
    got = await asyncio.wait_for(reader.read(), 3)  # first_frame_timeout_sec=0.5
    assert got.startswith(b"HTTP/1.1 408 ")
    writer.close()


async def test_a_keep_alive_connection_serves_many_requests(server):
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    for i in range(3):
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)
        assert head.startswith(b"HTTP/1.1 200")
        assert await reader.readexactly(2) == b"OK"
        await asyncio.sleep(0.6 if i == 0 else 0)  # idle between requests is not a slow head
    writer.close()


@pytest.mark.parametrize("path", ["/..%2f..%2fetc/passwd", "/../../etc/passwd", "/static/../../x",
                                  "/%00", "/vars/../../etc"])
async def test_traversal_paths_are_404_never_a_file(server, path):  # H11
    status, _, body = await fetch(server, "GET", path)
    assert status in (200, 404)
    assert b"root:" not in body
    if not path.startswith("/vars"):
        assert status == 404


@pytest.mark.parametrize("target,status", [
    (b"//h]alth", 404),  # urlsplit raised on it (an IPv6 host never closed): found by fuzzing
    (b"//health", 200),  # origin-form: a path, never a host
    (b"/health#frag?x", 200),
    (b"/health?x=1#y", 200),
    (b"http://example.com/health", 200),  # absolute-form
    (b"http://[::1/health", 400),  # absolute-form no URL parser takes
    (b"h]alth", 404),
])
async def test_any_request_target_is_answered_by_its_path(server, target, status):
    got, closed = await raw_exchange(server.port, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n",
                                     want=1 << 16, shutdown=True)
    assert got.startswith(f"HTTP/1.1 {status} ".encode()), got[:80]


async def test_pipelined_bytes_wait_in_the_kernel_while_a_request_is_answered(server):
    """A client that pipelines megabytes behind a slow request: the server stops reading, so
    its buffers stay bounded; everything is answered afterwards, in order."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    slow = b'{"message":"slow","sleep_ms":400}'
    writer.write(b"POST /interop.EchoService/Echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(slow), slow))
    await writer.drain()
    await asyncio.sleep(0.05)
    body = b'{"message":"' + b"p" * 60_000 + b'"}'
    one = b"POST /interop.EchoService/Echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    sender = asyncio.ensure_future(_send_all(writer, one, 100))  # 6 MB in all
    await asyncio.sleep(0.3)
    (conn,) = server.connections
    buffered = len(conn.http.parser.trailing_data[0]) + conn.decoder.reader.rbuf.available()
    assert buffered < 1 << 20, buffered
    answered = 0
    while answered < 101:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
        got = await reader.readexactly(length)
        assert head.startswith(b"HTTP/1.1 200") and (b"slow" in got) == (answered == 0)
        answered += 1
    await sender
    writer.close()


async def _send_all(writer, data: bytes, times: int) -> None:
    for _ in range(times):
        writer.write(data)
        await writer.drain()
