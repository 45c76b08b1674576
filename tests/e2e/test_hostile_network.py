"""Network rows of docs/hostile_inputs.md: A, B, D1-D5, E1-E4, E7, I3-I4, J."""

from __future__ import annotations

import asyncio
import gzip

import pytest
import pytest_asyncio

import aiobrpc
from aiobrpc import errors
from aiobrpc._proto import interop_pb2
from aiobrpc.protocol import baidu_std
from tests.helpers.interop_server import SERVICE, InteropEcho
from tests.helpers.peers import FakeServer, exchange_frames, raw_exchange, reset
from tests.helpers.unread import flood_without_reading
from tests.helpers.waiting import wait_until
from tests.helpers.wire import field_ld, field_varint, frame, rpc_meta

MIB = 1 << 20
Req = interop_pb2.EchoRequest
SVC = "interop.EchoService"


def req_frame(cid=1, message="x", **meta):
    meta.setdefault("service", SVC)
    return frame(rpc_meta(correlation_id=cid, **meta), Req(message=message).SerializeToString())


def responses(data: bytes) -> list:
    dec = baidu_std.Decoder(baidu_std.CLIENT)
    dec.feed(data)
    return dec.events()


@pytest_asyncio.fixture
async def server():
    srv = aiobrpc.Server(aiobrpc.ServerOptions(max_body_size=MIB, first_frame_timeout_sec=0.3))
    srv.add_service(InteropEcho())
    await srv.start("127.0.0.1:0")
    yield srv
    # the server still serves a fresh connection after every hostile case
    got, _ = await raw_exchange(srv.port, req_frame(cid=99), want=1)
    assert [e.meta.correlation_id for e in responses(got)] == [99]
    await srv.stop()
    await srv.join(timeout=2)
    assert not srv.connections and srv.concurrency == 0


# --- A: framing -------------------------------------------------------------------------------

@pytest.mark.parametrize("data,reason", [
    (b"XXXX" + bytes(8), "unknown_protocol"),                               # A1
    (frame(b"", body_size=0xFFFFFFFF), "bad_frame"),                         # A4, A8
    (frame(b"", body_size=MIB + 1), "bad_frame"),                            # A5
    (frame(rpc_meta(), b"ab", meta_size=100), "bad_frame"),                  # A6
    (frame(b"\xff" * 10), "bad_frame"),                                      # A9
])
async def test_bad_frames_close_without_reply(server, data, reason, caplog):
    got, closed = await raw_exchange(server.port, data)
    assert closed and got == b""
    assert server.stats.closed[reason] == 1
    assert server.stats.requests == 0


async def test_a2_partial_magic_closed_at_first_frame_timeout(server):
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    # read_timeout only guards against a hang: the close's reason says which timer closed it.
    got, closed = await raw_exchange(server.port, b"PR", read_timeout=10.0)
    assert closed and got == b"" and loop.time() - t0 > 0.25  # not before first_frame_timeout_sec=0.3
    assert server.stats.closed["first_frame_timeout"] == 1


async def test_a3_truncated_header_then_fin(server):
    got, closed = await raw_exchange(server.port, b"PRPC\0\0\0\1", shutdown=True)
    assert closed and got == b"" and server.stats.requests == 0


async def test_a5_body_of_exactly_max_body_size_is_accepted(server):
    data = Req(message="m", echo_attachment=False).SerializeToString()
    size = MIB - len(data) - 64
    meta = rpc_meta(correlation_id=5, service=SVC, attachment_size=size)
    att = b"\0" * (MIB - len(meta) - len(data))
    meta = rpc_meta(correlation_id=5, service=SVC, attachment_size=len(att))
    f = frame(meta, data + att)
    assert len(f) - 12 == MIB
    got, closed = await raw_exchange(server.port, f, want=1)
    (ev,) = responses(got)
    assert ev.meta.correlation_id == 5 and ev.meta.error_code == 0 and not closed


async def test_a11_hundred_frames_in_one_write_and_one_dribbled(server):
    frames = b"".join(req_frame(cid=i, message=str(i)) for i in range(100))
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(frames)
    one = req_frame(cid=1000)
    for i in range(len(one)):
        writer.write(one[i:i + 1])
        await writer.drain()
        await asyncio.sleep(0)
    dec = baidu_std.Decoder(baidu_std.CLIENT)
    seen = []
    while len(seen) < 101:
        chunk = await asyncio.wait_for(reader.read(65536), 2)
        assert chunk
        dec.feed(chunk)
        seen += [e.meta.correlation_id for e in dec.events()]
    assert sorted(seen) == list(range(100)) + [1000]
    writer.close()


async def test_a12_valid_frame_then_garbage(server):
    got, closed = await raw_exchange(server.port, req_frame(cid=3) + b"GARBAGE!" * 2)
    assert closed and [e.meta.correlation_id for e in responses(got)] == [3]


# --- B: metadata and dispatch -----------------------------------------------------------------

def _nested(depth: int) -> bytes:
    # EchoRequest has no message-typed field, so nest groups of an unknown field (100):
    # protobuf parses those recursively too.
    return Req(message="deep").SerializeToString() + b"\x83\x06" * depth + b"\x84\x06" * depth


@pytest.mark.parametrize("data,code,needle", [
    (frame(rpc_meta(correlation_id=7, service=SVC), b"\xff\xff"), errors.EREQUEST, "Fail to parse request"),  # B4
    (frame(rpc_meta(correlation_id=7, service=SVC), _nested(100_000)), errors.EREQUEST, "Fail to parse"),     # B5
    (frame(rpc_meta(correlation_id=7, service=SVC, raw_extra=field_varint(10, 7)), b"\x0a\x00"), errors.EREQUEST, "ContentType=unknown"),  # B6
    (frame(rpc_meta(correlation_id=7, service=None, method=None, error_code=0), b""), errors.EREQUEST, "missing"),  # B7
    (frame(rpc_meta(correlation_id=7, service="no.Such", method="X")), errors.ENOMETHOD, "no.Such/X"),  # B1
    (frame(b""), errors.EREQUEST, "missing"),                                                           # A7
], ids=["B4-bad-payload", "B5-deep-nesting", "B6-content-type", "B7-response-meta", "B1-unknown", "A7-empty-meta"])
async def test_bad_requests_get_error_replies_and_connection_is_kept(server, data, code, needle):
    evs, closed = await exchange_frames(server.port, data + req_frame(cid=8), 2)
    assert not closed
    assert evs[0].meta.error_code == code and needle in evs[0].meta.error_text
    assert evs[1].meta.correlation_id == 8 and evs[1].meta.error_code == 0


async def test_d4_reused_correlation_id_answered_twice(server):
    two = req_frame(cid=1, message="a") + frame(rpc_meta(correlation_id=1, service=SVC),
                                                Req(message="b", sleep_ms=50).SerializeToString())
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(two)
    dec = baidu_std.Decoder(baidu_std.CLIENT)
    evs = []
    while len(evs) < 2:
        dec.feed(await asyncio.wait_for(reader.read(65536), 2))
        evs += dec.events()
    assert [e.meta.correlation_id for e in evs] == [1, 1]
    writer.close()


# --- E: connection faults at the server ------------------------------------------------------

async def test_e1_reset_in_the_middle_of_a_request(server):
    _, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(req_frame(cid=1)[:20])
    await writer.drain()
    await asyncio.sleep(0.05)
    reset(writer)
    await asyncio.sleep(0.05)
    await wait_until(lambda: server.stats.requests == 0 and not server.connections)
    assert server.stats.requests == 0 and not server.connections


async def test_e4_half_close_still_answered(server):
    got, closed = await raw_exchange(server.port, req_frame(cid=4, message="half"), shutdown=True)
    assert closed and [e.meta.correlation_id for e in responses(got)] == [4]


# --- I: authentication ------------------------------------------------------------------------

class SlowAuth:
    def __init__(self, ok=True, raises=False):
        self.ok, self.raises = ok, raises

    async def verify_credential(self, credential, peer):
        await asyncio.sleep(0.1)
        if self.raises:
            raise RuntimeError("authenticator broke")
        return self.ok and credential == b"pw"


@pytest.mark.parametrize("ok,raises", [(True, False), (False, False), (True, True)])
async def test_i3_i4_frames_wait_for_the_verdict(ok, raises):
    servicer = InteropEcho()
    srv = aiobrpc.Server(aiobrpc.ServerOptions(auth=SlowAuth(ok, raises)))
    srv.add_service(servicer)
    await srv.start("127.0.0.1:0")
    data = (frame(rpc_meta(correlation_id=1, service=SVC, authentication_data=b"pw"),
                  Req(message="1").SerializeToString()) + req_frame(cid=2))
    got, closed = await raw_exchange(srv.port, data, read_timeout=1.0, want=None if not (ok and not raises) else 1)
    evs = responses(got)
    if ok and not raises:
        seen = [e.meta.correlation_id for e in evs]
        assert seen[0] == 1
    else:
        assert closed and len(evs) == 1
        assert evs[0].meta.error_code == errors.ERPCAUTH and evs[0].meta.error_text == "Fail to authenticate"
        assert servicer.calls_served == 0
    await srv.stop()
    await srv.join(timeout=2)


class PasswordAuth:
    def verify_credential(self, credential, peer):
        return credential == b"pw"


async def test_i11_guessing_credentials_costs_each_attempt_a_bounded_amount():
    """Hundreds of short connections that fail authentication: each is answered ERPCAUTH and
    closed, none is left open, and an authenticated client is served throughout."""
    servicer = InteropEcho()
    srv = aiobrpc.Server(aiobrpc.ServerOptions(auth=PasswordAuth()))
    srv.add_service(servicer)
    await srv.start("127.0.0.1:0")
    good = frame(rpc_meta(correlation_id=7, service=SVC, authentication_data=b"pw"), Req(message="ok").SerializeToString())
    reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)

    async def guess(i):
        data = frame(rpc_meta(correlation_id=1, service=SVC, authentication_data=b"guess%d" % i),
                     Req(message="x").SerializeToString())
        got, closed = await raw_exchange(srv.port, data, read_timeout=5.0)
        (ev,) = responses(got)
        assert closed and ev.meta.error_code == errors.ERPCAUTH

    async def probe():
        writer.write(good)
        dec = baidu_std.Decoder(baidu_std.CLIENT)
        while True:
            dec.feed(await asyncio.wait_for(reader.read(65536), 5))
            evs = dec.events()
            if evs:
                assert evs[0].meta.error_code == 0
                return
    await probe()
    for batch in range(10):
        await asyncio.gather(*[guess(batch * 50 + i) for i in range(50)])
        await probe()  # the authenticated connection is served between the waves
    assert servicer.calls_served == 11
    for _ in range(100):
        if len(srv.connections) == 1:
            break
        await asyncio.sleep(0.01)
    await wait_until(lambda: len(srv.connections) == 1)
    assert len(srv.connections) == 1  # every guessing connection is closed, none lingers
    writer.close()
    await srv.stop()
    await srv.join(timeout=2)


# --- client side: D1-D3, E2, E3, E7, J ---------------------------------------------------------

def _reply(cid: int, payload: bytes = b"", **meta) -> bytes:
    m = rpc_meta(service=None, method=None, correlation_id=cid, error_code=meta.pop("error_code", 0), **meta)
    return frame(m, payload)


def _ok_payload(message="ok") -> bytes:
    return interop_pb2.EchoResponse(message=message).SerializeToString()


def _fake(handler):
    dec = baidu_std.Decoder(baidu_std.SERVER)

    def on_data(writer, data):
        dec.feed(data)
        for ev in dec.events():
            handler(writer, ev.meta.correlation_id)
    return on_data


async def _call(port, timeout_ms=1000, **kw):
    channel = aiobrpc.Channel(f"127.0.0.1:{port}", aiobrpc.ChannelOptions(timeout_ms=timeout_ms, max_retry=0))
    try:
        return await aiobrpc.Stub(channel, SERVICE).Echo(Req(message="x"), **kw), channel
    finally:
        await channel.close()


async def test_d1_d2_unknown_and_duplicate_responses_dropped():
    def handler(writer, cid):
        writer.write(_reply(cid + 12345, _ok_payload("stranger")))
        writer.write(_reply(cid, _ok_payload("mine")) + _reply(cid, _ok_payload("twice")))
    async with FakeServer(_fake(handler)) as peer:
        resp, channel = await _call(peer.port)
        assert resp.message == "mine"
        await asyncio.sleep(0.05)
        await wait_until(lambda: channel.stats.late_or_unknown_responses == 2)
        assert channel.stats.late_or_unknown_responses == 2


@pytest.mark.parametrize("mode", ["reset", "close"])
async def test_e2_e3_connection_lost_with_calls_pending(mode):
    writers = []

    def handler(writer, cid):
        writers.append(writer)
        if len(writers) == 10:
            writer.write(_reply(cid, _ok_payload("x" * 100))[:30])  # a truncated response
            if mode == "reset":
                reset(writer)
            else:
                writer.close()
    async with FakeServer(_fake(handler)) as peer:
        channel = aiobrpc.Channel(f"127.0.0.1:{peer.port}", aiobrpc.ChannelOptions(timeout_ms=5000, max_retry=0))
        stub = aiobrpc.Stub(channel, SERVICE)
        results = await asyncio.gather(*[stub.Echo(Req(message=str(i))) for i in range(10)],
                                       return_exceptions=True)
        # failed by the close or reset (the codes below), not by the 5 s deadline
        want = errors.EFAILEDSOCKET if mode == "reset" else errors.EEOF
        assert [r.code for r in results] == [want] * 10
        assert not channel._conn or not channel._conn.pending
        await channel.close()


async def test_e7_connection_refused_fails_fast():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(aiobrpc.RpcError) as ei:
        await _call(port)
    assert ei.value.code == errors.ECONNREFUSED  # refused, not timed out: fast whatever the load


@pytest.mark.parametrize("reply,code", [
    (lambda cid: frame(b"", body_size=64 * MIB + 1), errors.EFAILEDSOCKET),                    # J1
    (lambda cid: _reply(cid, b"\xff\xff"), errors.ERESPONSE),                                   # J5
    (lambda cid: _reply(cid, gzip.compress(b"\0" * (65 * MIB)), compress_type=2), errors.ERESPONSE),  # J6
    (lambda cid: _reply(cid, b"abcd", attachment_size=100), errors.ERESPONSE),                  # C9 client
    (lambda cid: _reply(cid, error_code=1234, error_text="e" * (3 * MIB)), 1234),               # J3
])
async def test_client_parsing_a_hostile_server(reply, code):
    async with FakeServer(_fake(lambda w, cid: w.write(reply(cid)))) as peer:
        with pytest.raises(aiobrpc.RpcError) as ei:
            await _call(peer.port)
        assert ei.value.code == code


async def test_user_fields_past_the_limits_are_refused_and_the_connection_kept():
    srv = aiobrpc.Server(aiobrpc.ServerOptions(max_user_fields_bytes=1000))
    srv.add_service(InteropEcho())
    await srv.start("127.0.0.1:0")
    many = req_frame(cid=1, user_fields={f"k{i}": "v" for i in range(50_000)})
    big = req_frame(cid=2, user_fields={"a": "x" * 600, "b": "y" * 600})
    fine = req_frame(cid=3, user_fields={"a": "x" * 400, "b": "y" * 400})
    events, closed = await exchange_frames(srv.port, many + big + fine, 3)
    assert not closed and [e.meta.correlation_id for e in events] == [1, 2, 3]
    assert events[0].meta.error_code == errors.EREQUEST
    assert "more than 1024 user_fields (max_user_fields=1024)" in events[0].meta.error_text
    assert events[1].meta.error_code == errors.EREQUEST
    assert "hold 1202 bytes (max_user_fields_bytes=1000)" in events[1].meta.error_text
    assert not events[2].meta.error_code
    await srv.stop()
    await srv.join(timeout=2)


async def test_a_response_past_the_user_fields_limit_fails_the_call():
    fields = {f"k{i}": "v" for i in range(2000)}
    reply = frame(rpc_meta(service=None, method=None, correlation_id=1, user_fields=fields),
                  interop_pb2.EchoResponse(message="m").SerializeToString())

    async with FakeServer(lambda w, d: w.write(reply)) as fake:
        ch = aiobrpc.Channel(f"127.0.0.1:{fake.port}", aiobrpc.ChannelOptions(max_retry=0, timeout_ms=2000))
        with pytest.raises(aiobrpc.RpcError) as info:
            await aiobrpc.Stub(ch, SERVICE).Echo(Req(message="m"))
        await ch.close()
    assert info.value.code == errors.ERESPONSE and "more than 1024 user_fields" in info.value.text


# --- F: a client that never reads its replies -------------------------------------------------

@pytest.mark.parametrize("sleep_ms", [0, 5])  # replies at once, or after every request of a read was admitted
async def test_server_stops_reading_when_replies_are_not_read(sleep_ms):
    servicer = InteropEcho()
    srv = aiobrpc.Server(aiobrpc.ServerOptions(max_unwritten_bytes=4 * MIB))
    srv.add_service(servicer)
    await srv.start("127.0.0.1:0")
    reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
    await flood_without_reading(srv, servicer, reader, writer, 4 * MIB, sleep_ms)
    await srv.stop()
    await srv.join(timeout=2)


async def test_j4_streams_offered_in_a_response_are_reset():
    from aiobrpc._proto import brpc_streaming_pb2
    settings = brpc_streaming_pb2.StreamSettings(stream_id=77, need_feedback=True, writable=True,
                                                 extra_stream_ids=[78]).SerializeToString()
    got = bytearray()

    def on_data(writer, data):
        got.extend(data)
        if data.startswith(b"PRPC"):
            dec = baidu_std.Decoder(baidu_std.SERVER)
            dec.feed(data)
            for ev in dec.events():
                meta = rpc_meta(service=None, method=None, correlation_id=ev.meta.correlation_id,
                                error_code=0, raw_extra=field_ld(8, settings))
                writer.write(frame(meta, _ok_payload("streamy")))
    async with FakeServer(on_data) as peer:
        resp, _ = await _call(peer.port)
        assert resp.message == "streamy"
        await asyncio.sleep(0.05)
    dec = baidu_std.Decoder(baidu_std.SERVER)
    dec.feed(bytes(got))
    strm = [brpc_streaming_pb2.StreamFrameMeta.FromString(bytes(e.meta)) for e in dec.events()
            if not hasattr(e, "data")]
    assert [(m.stream_id, m.frame_type, m.HasField("source_stream_id")) for m in strm] == [
        (77, brpc_streaming_pb2.FRAME_TYPE_RST, False), (78, brpc_streaming_pb2.FRAME_TYPE_RST, False)]


async def test_client_queue_is_capped_with_eovercrowded():
    import numpy as np
    async with FakeServer(lambda w, d: None) as peer:  # never answers
        channel = aiobrpc.Channel(f"127.0.0.1:{peer.port}", aiobrpc.ChannelOptions(
            timeout_ms=500, max_retry=0, max_unwritten_bytes=MIB))
        stub = aiobrpc.Stub(channel, SERVICE)
        att = np.zeros(2 * MIB, dtype=np.uint8)
        results = await asyncio.gather(*[stub.Echo(Req(message=str(i)), aiobrpc.Controller(request_attachment=att))
                                         for i in range(40)], return_exceptions=True)
        codes = [r.code for r in results]
        assert set(codes) <= {errors.EOVERCROWDED, errors.ERPCTIMEDOUT}
        assert codes.count(errors.EOVERCROWDED) >= 30  # only the first few were queued
        await channel.close()
