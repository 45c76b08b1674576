"""The client's failure rules, proved against in-process servers (brpc's docs/en/client.md,
docs/hostile_inputs.md D5, D7, D8, D12): what is retried and where, what never is, backoff, the
retry throttle, the one deadline over all attempts, cancellation.

Every server counts the executions of its handler by request message; the assertions are on
those server-side counts (exact) and on the controller's `attempts`. Timing bounds are
generous: the tests run on asyncio and uvloop, on both codec twins, also on a loaded machine.
The backup request has its own file, test_backup_requests.py, which reuses the scaffolding
below (`Cluster`, `cluster`).
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import socket
import struct
import weakref
from collections import Counter
from dataclasses import dataclass

import pytest
import pytest_asyncio

import aiobrpc
from aiobrpc import errors
from aiobrpc._proto import interop_pb2
from aiobrpc.client import channel as channel_module
from aiobrpc.client.call import Call
from tests.helpers.interop_server import SERVICE
from tests.helpers.waiting import wait_until

Req = interop_pb2.EchoRequest
Resp = interop_pb2.EchoResponse
ECHO = f"{SERVICE.full_name}/Echo"  # "interop.EchoService/Echo"
assert ECHO == "interop.EchoService/Echo"


# -- scaffolding ------------------------------------------------------------------------------
@dataclass
class Run:
    """One execution of a handler: what, when (loop time), with which correlation id."""
    message: str
    n: int  # the n-th execution of this message over the whole cluster (1-based)
    t: float
    cid: int
    timeout_ms: int | None


class Scripted(aiobrpc.Servicer):
    """interop.EchoService whose Echo runs `script(srv, request, cntl, n)` (async), n being the
    cluster-wide execution number of `request.message`. The script may sleep, wait on an event,
    raise RpcError, call cntl.close_connection(), or return a response; returning None answers
    "<address>|<message>"."""

    SERVICE = SERVICE

    def __init__(self, srv: Srv) -> None:
        self.srv = srv

    async def Echo(self, request, cntl):
        srv = self.srv
        shared = srv.cluster.executions
        shared[request.message] += 1
        n = shared[request.message]
        srv.runs.append(Run(request.message, n, asyncio.get_running_loop().time(),
                            cntl.correlation_id, cntl.timeout_ms))
        if srv.script is not None:
            resp = await srv.script(srv, request, cntl, n)
            if resp is not None:
                return resp
        return Resp(message=f"{srv.address}|{request.message}")

    async def StartStream(self, request, cntl):
        raise aiobrpc.RpcError(errors.EREQUEST, "not used")


class Srv:
    """One in-process server of a Cluster."""

    def __init__(self, cluster: Cluster, script, server_options: aiobrpc.ServerOptions) -> None:
        self.cluster = cluster
        self.script = script
        self.runs: list[Run] = []
        self.server = aiobrpc.Server(server_options)
        self.server.add_service(Scripted(self))
        self.port = 0
        self.address = ""

    def count(self, message: str | None = None) -> int:
        """Executions of the handler here (of `message`, or of all)."""
        return sum(1 for r in self.runs if message is None or r.message == message)


class Cluster:
    """Servers and channels of one test, all closed at its end (events released first)."""

    def __init__(self) -> None:
        self.servers: list[Srv] = []
        self.channels: list[aiobrpc.Channel] = []
        self.raw: list = []
        self.events: list[asyncio.Event] = []
        self.executions: Counter = Counter()  # by message, over every server

    async def start(self, script=None, **server_options) -> Srv:
        server_options.setdefault("server_tag", "t")
        srv = Srv(self, script, aiobrpc.ServerOptions(**server_options))
        await srv.server.start("127.0.0.1:0")
        srv.port = srv.server.port
        srv.address = f"127.0.0.1:{srv.port}"
        self.servers.append(srv)
        return srv

    async def start_many(self, n: int, script=None, **server_options) -> list[Srv]:
        return [await self.start(script, **server_options) for _ in range(n)]

    def event(self) -> asyncio.Event:
        ev = asyncio.Event()
        self.events.append(ev)
        return ev

    def channel(self, targets, **options) -> tuple[aiobrpc.Channel, aiobrpc.Stub]:
        """A channel to one server ("host:port") or to several (list:// and rr). `targets` are
        Srv objects or "host:port" strings. Retries are not throttled unless asked."""
        options.setdefault("retry_throttle", None)
        addresses = [t if isinstance(t, str) else t.address for t in targets]
        opts = aiobrpc.ChannelOptions(**options)
        if len(addresses) == 1:
            channel = aiobrpc.Channel(addresses[0], opts)
        else:
            channel = aiobrpc.Channel("list://" + ",".join(addresses), opts, load_balancer="rr")
        self.channels.append(channel)
        return channel, aiobrpc.Stub(channel, SERVICE)

    def total(self, message: str | None = None) -> int:
        return sum(s.count(message) for s in self.servers)

    async def close(self) -> None:
        for ev in self.events:
            ev.set()
        for channel in self.channels:
            await channel.close()
        for srv in self.servers:
            await srv.server.stop()
        await asyncio.gather(*(srv.server.join(timeout=1) for srv in self.servers))
        for raw in self.raw:
            await raw.close()


@pytest_asyncio.fixture
async def cluster():
    c = Cluster()
    yield c
    await c.close()


def closed_port() -> int:
    """A port on 127.0.0.1 nobody listens on (bound, then closed): connecting is refused."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class RstServer:
    """Accepts connections and resets each (RST) at once, or after the first bytes arrived."""

    def __init__(self, after_data: bool) -> None:
        self.after_data = after_data
        self.connects = 0
        self.received = 0
        self._server = None
        self.address = ""

    async def _handle(self, reader, writer) -> None:
        self.connects += 1
        if self.after_data:
            try:
                data = await reader.read(65536)
            except OSError:
                data = b""
            self.received += len(data)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    async def start(self) -> RstServer:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def close(self) -> None:
        self._server.close()
        await self._server.wait_closed()


async def fails(coro) -> aiobrpc.RpcError:
    with pytest.raises(aiobrpc.RpcError) as ei:
        await coro
    return ei.value


def fail_with(code: int, text: str = "busy"):
    async def script(srv, request, cntl, n):
        raise aiobrpc.RpcError(code, text)
    return script


async def close_after_running(srv, request, cntl, n):
    """The handler ran, then the connection is closed instead of answering (D7)."""
    cntl.close_connection("the reply is lost")


def sides(cntl) -> list[str]:
    return [a.remote_side for a in cntl.attempts]


# -- D7: non-idempotent work is never repeated ------------------------------------------------
@pytest.mark.parametrize("how", ["channel", "controller"])
async def test_non_idempotent_call_is_not_retried_after_the_handler_ran(cluster, how):
    a, b = await cluster.start_many(2, close_after_running)
    if how == "channel":
        channel, stub = cluster.channel([a, b], max_retry=3, non_idempotent_methods={ECHO})
        cntl = aiobrpc.Controller()
    else:
        channel, stub = cluster.channel([a, b], max_retry=3)
        cntl = aiobrpc.Controller()
        cntl.idempotent = False
    err = await fails(stub.Echo(Req(message="once"), cntl))
    assert err.code in (errors.EEOF, errors.EFAILEDSOCKET)
    assert cntl.error_code == err.code and cntl.retried_count == 0
    await asyncio.sleep(0.03)  # a retry, if any, would have run by now
    await wait_until(lambda: cluster.total("once") == 1)
    assert cluster.total("once") == 1  # executed exactly once although another server is up
    assert len(cntl.attempts) == 1 and cntl.attempts[0].error_code == err.code
    assert channel.stats.retries == 0 and channel.pending_calls() == 0


async def test_idempotent_call_is_retried_on_the_other_server_after_a_lost_reply(cluster):
    async def close_first(srv, request, cntl, n):
        if n == 1:
            cntl.close_connection("the reply is lost")

    a, b = await cluster.start_many(2, close_first)
    _channel, stub = cluster.channel([a, b], max_retry=3)
    cntl = aiobrpc.Controller()
    resp = await stub.Echo(Req(message="twice"), cntl)
    first, second = cntl.attempts
    assert first.error_code == errors.EEOF and second.error_code == 0
    assert first.remote_side != second.remote_side  # the lost server is excluded
    assert resp.message == f"{second.remote_side}|twice"
    assert cntl.retried_count == 1 and cntl.remote_side == second.remote_side
    assert cluster.total("twice") == 2 <= 1 + 3
    assert a.count() == 1 and b.count() == 1


# -- never retried ------------------------------------------------------------------------------
class RetryEverything(aiobrpc.RetryPolicy):
    """A policy that says yes to everything, ERPCTIMEDOUT and ECANCELED included."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[int] = []

    def do_retry(self, cntl) -> bool:
        self.asked.append(cntl.error_code)
        return True


@pytest.mark.parametrize("policy", [None, "retry-everything"])
async def test_deadline_is_never_retried(cluster, policy):
    release = cluster.event()

    async def park(srv, request, cntl, n):
        await release.wait()

    a, b = await cluster.start_many(2, park)
    retry_policy = RetryEverything() if policy else None
    _channel, stub = cluster.channel([a, b], max_retry=3, timeout_ms=50, retry_policy=retry_policy)
    cntl = aiobrpc.Controller()
    err = await fails(stub.Echo(Req(message="slow"), cntl))
    assert err.code == errors.ERPCTIMEDOUT and cntl.retried_count == 0
    await asyncio.sleep(0.03)
    await wait_until(lambda: cluster.total("slow") == 1 and len(cntl.attempts) == 1)
    assert cluster.total("slow") == 1 and len(cntl.attempts) == 1
    assert retry_policy is None or retry_policy.asked == []
    release.set()


@pytest.mark.parametrize("code", [errors.ERPCTIMEDOUT, errors.EREQUEST, errors.ECANCELED])
@pytest.mark.parametrize("policy", [None, "retry-everything"])
async def test_codes_answered_by_the_server_that_are_never_retried(cluster, code, policy):
    """ERPCTIMEDOUT (a deadline downstream), EREQUEST, ECANCELED end the call even when another
    server is up and a custom policy says yes."""
    a, b = await cluster.start_many(2, fail_with(code, "no"))
    retry_policy = RetryEverything() if policy else None
    _channel, stub = cluster.channel([a, b], max_retry=3, retry_policy=retry_policy)
    cntl = aiobrpc.Controller()
    err = await fails(stub.Echo(Req(message="m"), cntl))
    assert err.code == code and cntl.retried_count == 0
    assert err.text == f"[t][E{code}]no"  # one attempt: the server's text as it came
    assert cluster.total("m") == 1
    assert retry_policy is None or retry_policy.asked == []


async def test_request_that_cannot_be_serialized_is_never_sent(cluster):
    a, b = await cluster.start_many(2)
    channel, stub = cluster.channel([a, b], max_retry=3, retry_policy=RetryEverything())
    cntl = aiobrpc.Controller()
    err = await fails(stub.Echo(Req(), cntl))  # the required `message` is missing
    assert err.code == errors.EREQUEST and cntl.retried_count == 0
    assert cluster.total() == 0 and channel.stats.connections_made == 0


class RetryFirstSuccess(aiobrpc.RetryPolicy):
    """Retries a first attempt that succeeded (brpc's docs/en/client.md: a custom policy may retry
    successful calls; the response is then discarded). brpc asks the policy on success too:
    `if ((!_error_code && _retry_policy == NULL) || nretry >= max_retry) goto END_OF_RPC`."""

    def do_retry(self, cntl) -> bool:
        if cntl.error_code == 0:
            return cntl.retried_count == 0
        return super().do_retry(cntl)


async def test_custom_policy_may_retry_a_success(cluster):
    srv = await cluster.start()
    _, stub = cluster.channel([srv], max_retry=3, retry_policy=RetryFirstSuccess())
    cntl = aiobrpc.Controller()
    await stub.Echo(Req(message="x"), cntl)
    assert srv.count() == 2 and cntl.retried_count == 1


# -- refused by the server: the handler did not run, so even non-idempotent work is retried ----
@pytest.mark.parametrize("code", [errors.ELIMIT, errors.ELOGOFF, errors.EOVERCROWDED])
async def test_refusals_are_retried_on_another_server_even_if_non_idempotent(cluster, code):
    refusing = await cluster.start(fail_with(code, "refused"))
    good = await cluster.start()
    channel, stub = cluster.channel([refusing, good], max_retry=3, non_idempotent_methods={ECHO})
    retried = 0
    for i in range(2):  # rr alternates: one of two calls picks `refusing` first
        cntl = aiobrpc.Controller()
        resp = await stub.Echo(Req(message=f"m{i}"), cntl)
        assert resp.message == f"{good.address}|m{i}"
        if cntl.retried_count:
            retried += 1
            assert [(a.remote_side, a.error_code) for a in cntl.attempts] == [
                (refusing.address, code), (good.address, 0)]
    assert retried >= 1 and refusing.count() == retried
    assert good.count("m0") == 1 and good.count("m1") == 1
    if code == errors.ELOGOFF:
        assert channel.server_states()[refusing.address] == "logged off"


async def test_server_at_max_concurrency_answers_elimit_without_running_the_handler(cluster):
    release = cluster.event()

    async def park_first(srv, request, cntl, n):
        if request.message == "occupy":
            await release.wait()

    full = await cluster.start(park_first, max_concurrency=1)
    good = await cluster.start(park_first)
    _, occupier = cluster.channel([full], max_retry=0, timeout_ms=5000)
    occupy = asyncio.ensure_future(occupier.Echo(Req(message="occupy")))
    while full.count("occupy") == 0:
        await asyncio.sleep(0.005)
    _channel, stub = cluster.channel([full, good], max_retry=3, non_idempotent_methods={ECHO})
    refused = 0
    for i in range(2):
        cntl = aiobrpc.Controller()
        assert (await stub.Echo(Req(message=f"m{i}"), cntl)).message == f"{good.address}|m{i}"
        if cntl.retried_count:
            refused += 1
            assert [(a.remote_side, a.error_code) for a in cntl.attempts] == [
                (full.address, errors.ELIMIT), (good.address, 0)]
    assert refused >= 1
    assert full.count() == 1 and full.server.stats.failed_requests == refused  # never ran
    assert good.count("m0") == good.count("m1") == 1
    release.set()
    await occupy


async def test_stopping_server_answers_elogoff_and_the_call_moves_on(cluster):
    stopping, good = await cluster.start_many(2)
    channel, stub = cluster.channel([stopping, good], max_retry=3, non_idempotent_methods={ECHO})
    await channel.connect()  # the connection to `stopping` stays open while it stops
    await stopping.server.stop()
    moved = 0
    for i in range(2):
        cntl = aiobrpc.Controller()
        assert (await stub.Echo(Req(message=f"m{i}"), cntl)).message == f"{good.address}|m{i}"
        if cntl.retried_count:
            moved += 1
            assert [(a.remote_side, a.error_code) for a in cntl.attempts] == [
                (stopping.address, errors.ELOGOFF), (good.address, 0)]
    assert moved == 1  # logged off: not picked again
    assert stopping.count() == 0 and good.count() == 2
    assert channel.server_states()[stopping.address] == "logged off"


# -- where retries go ---------------------------------------------------------------------------
async def test_retries_go_to_another_server(cluster):
    bad = await cluster.start(fail_with(errors.ELIMIT))
    good = await cluster.start_many(2)
    _channel, stub = cluster.channel([bad, *good], max_retry=3)
    retried = 0
    for i in range(3):  # every server is some call's first pick
        cntl = aiobrpc.Controller()
        await stub.Echo(Req(message=f"m{i}"), cntl)
        if cntl.retried_count:
            retried += 1
            first, second = cntl.attempts
            assert (first.remote_side, first.error_code) == (bad.address, errors.ELIMIT)
            assert second.remote_side in (good[0].address, good[1].address) and second.error_code == 0
            assert cntl.remote_side == second.remote_side
    assert retried >= 1 and bad.count() == retried
    assert sum(g.count() for g in good) == 3


async def test_excluded_servers_are_not_retried_while_others_are_available(cluster):
    servers = await cluster.start_many(3, fail_with(errors.ELIMIT))
    _channel, stub = cluster.channel(servers, max_retry=2)
    cntl = aiobrpc.Controller()
    err = await fails(stub.Echo(Req(message="x"), cntl))
    assert err.code == errors.ELIMIT and cntl.retried_count == 2
    assert sorted(sides(cntl)) == sorted(s.address for s in servers)  # each once
    assert [s.count() for s in servers] == [1, 1, 1]
    # One more retry than servers: the last attempt goes to an excluded one (last chance).
    cntl = aiobrpc.Controller(max_retry=3)
    await fails(stub.Echo(Req(message="y"), cntl))
    tried = sides(cntl)
    assert len(tried) == 4 and len(set(tried[:3])) == 3 and tried[3] in tried[:3]
    assert cluster.total("y") == 4


# -- D8: a retry storm stays bounded -------------------------------------------------------------
async def test_every_server_refusing_connections(cluster):
    ports = [closed_port() for _ in range(3)]
    channel, stub = cluster.channel([f"127.0.0.1:{p}" for p in ports], max_retry=3, timeout_ms=500)
    cntl = aiobrpc.Controller()
    err = await fails(stub.Echo(Req(message="x"), cntl))
    assert err.code != errors.ERPCTIMEDOUT  # refusals are fast: the attempts never waited for the deadline
    assert len(cntl.attempts) == 4 == 1 + cntl.retried_count  # max_retry + 1
    refused = cntl.attempts[:3]
    assert all(a.error_code == errors.ECONNREFUSED for a in refused)
    assert len({a.remote_side for a in refused}) == 3  # each server once
    # Every server is now down (health checks running): the last retry finds none.
    assert err.code == cntl.attempts[3].error_code == errors.EHOSTDOWN
    assert set(channel.server_states().values()) == {"down"}


@pytest.mark.parametrize("after_data", [False, True], ids=["rst-on-accept", "rst-after-request"])
async def test_every_server_resetting_connections(cluster, after_data):
    raw = [await RstServer(after_data).start() for _ in range(3)]
    cluster.raw += raw
    _channel, stub = cluster.channel([r.address for r in raw], max_retry=3, timeout_ms=500)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    cntl = aiobrpc.Controller()
    err = await fails(stub.Echo(Req(message="x"), cntl))
    elapsed = loop.time() - t0
    # A reset connection fails its attempt at once (even one reset before the request could be
    # written), so the storm ends long before the deadline.
    assert err.code != errors.ERPCTIMEDOUT, (err, elapsed, cntl.attempts)
    assert len(cntl.attempts) == 4 == 1 + cntl.retried_count
    assert len({a.remote_side for a in cntl.attempts[:3]}) == 3
    assert err.code == errors.EHOSTDOWN
    assert sum(r.connects for r in raw) == 3  # one connection per server, no storm


async def test_fixed_backoff_spaces_the_attempts(cluster):
    srv = await cluster.start(fail_with(errors.ELIMIT))
    _channel, stub = cluster.channel(
        [srv], max_retry=3, timeout_ms=2000,
        retry_policy=aiobrpc.FixedBackoffRetryPolicy(backoff_ms=20))
    cntl = aiobrpc.Controller()
    await fails(stub.Echo(Req(message="x"), cntl))
    times = [r.t for r in srv.runs]
    assert len(times) == 4 and cntl.retried_count == 3
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert all(0.019 <= g < 0.2 for g in gaps), gaps  # 1 ms of slack for timer granularity


async def test_retry_throttle_stops_retries_of_a_failing_cluster(cluster):
    servers = await cluster.start_many(3, fail_with(errors.ELIMIT))
    throttle = aiobrpc.RetryThrottle(max_tokens=4, token_ratio=0.5)
    channel, stub = cluster.channel(servers, max_retry=3, retry_throttle=throttle)
    attempts = []
    for i in range(3):
        cntl = aiobrpc.Controller()
        await fails(stub.Echo(Req(message=f"m{i}"), cntl))
        attempts.append(len(cntl.attempts))
    # tokens 4 -> 3 (retry allowed: 3 > 2) -> 2 (throttled) -> 1 -> 0: two attempts, then one.
    assert attempts == [2, 1, 1]
    assert cluster.total() == 4 and channel.stats.retries == 1
    assert channel.stats.retries_throttled == 3 and throttle.tokens == 0


async def test_default_channel_options_throttle_retries():
    opts = aiobrpc.ChannelOptions()
    assert isinstance(opts.retry_throttle, aiobrpc.RetryThrottle)
    assert aiobrpc.ChannelOptions().retry_throttle is not opts.retry_throttle


# -- backoff and the deadline --------------------------------------------------------------------
class RecordingBackoff(aiobrpc.RetryPolicy):
    """Asks for `backoff` ms before every retry and records what it was told."""

    def __init__(self, backoff_ms: float) -> None:
        super().__init__()
        self.backoff = backoff_ms
        self.remaining: list[float] = []

    def backoff_ms(self, cntl, remaining_ms: float) -> float:
        self.remaining.append(remaining_ms)
        return self.backoff


def fail_first(code: int):
    async def script(srv, request, cntl, n):
        if n == 1:
            raise aiobrpc.RpcError(code, "first fails")
    return script


@pytest.mark.parametrize("backoff_ms,applied", [(30, True), (1000, False)])
async def test_backoff_is_applied_only_if_shorter_than_the_remaining_time(cluster, backoff_ms, applied):
    srv = await cluster.start(fail_first(errors.ELIMIT))
    policy = RecordingBackoff(backoff_ms)
    _channel, stub = cluster.channel([srv], max_retry=3, timeout_ms=300, retry_policy=policy)
    cntl = aiobrpc.Controller()
    await stub.Echo(Req(message="x"), cntl)
    assert cntl.retried_count == 1 and len(policy.remaining) == 1
    assert 200 < policy.remaining[0] <= 300
    gap = srv.runs[1].t - srv.runs[0].t
    if applied:
        assert 0.029 <= gap < 0.25
    else:  # a backoff past the deadline is skipped: the retry goes at once (not after 1 s)
        assert gap < 0.1


async def test_deadline_covers_retries_and_backoff(cluster):
    hang = cluster.event()

    async def fail_then_hang(srv, request, cntl, n):
        if n == 1:
            raise aiobrpc.RpcError(errors.ELIMIT, "first fails")
        await hang.wait()

    srv = await cluster.start(fail_then_hang)
    _channel, stub = cluster.channel([srv], max_retry=3, timeout_ms=120,
                                    retry_policy=RecordingBackoff(50))
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    cntl = aiobrpc.Controller()
    err = await fails(stub.Echo(Req(message="x"), cntl))
    elapsed = loop.time() - t0
    assert err.code == errors.ERPCTIMEDOUT and "Reached timeout=120ms" in err.text
    assert elapsed >= 0.115  # at the deadline, never before (how late is the machine's load)
    assert srv.count() == 2 and cntl.retried_count == 1
    assert srv.runs[1].t - srv.runs[0].t >= 0.049
    await asyncio.sleep(0.05)
    await wait_until(lambda: srv.count() == 2)
    assert srv.count() == 2  # nothing after the deadline


# -- per-call settings ---------------------------------------------------------------------------
@pytest.mark.parametrize("channel_retry,call_retry,attempts", [(3, 1, 2), (3, 0, 1), (0, 2, 3), (1, None, 2)])
async def test_controller_max_retry_overrides_the_channel(cluster, channel_retry, call_retry, attempts):
    servers = await cluster.start_many(3, fail_with(errors.ELIMIT))
    _channel, stub = cluster.channel(servers, max_retry=channel_retry)
    cntl = aiobrpc.Controller(max_retry=call_retry)
    await fails(stub.Echo(Req(message="x"), cntl))
    assert len(cntl.attempts) == attempts and cntl.retried_count == attempts - 1
    assert cluster.total() == attempts


async def test_error_text_of_a_retried_call(cluster):
    srv = await cluster.start(fail_with(errors.ELIMIT, "busy"))
    _channel, stub = cluster.channel([srv], max_retry=2)
    single = await fails(stub.Echo(Req(message="a"), aiobrpc.Controller(max_retry=0)))
    text = single.text
    assert text == "[t][E2004]busy"
    cntl = aiobrpc.Controller()
    err = await fails(stub.Echo(Req(message="b"), cntl))
    assert err.code == errors.ELIMIT
    assert err.text == f"[E2004]{text} [R1-R2] same"  # the retries failed as the first attempt
    assert cntl.error_text == err.text and cntl.error_code == errors.ELIMIT


async def test_error_text_keeps_each_attempts_code(cluster):
    async def varied(srv, request, cntl, n):
        raise aiobrpc.RpcError(errors.ELIMIT if n == 1 else errors.EINTERNAL, f"try {n}")

    srv = await cluster.start(varied)
    _channel, stub = cluster.channel([srv], max_retry=3)
    err = await fails(stub.Echo(Req(message="x")))
    # EINTERNAL is not retryable: two attempts, the call ends with the last code.
    assert err.code == errors.EINTERNAL
    assert err.text == "[E2004][t][E2004]try 1 [R1][E2001][t][E2001]try 2"


# -- cancellation -------------------------------------------------------------------------------
async def test_cancelling_the_caller_ends_the_call(cluster):
    release = cluster.event()

    async def park(srv, request, cntl, n):
        if request.message == "parked":
            await release.wait()

    srv = await cluster.start(park)
    channel, stub = cluster.channel([srv], max_retry=3, timeout_ms=120, backup_request_ms=60)
    await stub.Echo(Req(message="warm"))
    task = asyncio.ensure_future(stub.Echo(Req(message="parked")))
    while srv.count("parked") == 0:
        await asyncio.sleep(0.002)
    assert channel.pending_calls() == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert channel.pending_calls() == 0 and channel.stats.cancelled == 1
    conn = channel._conn
    release.set()
    await asyncio.sleep(0.02)
    await wait_until(lambda: channel.stats.late_or_unknown_responses == 1)
    assert channel.stats.late_or_unknown_responses == 1  # the reply came and was dropped
    await asyncio.sleep(0.15)  # past the backup delay and the deadline: no timer fires
    await wait_until(lambda: srv.count("parked") == 1 and channel.stats.backup_requests == 0)
    assert srv.count("parked") == 1 and channel.stats.backup_requests == 0
    assert channel.stats.timeouts == 0 and channel.stats.cancelled == 1
    assert (await stub.Echo(Req(message="after"))).message == f"{srv.address}|after"
    assert channel._conn is conn and channel.stats.connections_made == 1


async def test_cancelling_during_a_backoff_cancels_the_retry(cluster):
    srv = await cluster.start(fail_with(errors.ELIMIT))
    channel, stub = cluster.channel([srv], max_retry=3, timeout_ms=1000,
                                    retry_policy=aiobrpc.FixedBackoffRetryPolicy(backoff_ms=60))
    task = asyncio.ensure_future(stub.Echo(Req(message="x")))
    while srv.count() == 0:
        await asyncio.sleep(0.002)
    await asyncio.sleep(0.01)  # the failure is back, the retry waits for its backoff
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert channel.stats.cancelled == 1 and channel.pending_calls() == 0
    await asyncio.sleep(0.1)
    await wait_until(lambda: srv.count() == 1 and channel.stats.retries == 1)
    assert srv.count() == 1 and channel.stats.retries == 1  # the retry never went


async def test_cancelling_while_connecting(cluster):
    srv = await cluster.start()
    channel, stub = cluster.channel([srv], max_retry=3, timeout_ms=1000)
    task = asyncio.ensure_future(stub.Echo(Req(message="x")))
    await asyncio.sleep(0)  # the call started its connect
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.02)
    await wait_until(lambda: srv.count() == 0 and channel.stats.cancelled == 1 and channel.pending_calls() == 0)
    assert srv.count() == 0 and channel.stats.cancelled == 1 and channel.pending_calls() == 0
    assert (await stub.Echo(Req(message="y"))).message == f"{srv.address}|y"


# -- D5: the deadline with a late reply -----------------------------------------------------------
async def test_timeout_with_a_late_reply(cluster, monkeypatch):
    calls: list = []

    class TrackedCall(Call):  # a subclass without __slots__ can be weakly referenced
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            calls.append(weakref.ref(self))

    monkeypatch.setattr(channel_module, "Call", TrackedCall)
    release = cluster.event()

    async def park(srv, request, cntl, n):
        if request.message == "late":
            await release.wait()

    srv = await cluster.start(park)
    channel, stub = cluster.channel([srv], max_retry=3, timeout_ms=50)
    await stub.Echo(Req(message="warm"))
    conn = channel._conn
    loop = asyncio.get_running_loop()
    refs = []

    async def timed_out_call():
        cntl = aiobrpc.Controller()
        refs.append(weakref.ref(cntl))
        t0 = loop.time()
        try:
            await stub.Echo(Req(message="late"), cntl)
        except aiobrpc.RpcError as e:
            return e.code, e.text, loop.time() - t0, cntl.retried_count
        return None

    code, text, elapsed, retried = await asyncio.ensure_future(timed_out_call())
    assert code == errors.ERPCTIMEDOUT and text == f"Reached timeout=50ms @{srv.address}"
    assert elapsed >= 0.045 and retried == 0  # never early; how late is the machine's load
    assert channel.pending_calls() == 0 and channel.stats.timeouts == 1
    gc.collect()
    assert refs[0]() is None  # nothing keeps the timed-out call's controller...
    assert len(calls) == 2 and all(ref() is None for ref in calls)  # ...nor the call
    release.set()
    await asyncio.sleep(0.02)
    await wait_until(lambda: channel.stats.late_or_unknown_responses == 1 and srv.count("late") == 1)
    assert channel.stats.late_or_unknown_responses == 1 and srv.count("late") == 1
    assert (await stub.Echo(Req(message="again"))).message == f"{srv.address}|again"
    assert channel._conn is conn and channel.stats.connections_made == 1


# -- D12: the deadline travels to the server --------------------------------------------------------
async def test_request_meta_carries_the_remaining_time(cluster):
    srv = await cluster.start()
    _channel, stub = cluster.channel([srv], timeout_ms=800, deliver_timeout_ms=True)
    await stub.Echo(Req(message="x"))
    assert 0 < srv.runs[0].timeout_ms <= 800
    _channel2, stub2 = cluster.channel([srv], timeout_ms=800)
    await stub2.Echo(Req(message="y"))
    assert srv.runs[1].timeout_ms is None  # not sent unless asked (brpc's default)


async def test_server_answers_once_when_its_deadline_passed(cluster):
    async def slow(srv, request, cntl, n):
        await asyncio.sleep(0.08)

    srv = await cluster.start(slow)
    channel, stub = cluster.channel([srv], timeout_ms=40, max_retry=3, deliver_timeout_ms=True)
    err = await fails(stub.Echo(Req(message="x")))
    assert err.code == errors.ERPCTIMEDOUT
    assert srv.count() == 1 and 0 < srv.runs[0].timeout_ms <= 40
    await asyncio.sleep(0.1)
    # One late reply (or none, if the server skips an expired handler), never two.
    assert channel.stats.late_or_unknown_responses <= 1
    assert srv.server.stats.requests == 1
