"""Connection types seen from the server (brpc's docs/en/client.md): single, pooled and short connections,
the pool's limits and idle timeout, a timed-out pooled call's connection, credentials on every
new connection, and ChannelOptions' checks.

Connect timeouts (docs/hostile_inputs.md E6, a SYN dropped) need a kernel that drops packets; they
are covered by tests/reliability/test_netns_faults.py. A listening socket with a full backlog
is not a dependable stand-in on loopback, so it is not used here.
"""

from __future__ import annotations

import asyncio
import socket

import pytest
import pytest_asyncio

import aiobrpc
from aiobrpc import errors
from aiobrpc._proto import interop_pb2
from tests.helpers.interop_server import SERVICE, InteropEcho, running_echo

Req = interop_pb2.EchoRequest


@pytest_asyncio.fixture
async def echo():
    """(server, servicer) of the interop EchoService on an ephemeral port."""
    async with running_echo() as pair:
        yield pair


def stub_for(server, **opts):
    opts.setdefault("max_retry", 0)
    opts.setdefault("timeout_ms", 2000)
    channel = aiobrpc.Channel(f"127.0.0.1:{server.port}", aiobrpc.ChannelOptions(**opts))
    return channel, aiobrpc.Stub(channel, SERVICE)


async def until(predicate, timeout: float = 1.0) -> None:
    """Wait for `predicate()` to hold (what the server sees happens a few loop turns later)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        if loop.time() > end:
            raise AssertionError(f"not true within {timeout}s: {predicate.__doc__ or predicate}")
        await asyncio.sleep(0.005)


async def echo_all(stub, n: int, sleep_ms: int = 0, tag: str = ""):
    results = await asyncio.gather(*[stub.Echo(Req(message=f"{tag}{i}", sleep_ms=sleep_ms)) for i in range(n)])
    assert [r.message for r in results] == [f"{tag}{i}" for i in range(n)]
    return results


# --- single ------------------------------------------------------------------------------------

async def test_single_pipelines_every_call_on_one_connection(echo):
    server, servicer = echo
    channel, stub = stub_for(server)
    await echo_all(stub, 20, sleep_ms=20)
    await echo_all(stub, 20)
    assert server.stats.connections_accepted == 1 and channel.connection_count() == 1
    assert sorted(servicer.executed) == list(range(1, 41))  # one connection's correlation ids
    await channel.close()
    await until(lambda: not server.connections)


# --- pooled ------------------------------------------------------------------------------------

async def test_pooled_one_call_per_connection_then_reused(echo):
    server, servicer = echo
    channel, stub = stub_for(server, connection_type="pooled")
    pool = channel._single
    n = 8
    await echo_all(stub, n, sleep_ms=30, tag="a")
    # n calls at once need n connections: a pooled connection carries one request at a time.
    assert server.stats.connections_accepted == n and len(server.connections) == n
    assert servicer.executed == [1] * n  # each connection's first request
    assert pool.idle_count() == n and channel.connection_count() == n
    await echo_all(stub, n, sleep_ms=30, tag="b")
    assert server.stats.connections_accepted == n and channel.stats.connections_made == n  # all reused
    assert servicer.executed[n:] == [2] * n  # each connection's second request
    for i in range(5):  # sequential calls take one idle connection and give it back
        assert (await stub.Echo(Req(message=f"s{i}"))).message == f"s{i}"
    assert server.stats.connections_accepted == n and pool.idle_count() == n
    await channel.close()
    await until(lambda: not server.connections)


async def test_pooled_idle_connections_beyond_the_pool_size_are_closed(echo):
    server, _ = echo
    channel, stub = stub_for(server, connection_type="pooled", max_connection_pool_size=3)
    await echo_all(stub, 8, sleep_ms=30)
    assert server.stats.connections_accepted == 8
    assert channel._single.idle_count() == 3
    await until(lambda: len(server.connections) == 3)
    assert channel.connection_count() == 3
    await echo_all(stub, 3, sleep_ms=10)
    assert server.stats.connections_accepted == 8  # the three kept ones served these
    await channel.close()
    await until(lambda: not server.connections)


async def test_pooled_pool_size_zero_closes_every_connection_after_its_call(echo):
    server, _ = echo
    channel, stub = stub_for(server, connection_type="pooled", max_connection_pool_size=0)
    await echo_all(stub, 3, sleep_ms=10)
    await echo_all(stub, 3, sleep_ms=10)
    assert server.stats.connections_accepted == 6 and channel._single.idle_count() == 0
    await until(lambda: not server.connections)
    await channel.close()


async def test_pooled_idle_connections_close_after_the_idle_timeout(echo):
    server, _ = echo
    timeout = 0.4
    channel, stub = stub_for(server, connection_type="pooled", pool_idle_timeout_s=timeout)
    pool = channel._single
    loop = asyncio.get_running_loop()
    await echo_all(stub, 4, sleep_ms=10)
    assert pool.idle_count() == 4 and len(server.connections) == 4
    first_sweep = pool._idle_timer.when()  # armed by the first release: its time + the timeout
    # A connection used again before the first sweep is idle since then: that sweep keeps it.
    await asyncio.sleep(0.1)
    assert (await stub.Echo(Req(message="again"))).message == "again"
    since = pool._idle[-1][1]
    assert since < first_sweep  # it was back in the pool before the first sweep (else this tests nothing)
    await until(lambda: len(server.connections) == 1, timeout=10)
    assert loop.time() >= first_sweep - 0.002  # the others closed at their timeout, not before
    assert pool.idle_count() == 1 and server.stats.connections_accepted == 4
    # The next sweep is armed for the kept connection's own timeout, not a whole timeout after the first.
    assert pool._idle_timer.when() == pytest.approx(since + timeout, abs=0.002)
    await until(lambda: not server.connections, timeout=10)
    assert loop.time() >= since + timeout - 0.002
    assert pool.idle_count() == 0 and channel.connection_count() == 0
    # A new call after the pool emptied connects again.
    assert (await stub.Echo(Req(message="new"))).message == "new"
    assert server.stats.connections_accepted == 5
    await channel.close()


async def test_pooled_timed_out_call_closes_its_connection(echo):
    """A reply still in flight must never answer the next call (brpc's docs/en/client.md)."""
    server, servicer = echo
    channel, stub = stub_for(server, connection_type="pooled")
    await stub.Echo(Req(message="warm"))
    assert channel._single.idle_count() == 1
    with pytest.raises(aiobrpc.RpcError) as ei:
        await stub.Echo(Req(message="slow", sleep_ms=150), aiobrpc.Controller(timeout_ms=40))
    assert ei.value.code == errors.ERPCTIMEDOUT
    assert channel._single.idle_count() == 0  # not returned to the pool...
    await until(lambda: channel.connection_count() == 0)  # ...but closed (at once: the idle timeout is far)
    server_conn = next(iter(server.connections))
    await until(lambda: server_conn.eof)  # the server saw the FIN
    # The next calls get a new connection and their own replies, also once the slow
    # handler has answered into the closed connection.
    assert (await stub.Echo(Req(message="mine"))).message == "mine"
    assert server.stats.connections_accepted == 2
    await until(lambda: server_conn not in server.connections)
    assert servicer.calls_served == 3
    results = await echo_all(stub, 3, tag="later")
    assert all(r.message.startswith("later") for r in results)
    assert channel.stats.late_or_unknown_responses == 0
    await channel.close()


async def test_pooled_cancelled_call_closes_its_connection(echo):
    server, _ = echo
    channel, stub = stub_for(server, connection_type="pooled")
    task = asyncio.ensure_future(stub.Echo(Req(message="c", sleep_ms=150)))
    await until(lambda: len(server.connections) == 1)
    await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await until(lambda: not server.connections)
    assert (await stub.Echo(Req(message="next"))).message == "next"
    assert server.stats.connections_accepted == 2 and channel.pending_calls() == 0
    await channel.close()


async def test_pooled_connection_closed_by_the_server_is_not_reused(echo):
    server, _ = echo
    channel, stub = stub_for(server, connection_type="pooled")
    await echo_all(stub, 2, sleep_ms=10)
    for conn in list(server.connections):
        conn.close()
    await until(lambda: channel.connection_count() == 0)
    await echo_all(stub, 2, sleep_ms=10)
    assert server.stats.connections_accepted == 4
    assert channel.server_states() == {f"127.0.0.1:{server.port}": "up"}  # not a server failure
    await channel.close()


# --- short -------------------------------------------------------------------------------------

async def test_short_a_new_connection_per_call_closed_after_it(echo):
    server, servicer = echo
    channel, stub = stub_for(server, connection_type="short")
    for i in range(5):
        assert (await stub.Echo(Req(message=str(i)))).message == str(i)
        await until(lambda: not server.connections)  # the server sees it close
        assert server.stats.connections_accepted == i + 1
    await echo_all(stub, 6, sleep_ms=10)
    assert server.stats.connections_accepted == 11
    assert servicer.executed == [1] * 11  # every connection carried exactly one request
    await until(lambda: not server.connections and channel.connection_count() == 0)
    await channel.close()


@pytest.mark.parametrize("how", ["elimit", "eof"])
async def test_short_retries_use_new_connections(echo, how):
    server, servicer = echo
    channel, stub = stub_for(server, connection_type="short", max_retry=2)
    req = Req(message="r", fail_code=errors.ELIMIT, fail_text="busy") if how == "elimit" \
        else Req(message="r", close_connection=True)
    cntl = aiobrpc.Controller()
    with pytest.raises(aiobrpc.RpcError) as ei:
        await stub.Echo(req, cntl)
    assert ei.value.code == (errors.ELIMIT if how == "elimit" else errors.EEOF)
    text = ei.value.text  # two retries: told apart, or once when they failed alike
    assert cntl.retried_count == 2 and ("[R1-R2]" in text or ("[R1]" in text and "[R2]" in text)), text
    assert server.stats.connections_accepted == 3 and servicer.executed == [1, 1, 1]
    await until(lambda: not server.connections)
    # a short connection's EOF is not a server failure
    assert channel.server_states() == {f"127.0.0.1:{server.port}": "up"}
    await channel.close()


async def test_controller_overrides_the_connection_type(echo):
    server, _ = echo
    channel, stub = stub_for(server)  # single
    await echo_all(stub, 3)
    cntl = aiobrpc.Controller()
    cntl.connection_type = "short"
    await stub.Echo(Req(message="s"), cntl)
    assert server.stats.connections_accepted == 2
    await until(lambda: len(server.connections) == 1)  # the short one closed, the single kept
    await channel.close()


@pytest.mark.parametrize("ctype", ["pooled", "short"])
async def test_connect_makes_a_connection_of_the_channels_type(echo, ctype):
    """connect() on a pooled/short channel opens no single connection: one that the server
    closed would mark the server failed although no call uses it."""
    server, _ = echo
    channel, stub = stub_for(server, connection_type=ctype)
    await channel.connect()
    assert channel._single.single is None and server.stats.connections_accepted == 1
    if ctype == "pooled":
        assert channel._single.idle_count() == 1
        assert (await stub.Echo(Req(message="warm"))).message == "warm"
        assert server.stats.connections_accepted == 1  # the connected one served it
    await until(lambda: len(server.connections) == (ctype == "pooled"))
    for conn in list(server.connections):
        conn.close()  # e.g. the server's idle timeout
    await until(lambda: channel.connection_count() == 0)
    assert channel.server_states() == {f"127.0.0.1:{server.port}": "up"}
    assert (await stub.Echo(Req(message="after"))).message == "after"
    await channel.close()


@pytest.mark.parametrize("ctype", ["single", "pooled", "short"])
async def test_connect_to_a_closed_port_raises_and_marks_the_server_down(ctype):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    channel = aiobrpc.Channel(f"127.0.0.1:{port}", aiobrpc.ChannelOptions(connection_type=ctype))
    with pytest.raises(aiobrpc.RpcError) as ei:
        await channel.connect()
    assert ei.value.code == errors.ECONNREFUSED
    assert channel.server_states() == {f"127.0.0.1:{port}": "down"}
    await channel.close()


# --- auth --------------------------------------------------------------------------------------

class Auth:
    def __init__(self):
        self.calls = 0
        self.peers: list[str] = []

    async def verify_credential(self, credential, peer):
        self.calls += 1
        self.peers.append(peer)
        return credential == b"secret"


class Cred:
    def __init__(self):
        self.generated = 0

    def generate_credential(self):
        self.generated += 1
        return b"secret"


@pytest_asyncio.fixture
async def auth_server():
    auth = Auth()
    server = aiobrpc.Server(aiobrpc.ServerOptions(auth=auth))
    servicer = InteropEcho()
    server.add_service(servicer)
    await server.start("127.0.0.1:0")
    yield server, auth
    await server.stop()
    await server.join(timeout=2)


@pytest.mark.parametrize("ctype", ["pooled", "short"])
async def test_every_new_connection_sends_the_credential_first(auth_server, ctype):
    server, auth = auth_server
    cred = Cred()
    channel, stub = stub_for(server, connection_type=ctype, auth=cred)
    # A connection whose first request lacked the credential would fail with ERPCAUTH.
    for round_ in range(2):
        results = await echo_all(stub, 4, sleep_ms=20, tag=f"r{round_}")
        assert all(r.authentication_data == b"secret" for r in results)
    made = server.stats.connections_accepted
    assert made == (4 if ctype == "pooled" else 8)
    assert auth.calls == made and cred.generated == made
    assert len(set(auth.peers)) == made  # once per connection
    await channel.close()


# --- options -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    ({"connection_type": "pool"}, r"connection_type must be one of \('single', 'pooled', 'short'\), got 'pool'"),
    ({"connection_type": None}, "connection_type must be one of"),
    ({"max_connection_pool_size": -1}, "max_connection_pool_size must be an int >= 0, got -1"),
    ({"max_connection_pool_size": 1.5}, "max_connection_pool_size must be an int"),
    ({"pool_idle_timeout_s": 0}, "pool_idle_timeout_s must be a number of seconds > 0, got 0"),
    ({"pool_idle_timeout_s": "1"}, "pool_idle_timeout_s must be a number of seconds"),
    ({"health_check_interval_s": -1.0}, "health_check_interval_s must be a number of seconds > 0"),
    ({"health_check_interval_s": True}, "health_check_interval_s must be a number of seconds"),
    ({"connect_timeout_ms": -2}, r"connect_timeout_ms must be -1 or an int in 0..2147483647, got -2"),
    ({"connect_timeout_ms": 0.5}, "connect_timeout_ms must be -1 or an int"),
    ({"health_check_timeout_ms": 1 << 31}, "health_check_timeout_ms must be -1 or an int"),
])
def test_channel_options_errors_are_clear(kwargs, match):
    with pytest.raises(ValueError, match=match):
        aiobrpc.ChannelOptions(**kwargs)


def test_channel_rejects_a_non_options_object():
    with pytest.raises(TypeError, match="options must be a ChannelOptions, got dict"):
        aiobrpc.Channel("127.0.0.1:1", {"connection_type": "pooled"})
