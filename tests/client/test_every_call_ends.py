"""Every call ends (issue 15): with its result or an error, never silence; a user callback that
raises fails only the call it served, with a clear error, and never reaches the loop.

Calls use timeout_ms=-1 (where the deadline is not what is tested) under asyncio.wait_for(.., 5):
a call that would never end fails the test in seconds. Scaffolding from test_call_rules.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import warnings

import numpy as np
import pytest
import pytest_asyncio
import uvloop

import aiobrpc
from aiobrpc import errors
from aiobrpc.client import channel as channel_module
from aiobrpc.client import pool as pool_module
from aiobrpc.client.lb import RoundRobinLoadBalancer, register_load_balancer
from aiobrpc.client.naming import ServerNode
from tests.client.test_call_rules import Cluster, Req, fails
from tests.client.test_naming_seam import QueueNaming
from tests.helpers.interop_server import SERVICE, running_echo

HANG = 5  # seconds: a call still running by then would never have ended


@pytest_asyncio.fixture
async def cluster():
    c = Cluster()
    yield c
    await c.close()


def ends(coro):
    return asyncio.wait_for(coro, HANG)


async def until(predicate, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + HANG
    while not predicate():
        assert loop.time() < deadline, f"waited {HANG}s for {what}"
        await asyncio.sleep(0.002)


def hold_until(event: asyncio.Event, message: str = "slow"):
    async def script(srv, request, cntl, n):
        if request.message == message:
            await event.wait()
    return script


# -- the connect step: whatever ends it ends the calls waiting for it --------------------------
class FirstCredentialBlocks:
    """The first connect's credential never comes; the others' at once."""

    def __init__(self) -> None:
        self.asked = 0

    async def generate_credential(self):
        self.asked += 1
        if self.asked == 1:
            await asyncio.Event().wait()
        return b"secret"


async def test_a_server_removed_while_connecting_fails_over(cluster):
    """Its connect is stopped: the calls waiting for it are told (and retried elsewhere)."""
    a, b = await cluster.start_many(2)
    QueueNaming.instances.clear()
    cred = FirstCredentialBlocks()
    channel = aiobrpc.Channel("testqueue://x", aiobrpc.ChannelOptions(timeout_ms=-1, auth=cred), load_balancer="rr")
    [naming] = QueueNaming.instances
    naming.updates.put_nowait([ServerNode("127.0.0.1", a.port)])
    cntl = aiobrpc.Controller()
    call = asyncio.ensure_future(aiobrpc.Stub(channel, SERVICE).Echo(Req(message="x"), cntl))
    await until(lambda: cred.asked == 1, "the connect to the first server")
    naming.updates.put_nowait([ServerNode("127.0.0.1", b.port)])
    assert (await ends(call)).message == f"{b.address}|x"
    assert [at.error_code for at in cntl.attempts] == [errors.EFAILEDSOCKET, 0]
    await channel.close()


async def test_a_connect_that_raises_anything_ends_the_call(cluster, monkeypatch, caplog):
    async def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(pool_module, "open_connection", broken)
    channel, stub = cluster.channel(["127.0.0.1:1"], timeout_ms=-1)
    err = await ends(fails(stub.Echo(Req(message="x"))))
    assert err.code == errors.EINTERNAL and err.text == "Internal error of the call: RuntimeError('boom')"
    assert [r.exc_info[0] for r in caplog.records if r.levelno == logging.ERROR] == [RuntimeError]


class LateWheel(channel_module.TimerWheel):
    """The channel's timers fire 20 ms late: the connect's own wait sees the deadline first."""

    def add(self, when: float, entry) -> int:
        return super().add(when + 0.02, entry)


@pytest.mark.parametrize("late_timer", [False, True])
async def test_calls_that_time_out_while_connecting_are_counted_as_timeouts(cluster, monkeypatch, late_timer):
    """Whichever sees the deadline first (the shared connect's wait or the call's timer), the
    call ends with ERPCTIMEDOUT and `stats.timeouts` counts it (CI once saw 19,750 of 20,000)."""
    if late_timer:
        monkeypatch.setattr(channel_module, "TimerWheel", LateWheel)
    srv = await cluster.start()
    cred = BlockedCredential()
    channel, stub = cluster.channel([srv], timeout_ms=30, auth=cred)
    results = await ends(asyncio.gather(*[stub.Echo(Req(message=f"c{i}")) for i in range(50)],
                                        return_exceptions=True))
    assert {getattr(r, "code", r) for r in results} == {errors.ERPCTIMEDOUT}
    assert channel.stats.timeouts == 50 and channel.pending_calls() == 0
    await channel.close()


# -- closing the channel ends its calls at once, without retries ---------------------------------
class BlockedCredential:
    """A credential generator that never finishes: the connect stays in flight."""

    def __init__(self) -> None:
        self.asked = 0

    async def generate_credential(self):
        self.asked += 1
        await asyncio.Event().wait()


async def test_close_ends_the_calls_waiting_for_the_connect(cluster):
    srv = await cluster.start()
    cred = BlockedCredential()
    channel, stub = cluster.channel([srv], timeout_ms=-1, auth=cred)
    calls = [asyncio.ensure_future(stub.Echo(Req(message=f"c{i}"))) for i in range(3)]
    await until(lambda: cred.asked == 1, "the connect")
    await channel.close()
    for call in calls:
        err = await ends(fails(call))
        assert err.code == errors.EFAILEDSOCKET and "closed" in err.text
    assert channel.stats.retries == 0 and cred.asked == 1


async def test_close_ends_the_calls_waiting_for_the_first_server_list():
    QueueNaming.instances.clear()
    channel = aiobrpc.Channel("testqueue://never", aiobrpc.ChannelOptions(timeout_ms=-1), load_balancer="rr")
    call = asyncio.ensure_future(aiobrpc.Stub(channel, SERVICE).Echo(Req(message="x")))
    await until(lambda: channel._first_list is not None, "the wait for the list")
    await channel.close()
    err = await ends(fails(call))
    assert err.code == errors.EHOSTDOWN and "closed" in err.text


async def test_close_ends_the_calls_in_flight_without_retrying(cluster):
    release = cluster.event()
    srv = await cluster.start(hold_until(release))
    channel, stub = cluster.channel([srv], timeout_ms=-1, max_retry=3)
    cntls = [aiobrpc.Controller() for _ in range(5)]
    calls = [asyncio.ensure_future(stub.Echo(Req(message="slow"), cntl)) for cntl in cntls]
    await until(lambda: srv.count("slow") == 5, "the calls to reach the server")
    await channel.close()
    for call, cntl in zip(calls, cntls):
        err = await ends(fails(call))
        assert err.code == errors.EFAILEDSOCKET and "closed" in err.text
        assert cntl.retried_count == 0
    assert channel.stats.retries == 0


async def test_close_ends_a_call_waiting_for_its_retry_backoff(cluster):
    async def fail_once(srv, request, cntl, n):
        if n == 1:
            raise aiobrpc.RpcError(errors.ELIMIT, "busy")

    srv = await cluster.start(fail_once)
    channel, stub = cluster.channel([srv], timeout_ms=-1, max_retry=3,
                                    retry_policy=aiobrpc.FixedBackoffRetryPolicy(60_000))
    call = asyncio.ensure_future(stub.Echo(Req(message="x")))
    await until(lambda: channel.stats.retries == 1, "the retry's backoff")
    await channel.close()
    err = await ends(fails(call))
    assert err.code == errors.EFAILEDSOCKET and "closed" in err.text
    assert srv.count("x") == 1


# -- the credential goes with the first request that is sent -------------------------------------
class Verifier:
    def __init__(self) -> None:
        self.credentials: list[bytes] = []

    def verify_credential(self, credential, peer):
        self.credentials.append(credential)
        return credential == b"secret"


class Secret:
    def generate_credential(self):
        return b"secret"


async def test_a_request_that_fails_to_pack_does_not_use_up_the_credential(cluster):
    verifier = Verifier()
    srv = await cluster.start(auth=verifier)
    channel, stub = cluster.channel([srv], timeout_ms=-1, auth=Secret())
    bad = aiobrpc.Controller()
    bad.request_attachment = np.arange(64, dtype=np.uint8)[::2]  # not contiguous: never packed
    err = await ends(fails(stub.Echo(Req(message="bad"), bad)))
    assert err.code == errors.EREQUEST
    # Sent without the credential, it would fail with ERPCAUTH (and lose the connection).
    assert (await ends(stub.Echo(Req(message="good")))).message.endswith("|good")
    assert verifier.credentials == [b"secret"] and srv.count() == 1


# -- user callbacks are isolated -----------------------------------------------------------------
class Boom(Exception):
    pass


class RaisingRetryPolicy(aiobrpc.RetryPolicy):
    """Raises in `hook`, for the calls with log_id 1 only."""

    def __init__(self, hook: str) -> None:
        super().__init__()
        self.hook = hook

    def _maybe_raise(self, hook: str, cntl) -> None:
        if hook == self.hook and cntl.log_id == 1:
            raise Boom(f"in {hook}")

    def do_retry(self, cntl):
        self._maybe_raise("do_retry", cntl)
        return super().do_retry(cntl)

    def backoff_ms(self, cntl, remaining_ms):
        self._maybe_raise("backoff_ms", cntl)
        return 0.0


def user_error(err: aiobrpc.RpcError, hook: str, caplog) -> None:
    """`err` names the hook that raised and what it raised; the log says it once."""
    assert err.code == errors.EINTERNAL
    assert err.text == f"{hook} raised Boom('in {hook.rpartition('.')[2]}')"
    records = [r for r in caplog.records if hook in r.getMessage()]
    assert len(records) == 1 and records[0].levelno == logging.ERROR
    assert records[0].exc_info is not None and records[0].exc_info[0] is Boom


@pytest.mark.parametrize("hook", ["do_retry", "backoff_ms"])
async def test_a_retry_policy_that_raises_fails_only_its_call(cluster, hook, caplog):
    release = cluster.event()

    async def script(srv, request, cntl, n):
        if request.message == "fails":
            raise aiobrpc.RpcError(errors.ELIMIT, "busy")
        await release.wait()

    srv = await cluster.start(script)
    channel, stub = cluster.channel([srv], timeout_ms=-1, max_retry=3, retry_policy=RaisingRetryPolicy(hook))
    other = asyncio.ensure_future(stub.Echo(Req(message="other")))
    await until(lambda: srv.count("other") == 1, "the other call to reach the server")
    conn = channel._conn
    cntl = aiobrpc.Controller(log_id=1)
    err = await ends(fails(stub.Echo(Req(message="fails"), cntl)))
    user_error(err, f"retry_policy.{hook}", caplog)
    assert cntl.error_code == errors.EINTERNAL and channel.stats.retries == 0 and cntl.retried_count == 0
    release.set()  # the other call on the same connection is unaffected
    assert (await ends(other)).message.endswith("|other")
    assert channel._conn is conn and not conn.is_closed


class RaisingCredential:
    def generate_credential(self):
        raise Boom("in generate_credential")


async def test_a_credential_generator_that_raises_fails_the_calls_waiting_for_it(cluster, caplog):
    srv = await cluster.start()
    _channel, stub = cluster.channel([srv], timeout_ms=-1, max_retry=3, auth=RaisingCredential())
    calls = [stub.Echo(Req(message=str(i))) for i in range(3)]
    for result in await ends(asyncio.gather(*calls, return_exceptions=True)):
        assert isinstance(result, aiobrpc.RpcError) and result.code == errors.EREQUEST
        assert result.text == f"Fail to generate credential for {srv.address}: Boom('in generate_credential')"
    records = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(records) == 1 and records[0].exc_info[0] is Boom  # one connect for the three
    assert srv.count() == 0


class RaisingBackupPolicy(aiobrpc.BackupRequestPolicy):
    """Raises in `hook`, for the calls with log_id 1 only."""

    def __init__(self, hook: str) -> None:
        self.hook = hook

    def _maybe_raise(self, hook: str, cntl) -> None:
        if hook == self.hook and cntl.log_id == 1:
            raise Boom(f"in {hook}")

    def backup_request_ms(self, cntl):
        self._maybe_raise("backup_request_ms", cntl)
        return 10

    def do_backup(self, cntl):
        self._maybe_raise("do_backup", cntl)
        return True

    def on_rpc_end(self, cntl):
        self._maybe_raise("on_rpc_end", cntl)


@pytest.mark.parametrize("hook,message,timeout_ms", [
    ("backup_request_ms", "slow", -1), ("do_backup", "slow", -1),
    ("on_rpc_end", "fast", -1), ("on_rpc_end", "slow", 50)])
async def test_a_backup_policy_that_raises_fails_only_its_call(cluster, hook, message, timeout_ms, caplog):
    release = cluster.event()
    srv = await cluster.start(hold_until(release))
    channel, stub = cluster.channel([srv], timeout_ms=timeout_ms, max_retry=3,
                                    backup_request_policy=RaisingBackupPolicy(hook))
    other = asyncio.ensure_future(stub.Echo(Req(message="slow"), aiobrpc.Controller(timeout_ms=-1)))
    await until(lambda: srv.count("slow") >= 1, "the other call to reach the server")
    conn = channel._conn
    cntl = aiobrpc.Controller(log_id=1)
    err = await ends(fails(stub.Echo(Req(message=message), cntl)))
    user_error(err, f"backup_request_policy.{hook}", caplog)
    assert cntl.error_code == errors.EINTERNAL
    release.set()  # the other call on the same connection is unaffected
    assert (await ends(other)).message.endswith("|slow")
    assert channel._conn is conn and not conn.is_closed


class RaisingLoadBalancer(RoundRobinLoadBalancer):
    hook = ""

    def select(self, **kwargs):
        if self.hook == "select":
            raise Boom("in select")
        return super().select(**kwargs)

    def feedback(self, server, error_code, latency_us):
        if self.hook == "feedback":
            raise Boom("in feedback")


register_load_balancer("raising_for_tests", lambda params: RaisingLoadBalancer())


@pytest.mark.parametrize("hook", ["select", "feedback"])
async def test_a_load_balancer_that_raises_fails_only_its_call(cluster, hook, caplog):
    a, b = await cluster.start_many(2)
    opts = aiobrpc.ChannelOptions(timeout_ms=-1, max_retry=3)
    async with aiobrpc.Channel(f"list://{a.address},{b.address}", opts, load_balancer="raising_for_tests") as channel:
        stub = aiobrpc.Stub(channel, SERVICE)
        channel.lb.hook = hook
        cntl = aiobrpc.Controller()
        err = await ends(fails(stub.Echo(Req(message="x"), cntl)))
        user_error(err, f"load_balancer.{hook}", caplog)
        assert channel.stats.retries == 0
        channel.lb.hook = ""
        assert (await ends(stub.Echo(Req(message="y")))).message.endswith("|y")


# -- a Channel outlives its event loop -----------------------------------------------------------
@contextlib.contextmanager
def echo_server_in_a_thread():
    """An InteropEcho server running in its own thread and loop; yields its address."""
    started = threading.Event()
    state: dict = {}

    async def serve() -> None:
        async with running_echo() as (server, _):
            state["address"], state["stop"] = server.address, asyncio.Event()
            started.set()
            await state["stop"].wait()

    def run() -> None:
        loop = asyncio.new_event_loop()
        state["loop"] = loop
        try:
            loop.run_until_complete(serve())
        finally:
            loop.close()
            started.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(HANG) and "address" in state, "the server did not start"
    try:
        yield state["address"]
    finally:
        state["loop"].call_soon_threadsafe(state["stop"].set)
        thread.join(HANG)


@pytest.mark.parametrize("factory", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
@pytest.mark.parametrize("first_loop", ["closed", "stopped"])
def test_a_channel_is_used_again_from_a_new_event_loop(factory, first_loop):
    """Two `asyncio.run(main())` with one module-level Channel (or run_until_complete on two
    loops): the second loop connects anew instead of using the first loop's connection."""
    with echo_server_in_a_thread() as address, warnings.catch_warnings():
        # The first loop ends with the connection open (as the pattern does), which
        # asyncio and uvloop report as a ResourceWarning once it is collected.
        warnings.simplefilter("ignore", ResourceWarning)
        channel = aiobrpc.Channel(address, aiobrpc.ChannelOptions(timeout_ms=-1))
        stub = aiobrpc.Stub(channel, SERVICE)

        async def main(message: str, close: bool) -> str:
            try:
                return (await ends(stub.Echo(Req(message=message)))).message
            finally:
                if close:
                    await channel.close()

        loops = [factory(), factory()]
        try:
            assert loops[0].run_until_complete(main("first", False)) == "first"
            if first_loop == "closed":
                loops[0].close()
            assert loops[1].run_until_complete(main("second", True)) == "second"
            assert channel.stats.connections_made == 2
        finally:
            for loop in loops:
                loop.close()
            gc.collect()


def test_a_channel_in_use_by_a_loop_still_running_says_so():
    with echo_server_in_a_thread() as address:
        channel = aiobrpc.Channel(address, aiobrpc.ChannelOptions(timeout_ms=-1))
        stub = aiobrpc.Stub(channel, SERVICE)
        in_use, finish = threading.Event(), threading.Event()

        async def use_and_keep_running() -> None:
            await ends(stub.Echo(Req(message="there")))
            in_use.set()
            while not finish.is_set():
                await asyncio.sleep(0.005)
            await channel.close()

        other = threading.Thread(target=asyncio.run, args=(use_and_keep_running(),), daemon=True)
        other.start()
        loop = asyncio.new_event_loop()
        try:
            assert in_use.wait(HANG)
            cntl = aiobrpc.Controller()
            with pytest.raises(aiobrpc.RpcError) as ei:
                loop.run_until_complete(ends(stub.Echo(Req(message="here"), cntl)))
            assert ei.value.code == cntl.error_code == errors.EINVAL
            assert "a Channel belongs to one loop at a time" in ei.value.text
        finally:
            loop.close()
            finish.set()
            other.join(HANG)
        assert not other.is_alive()
