"""Call deadlines and backup times share one loop timer per channel (deadlines.py,
issue 17): they still fire on time, never early, in order, and an ended call leaves nothing."""

from __future__ import annotations

import asyncio
import math

import pytest
import pytest_asyncio

import aiobrpc
from aiobrpc import errors
from aiobrpc.deadlines import TimerWheel
from tests.client.test_call_rules import Cluster, Req
from tests.helpers.waiting import wait_until


@pytest_asyncio.fixture
async def cluster():
    c = Cluster()
    yield c
    await c.close()


async def test_wheel_fires_in_time_order_never_early_and_forgets_removed_entries():
    loop = asyncio.get_running_loop()
    fired = []
    wheel = TimerWheel(loop, lambda entry: fired.append((entry, loop.time())))
    now = loop.time()
    whens = {f"e{i}": now + (i * 7 % 30) / 1000 for i in range(30)}
    keys = {name: wheel.add(when, name) for name, when in whens.items()}
    for name in ("e3", "e17"):
        wheel.remove(keys[name], name)
    wheel.remove(keys["e3"], "e3")  # twice: nothing
    await asyncio.sleep(0.06)
    names = [name for name, _ in fired]
    assert sorted(names) == sorted(set(whens) - {"e3", "e17"})
    # By millisecond, then in the order added (within one millisecond, not by time).
    assert names == sorted(names, key=lambda n: (keys[n], int(n[1:])))
    for name, at in fired:
        assert at >= whens[name] - 1e-6  # never early
    assert len(wheel) == 0 and wheel.handle is None and wheel.footprint() == 0


async def test_entries_removed_before_their_time_leave_no_heap_behind():
    """Issue 29 R8: far deadlines of calls that end first (the usual case) are forgotten
    entirely, not only their buckets: the heap of times stays within twice the live buckets."""
    loop = asyncio.get_running_loop()
    wheel = TimerWheel(loop, lambda entry: None)
    now = loop.time()
    kept = wheel.add(now + 5000, "kept")  # one call that stays in flight throughout
    for i in range(3000):
        key = wheel.add(now + 1000 + i / 100, i)  # each in a millisecond of its own
        wheel.remove(key, i)
        assert len(wheel.ticks) <= 2 * len(wheel.buckets) + 64
    assert len(wheel) == 1 and len(wheel.buckets) == 1
    wheel.remove(kept, "kept")
    assert len(wheel) == 0 and wheel.footprint() == 0
    # Still fires what is added afterwards, in order.
    fired = []
    wheel.expire = fired.append
    now = loop.time()
    for i in (3, 1, 2):
        wheel.add(now + i * 5 / 1000, i)  # 5 ms apart: one millisecond's bucket keeps the order added
    while len(fired) < 3:
        await asyncio.sleep(0.005)
    await wait_until(lambda: fired == [1, 2, 3] and wheel.footprint() == 0)
    assert fired == [1, 2, 3] and wheel.footprint() == 0
    wheel.close()


async def test_an_earlier_entry_rearms_the_timer_and_close_stops_it():
    loop = asyncio.get_running_loop()
    fired = []
    wheel = TimerWheel(loop, fired.append)
    late = loop.time() + 10
    wheel.add(late, "late")
    # armed for its millisecond (uvloop keeps whole milliseconds: its float may differ in the last bit)
    assert wheel.handle.when() == pytest.approx(math.ceil(late * 1000) / 1000, abs=1e-6)
    soon = loop.time() + 0.005
    wheel.add(soon, "soon")
    assert wheel.handle.when() == pytest.approx(math.ceil(soon * 1000) / 1000, abs=1e-6)  # armed again, earlier
    await asyncio.sleep(0.03)
    await wait_until(lambda: fired == ["soon"] and wheel.handle is not None)
    assert fired == ["soon"] and wheel.handle is not None  # armed again, for "late"
    wheel.close()
    assert wheel.handle is None and len(wheel) == 0


async def test_an_expire_that_raises_does_not_lose_the_others(loop_errors):
    loop = asyncio.get_running_loop()
    fired = []

    def expire(entry):
        if entry == "bad":
            raise ValueError("bad")
        fired.append(entry)
    wheel = TimerWheel(loop, expire)
    t = loop.time() + 0.002
    for name in ("a", "bad", "b"):
        wheel.add(t, name)
    await asyncio.sleep(0.02)
    await wait_until(lambda: fired == ["a", "b"])
    assert fired == ["a", "b"]
    assert [type(e["exception"]) for e in loop_errors] == [ValueError]
    loop_errors.clear()


async def test_many_calls_with_staggered_deadlines_time_out_on_time(cluster):
    async def never(srv, request, cntl, n):
        await asyncio.sleep(10)

    srv = await cluster.start(never)
    channel, stub = cluster.channel([srv], max_retry=0)
    await channel.connect()  # the deadlines below are of calls, not of a connect
    loop = asyncio.get_running_loop()
    expired = []  # the calls' deadlines, in the order the channel's timer expired them
    wheel = channel._deadlines
    expire = wheel.expire
    wheel.expire = lambda call: (expired.append(call.deadline), expire(call))

    async def one(i: int, timeout_ms: int):
        cntl = aiobrpc.Controller(timeout_ms=timeout_ms)
        start = loop.time()
        with pytest.raises(aiobrpc.RpcError) as ei:
            await stub.Echo(Req(message=str(i)), cntl)
        assert (loop.time() - start) * 1000 >= timeout_ms - 1  # never early (uvloop's clock: whole ms)
        assert ei.value.code == errors.ERPCTIMEDOUT and f"Reached timeout={timeout_ms}ms" in ei.value.text
        assert cntl.latency_us >= timeout_ms * 1000 - 1000

    timeouts = [20 + (i * 37) % 180 for i in range(300)]  # 20..199 ms, interleaved
    await asyncio.gather(*(one(i, t) for i, t in enumerate(timeouts)))
    # On time, as a behaviour and not as milliseconds that a loaded machine bends: the channel's
    # one timer expired every call, a millisecond at a time in deadline order, however late the
    # loop ran it (the wheel's own tests show it armed for the first deadline's millisecond).
    ticks = [math.ceil(d * 1000) for d in expired]
    assert len(ticks) == 300 and ticks == sorted(ticks)
    assert wheel is channel._deadlines
    assert channel.stats.timeouts == 300
    assert len(channel._deadlines) == 0 and channel._deadlines.footprint() == 0


async def test_a_call_that_ends_leaves_no_deadline_or_backup_behind(cluster):
    srv = await cluster.start()
    channel, stub = cluster.channel([srv], backup_request_ms=500, timeout_ms=1000)
    await asyncio.gather(*(stub.Echo(Req(message=str(i))) for i in range(20)))
    assert len(channel._deadlines) == 0 and len(channel._backups) == 0
    assert channel._deadlines.footprint() == 0 and channel._backups.footprint() == 0


async def test_far_deadlines_of_ended_calls_leave_nothing_in_the_channels_wheel(cluster):
    """Issue 29 R8, the channel's side: 3,000 calls whose deadlines are far and all different
    end first; the wheel holds nothing afterwards, heap included."""
    srv = await cluster.start()
    channel, stub = cluster.channel([srv])
    for start in range(0, 3000, 300):
        await asyncio.gather(*(stub.Echo(Req(message=str(i)), aiobrpc.Controller(timeout_ms=100_000 + i))
                               for i in range(start, start + 300)))
    assert len(channel._deadlines) == 0 and channel._deadlines.footprint() == 0
