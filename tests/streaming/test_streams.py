"""Streams between an aiobrpc client and server: messages from 1 B to 64 MiB arrive byte-exact
and in order, many streams share a connection with unary calls, flow control holds a writer
back from a slow reader, and every stream ends exactly once whichever way it ends."""

from __future__ import annotations

import asyncio
import os

import pytest

import aiobrpc
from aiobrpc import errors
from aiobrpc._proto import interop_pb2
from tests.helpers.interop_server import running_echo
from tests.helpers.waiting import wait_until
from tests.streaming.conftest import MIB, channel_stream_count, open_stream, stream_pair


class AcceptingServicer(aiobrpc.Servicer):
    """Accepts every offered stream and keeps it in `accepted`, for the test to drive."""

    SERVICE = interop_pb2.DESCRIPTOR.services_by_name["EchoService"]

    def __init__(self) -> None:
        self.accepted: list = []

    async def StartStream(self, request, cntl):
        self.accepted.append(aiobrpc.Stream.accept(cntl))
        return interop_pb2.EchoResponse(message="ok")

Req = interop_pb2.EchoRequest


class Recorder(aiobrpc.StreamHandler):
    def __init__(self) -> None:
        self.messages: list = []
        self.batches: list = []
        self.failed: list = []
        self.closed = 0
        self.idle = 0
        self.done = asyncio.Event()

    def on_received_messages(self, stream, messages):
        self.batches.append(len(messages))
        self.messages.extend(bytes(m) for m in messages)

    def on_idle_timeout(self, stream):
        self.idle += 1

    def on_failed(self, stream, error):
        self.failed.append(error.code)

    def on_closed(self, stream):
        self.closed += 1
        self.done.set()


async def test_messages_from_1_byte_to_64_mib_echo_byte_exact_in_order(echo_pair):
    _, _, _, stub = echo_pair
    stream, _ = await open_stream(stub)
    sizes = [1, 2, 100, 4096, 65535, 65536, 65537, MIB - 1, MIB, MIB + 1, 3 * MIB + 5]
    messages = [os.urandom(n) for n in sizes]
    for m in messages:  # all written before any is read: order is the stream's, not the test's
        await stream.write(m)
    for m in messages:
        got = await asyncio.wait_for(stream.read(), 10)
        assert bytes(got) == m
    big = os.urandom(64 * MIB)
    await stream.write(big)
    got = await asyncio.wait_for(stream.read(), 30)
    assert len(got) == len(big) and got == big
    await stream.close()
    assert await stream.read() is None


async def test_segments_of_long_messages_are_received_in_their_place(echo_pair):
    """After the first message in segments, the connection receives segments straight into
    the message's buffer (an mmap, reused): long messages come out as views of it, byte-exact,
    with single-frame and tiny messages in between as before."""
    import mmap

    from aiobrpc.protocol.placement import PlacingDecoder
    _, _, channel, stub = echo_pair
    stream, _ = await open_stream(stub)
    [conn] = [c for p in channel.pools.values() for c in p.connections]
    assert type(conn.decoder) is not PlacingDecoder  # nothing in segments yet: the plain decoder
    sizes = [5, 2 * MIB + 3, MIB, 70_000, 3 * MIB, 1, 5 * MIB + 1]
    messages = [os.urandom(n) for n in sizes]
    got = []
    for m in messages:  # one at a time: more than both windows would wait for a reader
        await stream.write(m)
        got.append(await asyncio.wait_for(stream.read(), 10))
    assert [bytes(g) for g in got] == messages
    assert type(conn.decoder) is PlacingDecoder and conn.streams.placing
    placed = [type(g.obj) is mmap.mmap for g in got]
    assert placed[4] and placed[6] and not placed[0] and not placed[2]  # the echoed long ones
    await stream.close()


async def test_any_buffer_is_a_message(echo_pair):
    np = pytest.importorskip("numpy")
    _, _, _, stub = echo_pair
    stream, _ = await open_stream(stub)
    arr = np.arange(1000, dtype=np.float64)
    await stream.write(arr)
    await stream.write(bytearray(b"ba"))
    await stream.write(memoryview(b"xyz")[1:])
    assert np.array_equal(np.frombuffer(await stream.read(), dtype=np.float64), arr)
    assert bytes(await stream.read()) == b"ba"
    assert bytes(await stream.read()) == b"yz"
    with pytest.raises(TypeError, match="buffer"):
        await stream.write("text")
    with pytest.raises(ValueError, match="C-contiguous"):
        await stream.write(np.zeros((4, 4))[:, 0])
    await stream.close()


async def test_many_streams_on_one_connection_beside_unary_calls(echo_pair):
    server, _, channel, stub = echo_pair
    streams = []
    for _ in range(4):
        cntl = aiobrpc.Controller()
        streams += aiobrpc.Stream.create_many(cntl, 5)
        await stub.StartStream(Req(message="many"), cntl)
    assert server.stream_count() == 20 and channel_stream_count(channel) == 20

    async def talk(i, stream):
        for k in range(30):
            await stream.write(f"{i}:{k}".encode() + bytes(k * 1000))
        for k in range(30):
            assert bytes(await stream.read()) == f"{i}:{k}".encode() + bytes(k * 1000)
        await stream.close()

    async def unary(i):
        return (await stub.Echo(Req(message=str(i)))).message

    results = await asyncio.gather(*[talk(i, s) for i, s in enumerate(streams)],
                                   *[unary(i) for i in range(100)])
    assert results[20:] == [str(i) for i in range(100)]
    assert channel.connection_count() == 1
    await asyncio.sleep(0.05)
    await wait_until(lambda: server.stream_count() == 0 and channel_stream_count(channel) == 0)
    assert server.stream_count() == 0 and channel_stream_count(channel) == 0


async def test_messages_that_arrived_together_are_read_without_a_loop_turn(echo_pair):
    _, _, _, stub = echo_pair
    stream, _ = await open_stream(stub)
    for i in range(50):
        await stream.write(b"m%d" % i)
    await asyncio.sleep(0.1)  # all echoed and received
    turns = 0

    def tick():
        nonlocal turns
        turns += 1
    handle = asyncio.get_running_loop().call_soon(tick)
    got = [bytes(await stream.read()) for _ in range(50)]
    assert turns == 0
    handle.cancel()
    assert got == [b"m%d" % i for i in range(50)]
    await stream.close()


async def test_writes_in_one_loop_turn_go_in_one_send(echo_pair):
    _, _, channel, stub = echo_pair
    stream, _ = await open_stream(stub)
    conn = channel._conn
    flushes = []
    flush = conn._flush

    def spy():
        if conn._out:
            flushes.append(len(conn._out))
        flush()
    conn._flush = spy
    try:
        for i in range(20):
            await stream.write(b"x" * 10)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    finally:
        del conn._flush
    assert flushes == [40]  # 20 frames of (header+meta, payload), one writelines
    for _ in range(20):
        await stream.read()
    await stream.close()


async def test_writes_before_the_call_are_sent_after_it_in_order(echo_pair):
    _, _, _, stub = echo_pair
    cntl = aiobrpc.Controller()
    stream = aiobrpc.Stream.create(cntl, max_buf_size=1000)
    await stream.write(b"early-1")
    await stream.write(b"early-2")
    await stream.write(bytes(2000))  # passes the window by one message, as brpc allows
    with pytest.raises(aiobrpc.RpcError) as ei:
        await stream.write(b"no room")  # waiting could never end: the call is not made yet
    assert ei.value.code == errors.EAGAIN
    await stub.StartStream(Req(message="x"), cntl)
    assert [bytes(await stream.read()) for _ in range(3)] == [b"early-1", b"early-2", bytes(2000)]
    await stream.close()


async def test_a_slow_reader_holds_the_writer_back():
    """The writer waits for the window; the reader never holds more than window + one message."""
    held = []

    class Slow(aiobrpc.StreamHandler):
        async def on_received_messages(self, stream, messages):
            held.append(stream._unconsumed)
            await asyncio.sleep(0.002)

    class Servicer(aiobrpc.Servicer):
        SERVICE = interop_pb2.DESCRIPTOR.services_by_name["EchoService"]

        async def StartStream(self, request, cntl):
            aiobrpc.Stream.accept(cntl, handler=Slow(), messages_in_batch=1)
            return interop_pb2.EchoResponse(message="ok")

    async with running_echo(servicer=Servicer()) as (server, _):
        channel = aiobrpc.Channel(server.address)
        stub = aiobrpc.Stub(channel, Servicer.SERVICE)
        stream, _ = await open_stream(stub, max_buf_size=2 * MIB)
        message = bytes(MIB)
        rss0 = _rss()
        peak = 0
        for _ in range(64):
            await stream.write(message)
            assert stream.produced - stream._remote_consumed <= 3 * MIB
            peak = max(peak, _rss() - rss0)
        assert max(held) <= 3 * MIB
        assert peak < 48 * MIB, peak
        await stream.close()
        await channel.close()


class _HandlerServicer(aiobrpc.Servicer):
    SERVICE = interop_pb2.DESCRIPTOR.services_by_name["EchoService"]

    def __init__(self, handler, **options) -> None:
        self.handler = handler
        self.options = options
        self.streams: list = []

    async def StartStream(self, request, cntl):
        self.streams.append(aiobrpc.Stream.accept(cntl, handler=self.handler, **self.options))
        return interop_pb2.EchoResponse(message="ok")


async def test_a_plain_handler_runs_without_a_task_and_an_async_one_one_batch_at_a_time():
    """A plain on_received_messages is called from a loop callback: no task exists for the
    stream while messages flow. An async one is awaited before the next batch is handed over:
    batches never overlap, and they keep the stream's order."""
    order: list = []
    running = [0]
    overlap = []

    class Plain(Recorder):
        def on_received_messages(self, stream, messages):
            super().on_received_messages(stream, messages)
            order.extend(t.get_coro().__qualname__ for t in asyncio.all_tasks())

    class Async(Recorder):
        async def on_received_messages(self, stream, messages):
            running[0] += 1
            overlap.append(running[0])
            await asyncio.sleep(0.001)
            super().on_received_messages(stream, messages)
            running[0] -= 1

    for handler in (Plain(), Async()):
        servicer = _HandlerServicer(handler, messages_in_batch=2)
        async with running_echo(servicer=servicer) as (server, _):
            channel = aiobrpc.Channel(server.address)
            stub = aiobrpc.Stub(channel, servicer.SERVICE)
            stream, _ = await open_stream(stub)
            sent = [b"m%d" % i for i in range(40)]
            for m in sent:
                await stream.write(m)
            await stream.close()
            await asyncio.wait_for(handler.done.wait(), 5)
            assert handler.messages == sent
            assert max(handler.batches) <= 2
            assert handler.closed == 1 and handler.failed == []
            if isinstance(handler, Plain):
                assert order and not [name for name in order if name.startswith("Stream.")]
            await channel.close()
    assert overlap and max(overlap) == 1


async def test_cancelling_an_async_handler_resets_the_stream_once():
    started = asyncio.Event()

    class Stuck(Recorder):
        async def on_received_messages(self, stream, messages):
            started.set()
            await asyncio.sleep(3600)

    handler = Stuck()
    servicer = _HandlerServicer(handler)
    async with running_echo(servicer=servicer) as (server, _):
        channel = aiobrpc.Channel(server.address)
        stub = aiobrpc.Stub(channel, servicer.SERVICE)
        stream, _ = await open_stream(stub)
        await stream.write(b"x")
        await asyncio.wait_for(started.wait(), 5)
        (peer,) = servicer.streams
        peer._handler_task.cancel()
        await asyncio.wait_for(handler.done.wait(), 5)
        assert handler.failed == [errors.ECANCELED] and handler.closed == 1
        assert peer.closed and peer.error.code == errors.ECANCELED
        with pytest.raises(aiobrpc.RpcError) as ei:  # the client got the RST
            await asyncio.wait_for(stream.read(), 5)
        assert ei.value.code == errors.ECONNRESET
        await asyncio.sleep(0.01)
        await wait_until(lambda: peer._handler_task is None and server.stream_count() == 0)
        assert peer._handler_task is None and server.stream_count() == 0
        await channel.close()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def test_the_window_blocks_and_feedback_reopens_it():
    servicer = AcceptingServicer()
    accepted = servicer.accepted
    async with running_echo(servicer=servicer) as (server, _):
        channel = aiobrpc.Channel(server.address)
        stub = aiobrpc.Stub(channel, AcceptingServicer.SERVICE)
        stream, _ = await open_stream(stub, max_buf_size=1000)
        await stream.write(bytes(600))
        await stream.write(bytes(600))  # 600 < 1000: accepted, now 1200 outstanding
        blocked = asyncio.ensure_future(stream.write(b"third"))
        await asyncio.sleep(0.05)
        assert not blocked.done()
        assert len(await accepted[0].read()) == 600  # consumed: FEEDBACK 600 -> 1200 < 1600
        await asyncio.wait_for(blocked, 2)
        await stream.close()
        assert [len(await accepted[0].read()) for _ in range(2)] == [600, 5]
        assert await accepted[0].read() is None
        await channel.close()


async def test_close_by_the_client_ends_both_ends_once(echo_pair):
    server, servicer, channel, stub = echo_pair
    handler = Recorder()
    stream, _ = await open_stream(stub, handler=handler)
    await stream.write(b"a")
    await stream.write(b"b")
    while len(handler.messages) < 2:
        await asyncio.sleep(0.01)
    await stream.close()
    await stream.close()  # idempotent
    await asyncio.wait_for(handler.done.wait(), 2)
    assert handler.messages == [b"a", b"b"] and handler.closed == 1 and handler.failed == []
    await asyncio.sleep(0.05)
    (peer,) = servicer.streams
    assert peer.closed and peer.error is None
    assert not servicer.stream_tasks
    with pytest.raises(aiobrpc.RpcError) as ei:
        await stream.write(b"late")
    assert ei.value.code == errors.ECONNRESET
    assert server.stream_count() == 0 and channel_stream_count(channel) == 0


async def test_close_by_the_server_ends_the_clients_reader_and_writer():
    servicer = AcceptingServicer()
    accepted = servicer.accepted
    async with running_echo(servicer=servicer) as (server, _):
        channel = aiobrpc.Channel(server.address)
        stub = aiobrpc.Stub(channel, AcceptingServicer.SERVICE)
        stream, _ = await open_stream(stub, max_buf_size=10)
        await accepted[0].write(b"last words")
        await stream.write(bytes(100))
        blocked = asyncio.ensure_future(stream.write(b"waits for the window"))
        await asyncio.sleep(0.02)
        await accepted[0].close()
        with pytest.raises(aiobrpc.RpcError) as ei:
            await asyncio.wait_for(blocked, 2)
        assert ei.value.code == errors.ECONNRESET
        assert bytes(await stream.read()) == b"last words"  # received before the close: still read
        assert await stream.read() is None
        assert stream.closed and stream.error is None
        await asyncio.sleep(0.02)
        await wait_until(lambda: server.stream_count() == 0 and channel_stream_count(channel) == 0)
        assert server.stream_count() == 0 and channel_stream_count(channel) == 0
        await channel.close()


async def test_the_handler_form_gets_batches_then_on_closed(echo_pair):
    _, _, _, stub = echo_pair
    handler = Recorder()
    stream, _ = await open_stream(stub, handler=handler, messages_in_batch=4)
    for i in range(20):
        await stream.write(b"%d" % i)
    while len(handler.messages) < 20:
        await asyncio.sleep(0.01)
    assert handler.messages == [b"%d" % i for i in range(20)]
    assert max(handler.batches) <= 4
    with pytest.raises(RuntimeError, match="handler"):
        await stream.read()
    await stream.close()
    await asyncio.wait_for(handler.done.wait(), 2)
    assert handler.closed == 1


async def test_a_stream_the_server_does_not_accept_fails_the_call(echo_pair):
    server, servicer, channel, stub = echo_pair
    handler = Recorder()
    cntl = aiobrpc.Controller()
    stream = aiobrpc.Stream.create(cntl, handler=handler)
    with pytest.raises(aiobrpc.RpcError) as ei:
        await stub.Echo(Req(message="no streams here"), cntl)  # Echo never accepts
    assert ei.value.code == errors.EREQUEST and "didn't accept the stream" in ei.value.text
    assert stream.closed and stream.error.code == errors.EREQUEST
    with pytest.raises(aiobrpc.RpcError) as ei:
        await stream.write(b"x")
    assert ei.value.code == errors.EREQUEST
    assert handler.failed == [errors.EREQUEST] and handler.closed == 1
    assert (await stub.Echo(Req(message="kept"))).message == "kept"


async def test_a_failed_call_fails_its_streams_with_its_error(echo_pair):
    _, servicer, channel, stub = echo_pair
    cntl = aiobrpc.Controller()
    streams = aiobrpc.Stream.create_many(cntl, 2)
    with pytest.raises(aiobrpc.RpcError) as ei:
        await stub.StartStream(Req(message="x", fail_code=1234, fail_text="no"), cntl)
    assert ei.value.code == 1234
    for s in streams:
        assert s.closed and s.error.code == 1234
        with pytest.raises(aiobrpc.RpcError):
            await s.read()
    assert servicer.streams == []


async def test_a_call_that_times_out_fails_its_streams_and_the_late_offer_is_reset(echo_pair):
    server, servicer, channel, stub = echo_pair
    cntl = aiobrpc.Controller(timeout_ms=50)
    stream = aiobrpc.Stream.create(cntl)
    with pytest.raises(aiobrpc.RpcError) as ei:
        await stub.StartStream(Req(message="slow", sleep_ms=200), cntl)
    assert ei.value.code == errors.ERPCTIMEDOUT
    assert stream.error.code == errors.ERPCTIMEDOUT
    await asyncio.sleep(0.4)  # the server accepted, answered, and got an RST back
    (late,) = servicer.streams
    assert late.closed and late.error.code == errors.ECONNRESET
    assert server.stream_count() == 0 and channel_stream_count(channel) == 0


async def test_a_call_with_streams_is_never_retried_nor_backed_up(echo_pair):
    server, servicer, channel, stub = echo_pair
    cntl = aiobrpc.Controller(max_retry=3, backup_request_ms=10)
    stream = aiobrpc.Stream.create(cntl)
    await stub.StartStream(Req(message="once", sleep_ms=50), cntl)
    assert not cntl.has_backup_request and servicer.calls_served == 1
    await stream.close()


async def test_a_stream_serves_one_call_only(echo_pair):
    _, _, _, stub = echo_pair
    cntl = aiobrpc.Controller()
    stream = aiobrpc.Stream.create(cntl)
    await stub.StartStream(Req(message="1"), cntl)
    with pytest.raises(ValueError, match="already has streams"):
        cntl._streams = [stream]
        aiobrpc.Stream.create(cntl)
    with pytest.raises(aiobrpc.RpcError) as ei:
        await stub.StartStream(Req(message="2"), cntl)  # the same stream again
    assert ei.value.code == errors.EREQUEST
    cntl._streams = None
    await stream.close()


async def test_accept_misuse_is_a_clear_error(echo_pair):
    with pytest.raises(ValueError, match="offers no stream"):
        aiobrpc.Stream.accept(aiobrpc.Controller())
    with pytest.raises(ValueError, match="messages_in_batch"):
        aiobrpc.Stream.create(aiobrpc.Controller(), messages_in_batch=0)
    with pytest.raises(ValueError, match="idle_timeout_ms"):
        aiobrpc.Stream.create(aiobrpc.Controller(), idle_timeout_ms=-5)
    with pytest.raises(TypeError, match="on_received_messages"):
        aiobrpc.Stream.create(aiobrpc.Controller(), handler=object())
    with pytest.raises(ValueError, match="n must be"):
        aiobrpc.Stream.create_many(aiobrpc.Controller(), 0)


async def test_accept_from_a_thread_handler_is_refused():
    errors_seen = []

    class Servicer(aiobrpc.Servicer):
        SERVICE = interop_pb2.DESCRIPTOR.services_by_name["EchoService"]

        def StartStream(self, request, cntl):  # a plain def: runs in the thread pool
            try:
                aiobrpc.Stream.accept(cntl)
            except RuntimeError as e:
                errors_seen.append(str(e))
            return interop_pb2.EchoResponse(message="ok")

    async with running_echo(servicer=Servicer()) as (server, _):
        channel = aiobrpc.Channel(server.address)
        stub = aiobrpc.Stub(channel, Servicer.SERVICE)
        cntl = aiobrpc.Controller()
        aiobrpc.Stream.create(cntl)
        with pytest.raises(aiobrpc.RpcError) as ei:
            await stub.StartStream(Req(message="x"), cntl)
        assert ei.value.code == errors.EREQUEST
        assert errors_seen and "event loop" in errors_seen[0]
        await channel.close()


async def test_two_readers_at_once_is_an_error(echo_pair):
    _, _, _, stub = echo_pair
    stream, _ = await open_stream(stub)
    first = asyncio.ensure_future(stream.read())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="already reading"):
        await stream.read()
    await stream.write(b"one")
    assert bytes(await first) == b"one"
    await stream.close()


async def test_a_cancelled_reader_and_writer_leave_the_stream_usable(echo_pair):
    _, _, _, stub = echo_pair
    stream, _ = await open_stream(stub)
    reader = asyncio.ensure_future(stream.read())
    await asyncio.sleep(0)
    reader.cancel()
    await asyncio.gather(reader, return_exceptions=True)
    await stream.write(b"after")
    assert bytes(await asyncio.wait_for(stream.read(), 2)) == b"after"
    async with stream:
        pass  # closes
    assert stream.closed


async def test_writers_waiting_for_the_window_write_in_their_order_and_cancels_pass_the_turn():
    servicer = AcceptingServicer()
    async with running_echo(servicer=servicer) as (server, _):
        channel = aiobrpc.Channel(server.address)
        stub = aiobrpc.Stub(channel, AcceptingServicer.SERVICE)
        stream, _ = await open_stream(stub, max_buf_size=1000)
        (peer,) = servicer.accepted
        await stream.write(bytes(1200))  # the window is full now
        writers = {i: asyncio.ensure_future(stream.write(bytes([i]) * 100)) for i in range(1, 6)}
        await asyncio.sleep(0.01)
        assert not any(w.done() for w in writers.values())
        writers[2].cancel()  # waiting for its turn: it leaves the queue
        await asyncio.gather(writers[2], return_exceptions=True)
        got = [len(await asyncio.wait_for(peer.read(), 2))]  # the FEEDBACK opens the window
        for _ in range(4):
            got.append(bytes(await asyncio.wait_for(peer.read(), 2))[:1])
        assert got == [1200, b"\x01", b"\x03", b"\x04", b"\x05"]
        await asyncio.gather(*(writers[i] for i in (1, 3, 4, 5)))
        assert not stream._writer_busy

        # A writer handed the turn and cancelled before it ran passes the turn on.
        stream._writer_busy = True  # as if a write were waiting for the window
        second = asyncio.ensure_future(stream.write(b"second"))
        third = asyncio.ensure_future(stream.write(b"third"))
        await asyncio.sleep(0)
        stream._next_writer()  # the turn goes to `second`...
        second.cancel()  # ...which is cancelled before it runs
        await asyncio.wait_for(third, 2)
        assert second.cancelled()
        assert bytes(await asyncio.wait_for(peer.read(), 2)) == b"third"
        assert not stream._writer_busy and not stream._write_turns
        await stream.close()
        await channel.close()


async def test_a_late_wrapped_response_resets_every_stream_it_offers(echo_pair):
    server, servicer, channel, stub = echo_pair
    cntl = aiobrpc.Controller(timeout_ms=50)
    streams = aiobrpc.Stream.create_many(cntl, 3)
    with pytest.raises(aiobrpc.RpcError) as ei:
        await stub.StartStream(Req(message="slow", sleep_ms=200), cntl)
    assert ei.value.code == errors.ERPCTIMEDOUT
    assert all(s.error.code == errors.ERPCTIMEDOUT for s in streams)
    await asyncio.sleep(0.4)  # the server accepted all three and answered: each gets an RST
    late = servicer.streams
    assert len(late) == 3
    assert all(s.closed and s.error.code == errors.ECONNRESET for s in late)
    assert server.stream_count() == 0 and channel_stream_count(channel) == 0
    assert channel.stats.late_or_unknown_responses == 1
