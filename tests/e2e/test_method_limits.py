"""Per-method concurrency limiters (F2), and "auto" shedding load under overload."""

from __future__ import annotations

import asyncio
import statistics
import time

import pytest

import aiobrpc
from aiobrpc import errors
from aiobrpc._proto import echo_pb2, interop_pb2
from tests.helpers.interop_server import SERVICE, InteropEcho

ECHO = "interop.EchoService.Echo"


async def test_a_method_limit_answers_elimit_naming_the_method():
    srv = aiobrpc.Server()
    srv.add_service(InteropEcho())
    srv.max_concurrency_of(ECHO, 2)
    await srv.start("127.0.0.1:0")
    ch = aiobrpc.Channel(srv.address, aiobrpc.ChannelOptions(max_retry=0))
    stub = aiobrpc.Stub(ch, SERVICE)
    results = await asyncio.gather(*(stub.Echo(interop_pb2.EchoRequest(message="m", sleep_ms=300))
                                     for _ in range(6)), return_exceptions=True)
    refused = [r for r in results if isinstance(r, aiobrpc.RpcError)]
    assert len(refused) == 4 and {e.code for e in refused} == {errors.ELIMIT}
    assert "Rejected by interop.EchoService.Echo's ConcurrencyLimiter, concurrency=3" in refused[0].text
    figures = srv.registry.services["interop.EchoService"]["Echo"].status.describe()
    assert figures["max_concurrency"] == 2 and figures["count"] == 2
    await ch.close()
    await srv.stop()
    await srv.join(timeout=2)


async def test_limits_are_checked_and_set_before_start():
    srv = aiobrpc.Server(aiobrpc.ServerOptions(method_max_concurrency={"timeout_ms": 100, "max_concurrency": 5}))
    srv.add_service(InteropEcho())
    limiter = srv.registry.services["interop.EchoService"]["StartStream"].status.limiter
    assert (limiter.timeout_ms, limiter.max_concurrency) == (100, 5)
    with pytest.raises(ValueError, match="no method 'interop.EchoService.Nope' here; the methods are: "
                                         "interop.EchoService.Echo, interop.EchoService.StartStream"):
        srv.max_concurrency_of("interop.EchoService.Nope", 3)
    with pytest.raises(ValueError, match="max_concurrency is 0, 'unlimited'"):
        srv.max_concurrency_of(ECHO, "fast")
    with pytest.raises(ValueError, match="max_concurrency"):
        aiobrpc.ServerOptions(method_max_concurrency=-2)
    srv.max_concurrency_of(ECHO, "unlimited")
    assert srv.registry.services["interop.EchoService"]["Echo"].status.limiter is None
    await srv.start("127.0.0.1:0")
    with pytest.raises(RuntimeError, match="before start"):
        srv.max_concurrency_of(ECHO, 3)
    await srv.stop()
    await srv.join(timeout=1)


class Workers(aiobrpc.Servicer):
    """A service with 4 workers of 2 ms each: past 4 calls at once, calls queue."""

    SERVICE = echo_pb2.DESCRIPTOR.services_by_name["EchoService"]

    def __init__(self) -> None:
        self.workers = asyncio.Semaphore(4)
        self.inside = 0     # requests in the handler now (queued for a worker or on one)
        self.peak = 0       # the most at once since `watch` was set
        self.watch = False

    async def Echo(self, request, cntl):
        self.inside += 1
        if self.watch:
            self.peak = max(self.peak, self.inside)
        try:
            async with self.workers:
                await asyncio.sleep(0.002)
        finally:
            self.inside -= 1
        return echo_pb2.EchoResponse(message=request.message)


async def _overload(setting) -> tuple[float, int, int, int]:
    """p50 latency (ms) of the calls served in the last second of an overload, calls served
    then, calls refused with ELIMIT, and the most requests in the handler at once then, with
    `setting` as the method's limiter."""
    srv = aiobrpc.Server()
    workers = Workers()
    srv.add_service(workers)
    srv.max_concurrency_of("example.EchoService.Echo", setting)
    await srv.start("127.0.0.1:0")
    ch = aiobrpc.Channel(srv.address, aiobrpc.ChannelOptions(max_retry=0, timeout_ms=5000))
    stub = aiobrpc.Stub(ch, Workers.SERVICE)
    latencies: list[float] = []
    refused = 0
    start = time.monotonic()
    measure_from = start + 1.4

    async def client(begin: float, until: float) -> None:
        nonlocal refused
        await asyncio.sleep(begin)
        if begin:
            asyncio.get_running_loop().call_at(asyncio.get_running_loop().time() + 0.8,
                                               setattr, workers, "watch", True)
        while time.monotonic() < until:
            t0 = time.monotonic()
            try:
                await stub.Echo(echo_pb2.EchoRequest(message="x"))
            except aiobrpc.RpcError as e:
                assert e.code == errors.ELIMIT
                if t0 >= measure_from:
                    refused += 1
                await asyncio.sleep(0.005)  # a refused caller backs off a little
                continue
            if t0 >= measure_from:
                latencies.append(time.monotonic() - t0)

    end = start + 2.4
    # light load first (no queueing: the limiter learns the no-load latency), then 64 callers
    await asyncio.gather(*(client(0, end) for _ in range(2)), *(client(0.6, end) for _ in range(62)))
    await ch.close()
    await srv.stop()
    await srv.join(timeout=2)
    return statistics.median(latencies) * 1000, len(latencies), refused, workers.peak


async def test_auto_sheds_load_and_keeps_latency_when_overloaded():
    none_p50, none_served, none_refused, none_peak = await _overload(0)
    auto_p50, auto_served, auto_refused, auto_peak = await _overload("auto")
    assert none_refused == 0 and auto_refused > 0
    # Without a limit the 64 callers all wait in the handler for 4 workers; "auto" keeps about
    # its floor of 8 in (the figures that follow from it, on an idle machine: served calls wait
    # 6-7 ms instead of 36, and ~80 % as many are served; docs/server.md). The bounds here are
    # loose: test runs share the cores, and time is what they steal.
    assert none_peak > 40 and auto_peak <= 20, (none_peak, auto_peak)
    assert auto_p50 < none_p50, (auto_p50, none_p50)
    assert auto_served > none_served * 0.2, (auto_served, none_served)
