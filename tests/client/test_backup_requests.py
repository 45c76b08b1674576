"""The backup request (brpc's docs/en/client.md, docs/hostile_inputs.md D9, D10): when it goes, who wins,
what happens to the loser, the EBACKUPREQUEST quirk, the policy hooks, and cancellation or
the deadline with a backup in flight. Scaffolding from test_call_rules.py; executions are
counted on the server side."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio

import aiobrpc
from aiobrpc import errors
from tests.client.test_call_rules import ECHO, Cluster, Req, fails
from tests.helpers.waiting import wait_until


@pytest_asyncio.fixture
async def cluster():
    c = Cluster()
    yield c
    await c.close()


async def wait_for_count(cluster, n: int, message: str | None = None, timeout: float = 2.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while cluster.total(message) < n:
        assert loop.time() < deadline, f"{cluster.total(message)} executions, waited for {n}"
        await asyncio.sleep(0.002)


def by_backup(cntl) -> tuple:
    """(original, backup) among the attempts of a call that sent a backup."""
    attempts = cntl.attempts
    originals = [a for a in attempts if not a.backup]
    backups = [a for a in attempts if a.backup]
    assert len(backups) == 1, attempts
    return originals, backups[0]


# -- D9: the backup wins ------------------------------------------------------------------------
async def test_backup_to_the_same_server_wins(cluster):
    slow = cluster.event()

    async def first_is_slow(srv, request, cntl, n):
        if n == 1 and request.message == "x":
            await slow.wait()

    srv = await cluster.start(first_is_slow)
    channel, stub = cluster.channel([srv], max_retry=3, timeout_ms=1000, backup_request_ms=20)
    await stub.Echo(Req(message="warm"))
    conn = channel._conn
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    cntl = aiobrpc.Controller()
    resp = await stub.Echo(Req(message="x"), cntl)
    elapsed = loop.time() - t0
    assert resp.message == f"{srv.address}|x"
    assert 0.019 <= elapsed < 0.9  # never early; before the 1 s deadline (how late: the machine's load)
    assert cntl.has_backup_request and cntl.retried_count == 1 and not cntl.failed
    [original], backup = by_backup(cntl)
    assert original.error_code is None and backup.error_code == 0  # abandoned / won
    assert original.remote_side == backup.remote_side == srv.address
    # Same connection, next correlation id (brpc's docs/en/client.md, verified against C++).
    assert [r.cid for r in srv.runs if r.message == "x"] == [original.correlation_id, backup.correlation_id]
    assert backup.correlation_id == original.correlation_id + 1 == cntl.correlation_id
    assert channel._conn is conn and channel.stats.connections_made == 1
    assert channel.stats.backup_requests == 1 and channel.stats.backup_losers == 1
    assert channel.pending_calls() == 0
    slow.set()  # the original answers now: dropped and counted
    await asyncio.sleep(0.02)
    await wait_until(lambda: channel.stats.late_or_unknown_responses == 1 and srv.count("x") == 2)
    assert channel.stats.late_or_unknown_responses == 1 and srv.count("x") == 2


async def test_backup_to_another_server_wins(cluster):
    slow = cluster.event()

    async def first_is_slow(srv, request, cntl, n):
        if n == 1:
            await slow.wait()

    a, b = await cluster.start_many(2, first_is_slow)
    channel, stub = cluster.channel([a, b], max_retry=3, timeout_ms=1000, backup_request_ms=20)
    cntl = aiobrpc.Controller()
    resp = await stub.Echo(Req(message="x"), cntl)
    [original], backup = by_backup(cntl)
    first = next(s for s in (a, b) if s.runs and s.runs[0].n == 1)
    second = b if first is a else a
    assert (original.remote_side, backup.remote_side) == (first.address, second.address)
    assert resp.message == f"{second.address}|x" and cntl.remote_side == second.address
    assert cntl.has_backup_request and cntl.retried_count == 1
    assert a.count() == b.count() == 1
    assert channel.stats.backup_losers == 1
    slow.set()
    await asyncio.sleep(0.02)
    await wait_until(lambda: channel.stats.late_or_unknown_responses == 1)
    assert channel.stats.late_or_unknown_responses == 1


async def test_original_answering_first_wins(cluster):
    backup_arrived = cluster.event()
    hold = cluster.event()

    async def script(srv, request, cntl, n):
        if n == 1:
            await backup_arrived.wait()  # answer only once the backup is out
        else:
            backup_arrived.set()
            await hold.wait()

    srv = await cluster.start(script)
    channel, stub = cluster.channel([srv], max_retry=3, timeout_ms=1000, backup_request_ms=20)
    cntl = aiobrpc.Controller()
    await stub.Echo(Req(message="x"), cntl)
    [original], backup = by_backup(cntl)
    assert original.error_code == 0 and backup.error_code is None
    assert cntl.correlation_id == original.correlation_id
    assert cntl.has_backup_request and cntl.retried_count == 1
    assert channel.stats.backup_losers == 1 and channel.pending_calls() == 0
    hold.set()
    await asyncio.sleep(0.02)
    await wait_until(lambda: channel.stats.late_or_unknown_responses == 1)
    assert channel.stats.late_or_unknown_responses == 1


@pytest.mark.parametrize("how", ["channel", "controller"])
async def test_no_backup_for_non_idempotent_methods(cluster, how):
    async def first_is_slow(srv, request, cntl, n):
        if n == 1:
            await asyncio.sleep(0.08)

    srv = await cluster.start(first_is_slow)
    cntl = aiobrpc.Controller()
    if how == "channel":
        channel, stub = cluster.channel([srv], timeout_ms=1000, backup_request_ms=20,
                                        non_idempotent_methods={ECHO})
    else:
        channel, stub = cluster.channel([srv], timeout_ms=1000, backup_request_ms=20)
        cntl.idempotent = False
    await stub.Echo(Req(message="x"), cntl)
    assert srv.count() == 1 and not cntl.has_backup_request and cntl.retried_count == 0
    assert channel.stats.backup_requests == 0 and cntl.latency_us >= 75_000


# -- D10: both replies in one loop turn -----------------------------------------------------------
@pytest.mark.parametrize("servers", [1, 2])
async def test_both_replies_in_the_same_loop_turn(cluster, loop_errors, servers):
    release = cluster.event()

    async def park(srv, request, cntl, n):
        await release.wait()

    srvs = await cluster.start_many(servers, park)
    channel, stub = cluster.channel(srvs, max_retry=3, timeout_ms=1000, backup_request_ms=20)
    results = []
    task = asyncio.ensure_future(stub.Echo(Req(message="x"), cntl := aiobrpc.Controller()))
    task.add_done_callback(results.append)
    await wait_for_count(cluster, 2)  # the original and the backup both wait for `release`
    release.set()  # one set: both handlers answer in the same iteration
    resp = await task
    await asyncio.sleep(0.02)
    await wait_until(lambda: len(results) == 1 and resp.message.endswith("|x"))
    assert len(results) == 1 and resp.message.endswith("|x")
    originals, _backup = by_backup(cntl)
    outcomes = sorted(str(a.error_code) for a in cntl.attempts)
    assert outcomes == ["0", "None"]  # exactly one winner, the other dropped
    if servers == 1:
        # Same connection: the replies come in request order, so the original wins.
        assert originals[0].error_code == 0 and cntl.correlation_id == originals[0].correlation_id
    assert channel.stats.backup_losers == 1 and channel.stats.late_or_unknown_responses == 1
    assert channel.pending_calls() == 0 and cluster.total() == 2
    assert not loop_errors


# -- a failed attempt while the other is pending ---------------------------------------------------
async def test_original_failing_after_the_backup_left_waits_for_the_backup(cluster):
    backup_arrived = cluster.event()

    async def script(srv, request, cntl, n):
        if n == 1:
            await backup_arrived.wait()
            raise aiobrpc.RpcError(errors.EINTERNAL, "original failed")  # not retryable
        backup_arrived.set()
        await asyncio.sleep(0.04)  # the original's failure arrives first

    srv = await cluster.start(script)
    channel, stub = cluster.channel([srv], max_retry=3, timeout_ms=1000, backup_request_ms=20)
    cntl = aiobrpc.Controller()
    resp = await stub.Echo(Req(message="x"), cntl)
    assert resp.message == f"{srv.address}|x" and not cntl.failed
    [original], backup = by_backup(cntl)
    assert original.error_code == errors.EINTERNAL and backup.error_code == 0
    assert cntl.retried_count == 1 and srv.count() == 2
    assert channel.stats.backup_losers == 0 and channel.stats.late_or_unknown_responses == 0


async def test_backup_failing_leaves_the_original_to_finish(cluster):
    async def script(srv, request, cntl, n):
        if n == 1:
            while srv.cluster.executions["x"] < 2:
                await asyncio.sleep(0.002)
            await asyncio.sleep(0.03)  # answer after the backup failed
            return
        raise aiobrpc.RpcError(errors.EINTERNAL, "backup failed")  # not retryable

    srv = await cluster.start(script)
    _channel, stub = cluster.channel([srv], max_retry=3, timeout_ms=1000, backup_request_ms=20)
    cntl = aiobrpc.Controller()
    resp = await stub.Echo(Req(message="x"), cntl)
    assert resp.message == f"{srv.address}|x" and not cntl.failed
    [original], backup = by_backup(cntl)
    assert original.error_code == 0 and backup.error_code == errors.EINTERNAL
    assert cntl.correlation_id == original.correlation_id and cntl.retried_count == 1
    assert srv.count() == 2


async def test_failed_backup_is_retried_while_the_original_is_pending(cluster):
    hold = cluster.event()

    async def script(srv, request, cntl, n):
        if n == 1:
            await hold.wait()
        elif n == 2:
            raise aiobrpc.RpcError(errors.ELIMIT, "backup refused")

    srv = await cluster.start(script)
    channel, stub = cluster.channel([srv], max_retry=3, timeout_ms=1000, backup_request_ms=20)
    cntl = aiobrpc.Controller()
    await stub.Echo(Req(message="x"), cntl)
    codes = [(a.backup, a.error_code) for a in cntl.attempts]
    assert sorted(codes, key=str) == sorted([(False, None), (True, errors.ELIMIT), (False, 0)], key=str)
    assert cntl.retried_count == 2 and srv.count() == 3
    assert channel.stats.backup_losers == 1  # the original, abandoned
    hold.set()
    await asyncio.sleep(0.02)
    await wait_until(lambda: channel.stats.late_or_unknown_responses == 1)
    assert channel.stats.late_or_unknown_responses == 1


async def test_both_failing_fails_the_call_with_both_errors(cluster):
    backup_arrived = cluster.event()

    async def script(srv, request, cntl, n):
        if n == 1:
            await backup_arrived.wait()
            raise aiobrpc.RpcError(errors.EINTERNAL, "original")
        backup_arrived.set()
        await asyncio.sleep(0.02)
        raise aiobrpc.RpcError(errors.EINTERNAL, "backup")

    srv = await cluster.start(script)
    _channel, stub = cluster.channel([srv], max_retry=3, timeout_ms=1000, backup_request_ms=20)
    err = await fails(stub.Echo(Req(message="x")))
    assert err.code == errors.EINTERNAL
    assert err.text == "[E2001][t][E2001]original [R1][E2001][t][E2001]backup"


# -- the deadline and the EBACKUPREQUEST quirk ---------------------------------------------------
async def test_only_one_backup_and_the_deadline_covers_it(cluster):
    release = cluster.event()

    async def park(srv, request, cntl, n):
        await release.wait()

    srv = await cluster.start(park)
    channel, stub = cluster.channel([srv], max_retry=3, timeout_ms=120, backup_request_ms=20)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    cntl = aiobrpc.Controller()
    err = await fails(stub.Echo(Req(message="x"), cntl))
    assert err.code == errors.ERPCTIMEDOUT and loop.time() - t0 >= 0.115
    assert srv.count() == 2 and cntl.has_backup_request and cntl.retried_count == 1
    assert [a.error_code for a in cntl.attempts] == [None, None]
    assert channel.stats.backup_losers == 0 and channel.pending_calls() == 0
    release.set()
    await asyncio.sleep(0.02)
    await wait_until(lambda: channel.stats.late_or_unknown_responses == 2)
    assert channel.stats.late_or_unknown_responses == 2


async def test_backup_delay_not_below_the_timeout_sends_no_backup(cluster):
    release = cluster.event()

    async def park(srv, request, cntl, n):
        await release.wait()

    srv = await cluster.start(park)
    channel, stub = cluster.channel([srv], max_retry=3, timeout_ms=50, backup_request_ms=50)
    err = await fails(stub.Echo(Req(message="x")))
    assert err.code == errors.ERPCTIMEDOUT
    await asyncio.sleep(0.02)
    await wait_until(lambda: srv.count() == 1 and channel.stats.backup_requests == 0)
    assert srv.count() == 1 and channel.stats.backup_requests == 0


async def test_controller_backup_request_ms_overrides_the_channel(cluster):
    slow = cluster.event()

    async def first_is_slow(srv, request, cntl, n):
        if n == 1:
            await slow.wait()

    srv = await cluster.start(first_is_slow)
    _channel, stub = cluster.channel([srv], max_retry=3, timeout_ms=1000)  # no backup
    cntl = aiobrpc.Controller()
    cntl.backup_request_ms = 20
    await stub.Echo(Req(message="x"), cntl)
    assert cntl.has_backup_request and srv.count() == 2


@pytest.mark.parametrize("where", ["channel", "controller"])
async def test_max_retry_zero_ends_the_call_at_the_backup_delay(cluster, where):
    """brpc's quirk (verified against the C++ client): no retry left, so the backup timer
    ends the call with EBACKUPREQUEST."""
    release = cluster.event()

    async def park(srv, request, cntl, n):
        await release.wait()

    srv = await cluster.start(park)
    cntl = aiobrpc.Controller()
    if where == "channel":
        channel, stub = cluster.channel([srv], max_retry=0, timeout_ms=1000, backup_request_ms=50)
    else:
        channel, stub = cluster.channel([srv], max_retry=3, timeout_ms=1000, backup_request_ms=50)
        cntl.max_retry = 0
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    err = await fails(stub.Echo(Req(message="x"), cntl))
    elapsed = loop.time() - t0
    assert err.code == errors.EBACKUPREQUEST == 1007
    assert err.text == f"Reached backup timeout=50ms @{srv.address}"
    assert 0.045 <= elapsed < 0.9  # never early; the backup timer ended it, not the 1 s deadline
    assert cntl.error_code == errors.EBACKUPREQUEST and cntl.retried_count == 0
    assert not cntl.has_backup_request and channel.pending_calls() == 0
    release.set()
    await asyncio.sleep(0.02)
    await wait_until(lambda: srv.count() == 1 and channel.stats.late_or_unknown_responses == 1)
    assert srv.count() == 1 and channel.stats.late_or_unknown_responses == 1


# -- cancellation with a backup in flight ------------------------------------------------------------
async def test_cancelling_with_a_backup_in_flight(cluster):
    release = cluster.event()

    async def park(srv, request, cntl, n):
        if request.message == "x":
            await release.wait()

    srv = await cluster.start(park)
    channel, stub = cluster.channel([srv], max_retry=3, timeout_ms=100, backup_request_ms=20)
    task = asyncio.ensure_future(stub.Echo(Req(message="x")))
    await wait_for_count(cluster, 2, "x")
    assert channel.pending_calls() == 2
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert channel.pending_calls() == 0 and channel.stats.cancelled == 1
    assert channel.stats.backup_losers == 0
    release.set()
    await asyncio.sleep(0.02)
    await wait_until(lambda: channel.stats.late_or_unknown_responses == 2)
    assert channel.stats.late_or_unknown_responses == 2
    await asyncio.sleep(0.1)  # past the deadline: nothing fires
    await wait_until(lambda: channel.stats.timeouts == 0 and srv.count("x") == 2)
    assert channel.stats.timeouts == 0 and srv.count("x") == 2
    assert (await stub.Echo(Req(message="y"))).message == f"{srv.address}|y"
    assert channel.stats.connections_made == 1


# -- BackupRequestPolicy ---------------------------------------------------------------------------
class RecordingPolicy(aiobrpc.BackupRequestPolicy):
    def __init__(self, delay_ms: int, allow: bool) -> None:
        self.delay_ms = delay_ms
        self.allow = allow
        self.asked_delay = 0
        self.asked_backup: list[float] = []
        self.ended: list[tuple[int, int]] = []

    def backup_request_ms(self, cntl) -> int:
        self.asked_delay += 1
        return self.delay_ms

    def do_backup(self, cntl) -> bool:
        self.asked_backup.append(asyncio.get_running_loop().time())
        return self.allow

    def on_rpc_end(self, cntl) -> None:
        self.ended.append((cntl.error_code, cntl.latency_us))


async def test_policy_declining_the_backup_sends_none_and_keeps_the_deadline(cluster):
    release = cluster.event()

    async def script(srv, request, cntl, n):
        if request.message == "slow":
            await asyncio.sleep(0.06)
        elif request.message == "parked":
            await release.wait()

    srv = await cluster.start(script)
    policy = RecordingPolicy(20, allow=False)
    channel, stub = cluster.channel([srv], max_retry=3, timeout_ms=150, backup_request_policy=policy)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    cntl = aiobrpc.Controller()
    await stub.Echo(Req(message="slow"), cntl)
    assert policy.asked_delay == 1 and len(policy.asked_backup) == 1
    assert 0.019 <= policy.asked_backup[0] - t0 < 0.055
    assert not cntl.has_backup_request and srv.count("slow") == 1
    assert policy.ended == [(0, cntl.latency_us)] and cntl.latency_us >= 55_000
    # brpc leaves the deadline unarmed on this path; here it still ends the call.
    t0 = loop.time()
    err = await fails(stub.Echo(Req(message="parked")))
    assert err.code == errors.ERPCTIMEDOUT and loop.time() - t0 >= 0.145
    assert srv.count("parked") == 1 and channel.stats.backup_requests == 0
    assert [code for code, _ in policy.ended] == [0, errors.ERPCTIMEDOUT]


@pytest.mark.parametrize("delay_ms,backup", [(-2, False), (-1, True), (20, True)])
async def test_policy_delay_values(cluster, delay_ms, backup):
    """−1: the channel's delay (30 ms here), other negatives: no backup, ≥ 0: the delay."""
    slow = cluster.event()

    async def first_is_slow(srv, request, cntl, n):
        if n == 1:
            await slow.wait()

    srv = await cluster.start(first_is_slow)
    policy = RecordingPolicy(delay_ms, allow=True)
    _channel, stub = cluster.channel([srv], max_retry=3, timeout_ms=150, backup_request_ms=30,
                                    backup_request_policy=policy)
    cntl = aiobrpc.Controller()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    if backup:
        await stub.Echo(Req(message="x"), cntl)
        assert cntl.has_backup_request and srv.count() == 2
        want = 0.03 if delay_ms == -1 else delay_ms / 1000
        assert want - 0.001 <= policy.asked_backup[0] - t0 < want + 0.05
    else:
        err = await fails(stub.Echo(Req(message="x"), cntl))
        assert err.code == errors.ERPCTIMEDOUT and srv.count() == 1
        assert policy.asked_backup == [] and not cntl.has_backup_request


async def test_latency_quantile_policy_through_the_channel(cluster):
    slow = cluster.event()

    async def script(srv, request, cntl, n):
        if request.message.startswith("warm"):
            await asyncio.sleep(0.015)
        elif n == 1:
            await slow.wait()  # the outlier

    srv = await cluster.start(script)
    policy = aiobrpc.LatencyQuantileBackupPolicy(quantile=0.5, window=16, min_samples=5)
    channel, stub = cluster.channel([srv], max_retry=3, timeout_ms=1000, backup_request_policy=policy)
    for i in range(5):
        cntl = aiobrpc.Controller()
        await stub.Echo(Req(message=f"warm{i}"), cntl)
        assert not cntl.has_backup_request  # no delay known yet, none on the channel
    assert policy.sample_count == 5
    delay = policy.backup_request_ms(aiobrpc.Controller())
    assert 15 <= delay <= 100
    assert delay == -(-policy.latency_quantile_us // 1000)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    cntl = aiobrpc.Controller()
    await stub.Echo(Req(message="outlier"), cntl)
    elapsed = loop.time() - t0
    assert cntl.has_backup_request and srv.count("outlier") == 2
    assert delay / 1000 - 0.001 <= elapsed < 0.9  # never before the policy's delay; before the deadline
    assert channel.stats.backup_requests == 1 and policy.sample_count == 6
