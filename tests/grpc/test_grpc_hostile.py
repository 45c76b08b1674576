"""Hostile HTTP/2 peers (docs/hostile_inputs.md H1 and H12), over raw sockets: the `h2`
package in client mode, and frames built by hand where h2 would refuse to send them. Each
case ends with a GOAWAY naming the cause (or a reset of the one stream), one log line, and a
connection beside it that carries on."""

from __future__ import annotations

import asyncio
import logging

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import hpack
import pytest
import pytest_asyncio
from h2.errors import ErrorCodes
from hyperframe.frame import (ContinuationFrame, DataFrame, Frame, GoAwayFrame, HeadersFrame, PingFrame, RstStreamFrame,
                              SettingsFrame, WindowUpdateFrame)

from aiobrpc import Server, ServerOptions
from aiobrpc._proto import grpc_test_pb2
from aiobrpc.server.grpc import session as h2_session
from aiobrpc.server.grpc.session import MAX_CONTROL_FRAMES_PER_SECOND, MAX_RESETS_PER_SECOND
from tests.grpc.test_grpc_server import GrpcTest

Msg = grpc_test_pb2.GrpcMessage
PATH = b"/aiobrpc.test.GrpcTestService/Unary"
GRPC_HEADERS = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", PATH), (b":authority", b"x"),
                (b"content-type", b"application/grpc"), (b"te", b"trailers")]


@pytest.fixture(autouse=True)
def logs_not_rate_limited():
    h2_session._close_log._next = 0.0
    h2_session._stream_log._next = 0.0


class Peer:
    """An HTTP/2 client connection driven by hand."""

    def __init__(self, reader, writer, config: h2.config.H2Configuration | None = None) -> None:
        self.reader, self.writer = reader, writer
        self.h2 = h2.connection.H2Connection(config or h2.config.H2Configuration(client_side=True,
                                                                                 header_encoding=None))
        self.events: list = []

    @classmethod
    async def connect(cls, server: Server, settings: dict | None = None,
                      config: h2.config.H2Configuration | None = None) -> Peer:
        """A connection to `server`, its preface sent with `settings` (h2's SettingCodes)."""
        peer = cls(*await asyncio.open_connection(server.host, server.port), config)
        if settings:
            peer.h2.local_settings = h2.settings.Settings(client=True, initial_values=settings)
        peer.h2.initiate_connection()
        peer.send()
        return peer

    async def closed_by_server(self, timeout: float = 5.0) -> bool:
        """Whether the server closes the connection within `timeout` (what it sends meanwhile is
        read as events)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while loop.time() < end:
            try:
                data = await asyncio.wait_for(self.reader.read(65536), max(0.01, end - loop.time()))
            except asyncio.TimeoutError:
                return False
            except ConnectionError:
                return True
            if not data:
                return True
            try:
                self.events += self.h2.receive_data(data)
            except h2.exceptions.ProtocolError:
                pass
        return False

    def send(self, raw: bytes = b"") -> None:
        self.writer.write(self.h2.data_to_send() + raw)

    async def read_until(self, predicate, timeout: float = 5.0) -> bool:
        """Read events until `predicate(events)` or the end of the connection; whether it held."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while not predicate(self.events):
            try:
                data = await asyncio.wait_for(self.reader.read(65536), max(0.01, end - loop.time()))
            except (asyncio.TimeoutError, ConnectionError):
                return predicate(self.events)
            if not data:
                return predicate(self.events)
            try:
                self.events += self.h2.receive_data(data)
            except h2.exceptions.ProtocolError:
                return predicate(self.events)
            self.send()
        return True

    def goaway(self):
        return next((e for e in self.events if isinstance(e, h2.events.ConnectionTerminated)), None)

    def request(self, message: bytes = Msg(text="hi").SerializeToString(), end: bool = True,
                headers: list | None = None) -> int:
        sid = self.h2.get_next_available_stream_id()
        self.h2.send_headers(sid, headers or [(b":method", b"POST"), (b":scheme", b"http"), (b":path", PATH),
                                              (b":authority", b"x"), (b"content-type", b"application/grpc"),
                                              (b"te", b"trailers")])
        if message is not None:
            self.h2.send_data(sid, b"\x00" + len(message).to_bytes(4, "big") + message, end_stream=end)
        return sid

    def close(self) -> None:
        self.writer.close()


class RawPeer:
    """An HTTP/2 client that builds its frames itself (hyperframe, hpack): it sends what h2
    would refuse to, and reads every frame the server sends (DATA is acknowledged at once)."""

    def __init__(self, reader, writer) -> None:
        self.reader, self.writer = reader, writer
        self.encoder, self.decoder = hpack.Encoder(), hpack.Decoder()
        self.frames: list = []  # every frame received, HEADERS with `.headers` decoded
        self.eof = False
        self.next_sid = 1
        self._in = bytearray()
        self._out: list = []

    @classmethod
    async def connect(cls, server: Server, settings: dict | None = None) -> RawPeer:
        peer = cls(*await asyncio.open_connection(server.host, server.port))
        peer.writer.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + SettingsFrame(0, settings=settings or {}).serialize())
        # the server's SETTINGS acknowledged now: no ACK comes later inside what a test sends
        assert await peer.read_until(lambda p: any(isinstance(f, SettingsFrame) for f in p.frames))
        return peer

    def queue(self, *frames) -> None:
        self._out += [f if isinstance(f, (bytes, bytearray)) else f.serialize() for f in frames]

    def flush(self) -> None:
        if self._out and not self.writer.transport.is_closing():
            self.writer.write(b"".join(self._out))
        self._out = []

    def send(self, *frames) -> None:
        self.queue(*frames)
        self.flush()

    def request(self, message: bytes = Msg(text="hi").SerializeToString(), headers: list | None = None,
                end: bool = True, send: bool = True) -> int:
        """A gRPC call on a new stream (HEADERS, then DATA with the message unless None)."""
        sid, self.next_sid = self.next_sid, self.next_sid + 2
        block = self.encoder.encode(headers or GRPC_HEADERS)
        flags = ["END_HEADERS"] + (["END_STREAM"] if end and message is None else [])
        self.queue(HeadersFrame(sid, data=block, flags=flags))
        if message is not None:
            self.queue(DataFrame(sid, data=b"\x00" + len(message).to_bytes(4, "big") + message,
                                 flags=["END_STREAM"] if end else []))
        if send:
            self.flush()
        return sid

    async def read_until(self, predicate, timeout: float = 5.0) -> bool:
        """Read frames until `predicate(self)` or the end of the connection; whether it held."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while not predicate(self):
            if self.eof:
                return False
            try:
                data = await asyncio.wait_for(self.reader.read(65536), max(0.01, end - loop.time()))
            except asyncio.TimeoutError:
                return predicate(self)
            except ConnectionError:
                data = b""
            if not data:
                self.eof = True
                continue
            self._in += data
            self._parse()
            self.flush()
        return True

    def _parse(self) -> None:
        while len(self._in) >= 9:
            frame, length = Frame.parse_frame_header(memoryview(self._in[:9]))
            if len(self._in) < 9 + length:
                return
            frame.parse_body(memoryview(self._in[9:9 + length]))
            del self._in[:9 + length]
            if isinstance(frame, HeadersFrame):
                frame.headers = dict(self.decoder.decode(frame.data, raw=True))
            elif isinstance(frame, DataFrame) and frame.flow_controlled_length:
                self.queue(WindowUpdateFrame(0, window_increment=frame.flow_controlled_length),
                           WindowUpdateFrame(frame.stream_id, window_increment=frame.flow_controlled_length))
            elif isinstance(frame, SettingsFrame) and "ACK" not in frame.flags:
                self.queue(SettingsFrame(0, flags=["ACK"]))
            self.frames.append(frame)

    def goaway(self):
        return next((f for f in self.frames if isinstance(f, GoAwayFrame)), None)

    def reset(self, sid: int):
        """The error code of the RST_STREAM the server sent on `sid`, or None."""
        return next((f.error_code for f in self.frames if isinstance(f, RstStreamFrame) and f.stream_id == sid), None)

    def trailers(self, sid: int) -> dict:
        for f in self.frames:
            if isinstance(f, HeadersFrame) and f.stream_id == sid and b"grpc-status" in f.headers:
                return f.headers
        return {}

    def close(self) -> None:
        self.writer.close()


def p_status(peer: RawPeer, sid: int) -> bytes | None:
    return peer.trailers(sid).get(b"grpc-status")


def _header_block(peer: Peer, headers) -> bytes:
    return peer.h2.encoder.encode(headers)


def _went_away(events) -> bool:
    return any(isinstance(e, h2.events.ConnectionTerminated) for e in events)


async def goaway_after(server: Server, caplog, send) -> int:
    """The error code of the GOAWAY that a new connection gets after `send(peer)` (which
    queues frames); a connection beside it is still served afterwards."""
    peer = await Peer.connect(server)
    with caplog.at_level(logging.WARNING):
        send(peer)
        assert await peer.read_until(_went_away)
    peer.close()
    await still_serves(server)
    return peer.goaway().error_code


def trailers_of(events, sid) -> dict:
    for e in events:
        if isinstance(e, (h2.events.TrailersReceived, h2.events.ResponseReceived)) and e.stream_id == sid \
                and any(n == b"grpc-status" for n, _ in e.headers):
            return dict(e.headers)
    return {}


async def started(**opts) -> Server:
    server = Server(ServerOptions(**opts))
    server.add_service(GrpcTest())
    await server.start("127.0.0.1:0")
    return server


@pytest_asyncio.fixture
async def server():
    srv = await started()
    yield srv
    await srv.stop()
    await srv.join(1)


async def still_serves(server: Server) -> None:
    """A connection beside the hostile one is answered."""
    peer = await Peer.connect(server)
    sid = peer.request()
    assert await peer.read_until(lambda ev: trailers_of(ev, sid))
    assert trailers_of(peer.events, sid)[b"grpc-status"] == b"0"
    peer.close()


async def test_the_preface_is_served_and_a_call_answered(server):
    await still_serves(server)


async def test_rapid_reset_is_told_to_calm_down(server, caplog):
    def flood(peer):
        for _ in range(MAX_RESETS_PER_SECOND + 50):
            sid = peer.request(Msg(sleep_ms=1000).SerializeToString())
            peer.h2.reset_stream(sid, ErrorCodes.CANCEL)
        peer.send()
    assert await goaway_after(server, caplog, flood) == ErrorCodes.ENHANCE_YOUR_CALM
    assert "a rapid reset flood" in caplog.text
    for _ in range(100):
        if server.concurrency == 0:
            break
        await asyncio.sleep(0.01)
    assert server.concurrency == 0  # every cancelled handler ended


@pytest.mark.parametrize("frame", ["ping", "settings"])
async def test_ping_and_settings_floods_are_told_to_calm_down(server, caplog, frame):
    one = (PingFrame(0, opaque_data=b"12345678") if frame == "ping" else SettingsFrame(0)).serialize()
    code = await goaway_after(server, caplog, lambda peer: peer.send(one * (MAX_CONTROL_FRAMES_PER_SECOND + 10)))
    assert code == ErrorCodes.ENHANCE_YOUR_CALM
    assert "PING and SETTINGS frames within a second" in caplog.text


async def test_window_update_past_2_31_is_a_flow_control_error(server, caplog):
    update = WindowUpdateFrame(0, window_increment=2**31 - 1).serialize()
    assert await goaway_after(server, caplog, lambda peer: peer.send(update)) == ErrorCodes.FLOW_CONTROL_ERROR
    assert "FlowControlError" in caplog.text


async def test_a_continuation_flood_closes_the_connection(server, caplog):
    def flood(peer):
        block = _header_block(peer, [(b":method", b"POST"), (b":path", PATH)])
        first = HeadersFrame(1, data=block)  # no END_HEADERS: CONTINUATION frames follow
        peer.send(first.serialize() + ContinuationFrame(1, data=b"\x40\x01a\x01b").serialize() * 1000)
    assert await goaway_after(server, caplog, flood) == ErrorCodes.PROTOCOL_ERROR
    assert "closing HTTP/2 connection" in caplog.text


async def test_an_hpack_bomb_closes_the_connection(server, caplog):
    def bomb(peer):
        big = b"v" * 3000  # indexed once, then referenced: 1 byte each on the wire, 3 KB each decoded
        headers = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", PATH), (b":authority", b"x"),
                   (b"content-type", b"application/grpc")] + [(b"x-bomb", big)] * 100
        block = _header_block(peer, headers)
        assert len(block) < 16384
        peer.send(HeadersFrame(1, data=block, flags=["END_HEADERS", "END_STREAM"]).serialize())
    assert await goaway_after(server, caplog, bomb) != ErrorCodes.NO_ERROR
    assert "header list larger than" in caplog.text


async def test_streams_past_max_concurrent_streams_are_refused_alone(server, caplog):
    """RFC 9113 §5.1.2: the streams past the limit are reset REFUSED_STREAM (the client may
    retry them); the calls within it are answered and the connection carries on."""
    limit = h2_session.MAX_CONCURRENT_STREAMS
    peer = await RawPeer.connect(server)
    slow = Msg(sleep_ms=300).SerializeToString()
    sids = [peer.request(slow, send=False) for _ in range(limit + 20)]
    peer.flush()
    assert await peer.read_until(lambda p: all(p.trailers(s) or p.reset(s) is not None for s in sids))
    answered = [s for s in sids if p_status(peer, s) == b"0"]
    refused = [s for s in sids if peer.reset(s) == ErrorCodes.REFUSED_STREAM]
    assert len(answered) == limit and len(refused) == 20 and peer.goaway() is None
    sid = peer.request()  # the same connection serves the next call
    assert await peer.read_until(lambda p: p.trailers(sid)) and p_status(peer, sid) == b"0"
    peer.close()


async def test_a_peer_that_keeps_opening_past_the_limit_is_told_to_calm_down(server, caplog):
    limit = h2_session.MAX_CONCURRENT_STREAMS
    peer = await RawPeer.connect(server)
    slow = Msg(sleep_ms=2000).SerializeToString()
    with caplog.at_level(logging.WARNING):
        for _ in range(limit + MAX_RESETS_PER_SECOND + 10):
            peer.request(slow, send=False)
        peer.flush()
        assert await peer.read_until(lambda p: p.goaway() is not None)
    assert peer.goaway().error_code == ErrorCodes.ENHANCE_YOUR_CALM
    assert "refused to it within a second" in caplog.text
    peer.close()
    await still_serves(server)


async def test_data_past_max_body_size_ends_the_call_not_the_connection():
    server = await started(max_body_size=1024)
    try:
        peer = await Peer.connect(server)
        sid = peer.request(Msg(data=b"x" * 4000).SerializeToString())
        peer.send()
        assert await peer.read_until(lambda ev: trailers_of(ev, sid))
        t = trailers_of(peer.events, sid)
        assert t[b"grpc-status"] == b"8"  # RESOURCE_EXHAUSTED
        assert t[b"grpc-message"].endswith(b"exceeds max_body_size=1024"), t
        sid = peer.request()  # the same connection carries on
        peer.send()
        assert await peer.read_until(lambda ev: trailers_of(ev, sid))
        assert trailers_of(peer.events, sid)[b"grpc-status"] == b"0"
        peer.close()
    finally:
        await server.stop()
        await server.join(1)


async def test_requests_that_are_no_grpc_calls_are_answered_415_and_405(server):
    peer = await Peer.connect(server)
    base = [(b":scheme", b"http"), (b":path", PATH), (b":authority", b"x")]
    json_sid = peer.request(None, headers=[(b":method", b"POST"), *base, (b"content-type", b"application/json")])
    get_sid = peer.request(None, headers=[(b":method", b"GET"), *base, (b"content-type", b"application/grpc")])
    peer.h2.end_stream(json_sid)
    peer.h2.end_stream(get_sid)
    peer.send()

    def statuses(ev):
        return {e.stream_id: dict(e.headers)[b":status"] for e in ev if isinstance(e, h2.events.ResponseReceived)}
    assert await peer.read_until(lambda ev: len(statuses(ev)) == 2)
    assert statuses(peer.events) == {json_sid: b"415", get_sid: b"405"}
    peer.close()


async def test_a_server_side_deadline_ends_the_call_deadline_exceeded(server):
    peer = await Peer.connect(server)
    sid = peer.h2.get_next_available_stream_id()
    peer.h2.send_headers(sid, [(b":method", b"POST"), (b":scheme", b"http"), (b":path", PATH),
                               (b":authority", b"x"), (b"content-type", b"application/grpc"),
                               (b"grpc-timeout", b"100m")])
    body = Msg(sleep_ms=5000).SerializeToString()
    peer.h2.send_data(sid, b"\x00" + len(body).to_bytes(4, "big") + body, end_stream=True)
    peer.send()
    started = asyncio.get_running_loop().time()
    assert await peer.read_until(lambda ev: trailers_of(ev, sid))
    assert trailers_of(peer.events, sid)[b"grpc-status"] == b"4"
    assert asyncio.get_running_loop().time() - started < 2.0
    # Deadlines are entries of the connection's one TimerWheel: calls that end first leave none.
    session = next(iter(server.connections)).http
    sids = []
    for _ in range(20):
        sids.append(peer.h2.get_next_available_stream_id())
        peer.h2.send_headers(sids[-1], [(b":method", b"POST"), (b":scheme", b"http"), (b":path", PATH),
                                        (b":authority", b"x"), (b"content-type", b"application/grpc"),
                                        (b"grpc-timeout", b"30S")])
        body = Msg(text="fast").SerializeToString()
        peer.h2.send_data(sids[-1], b"\x00" + len(body).to_bytes(4, "big") + body, end_stream=True)
    peer.send()
    assert await peer.read_until(lambda ev: all(trailers_of(ev, s) for s in sids))
    assert {trailers_of(peer.events, s)[b"grpc-status"] for s in sids} == {b"0"}
    assert len(session.deadlines) == 0
    peer.close()
