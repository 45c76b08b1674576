"""A channel's figures per method (ChannelOptions.method_status, Channel.status(), the Prometheus
collector): every call counted once when it ends, whatever ends it, with its latency as the
controller reports it; retries and backup requests counted; the method table bounded.

Windowed figures (qps, percentiles) cover whole seconds before now: `settled()` moves the
recorders' clocks one second on, so the calls just made are read without waiting.
Scaffolding from test_call_rules.py.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

import aiobrpc
from aiobrpc import errors
from aiobrpc._proto import brpc_meta_pb2
from aiobrpc.client import metrics as client_metrics
from aiobrpc.client.metrics import MAX_METHODS, OTHER
from aiobrpc.client.prometheus import ChannelCollector, prometheus_text
from aiobrpc.metrics import MethodStatus
from tests.client.test_call_rules import ECHO, Cluster, Req, fail_with, fails
from tests.helpers.interop_server import SERVICE
from tests.helpers.waiting import wait_until

PROM_ECHO = "interop_echo_service_echo"  # ECHO underscored
UNSERIALIZABLE = brpc_meta_pb2.RpcRequestMeta()  # its required fields are missing: EncodeError


@pytest_asyncio.fixture
async def cluster():
    c = Cluster()
    yield c
    await c.close()


def settled(channel) -> dict:
    """channel.status() read one second later: the calls made so far are in whole seconds."""
    recorders = [s.latency for methods in channel._methods._by_service.values() for s in methods.values()]
    if channel._methods.other is not None:
        recorders.append(channel._methods.other.latency)
    for r in recorders:
        r._clock = lambda: time.monotonic() + 1.0
    return channel.status()


async def calls(stub, n: int, message: str = "x", **controller) -> list[aiobrpc.Controller]:
    """`n` calls in turn; the controllers of all, failed or not."""
    out = []
    for _ in range(n):
        cntl = aiobrpc.Controller(**controller)
        try:
            await stub.Echo(Req(message=message), cntl)
        except aiobrpc.RpcError:
            pass
        out.append(cntl)
    return out


async def test_successes_are_counted_with_the_latency_the_controller_reports(cluster):
    async def slow(srv, request, cntl, n):
        await asyncio.sleep(0.02)

    srv = await cluster.start(slow)
    channel, stub = cluster.channel([srv], timeout_ms=5000)
    assert channel.status() == {}
    done = await calls(stub, 5)
    assert not any(c.failed for c in done)
    status = settled(channel)
    assert list(status) == [ECHO]
    figs = status[ECHO]
    # The server's figures by the server's names (bar its concurrency), then the client's own.
    assert list(figs) == [k for k in MethodStatus().describe() if k != "concurrency"] + ["retries", "backups"]
    assert figs["count"] == 5 and figs["error"] == 0 and figs["eps"] == 0
    assert figs["max_latency"] == max(c.latency_us for c in done)
    assert 15000 <= figs["latency_50"] <= figs["latency_99"] <= figs["max_latency"]
    assert figs["latency"] * 5 <= sum(c.latency_us for c in done) + 5  # the window's mean, floored
    assert figs["qps"] > 0
    assert figs["retries"] == figs["backups"] == 0


async def test_failures_are_counted_as_errors(cluster):
    async def odd_fail(srv, request, cntl, n):
        if n % 2:
            raise aiobrpc.RpcError(errors.EINTERNAL, "odd")  # not retried by default
        if request.message == "crash":
            raise ValueError("a handler that raises")

    srv = await cluster.start(odd_fail)
    channel, stub = cluster.channel([srv], timeout_ms=5000)
    done = await calls(stub, 6)
    crash = await calls(stub, 2, "crash")
    assert [c.failed for c in done] == [True, False] * 3
    assert [c.error_code for c in crash] == [errors.EINTERNAL] * 2
    figs = settled(channel)[ECHO]
    assert figs["count"] == 8 and figs["error"] == 5 and figs["eps"] > 0
    assert figs["retries"] == 0


async def test_a_timeout_is_one_failed_call_as_long_as_its_deadline(cluster):
    hold = cluster.event()

    async def hang(srv, request, cntl, n):
        await hold.wait()

    srv = await cluster.start(hang)
    channel, stub = cluster.channel([srv], timeout_ms=50, max_retry=0)
    [cntl] = await calls(stub, 1)
    assert cntl.error_code == errors.ERPCTIMEDOUT
    figs = settled(channel)[ECHO]
    assert figs["count"] == 1 and figs["error"] == 1
    assert figs["max_latency"] == cntl.latency_us >= 45000
    hold.set()
    await asyncio.sleep(0.02)  # the late reply is dropped, not counted again
    await wait_until(lambda: channel.status()[ECHO]["count"] == 1)
    assert channel.status()[ECHO]["count"] == 1


async def test_a_cancelled_call_and_a_closed_channel_are_counted_once_each(cluster):
    hold = cluster.event()

    async def hang(srv, request, cntl, n):
        await hold.wait()

    srv = await cluster.start(hang)
    channel, stub = cluster.channel([srv], timeout_ms=-1, max_retry=0)
    task = asyncio.ensure_future(stub.Echo(Req(message="x")))
    await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert channel.status()[ECHO]["count"] == 1 and channel.status()[ECHO]["error"] == 1
    inflight = asyncio.ensure_future(stub.Echo(Req(message="y")))
    await asyncio.sleep(0.02)
    await channel.close()
    assert (await fails(inflight)).code == errors.EFAILEDSOCKET
    assert (await fails(stub.Echo(Req(message="z")))).code == errors.EHOSTDOWN  # refused: closed
    figs = channel.status()[ECHO]
    assert figs["count"] == 3 and figs["error"] == 3
    assert channel.stats.cancelled == 1


async def test_a_request_that_does_not_serialize_is_a_failed_call(cluster):
    srv = await cluster.start()
    channel, stub = cluster.channel([srv])
    bad = aiobrpc.Controller()
    with pytest.raises(aiobrpc.RpcError):
        await channel.call_method(SERVICE.full_name, "Echo", UNSERIALIZABLE, Req, bad)
    assert bad.error_code == errors.EREQUEST
    figs = channel.status()[ECHO]
    assert figs["count"] == 1 and figs["error"] == 1


async def test_retries_are_counted_per_method(cluster):
    async def busy_first(srv, request, cntl, n):
        if n == 1:
            raise aiobrpc.RpcError(errors.ELIMIT, "busy")  # retried: the handler did not run

    srv = await cluster.start(busy_first)
    channel, stub = cluster.channel([srv], timeout_ms=5000, max_retry=3)
    [a, b] = await calls(stub, 2, "a")  # the first retried once
    [c] = await calls(stub, 1, "c")  # retried once
    assert not a.failed and a.retried_count == 1 and b.retried_count == 0 and c.retried_count == 1
    figs = channel.status()[ECHO]
    assert figs["count"] == 3 and figs["error"] == 0
    assert figs["retries"] == 2 == channel.stats.retries and figs["backups"] == 0

    # Every attempt fails: max_retry retries, one failed call.
    srv2 = await cluster.start(fail_with(errors.ELIMIT))
    channel2, stub2 = cluster.channel([srv2], timeout_ms=5000, max_retry=2)
    assert (await fails(stub2.Echo(Req(message="d")))).code == errors.ELIMIT
    figs2 = channel2.status()[ECHO]
    assert figs2["count"] == 1 and figs2["error"] == 1 and figs2["retries"] == 2


async def test_backup_requests_are_counted_apart_from_retries(cluster):
    hold = cluster.event()

    async def first_is_slow(srv, request, cntl, n):
        if n == 1:
            await hold.wait()

    srv = await cluster.start(first_is_slow)
    channel, stub = cluster.channel([srv], timeout_ms=5000, max_retry=3, backup_request_ms=20)
    cntl = aiobrpc.Controller()
    await stub.Echo(Req(message="x"), cntl)
    assert cntl.has_backup_request and cntl.retried_count == 1
    await stub.Echo(Req(message="y"), aiobrpc.Controller())  # n == 1 of "y": a backup again
    await calls(stub, 2, "x")  # answered at once: no backup
    figs = channel.status()[ECHO]
    assert figs["count"] == 4 and figs["error"] == 0
    assert figs["backups"] == 2 == channel.stats.backup_requests and figs["retries"] == 0
    hold.set()  # the losers answer now: dropped, not counted as calls
    await asyncio.sleep(0.02)
    await wait_until(lambda: channel.status()[ECHO]["count"] == 4)
    assert channel.status()[ECHO]["count"] == 4


async def test_methods_are_kept_apart_and_the_table_is_bounded(cluster, monkeypatch):
    assert aiobrpc.Channel("127.0.0.1:1")._methods.max_methods == MAX_METHODS == 1024
    cap = 16  # the same rule as 1024, without 47 MB of recorders
    monkeypatch.setattr(client_metrics, "MAX_METHODS", cap)
    srv = await cluster.start()
    channel, stub = cluster.channel([srv], timeout_ms=5000)
    await stub.Echo(Req(message="x"))
    assert len(channel._methods) == 1
    extra = 5
    # Methods the server does not have: each call fails at once with ENOMETHOD.
    names = [f"M{i}" for i in range(cap - 1 + extra)]
    results = await asyncio.gather(*(channel.call_method("pkg.Svc", n, Req(message="m"), Req) for n in names),
                                   return_exceptions=True)
    assert all(isinstance(r, aiobrpc.RpcError) and r.code == errors.ENOMETHOD for r in results)
    await stub.Echo(Req(message="x"))  # a method kept by name is still counted as itself
    await calls(stub, 1)
    status = channel.status()
    assert len(channel._methods) == cap
    assert len(status) == cap + 1 and list(status)[-1] == OTHER
    assert status[ECHO]["count"] == 3
    assert status["pkg.Svc/M0"]["count"] == 1 and status["pkg.Svc/M0"]["error"] == 1
    assert f"pkg.Svc/M{cap - 2}" in status and f"pkg.Svc/M{cap - 1}" not in status
    assert status[OTHER]["count"] == extra and status[OTHER]["error"] == extra
    with pytest.raises(aiobrpc.RpcError):
        await channel.call_method("pkg.Svc", "yet_another", Req(message="m"), Req)
    assert len(channel.status()) == cap + 1 and channel.status()[OTHER]["count"] == extra + 1
    assert f"rpc_client_t_{OTHER}_count {extra + 1}" in prometheus_text(channel, "t")


async def test_the_prometheus_collector_exports_each_method_and_the_channel(cluster):
    async def fail_second(srv, request, cntl, n):
        if n == 2:
            raise aiobrpc.RpcError(errors.EINTERNAL, "second")

    srv = await cluster.start(fail_second)
    channel, stub = cluster.channel([srv], timeout_ms=5000)
    done = await calls(stub, 3)
    settled(channel)
    families = {f.name: f for f in ChannelCollector(channel, name="echo").collect()}
    base = f"rpc_client_echo_{PROM_ECHO}"
    summary = families[f"{base}_latency"]
    assert summary.type == "summary"
    samples = {(s.name, s.labels.get("quantile")): s.value for s in summary.samples}
    assert samples[(f"{base}_latency_count", None)] == 3
    assert samples[(f"{base}_latency", "1")] == max(c.latency_us for c in done)
    assert samples[(f"{base}_latency", "0.5")] <= samples[(f"{base}_latency", "0.99")] <= \
        samples[(f"{base}_latency", "1")]
    gauges = {name: f.samples[0].value for name, f in families.items() if f.type == "gauge"}
    assert gauges[f"{base}_count"] == 3 and gauges[f"{base}_error"] == 1
    assert gauges[f"{base}_retries"] == 0 and gauges[f"{base}_backups"] == 0
    assert gauges["rpc_client_echo_connections_made"] == 1
    assert gauges["rpc_client_echo_connection_count"] == 1 and gauges["rpc_client_echo_pending_calls"] == 0
    assert set(channel.stats.as_dict()) <= {n.removeprefix("rpc_client_echo_") for n in gauges}

    # Unnamed: the channel's address underscored; the text parses as it is.
    text = prometheus_text(channel)
    prefix = "rpc_client_127_0_0_1_" + str(srv.port)
    names = {f.name for f in text_string_to_metric_families(text)}
    assert f"{prefix}_{PROM_ECHO}_latency" in names and f"{prefix}_timeouts" in names


async def test_method_status_off_records_nothing(cluster):
    srv = await cluster.start(fail_with(errors.EINTERNAL))
    channel, stub = cluster.channel([srv], timeout_ms=5000, method_status=False)
    await calls(stub, 3)
    with pytest.raises(aiobrpc.RpcError):
        await channel.call_method(SERVICE.full_name, "Echo", UNSERIALIZABLE, Req)
    assert channel._methods is None and channel.status() == {}
    assert "interop" not in prometheus_text(channel, "off")
    assert "rpc_client_off_connections_made 1" in prometheus_text(channel, "off")
