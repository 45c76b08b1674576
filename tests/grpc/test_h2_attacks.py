"""HTTP/2 peers that vanish, stall, hold memory or send what RFC 9113 forbids (issue 29), over
raw sockets: each one ends its own stream or connection, bounded in time and memory, and the
calls beside it are answered."""

from __future__ import annotations

import asyncio
import logging

import h2.config
import h2.events
import h2.settings
import pytest
from h2.errors import ErrorCodes
from hyperframe.frame import ContinuationFrame, GoAwayFrame, HeadersFrame, PingFrame, RstStreamFrame

from aiobrpc import Server, Servicer
from aiobrpc._proto import grpc_test_pb2
from aiobrpc.protocol.grpc import PREFIX_SIZE
from aiobrpc.server.grpc import session as h2_session
from tests.grpc.test_grpc_hostile import (GRPC_HEADERS, PATH, Peer, RawPeer, logs_not_rate_limited,  # noqa: F401
                                          p_status, still_serves, trailers_of)
from tests.grpc.test_grpc_server import started, stopped
from tests.helpers.waiting import wait_until

Msg = grpc_test_pb2.GrpcMessage
SERVICE = grpc_test_pb2.DESCRIPTOR.services_by_name["GrpcTestService"]
STREAM_PATH = b"/aiobrpc.test.GrpcTestService/ServerStream"
MIB = 1 << 20
Settings = h2.settings.SettingCodes


class Attacked(Servicer):
    """Unary answers the size of the request's data; ServerStream yields `count` messages of
    int(text) bytes. Both record what ran and how it ended."""

    SERVICE = SERVICE

    def __init__(self) -> None:
        self.unary_runs = 0
        self.streams_begun = 0
        self.streams_closed = 0  # generators closed before their last message (cancelled)
        self.messages_made = 0

    async def Unary(self, request, cntl):
        self.unary_runs += 1
        if request.sleep_ms:
            await asyncio.sleep(request.sleep_ms / 1000)
        return Msg(text=request.text, count=len(request.data))

    async def ServerStream(self, request, cntl):
        self.streams_begun += 1
        size = int(request.text)
        done = False
        try:
            for _ in range(request.count):
                self.messages_made += 1
                yield Msg(data=b"x" * size)
            done = True
        finally:
            if not done:
                self.streams_closed += 1


async def serving(**opts) -> tuple[Server, Attacked]:
    return await started(Attacked(), **opts)


async def eventually(condition, timeout: float = 5.0) -> bool:
    """Whether `condition()` holds within `timeout` (polled)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not condition():
        if loop.time() > end:
            return False
        await asyncio.sleep(0.01)
    return True


def stream_call(peer: Peer, count: int, size: int) -> int:
    sid = peer.h2.get_next_available_stream_id()
    peer.h2.send_headers(sid, [(b":method", b"POST"), (b":scheme", b"http"), (b":path", STREAM_PATH),
                               (b":authority", b"x"), (b"content-type", b"application/grpc")])
    body = Msg(count=count, text=str(size)).SerializeToString()
    peer.h2.send_data(sid, b"\x00" + len(body).to_bytes(4, "big") + body, end_stream=True)
    return sid


def the_connection(server: Server):
    return next(iter(server.connections))


def resets(events) -> dict:
    return {e.stream_id: e.error_code for e in events if isinstance(e, h2.events.StreamReset)}


# -- R4: a malformed request is refused on its stream, before any handler ------------------------
MALFORMED = {
    "CR LF in a value": [(b"x-note", b"a\r\nx-injected: 1")],
    "NUL in a value": [(b"x-note", b"a\x00b")],
    "an uppercase name": [(b"X-Note", b"a")],
    "a connection-specific field": [(b"connection", b"keep-alive")],
    "te other than trailers": [(b"te", b"gzip")],
}


@pytest.mark.parametrize("case", [*MALFORMED, "a pseudo-header after a regular field"])
async def test_a_malformed_request_is_reset_protocol_error_before_its_handler(case, caplog):
    server, servicer = await serving()
    try:
        permissive = h2.config.H2Configuration(client_side=True, header_encoding=None,
                                               validate_outbound_headers=False, normalize_outbound_headers=False)
        peer = await Peer.connect(server, config=permissive)
        base = [h for h in GRPC_HEADERS if h[0] != b"te"]
        if case in MALFORMED:
            headers = base + MALFORMED[case]
        else:
            headers = [base[0], (b"x-note", b"a"), *base[1:]]
        with caplog.at_level(logging.WARNING):
            bad = peer.request(headers=headers)
            peer.send()
            assert await peer.read_until(lambda ev: bad in resets(ev))
        assert resets(peer.events)[bad] == ErrorCodes.PROTOCOL_ERROR
        assert servicer.unary_runs == 0
        assert "malformed request" in caplog.text
        good = peer.request()  # the same connection carries on
        peer.send()
        assert await peer.read_until(lambda ev: trailers_of(ev, good))
        assert trailers_of(peer.events, good)[b"grpc-status"] == b"0" and servicer.unary_runs == 1
        peer.close()
    finally:
        await stopped(server)


# -- R5: a client that vanishes ends its calls ----------------------------------------------------
async def test_calls_waiting_for_a_window_end_when_the_client_closes_its_socket():
    server, servicer = await serving()
    try:
        peer = await Peer.connect(server, settings={Settings.INITIAL_WINDOW_SIZE: 0})
        for _ in range(50):
            stream_call(peer, count=4, size=100_000)
        peer.send()
        assert await eventually(lambda: servicer.streams_begun == 50 and server.concurrency == 50)
        await asyncio.sleep(0.05)  # every reply waits for the window the client never opens
        await wait_until(lambda: server.concurrency == 50)
        assert server.concurrency == 50
        peer.close()
        assert await eventually(lambda: servicer.streams_closed == 50 and server.concurrency == 0
                                and not server.connections)
    finally:
        await stopped(server)


# -- R6: an authenticator still deciding when the first call ends ----------------------------------
class SlowAuthenticator:
    def __init__(self, verdict: bool) -> None:
        self.verdict = verdict
        self.asked = 0

    async def verify_credential(self, credential, peer):
        self.asked += 1
        await asyncio.sleep(0.5)
        return self.verdict


@pytest.mark.parametrize("verdict", [True, False], ids=["let in", "refused"])
@pytest.mark.parametrize("first_call_ends_by", ["its deadline", "RST_STREAM"])
async def test_the_next_call_gets_the_verdict_when_the_first_ends_during_the_check(first_call_ends_by, verdict):
    auth = SlowAuthenticator(verdict)
    server, servicer = await serving(auth=auth)
    try:
        peer = await Peer.connect(server)
        headers = GRPC_HEADERS + [(b"authorization", b"Bearer x")]
        if first_call_ends_by == "its deadline":
            first = peer.request(headers=headers + [(b"grpc-timeout", b"100m")])
            peer.send()
            assert await peer.read_until(lambda ev: trailers_of(ev, first))
            assert trailers_of(peer.events, first)[b"grpc-status"] == b"4"  # DEADLINE_EXCEEDED
        else:
            first = peer.request(headers=headers)
            peer.send()
            assert await eventually(lambda: auth.asked == 1)
            peer.h2.reset_stream(first)
            peer.send()
        second = peer.request(headers=headers)
        peer.send()
        assert await peer.read_until(lambda ev: trailers_of(ev, second), timeout=3.0)
        status = trailers_of(peer.events, second)[b"grpc-status"]
        assert status == (b"0" if verdict else b"16")  # OK, UNAUTHENTICATED
        assert auth.asked == 1  # the first check's verdict, not a second check
        assert servicer.unary_runs == (1 if verdict else 0)
        peer.close()
    finally:
        await stopped(server)


# -- R7: the client's graceful GOAWAY ---------------------------------------------------------------
async def test_calls_in_flight_are_answered_after_the_clients_graceful_goaway():
    server, servicer = await serving()
    try:
        peer = await Peer.connect(server)
        sids = [peer.request(Msg(sleep_ms=200, text=str(i)).SerializeToString()) for i in range(5)]
        peer.send()
        assert await eventually(lambda: server.concurrency == 5)
        # A draining client or proxy: GOAWAY(NO_ERROR), built by hand (h2 would then refuse the replies)
        peer.send(GoAwayFrame(0, last_stream_id=0, error_code=0).serialize())
        late = peer.request()  # a stream opened after it is refused, to be retried elsewhere
        peer.send()
        assert await peer.closed_by_server()
        assert [trailers_of(peer.events, s).get(b"grpc-status") for s in sids] == [b"0"] * 5
        assert resets(peer.events)[late] == ErrorCodes.REFUSED_STREAM
        assert peer.goaway().error_code == ErrorCodes.NO_ERROR  # the server's, once the calls were answered
        assert servicer.unary_runs == 5
        peer.close()
    finally:
        await stopped(server)


# -- R9: what unary requests make the server hold is bounded by the connection's window ------------
async def send_within_windows(peer: Peer, messages: dict[int, memoryview], quiet: float = 0.3) -> int:
    """Send each stream's bytes, round robin, as far as the server's windows let; stop once a
    round sends nothing and no window opens for `quiet` seconds. The bytes sent."""
    sent = 0
    while True:
        progress = 0
        for sid, rest in messages.items():
            n = min(len(rest), peer.h2.local_flow_control_window(sid), peer.h2.max_outbound_frame_size)
            if n > 0:
                peer.h2.send_data(sid, rest[:n])
                messages[sid] = rest[n:]
                progress += n
        peer.send()
        sent += progress
        if not any(messages.values()):
            return sent
        before = peer.h2.outbound_flow_control_window
        await peer.read_until(lambda ev: False, timeout=quiet if not progress else 0.05)
        if not progress and peer.h2.outbound_flow_control_window == before:
            return sent


def open_unary(peer: Peer) -> int:
    sid = peer.h2.get_next_available_stream_id()
    peer.h2.send_headers(sid, GRPC_HEADERS)
    return sid


async def test_unfinished_unary_messages_hold_at_most_the_connection_window():
    body_limit = 2 * MIB
    server, servicer = await serving(max_body_size=body_limit)
    try:
        peer = await Peer.connect(server)
        whole = memoryview(b"\x00" + body_limit.to_bytes(4, "big") + bytes(body_limit))
        messages = {open_unary(peer): whole[:-1024] for _ in range(60)}  # each all but its last KiB
        sent = await send_within_windows(peer, messages)
        bound = h2_session.CONNECTION_WINDOW + body_limit + PREFIX_SIZE  # the window, and one message lent
        assert sent <= bound
        held = the_connection(server).http.held_bytes()
        assert h2_session.CONNECTION_WINDOW - MIB <= held <= bound
        assert servicer.unary_runs == 0
        peer.close()
    finally:
        await stopped(server)


@pytest.mark.parametrize("size_mib", [20, 3])
async def test_a_message_larger_than_the_windows_still_arrives(size_mib, monkeypatch):
    if size_mib == 3:  # larger than the connection's window itself: a part of it is lent
        monkeypatch.setattr(h2_session, "CONNECTION_WINDOW", MIB)
    server, servicer = await serving(max_body_size=64 * MIB)
    try:
        peer = await Peer.connect(server)
        body = Msg(data=bytes(size_mib * MIB)).SerializeToString()
        sids = [open_unary(peer) for _ in range(2)]
        await send_within_windows(peer, {sid: memoryview(b"\x00" + len(body).to_bytes(4, "big") + body)
                                         for sid in sids})
        for sid in sids:
            peer.h2.end_stream(sid)
        peer.send()
        assert await peer.read_until(lambda ev: all(trailers_of(ev, s) for s in sids), timeout=10)
        assert [trailers_of(peer.events, s)[b"grpc-status"] for s in sids] == [b"0", b"0"]
        assert the_connection(server).http.held_bytes() == 0
        peer.close()
    finally:
        await stopped(server)


# -- R10: a peer that does not read holds the server-streaming call, not the server's memory -------
async def test_server_streaming_keeps_to_max_unwritten_bytes_for_a_peer_that_does_not_read():
    cap, size = MIB, 16 * 1024
    server, servicer = await serving(max_unwritten_bytes=cap)
    try:
        huge = 2**31 - 1
        peer = await Peer.connect(server, settings={Settings.INITIAL_WINDOW_SIZE: huge})
        peer.h2.increment_flow_control_window(huge - 65535)
        stream_call(peer, count=1_000_000, size=size)
        peer.send()  # and never read again

        conn = None
        unwritten = 0
        for _ in range(30):  # while the kernel's buffers fill, and after
            await asyncio.sleep(0.05)
            if server.connections:
                conn = the_connection(server)
                unwritten = max(unwritten, conn.unwritten_bytes() + conn.http.h2.unsent_bytes)
        assert unwritten <= cap + 2 * size
        made = servicer.messages_made
        await asyncio.sleep(0.3)
        assert servicer.messages_made == made  # the handler waits for the peer
        assert server.concurrency == 1 and servicer.streams_closed == 0 and not server.stats.failed_requests
        peer.close()
    finally:
        await stopped(server)


# -- R11: header blocks bounded by bytes, and in time ------------------------------------------------
def header_block_start(peer: RawPeer, sid: int) -> bytes:
    """A HEADERS frame without END_HEADERS: CONTINUATION frames must follow."""
    return HeadersFrame(sid, data=peer.encoder.encode(GRPC_HEADERS)).serialize()


@pytest.mark.parametrize("flood", ["one CONTINUATION of 1 MiB", "CONTINUATIONs of 16 KiB"])
async def test_a_header_block_past_twice_max_header_list_size_is_refused_at_once(flood, caplog):
    server, _ = await serving()
    try:
        peer = await RawPeer.connect(server)
        with caplog.at_level(logging.WARNING):
            if flood == "one CONTINUATION of 1 MiB":
                # its header, and 64 KiB of its body: refused by what it announces
                frame = ContinuationFrame(1, data=b"\x00" * h2_session.MAX_FRAME_SIZE).serialize()
                peer.send(header_block_start(peer, 1) + frame[:9 + 64 * 1024])
            else:
                # each complete, fewer than the 64 frames h2 counts, more bytes than the bound
                frame = ContinuationFrame(1, data=b"\x00" * 16 * 1024).serialize()
                peer.send(header_block_start(peer, 1) + frame * 20)
            assert await peer.read_until(lambda p: p.goaway() is not None)
        assert peer.goaway().error_code == ErrorCodes.ENHANCE_YOUR_CALM
        assert "a header block of" in caplog.text
        assert await peer.read_until(lambda p: p.eof)
        peer.close()
        await still_serves(server)
    finally:
        await stopped(server)


@pytest.mark.parametrize("after_a_call", [False, True], ids=["first", "after a call"])
async def test_a_header_block_left_unfinished_is_closed_by_the_timer(after_a_call):
    server, _ = await serving(first_frame_timeout_sec=0.5)
    try:
        peer = await RawPeer.connect(server)
        sid = 1
        if after_a_call:
            sid = peer.request()
            assert await peer.read_until(lambda p: p.trailers(sid))
            sid += 2
        continuation = ContinuationFrame(sid, data=b"").serialize()
        peer.send(header_block_start(peer, sid) + continuation * 62)  # 63 frames, then silence
        assert await peer.read_until(lambda p: p.goaway() is not None and p.eof, timeout=3.0)
        assert peer.goaway().error_code == (ErrorCodes.ENHANCE_YOUR_CALM if after_a_call else ErrorCodes.NO_ERROR)
        peer.close()
    finally:
        await stopped(server)


# -- R12: a frame longer than MAX_FRAME_SIZE is refused from its header -------------------------------
async def test_a_frame_announcing_16_mib_is_refused_from_its_header():
    server, _ = await serving()
    try:
        peer = await RawPeer.connect(server)
        header = (2**24 - 1).to_bytes(3, "big") + b"\x00\x00" + (1).to_bytes(4, "big")  # DATA on stream 1
        peer.send(header + b"\x00" * 100)  # and a trickle of its body
        assert await peer.read_until(lambda p: p.goaway() is not None, timeout=2.0)
        assert peer.goaway().error_code == ErrorCodes.FRAME_SIZE_ERROR
        assert await peer.read_until(lambda p: p.eof, timeout=2.0)
        peer.close()
        await still_serves(server)
    finally:
        await stopped(server)


# -- R13: a connection must open a stream in time, and is closed when idle --------------------------
async def test_a_connection_that_opens_no_stream_is_closed_after_first_frame_timeout_sec():
    server, _ = await serving(first_frame_timeout_sec=0.5)
    try:
        idle = await RawPeer.connect(server)  # the preface and SETTINGS, nothing more
        busy = await RawPeer.connect(server)
        sid = busy.request()
        assert await busy.read_until(lambda p: p.trailers(sid))
        assert await idle.read_until(lambda p: p.goaway() is not None and p.eof, timeout=3.0)
        assert idle.goaway().error_code == ErrorCodes.NO_ERROR
        assert server.stats.closed["first_frame_timeout"] == 1
        idle.close()
        await asyncio.sleep(0.6)
        sid = busy.request()  # the one that opened a stream in time is still served
        assert await busy.read_until(lambda p: p.trailers(sid)) and p_status(busy, sid) == b"0"
        busy.close()
    finally:
        await stopped(server)


async def test_pings_do_not_keep_an_idle_connection_open():
    server, _ = await serving(idle_timeout_sec=0.5)
    try:
        peer = await RawPeer.connect(server)
        sid = peer.request()
        assert await peer.read_until(lambda p: p.trailers(sid))
        ping = PingFrame(0, opaque_data=b"12345678").serialize()
        loop = asyncio.get_running_loop()
        end = loop.time() + 3.0
        while not peer.eof and loop.time() < end:
            peer.send(ping)
            await peer.read_until(lambda p: p.eof, timeout=0.1)
        assert peer.eof and peer.goaway().error_code == ErrorCodes.NO_ERROR
        assert server.stats.closed["idle_timeout"] == 1
        peer.close()
    finally:
        await stopped(server)


# -- fuzz/h2_server findings: frames later in one read close what an earlier one answers ---------
async def test_a_stream_refused_after_a_later_frame_of_the_same_read_closed_it(caplog):
    """A malformed request, its own RST_STREAM and a GOAWAY(PROTOCOL_ERROR) in one write: h2 has
    closed the stream and the connection before the server refuses the request; the refusal
    is dropped, nothing raises out of the protocol, the connection is closed."""
    server, servicer = await serving()
    try:
        peer = await RawPeer.connect(server)
        bad = [*GRPC_HEADERS, (b"x-note", b"a\x00b")]
        sid = peer.request(headers=bad, message=None, end=False, send=False)
        peer.queue(RstStreamFrame(sid, error_code=ErrorCodes.CANCEL), GoAwayFrame(0, last_stream_id=sid, error_code=1))
        peer.flush()
        assert await peer.read_until(lambda p: p.eof)
        assert servicer.unary_runs == 0 and not server.connections
        peer.close()
        await still_serves(server)
    finally:
        await stopped(server)


async def test_a_reply_after_the_servers_goaway_is_dropped_not_raised():
    """The server stops while a call runs: its GOAWAY closes h2's side, the call's deadline
    then passes; the trailers h2 refuses to send are dropped, not raised into the timer."""
    server, servicer = await serving()
    peer = await Peer.connect(server)
    sid = peer.h2.get_next_available_stream_id()
    peer.h2.send_headers(sid, [*GRPC_HEADERS, (b"grpc-timeout", b"50m")])
    body = Msg(sleep_ms=2000).SerializeToString()
    peer.h2.send_data(sid, b"\x00" + len(body).to_bytes(4, "big") + body, end_stream=True)
    peer.send()
    loop = asyncio.get_running_loop()
    end = loop.time() + 5
    while not server.concurrency and loop.time() < end:
        await asyncio.sleep(0.005)
    session = next(iter(server.connections)).http
    session.goaway()  # as Server.stop() does first
    await asyncio.sleep(0.2)  # the call's deadline passes meanwhile
    peer.close()
    await stopped(server)
