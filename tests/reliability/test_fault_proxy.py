"""FaultProxy on raw sockets, then each of its faults against the real aiobrpc client and server
(docs/hostile_inputs.md rows D7, E1-E3, E5-E7)."""

from __future__ import annotations

import asyncio
import os

import pytest
import pytest_asyncio

import aiobrpc
from aiobrpc import errors
from aiobrpc._proto import interop_pb2
from tests.helpers.health import wait_up
from tests.helpers.fault_proxy import FaultProxy
from tests.helpers.interop_server import SERVICE, InteropEcho

Req = interop_pb2.EchoRequest


class EchoServer:
    """A raw TCP echo server that records what it received and ends its tasks on exit."""

    def __init__(self) -> None:
        self.received = bytearray()
        self.connections = 0
        self.resets = 0
        self._tasks: set[asyncio.Task] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    async def _handle(self, reader, writer) -> None:
        self._tasks.add(asyncio.current_task())
        self.connections += 1
        try:
            while data := await reader.read(65536):
                self.received += data
                writer.write(data)
                await writer.drain()
        except ConnectionResetError:
            self.resets += 1
        except OSError:
            pass
        finally:
            self._tasks.discard(asyncio.current_task())
            writer.close()  # after what is still buffered
            try:
                await writer.wait_closed()
            except OSError:
                pass

    async def __aenter__(self) -> EchoServer:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self._server.close()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._server.wait_closed()
        await asyncio.sleep(0)


@pytest_asyncio.fixture
async def echo():
    async with EchoServer() as server:
        yield server


@pytest_asyncio.fixture
async def proxy(echo):
    p = FaultProxy(("127.0.0.1", echo.port))
    await p.start()
    yield p
    await p.close()
    assert p.active_connections == 0


async def connect(proxy):
    return await asyncio.open_connection("127.0.0.1", proxy.port)


async def read_exactly(reader, n, timeout=2.0):
    return await asyncio.wait_for(reader.readexactly(n), timeout)


async def eventually(predicate, timeout=2.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        assert loop.time() < end, "condition not reached in time"
        await asyncio.sleep(0.005)


async def close(writer) -> None:
    writer.transport.abort()
    try:
        await writer.wait_closed()  # retrieves a reset, which gc would otherwise report
    except OSError:
        pass


def open_sockets() -> int:
    # Sockets only: uvloop opens a spare /dev/null for EMFILE on its first listen, for good.
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:  # the fd of the listdir itself
            pass
    return count


# --- the proxy itself -------------------------------------------------------------------------

async def test_passthrough_and_counters(proxy, echo):
    reader, writer = await connect(proxy)
    data = os.urandom(200_000)
    writer.write(data)
    assert await read_exactly(reader, len(data)) == data
    assert proxy.bytes_up == proxy.bytes_down == len(data)
    assert proxy.connections_accepted == 1 and proxy.active_connections == 1
    writer.close()
    await writer.wait_closed()
    await eventually(lambda: proxy.active_connections == 0)
    assert echo.connections == 1


async def test_half_close_is_passed_on(proxy):
    reader, writer = await connect(proxy)
    writer.write(b"last words")
    writer.write_eof()
    assert await asyncio.wait_for(reader.read(), 2) == b"last words"  # then EOF
    await close(writer)


async def test_large_transfer_then_half_close_loses_nothing(proxy):
    reader, writer = await connect(proxy)
    data = os.urandom(4 << 20)

    async def send():
        writer.write(data)
        writer.write_eof()
        await writer.drain()
    _, echoed = await asyncio.wait_for(asyncio.gather(send(), reader.read()), 10)
    assert echoed == data and proxy.bytes_up == proxy.bytes_down == len(data)
    await eventually(lambda: proxy.active_connections == 0)
    await close(writer)


async def test_delay_applies_to_new_and_open_connections(proxy):
    loop = asyncio.get_running_loop()
    proxy.delay = 0.1
    reader, writer = await connect(proxy)
    t0 = loop.time()
    writer.write(b"ping")
    assert await read_exactly(reader, 4) == b"ping"
    assert loop.time() - t0 >= 0.19  # once each way
    proxy.delay = 0.0
    writer.write(b"pong")
    assert await read_exactly(reader, 4) == b"pong"
    await close(writer)  # undelayed: how fast is the machine's load, the delayed way is checked above


async def test_dribble_splits_into_small_writes(proxy):
    proxy.dribble, proxy.dribble_interval = 10, 0.005
    reader, writer = await connect(proxy)
    data = bytes(range(200))
    writer.write(data)
    chunks = []
    while sum(map(len, chunks)) < len(data):
        chunks.append(await asyncio.wait_for(reader.read(65536), 2))
    assert b"".join(chunks) == data
    # 20 writes of 10 bytes each way; a busy reader may see a few of them together
    assert len(chunks) >= 8 and min(map(len, chunks)) <= 10
    await close(writer)


@pytest.mark.parametrize("mode", ["reset", "close"])
async def test_cut_after_up(proxy, echo, mode):
    proxy.cut_after, proxy.cut_direction, proxy.cut_mode = 50, "up", mode
    reader, writer = await connect(proxy)
    writer.write(bytes(100))
    if mode == "reset":
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(reader.read(65536), 2)
    else:
        assert await asyncio.wait_for(reader.read(65536), 2) == b""
    await eventually(lambda: len(echo.received) == 50 and proxy.active_connections == 0)
    assert proxy.bytes_up == 50
    await close(writer)


async def test_cut_after_down_reset_after_the_request_arrived(proxy, echo):
    proxy.cut_after, proxy.cut_direction = 0, "down"
    reader, writer = await connect(proxy)
    writer.write(b"hello")
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(reader.read(65536), 2)
    assert bytes(echo.received) == b"hello" and proxy.bytes_down == 0
    await close(writer)


async def test_cut_after_down_close_keeps_the_bytes_before_the_cut(proxy):
    proxy.cut_after, proxy.cut_direction, proxy.cut_mode = 3, "down", "close"
    reader, writer = await connect(proxy)
    writer.write(b"hello")
    assert await asyncio.wait_for(reader.read(), 2) == b"hel"  # then EOF
    await close(writer)


async def test_blackhole_reads_everything_and_never_answers(proxy, echo):
    proxy.blackhole = True
    reader, writer = await connect(proxy)
    writer.write(b"anyone there?")
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(reader.read(1), 0.2)
    assert not writer.is_closing() and not reader.at_eof()
    writer.write(b"still open")
    await writer.drain()
    await eventually(lambda: proxy.bytes_discarded == 23)
    assert echo.connections == 0 and proxy.active_connections == 1
    # the proxy's close is the only way out
    await proxy.close()
    assert await asyncio.wait_for(reader.read(), 2) == b""
    await close(writer)


async def test_blackhole_on_an_open_connection(proxy, echo):
    reader, writer = await connect(proxy)
    writer.write(b"a")
    assert await read_exactly(reader, 1) == b"a"
    proxy.blackhole = True
    writer.write(b"b")
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(reader.read(1), 0.2)
    proxy.blackhole = False
    writer.write(b"c")
    assert await read_exactly(reader, 1) == b"c"
    assert bytes(echo.received) == b"ac"
    await close(writer)


async def test_refuse_then_accept_again_on_the_same_port(proxy):
    reader, writer = await connect(proxy)
    port = proxy.port
    await proxy.refuse()
    assert proxy.refusing
    with pytest.raises(ConnectionRefusedError):
        await connect(proxy)
    writer.write(b"open ones go on")
    assert await read_exactly(reader, 15) == b"open ones go on"
    await proxy.accept_again()
    assert proxy.port == port and not proxy.refusing
    r2, w2 = await connect(proxy)
    w2.write(b"x")
    assert await read_exactly(r2, 1) == b"x"
    assert proxy.connections_accepted == 2
    await close(writer)
    await close(w2)


@pytest.mark.parametrize("mode", ["reset", "close"])
async def test_cut_all(proxy, mode):
    conns = [await connect(proxy) for _ in range(3)]
    for reader, writer in conns:
        writer.write(b"hi")
        assert await read_exactly(reader, 2) == b"hi"
    proxy.cut_all(mode)
    for reader, writer in conns:
        if mode == "reset":
            with pytest.raises(ConnectionResetError):
                await asyncio.wait_for(reader.read(65536), 2)
        else:
            assert await asyncio.wait_for(reader.read(65536), 2) == b""
        await close(writer)
    await eventually(lambda: proxy.active_connections == 0)
    # the listener is untouched
    reader, writer = await connect(proxy)
    writer.write(b"ok")
    assert await read_exactly(reader, 2) == b"ok"
    await close(writer)


async def test_unreachable_upstream_closes_the_client():
    async with EchoServer() as gone:
        port = gone.port
    async with FaultProxy(("127.0.0.1", port)) as proxy:
        reader, writer = await connect(proxy)
        assert await asyncio.wait_for(reader.read(), 2) == b""
        await close(writer)


async def test_close_leaves_no_task_and_no_socket():
    tasks_before = asyncio.all_tasks()
    sockets_before = open_sockets()
    async with EchoServer() as echo:
        proxy = FaultProxy(("127.0.0.1", echo.port), delay=0.05, dribble=3)
        await proxy.start()
        conns = [await connect(proxy) for _ in range(3)]
        for _, writer in conns:
            writer.write(b"in flight")  # still queued in the proxy when it closes
        proxy.blackhole = True
        conns.append(await connect(proxy))
        await eventually(lambda: proxy.active_connections == 4)
        await proxy.close()
        assert proxy.active_connections == 0 and proxy.refusing
        for reader, writer in conns:
            await asyncio.wait_for(reader.read(), 2)
            await close(writer)
        await proxy.close()  # twice is fine
    await asyncio.sleep(0)
    assert asyncio.all_tasks() == tasks_before
    assert open_sockets() == sockets_before
    assert proxy.connections_accepted == 4


def test_faults_are_checked_when_set():
    proxy = FaultProxy(("127.0.0.1", 1))
    for name, value in [("cut_mode", "rst"), ("cut_direction", "both"), ("dribble", 0),
                        ("cut_after", -1), ("delay", -0.1)]:
        with pytest.raises(ValueError, match=name):
            setattr(proxy, name, value)


# --- the aiobrpc client and server through the proxy -------------------------------------------

@pytest_asyncio.fixture
async def brpc_proxy():
    """(proxy, servicer) in front of an aiobrpc server of the interop EchoService."""
    servicer = InteropEcho()
    server = aiobrpc.Server(aiobrpc.ServerOptions())
    server.add_service(servicer)
    await server.start("127.0.0.1:0")
    proxy = FaultProxy(("127.0.0.1", server.port))
    await proxy.start()
    yield proxy, servicer
    await proxy.close()
    await server.stop()
    await server.join(timeout=2)
    assert not server.connections


def stub_for(proxy, **opts):
    opts.setdefault("max_retry", 0)
    channel = aiobrpc.Channel(proxy.address, aiobrpc.ChannelOptions(**opts))
    return channel, aiobrpc.Stub(channel, SERVICE)


async def timed_call(stub, message="m", **cntl):
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        resp = await stub.Echo(Req(message=message), aiobrpc.Controller(**cntl))
    except aiobrpc.RpcError as e:
        return e, loop.time() - t0
    return resp, loop.time() - t0


async def test_rpc_through_delay_succeeds_later(brpc_proxy):
    proxy, _ = brpc_proxy
    channel, stub = stub_for(proxy, timeout_ms=5000)
    resp, _ = await timed_call(stub)
    assert resp.message == "m"
    proxy.delay = 0.1
    resp, elapsed = await timed_call(stub, "slow")
    assert resp.message == "slow" and 0.19 <= elapsed < 3
    await channel.close()


@pytest.mark.parametrize("mode,codes", [
    ("reset", {errors.EFAILEDSOCKET}),                 # E2
    ("close", {errors.EEOF, errors.EFAILEDSOCKET}),    # E3
])
async def test_rpc_cut_after_the_request_reached_the_server(brpc_proxy, mode, codes):
    """D7 with max_retry=0: executed once, the client sees the broken connection."""
    proxy, servicer = brpc_proxy
    proxy.cut_after, proxy.cut_direction, proxy.cut_mode = 0, "down", mode
    channel, stub = stub_for(proxy, timeout_ms=5000)
    err, elapsed = await timed_call(stub)
    assert isinstance(err, aiobrpc.RpcError) and err.code in codes, err
    assert elapsed < 4.0  # promptly, not at the 5 s deadline
    assert len(servicer.executed) == 1
    # E5: the server is marked down, the health check revives it, the next call reconnects
    proxy.cut_after = None
    assert channel.server_states() == {proxy.address: "down"}
    await wait_up(channel)
    resp, _ = await timed_call(stub)
    assert resp.message == "m" and channel.stats.connections_made == 2
    await channel.close()


async def test_rpc_into_a_blackhole_times_out_at_the_deadline(brpc_proxy):
    """E6 / F5: the connect succeeds, nothing ever answers."""
    proxy, servicer = brpc_proxy
    proxy.blackhole = True
    channel, stub = stub_for(proxy, timeout_ms=100)
    err, elapsed = await timed_call(stub)
    assert isinstance(err, aiobrpc.RpcError) and err.code == errors.ERPCTIMEDOUT, err
    assert 0.09 <= elapsed < 1.0
    assert servicer.executed == [] and channel.stats.timeouts == 1
    await channel.close()


async def test_rpc_on_a_connection_that_turns_into_a_blackhole(brpc_proxy):
    """E6: an established connection whose packets vanish times out at the deadline."""
    proxy, servicer = brpc_proxy
    channel, stub = stub_for(proxy, timeout_ms=100)
    resp, _ = await timed_call(stub)
    assert resp.message == "m"
    proxy.blackhole = True
    err, elapsed = await timed_call(stub)
    assert isinstance(err, aiobrpc.RpcError) and err.code == errors.ERPCTIMEDOUT, err
    assert 0.09 <= elapsed < 1.0
    assert len(servicer.executed) == 1 and proxy.connections_accepted == 1
    await channel.close()


async def test_rpc_refused_then_served_again(brpc_proxy):
    """E7 with a closed port, then E5: the channel is not broken for good."""
    proxy, _ = brpc_proxy
    channel, stub = stub_for(proxy, timeout_ms=2000)
    await proxy.refuse()
    err, elapsed = await timed_call(stub)
    assert isinstance(err, aiobrpc.RpcError) and err.code == errors.ECONNREFUSED, err
    assert elapsed < 1.5  # refused, not the 2 s deadline
    err, elapsed = await timed_call(stub)  # marked down: fails fast until revived
    assert isinstance(err, aiobrpc.RpcError) and err.code == errors.EHOSTDOWN, err  # fast: no connect tried
    await proxy.accept_again()
    await wait_up(channel)
    resp, _ = await timed_call(stub)
    assert resp.message == "m"
    await channel.close()


async def test_rpc_through_dribble(brpc_proxy):
    proxy, _ = brpc_proxy
    proxy.dribble, proxy.dribble_interval = 7, 0.0
    channel, stub = stub_for(proxy, timeout_ms=5000)
    resp, _ = await timed_call(stub, "x" * 300)
    assert resp.message == "x" * 300
    await channel.close()
