"""The G rows of docs/hostile_inputs.md: a raw peer sends STRM frames an honest brpc would not,
and the library drops, resets or closes only what it must, with bounded memory, and every
stream ends once."""

from __future__ import annotations

import asyncio
import logging

import pytest

import aiobrpc
from aiobrpc import errors
from aiobrpc._proto import interop_pb2
from aiobrpc.protocol import baidu_std, streaming
from tests.helpers.interop_server import running_echo
from tests.helpers.waiting import wait_until
from tests.helpers.wire import field_ld, field_varint, frame, rpc_meta
from tests.streaming.conftest import MIB, channel_stream_count, open_stream

SERVICE = interop_pb2.DESCRIPTOR.services_by_name["EchoService"]
Req = interop_pb2.EchoRequest
CLIENT_ID = 41


class Holder(aiobrpc.Servicer):
    """StartStream accepts with `options` and keeps the streams; it never reads them itself."""

    SERVICE = SERVICE

    def __init__(self, **options) -> None:
        self.options = options
        self.streams: list = []

    async def StartStream(self, request, cntl):
        accepted = aiobrpc.Stream.accept(cntl, **self.options)
        self.streams += accepted if isinstance(accepted, list) else [accepted]
        return interop_pb2.EchoResponse(message="ok")

    async def Echo(self, request, cntl):
        return interop_pb2.EchoResponse(message=request.message)


class RawClient:
    """A client speaking raw bytes: it opens a stream with a StartStream request and then sends
    whatever a test builds."""

    def __init__(self, reader, writer) -> None:
        self.reader, self.writer = reader, writer
        self.decoder = baidu_std.Decoder(baidu_std.CLIENT)
        self.server_id = None
        self.events: list = []

    @classmethod
    async def open(cls, port: int, need_feedback: bool = True) -> RawClient:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        self = cls(reader, writer)
        settings = streaming.encode_settings(CLIENT_ID, need_feedback, True)
        meta = rpc_meta("interop.EchoService", "StartStream", correlation_id=1, raw_extra=field_ld(8, settings))
        self.send(frame(meta, Req(message="raw").SerializeToString()))
        (first,) = await self.frames(1)
        meta, payload = first
        assert meta.frame_type == streaming.DATA and meta.stream_id == CLIENT_ID
        self.server_id = meta.source_stream_id
        return self

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def frames(self, n: int | None = None, timeout: float = 1.0) -> list:
        """The next `n` STRM frames as (FrameMeta, payload bytes); with n None, all that come
        within `timeout`."""
        out = []
        try:
            while n is None or len(out) < n:
                self._decoded(out)
                if n is not None and len(out) >= n:
                    break
                chunk = await asyncio.wait_for(self.reader.read(1 << 20), timeout)
                if not chunk:
                    break
                self.decoder.feed(chunk)
        except asyncio.TimeoutError:
            pass
        return out

    async def frames_until(self, done, timeout: float = 10.0) -> list:
        """STRM frames as `frames` gives them, read until `done(frames)` holds: what the server
        answers is waited for, however busy the machine (`timeout` is only a hang guard)."""
        out: list = []
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while True:
            self._decoded(out)
            if done(out) or loop.time() >= end:
                return out
            try:
                chunk = await asyncio.wait_for(self.reader.read(1 << 20), end - loop.time())
            except asyncio.TimeoutError:
                return out
            if not chunk:
                return out
            self.decoder.feed(chunk)

    def _decoded(self, out: list) -> None:
        for ev in self.decoder.events():
            if hasattr(ev, "payload"):
                out.append((streaming.decode_frame_meta(ev.meta), bytes(ev.payload)))
            else:
                self.events.append(ev)

    async def echo_works(self, text: str = "kept") -> bool:
        """A unary call on the same connection is answered."""
        self.send(frame(rpc_meta("interop.EchoService", "Echo", correlation_id=99), Req(message=text).SerializeToString()))
        await self.frames_until(lambda _: any(ev.meta.correlation_id == 99 for ev in self.events))
        for ev in self.events:
            if ev.meta.correlation_id == 99:
                return interop_pb2.EchoResponse.FromString(bytes(ev.data)).message == text
        return False

    def data(self, payload: bytes, more: bool = False, to: int | None = None, source: int = CLIENT_ID) -> bytes:
        return b"".join(bytes(b) for b in streaming.segments(
            memoryview(payload), len(payload), streaming.data_meta(self.server_id if to is None else to, source),
            streaming.data_meta(self.server_id if to is None else to, source, True), 1 << 30)) if not more else \
            streaming.data_head(streaming.data_meta(self.server_id if to is None else to, source, True), len(payload)) + payload

    def close(self) -> None:
        self.writer.close()


async def _server(**options):
    holder = Holder(**options.pop("stream_options", {}))
    return running_echo(aiobrpc.ServerOptions(**options), servicer=holder), holder


async def test_g1_frames_for_an_unknown_stream_id():
    ctx, holder = await _server()
    async with ctx as (server, _):
        raw = await RawClient.open(server.port)
        dropped = server.stats.stream_frames_dropped
        raw.send(raw.data(b"to nobody", to=987654321, source=5))
        raw.send(streaming.feedback_frame(987654321, 6, 100))  # FEEDBACK: never answered
        raw.send(streaming.close_frame(987654322, 7))
        raw.send(streaming.rst_frame(987654323))  # RST: never answered
        got = await raw.frames_until(lambda got: len(got) >= 2)
        got += await raw.frames(timeout=0.3)  # and nothing after them
        assert [(m.frame_type, m.stream_id, m.source_stream_id) for m, _ in got] == [
            (streaming.RST, 5, None), (streaming.RST, 7, None)]
        assert server.stats.stream_frames_dropped == dropped + 4
        assert await raw.echo_works()
        (stream,) = holder.streams
        assert not stream.closed  # the open stream was not touched
        raw.close()


async def test_g3_a_writer_that_ignores_the_window_is_reset(caplog):
    ctx, holder = await _server(max_body_size=MIB)
    async with ctx as (server, _):
        raw = await RawClient.open(server.port)
        (stream,) = holder.streams
        chunk = raw.data(bytes(MIB - 64))
        with caplog.at_level(logging.WARNING, logger="aiobrpc.stream"):
            for _ in range(100):
                raw.send(chunk)
                await raw.writer.drain()
            got = await raw.frames_until(lambda got: any(m.frame_type == streaming.RST for m, _ in got))
        rst = [m for m, _ in got if m.frame_type == streaming.RST]
        assert rst and rst[0].stream_id == CLIENT_ID
        assert stream.closed and stream.error.code == errors.EPROTO
        assert "does not wait for FEEDBACK" in stream.error.text
        assert any("resetting stream" in r.message for r in caplog.records)
        assert stream._unconsumed == 0 and not stream._queue  # what it held is freed
        assert await raw.echo_works()
        assert server.stream_count() == 0
        raw.close()


async def test_g4_endless_continuations_are_capped_then_reset():
    ctx, holder = await _server(max_body_size=MIB)
    async with ctx as (server, _):
        raw = await RawClient.open(server.port)
        (stream,) = holder.streams
        piece = raw.data(bytes(64 * 1024), more=True)
        for _ in range(40):  # 2.5 MiB of one message, never finished
            raw.send(piece)
        await raw.writer.drain()
        got = await raw.frames_until(lambda got: any(m.frame_type == streaming.RST for m, _ in got))
        assert streaming.RST in [m.frame_type for m, _ in got]
        assert stream.closed and stream.error.code == errors.EPROTO
        assert "max_body_size=1048576" in stream.error.text
        assert stream._reassembly.size == 0
        assert await raw.echo_works()
        raw.close()


async def test_g5_a_feedback_frame_with_a_payload():
    ctx, holder = await _server()
    async with ctx as (server, _):
        raw = await RawClient.open(server.port)
        (stream,) = holder.streams
        dropped = server.stats.stream_frames_dropped
        meta = streaming.feedback_meta(raw.server_id, CLIENT_ID, 0)
        raw.send(frame(meta, b"not allowed here", magic=b"STRM"))
        await asyncio.sleep(0.05)
        await wait_until(lambda: server.stats.stream_frames_dropped == dropped + 1)
        assert server.stats.stream_frames_dropped == dropped + 1  # the payload was ignored, counted
        assert not stream.closed
        await stream.write(b"still works")
        ((m, payload),) = await raw.frames(1)
        assert m.frame_type == streaming.DATA and payload == b"still works"
        raw.close()


@pytest.mark.parametrize("ftype", [0, 99])
async def test_g7_an_unknown_frame_type_is_dropped(ftype):
    ctx, holder = await _server()
    async with ctx as (server, _):
        raw = await RawClient.open(server.port)
        (stream,) = holder.streams
        meta = field_varint(1, raw.server_id) + field_varint(2, CLIENT_ID) + field_varint(3, ftype)
        raw.send(frame(meta, b"", magic=b"STRM"))
        raw.send(raw.data(b"after"))
        assert bytes(await asyncio.wait_for(stream.read(), 2)) == b"after"
        raw.close()


async def test_g8_data_after_close_does_not_revive_the_stream():
    ctx, holder = await _server()
    async with ctx as (server, _):
        raw = await RawClient.open(server.port)
        (stream,) = holder.streams
        raw.send(streaming.close_frame(raw.server_id, CLIENT_ID))
        got = await raw.frames(1)
        assert got[0][0].frame_type == streaming.CLOSE  # closed as brpc does: CLOSE back
        raw.send(raw.data(b"too late"))
        got = await raw.frames(1)
        assert got[0][0].frame_type == streaming.RST and got[0][0].stream_id == CLIENT_ID
        assert stream.closed and stream.error is None
        assert await stream.read() is None
        assert server.stream_count() == 0
        raw.send(streaming.rst_frame(raw.server_id))  # an RST after it: nothing happens
        assert await raw.echo_works()
        raw.close()


async def test_g9_a_message_over_max_body_size_tells_the_sender():
    ctx, holder = await _server(max_body_size=MIB)
    async with ctx as (server, _):
        channel = aiobrpc.Channel(server.address, aiobrpc.ChannelOptions(max_body_size=MIB))
        stub = aiobrpc.Stub(channel, SERVICE)
        handler_events = []

        class H(aiobrpc.StreamHandler):
            def on_received_messages(self, stream, messages):
                pass

            def on_failed(self, stream, error):
                handler_events.append(("failed", error.code))

            def on_closed(self, stream):
                handler_events.append(("closed",))

        stream, _ = await open_stream(stub, handler=H())
        try:
            await stream.write(bytes(2 * MIB))
        except aiobrpc.RpcError as e:
            assert e.code == errors.ECONNRESET
        await asyncio.wait_for(stream.wait_closed(), 2)
        assert stream.error.code == errors.ECONNRESET
        with pytest.raises(aiobrpc.RpcError):
            await stream.write(b"x")
        await asyncio.sleep(0.02)
        await wait_until(lambda: handler_events == [("failed", errors.ECONNRESET), ("closed",)])
        assert handler_events == [("failed", errors.ECONNRESET), ("closed",)]
        (peer,) = holder.streams
        assert peer.error.code == errors.EPROTO
        assert (await stub.Echo(Req(message="kept"))).message == "kept"
        await channel.close()


async def test_g10_idle_timeout():
    ctx, holder = await _server()
    async with ctx as (server, _):
        channel = aiobrpc.Channel(server.address)
        stub = aiobrpc.Stub(channel, SERVICE)
        idle = []

        class H(aiobrpc.StreamHandler):
            def on_received_messages(self, stream, messages):
                pass

            def on_idle_timeout(self, stream):
                idle.append(asyncio.get_running_loop().time())

        start = asyncio.get_running_loop().time()
        with_handler, _ = await open_stream(stub, handler=H(), idle_timeout_ms=50)
        await asyncio.sleep(0.2)
        await wait_until(lambda: len(idle) >= 2 and idle[0] - start >= 0.04)
        assert len(idle) >= 2 and idle[0] - start >= 0.04
        assert not with_handler.closed  # brpc only tells the handler
        # Read by iteration, a stream with nothing to read for that long ends.
        iterated, _ = await open_stream(stub, idle_timeout_ms=50)
        with pytest.raises(aiobrpc.RpcError) as ei:
            await asyncio.wait_for(iterated.read(), 2)
        assert ei.value.code == errors.ERPCTIMEDOUT
        await asyncio.sleep(0.05)
        await wait_until(lambda: holder.streams[1].closed)
        # it got an RST, not a CLOSE: a peer must not take the timed-out stream for a finished one
        assert holder.streams[1].closed and holder.streams[1].error.code == errors.ECONNRESET
        await with_handler.close()
        await channel.close()


async def test_g11_the_peer_disconnects_with_streams_open():
    ctx, holder = await _server()
    async with ctx as (server, _):
        channel = aiobrpc.Channel(server.address)
        stub = aiobrpc.Stub(channel, SERVICE)
        ended = []

        class H(aiobrpc.StreamHandler):
            def on_received_messages(self, stream, messages):
                pass

            def on_failed(self, stream, error):
                ended.append(("failed", stream.id, error.code))

            def on_closed(self, stream):
                ended.append(("closed", stream.id))

        cntl = aiobrpc.Controller()
        iterated = aiobrpc.Stream.create_many(cntl, 2, max_buf_size=1000)
        await stub.StartStream(Req(message="x"), cntl)
        with_handler, _ = await open_stream(stub, handler=H())
        await iterated[0].write(bytes(1000))
        blocked = asyncio.ensure_future(iterated[0].write(b"waits for the window"))
        reading = asyncio.ensure_future(iterated[1].read())
        await asyncio.sleep(0.02)
        (conn,) = server.connections
        sock = conn.transport.get_extra_info("socket")
        import socket as socket_mod
        import struct
        sock.setsockopt(socket_mod.SOL_SOCKET, socket_mod.SO_LINGER, struct.pack("ii", 1, 0))
        conn.abort()  # RST
        for fut in (blocked, reading):
            with pytest.raises(aiobrpc.RpcError) as ei:
                await asyncio.wait_for(fut, 2)
            assert ei.value.code in (errors.EFAILEDSOCKET, errors.EEOF)
        await asyncio.sleep(0.05)
        await wait_until(lambda: [e[0] for e in ended] == ["failed", "closed"])
        assert [e[0] for e in ended] == ["failed", "closed"]
        assert all(s.closed and s.error is not None for s in [*iterated, with_handler, *holder.streams])
        assert server.stream_count() == 0 and channel_stream_count(channel) == 0
        await channel.close()


async def test_a_peer_that_lies_about_consumed_does_not_open_the_window():
    ctx, holder = await _server(stream_options={"max_buf_size": 1000})
    async with ctx as (server, _):
        raw = await RawClient.open(server.port)
        (stream,) = holder.streams
        await stream.write(bytes(1000))
        raw.send(streaming.feedback_frame(raw.server_id, CLIENT_ID, 1 << 40))  # "consumed" 1 TiB
        await asyncio.sleep(0.05)
        await wait_until(lambda: stream._remote_consumed == 1000)
        assert stream._remote_consumed == 1000  # never more than was sent
        await stream.write(bytes(1000))
        blocked = asyncio.ensure_future(stream.write(b"must wait"))
        await asyncio.sleep(0.05)
        assert not blocked.done()
        raw.send(streaming.feedback_frame(raw.server_id, CLIENT_ID, 1500))
        await asyncio.wait_for(blocked, 2)
        raw.close()
        await asyncio.sleep(0.05)
        await wait_until(lambda: stream.closed)
        assert stream.closed


async def test_writing_to_a_peer_that_does_not_read_is_ebadf():
    ctx, holder = await _server()
    async with ctx as (server, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        raw = RawClient(reader, writer)
        settings = streaming.encode_settings(CLIENT_ID, True, False)  # writable = false
        meta = rpc_meta("interop.EchoService", "StartStream", correlation_id=1, raw_extra=field_ld(8, settings))
        raw.send(frame(meta, Req(message="raw").SerializeToString()))
        await raw.frames(1)
        (stream,) = holder.streams
        with pytest.raises(aiobrpc.RpcError) as ei:
            await stream.write(b"x")
        assert ei.value.code == errors.EBADF
        raw.close()


async def test_a_bad_stream_settings_offer_is_refused():
    ctx, holder = await _server()
    async with ctx as (server, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        raw = RawClient(reader, writer)
        meta = rpc_meta("interop.EchoService", "StartStream", correlation_id=1, raw_extra=field_ld(8, b"\x10\x01"))
        raw.send(frame(meta, Req(message="raw").SerializeToString()))
        await raw.frames_until(lambda _: raw.events)
        (ev,) = raw.events
        assert ev.meta.error_code == errors.EREQUEST and "stream_settings" in ev.meta.error_text
        assert holder.streams == []
        raw.close()
