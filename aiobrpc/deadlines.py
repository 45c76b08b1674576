"""Many calls' deadlines on one loop timer (issue 17): a call costs no TimerHandle. A channel's
calls (client/channel.py) and a gRPC connection's calls on the server (server/grpc/session.py)
each share one.

A `TimerWheel` keeps its entries in buckets of one millisecond, by the millisecond their time
falls in (rounded up: an entry never fires early), and keeps one loop timer armed at the
earliest bucket. Adding an entry is a dict lookup and an insert (a heap push for a bucket's
first entry); removing one (the call ended first, the usual case) is a dict pop, and the
bucket goes when it empties, so an ended call is never kept alive until its deadline. The heap
of bucket times is pruned lazily: emptied when the last entry goes, and rebuilt from the
buckets once it holds more than twice as many times as there are buckets (plus a few), so a
peer that picks far deadlines for calls that end early never grows it. When the
timer fires, every bucket that is due is expired, in time order and, within a bucket, in the
order entries were added; then the timer is armed at the next bucket still holding entries.

A per-call `loop.call_at` costs a TimerHandle (and, on uvloop, a libuv timer started and
stopped) for a timer that almost never fires; here a call pays ~0.2 us and the loop wakes at
most once per millisecond per wheel, only while some entry is due in that millisecond.

>>> import asyncio
>>> fired = []
>>> async def main():
...     loop = asyncio.get_running_loop()
...     wheel = TimerWheel(loop, fired.append)
...     now = loop.time()
...     late = wheel.add(now + 0.002, "late")
...     wheel.add(now + 0.001, "early")
...     kept = wheel.add(now + 0.003, "removed")
...     wheel.remove(kept, "removed")
...     await asyncio.sleep(0.01)
>>> asyncio.run(main()); fired
['early', 'late']
"""

from __future__ import annotations

import heapq
import math

_heappush = heapq.heappush
_heappop = heapq.heappop
_ceil = math.ceil
_heapify = heapq.heapify
_SLACK = 64  # stale heap entries tolerated beyond twice the live buckets before a rebuild


class TimerWheel:
    """Entries (any hashable object) expired by `expire(entry)` at their time, on `loop`."""

    __slots__ = ("loop", "expire", "buckets", "ticks", "handle", "armed")

    def __init__(self, loop, expire) -> None:
        self.loop = loop
        self.expire = expire
        self.buckets: dict[int, dict] = {}  # millisecond -> {entry: None}, in the order added
        self.ticks: list[int] = []  # heap of the milliseconds of buckets (some maybe gone)
        self.handle = None  # the one loop timer, armed at millisecond `armed`
        self.armed = 0

    def add(self, when: float, entry) -> int:
        """Expire `entry` at loop time `when` (up to 1 ms later); returns the key `remove` takes."""
        tick = _ceil(when * 1000)
        bucket = self.buckets.get(tick)
        if bucket is None:
            self.buckets[tick] = {entry: None}
            _heappush(self.ticks, tick)
            if self.handle is None or tick < self.armed:
                self._arm(tick)
        else:
            bucket[entry] = None
        return tick

    def remove(self, tick: int, entry) -> None:
        """Forget `entry`, added with key `tick` (nothing if it has expired meanwhile)."""
        buckets = self.buckets
        bucket = buckets.get(tick)
        if bucket is not None:
            bucket.pop(entry, None)
            if not bucket:
                del buckets[tick]
                ticks = self.ticks
                if not buckets:
                    ticks.clear()
                elif len(ticks) > 2 * len(buckets) + _SLACK:
                    ticks[:] = buckets  # in place: _fire may hold this list
                    _heapify(ticks)

    def __len__(self) -> int:
        return sum(len(b) for b in self.buckets.values())

    def footprint(self) -> int:
        """What the wheel holds besides its entries: buckets and heap times (0 when empty)."""
        return len(self.buckets) + len(self.ticks)

    def close(self) -> None:
        """Forget every entry and stop the timer."""
        self.buckets.clear()
        self.ticks.clear()
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None

    def _arm(self, tick: int) -> None:
        if self.handle is not None:
            self.handle.cancel()
        self.armed = tick
        self.handle = self.loop.call_at(tick / 1000, self._fire)

    def _fire(self) -> None:
        self.handle = None
        buckets = self.buckets
        ticks = self.ticks
        expire = self.expire
        # Every bucket whose millisecond has begun is due: the armed one, and any the loop's
        # clock has passed meanwhile.
        due = max(self.armed, int(self.loop.time() * 1000))
        while ticks and ticks[0] <= due:
            bucket = buckets.pop(_heappop(ticks), None)
            if bucket:
                for entry in bucket:
                    try:
                        expire(entry)
                    except Exception as e:  # one entry's failure must not lose the others
                        self.loop.call_exception_handler({"message": "TimerWheel: expire() raised",
                                                          "exception": e, "entry": entry})
        while ticks and ticks[0] not in buckets:  # buckets emptied by remove()
            _heappop(ticks)
        if ticks and (self.handle is None or ticks[0] < self.armed):
            self._arm(ticks[0])
