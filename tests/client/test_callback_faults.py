"""Randomized faults in every user-supplied callback on a call's path: the handler (async and in
the thread pool), the retry policy, the backup policy, the authenticator, the naming service
(raising, junk lists, stopping) and the load balancer (select, feedback, set_servers), each raising for
some calls chosen at random. Every call must end (a result or an RpcError, never a hang), no
exception may reach the loop (the loop_errors fixture), and once the faulty calls are over a
clean call on the same channel succeeds on the same connection.
"""

from __future__ import annotations

import asyncio
import random

import pytest

import aiobrpc
from aiobrpc import errors
from aiobrpc._proto import interop_pb2
from aiobrpc.client import channel as channel_module
from aiobrpc.client.backup import BackupRequestPolicy
from aiobrpc.client.lb import register_load_balancer
from aiobrpc.client.lb.rr import RoundRobinLoadBalancer
from aiobrpc.client.naming import ServerNode, register_naming_service
from aiobrpc.client.naming.base import NamingService
from tests.helpers.interop_server import SERVICE, InteropEcho, running_echo

HANG = 10  # seconds: a call still running by then would never have ended
CALLS = 40


class Boom(Exception):
    """The injected fault."""


class FaultyEcho(InteropEcho):
    """Fails the calls whose message names a fault: raises, or answers with a retryable code."""

    async def Echo(self, request, cntl):
        if request.message.startswith("raise"):
            raise Boom(request.message)
        if request.message.startswith("elimit"):
            raise aiobrpc.RpcError(errors.ELIMIT, "retry me")
        if request.message.startswith("sync"):
            return await asyncio.get_running_loop().run_in_executor(None, self._sync_fault, request)
        return await super().Echo(request, cntl)

    @staticmethod
    def _sync_fault(request):
        raise Boom(request.message)


def faulty_for(log_ids: set[int]):
    """A callback that raises for the calls whose log_id is in `log_ids`, and answers otherwise."""
    def check(cntl) -> None:
        if cntl.log_id in log_ids:
            raise Boom(f"injected for log_id {cntl.log_id}")
    return check


class FaultyRetry(aiobrpc.RetryPolicy):
    def __init__(self, do_retry_fails: set[int], backoff_fails: set[int]) -> None:
        super().__init__()
        self._do_retry, self._backoff = faulty_for(do_retry_fails), faulty_for(backoff_fails)

    def do_retry(self, cntl) -> bool:
        self._do_retry(cntl)
        return super().do_retry(cntl)

    def backoff_ms(self, cntl, remaining_ms: float) -> float:
        self._backoff(cntl)
        return 1


class FaultyBackup(BackupRequestPolicy):
    def __init__(self, delay_fails: set[int], do_backup_fails: set[int], end_fails: set[int]) -> None:
        self._delay, self._do = faulty_for(delay_fails), faulty_for(do_backup_fails)
        self._end = faulty_for(end_fails)

    def backup_request_ms(self, cntl) -> int:
        self._delay(cntl)
        return 20

    def do_backup(self, cntl) -> bool:
        self._do(cntl)
        return True

    def on_rpc_end(self, cntl) -> None:
        self._end(cntl)


def some(rng: random.Random, ids: range) -> set[int]:
    return {i for i in ids if rng.random() < 0.2}


@pytest.mark.parametrize("seed", range(4))
async def test_faults_in_user_callbacks_end_only_their_own_calls(seed):
    rng = random.Random(seed)
    ids = range(1, CALLS + 1)
    retry = FaultyRetry(some(rng, ids), some(rng, ids))
    backup = FaultyBackup(some(rng, ids), some(rng, ids), some(rng, ids))
    messages = {i: rng.choice(["ok", "ok", "raise", "elimit", "sync", "slow"]) for i in ids}
    opts = aiobrpc.ChannelOptions(timeout_ms=-1, max_retry=2, retry_policy=retry, backup_request_policy=backup)
    async with running_echo(servicer=FaultyEcho()) as (server, _), \
            aiobrpc.Channel(f"127.0.0.1:{server.port}", opts) as channel:
        stub = aiobrpc.Stub(channel, SERVICE)

        async def call(i: int):
            req = interop_pb2.EchoRequest(message=messages[i], sleep_ms=40 if messages[i] == "slow" else 0)
            try:
                return await stub.Echo(req, aiobrpc.Controller(log_id=i))
            except aiobrpc.RpcError as e:
                return e

        results = await asyncio.wait_for(asyncio.gather(*[call(i) for i in ids]), HANG)
        assert all(isinstance(r, (interop_pb2.EchoResponse, aiobrpc.RpcError)) for r in results)
        for i, r in zip(ids, results):
            if messages[i] in ("raise", "sync"):
                assert isinstance(r, aiobrpc.RpcError) and r.code == errors.EINTERNAL, (i, r)
        assert channel.pending_calls() == 0 and channel.connection_count() == 1
        resp = await asyncio.wait_for(stub.Echo(interop_pb2.EchoRequest(message="clean"),
                                                aiobrpc.Controller(log_id=0)), HANG)
        assert resp.message == "clean" and channel.stats.connections_made == 1


class FaultyAuth:
    def __init__(self, fail: str) -> None:
        self.fail = fail

    def generate_credential(self) -> bytes:
        if self.fail == "generate":
            raise Boom("generate_credential")
        return b"secret"

    async def verify_credential(self, credential: bytes, peer: str) -> bool:
        if self.fail == "verify":
            raise Boom("verify_credential")
        return credential == b"secret"


@pytest.mark.parametrize("fail", ["generate", "verify"])
async def test_a_raising_authenticator_ends_every_call_and_the_next_connection_works(fail):
    auth = FaultyAuth(fail)
    async with running_echo(aiobrpc.ServerOptions(auth=auth)) as (server, servicer), \
            aiobrpc.Channel(f"127.0.0.1:{server.port}", aiobrpc.ChannelOptions(timeout_ms=-1, auth=auth)) as channel:
        stub = aiobrpc.Stub(channel, SERVICE)
        results = await asyncio.wait_for(asyncio.gather(
            *[stub.Echo(interop_pb2.EchoRequest(message="x")) for _ in range(10)], return_exceptions=True), HANG)
        assert all(isinstance(r, aiobrpc.RpcError) for r in results), results
        assert servicer.calls_served == 0
        auth.fail = ""
        await asyncio.sleep(0.3)  # the server is marked down after an auth failure; revived by its health check
        resp = await asyncio.wait_for(stub.Echo(interop_pb2.EchoRequest(message="after")), HANG)
        assert resp.message == "after"


class FaultyRR(RoundRobinLoadBalancer):
    """Round robin whose select and feedback raise for the chosen calls (select knows the call
    only by its order: the n-th select), and whose set_servers refuses some lists."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        self.rng = rng

    def select(self, **kw):
        if self.rng.random() < 0.15:
            raise Boom("select")
        return super().select(**kw)

    def feedback(self, server, error_code, latency_us) -> None:
        if self.rng.random() < 0.15:
            raise Boom("feedback")

    def set_servers(self, servers) -> None:
        if self.rng.random() < 0.3:
            raise Boom("set_servers")
        super().set_servers(servers)


class FlakyNaming(NamingService):
    """Yields the test's servers with faults between: raises, yields junk, stops early."""

    nodes: list = []
    rng = random.Random()

    def __init__(self, rest: str) -> None:
        pass

    async def watch(self):
        for _ in range(3):
            fault = self.rng.choice(["raise", "junk", "none", "ok", "ok"])
            if fault == "raise":
                raise Boom("watch")
            if fault == "junk":
                yield [f"127.0.0.1:{n.port}" for n in self.nodes]
            elif fault == "ok":
                yield list(self.nodes)
            await asyncio.sleep(self.rng.random() * 0.02)
        yield list(self.nodes)
        await asyncio.Event().wait()


register_naming_service("flaky", FlakyNaming)


@pytest.mark.parametrize("seed", range(4))
async def test_faults_in_naming_service_and_load_balancer_end_only_their_own_calls(seed, monkeypatch):
    monkeypatch.setattr(channel_module, "NAMING_RETRY_MIN_S", 0.005)
    rng = random.Random(seed)
    lb = FaultyRR(rng)
    register_load_balancer("faulty-rr", lambda params: lb)
    FlakyNaming.rng = rng
    async with running_echo() as (a, _), running_echo() as (b, _):
        FlakyNaming.nodes = [ServerNode("127.0.0.1", a.port), ServerNode("127.0.0.1", b.port)]
        opts = aiobrpc.ChannelOptions(timeout_ms=-1, max_retry=2)
        async with aiobrpc.Channel("flaky://x", opts, load_balancer="faulty-rr") as channel:
            stub = aiobrpc.Stub(channel, SERVICE)

            async def call(i: int):
                await asyncio.sleep(rng.random() * 0.05)
                try:
                    return await stub.Echo(interop_pb2.EchoRequest(message=str(i)), aiobrpc.Controller(log_id=i))
                except aiobrpc.RpcError as e:
                    return e

            results = await asyncio.wait_for(asyncio.gather(*[call(i) for i in range(CALLS)]), HANG)
            for i, r in enumerate(results):
                assert isinstance(r, interop_pb2.EchoResponse) and r.message == str(i) or \
                    isinstance(r, aiobrpc.RpcError) and r.code in (errors.EINTERNAL, errors.ENODATA), (i, r)
            assert channel.pending_calls() == 0
            lb.rng = random.Random(0)
            lb.rng.random = lambda: 1.0  # no more faults
            for _ in range(200):  # the watch ends up giving its list whatever came before
                if len(channel.pools) == 2:
                    break
                await asyncio.sleep(0.01)
            resp = await asyncio.wait_for(stub.Echo(interop_pb2.EchoRequest(message="clean")), HANG)
            assert resp.message == "clean"


class FaultyThrottle(aiobrpc.RetryThrottle):
    def __init__(self, fails: str) -> None:
        super().__init__()
        self.fails = fails

    def allow_retry(self) -> bool:
        if self.fails == "allow_retry":
            raise Boom("allow_retry")
        return super().allow_retry()

    def on_success(self) -> None:
        if self.fails == "on_success":
            raise Boom("on_success")
        super().on_success()

    def on_failure(self) -> None:
        if self.fails == "on_failure":
            raise Boom("on_failure")
        super().on_failure()


@pytest.mark.parametrize("fails", ["allow_retry", "on_success", "on_failure"])
async def test_a_raising_retry_throttle_ends_its_call_with_einternal(fails):
    throttle = FaultyThrottle(fails)
    opts = aiobrpc.ChannelOptions(timeout_ms=-1, max_retry=2, retry_throttle=throttle)
    async with running_echo(servicer=FaultyEcho()) as (server, _), \
            aiobrpc.Channel(f"127.0.0.1:{server.port}", opts) as channel:
        stub = aiobrpc.Stub(channel, SERVICE)
        message = "ok" if fails == "on_success" else "elimit"
        with pytest.raises(aiobrpc.RpcError) as ei:
            await asyncio.wait_for(stub.Echo(interop_pb2.EchoRequest(message=message)), HANG)
        assert ei.value.code == errors.EINTERNAL and f"retry_throttle.{fails} raised" in ei.value.text
        throttle.fails = ""
        resp = await asyncio.wait_for(stub.Echo(interop_pb2.EchoRequest(message="clean")), HANG)
        assert resp.message == "clean" and channel.stats.connections_made == 1
