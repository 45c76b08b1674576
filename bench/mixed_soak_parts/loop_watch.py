"""How long the soak's own event loop could not run: the time a check must not count.

A call that does not end within its deadline plus the slack is "lost", a hang of the library.
But the process that checks may itself not run: on a machine busy with other work the kernel
leaves it unscheduled for seconds, and then the library's timers (which would end the call) and
the check's timer fire late together. `LoopWatch` measures that: a task sleeps `tick` seconds
again and again, and every wake-up later than asked adds the lateness to `stalled()`. A check
extends its window by what `stalled()` grew during it, so it counts only the time the loop ran.

Whether a stall was the loop busy with our own work (a callback that blocks: a defect) or the
process not scheduled (the machine's load) shows in the loop thread's CPU time over the stall:
`worst` keeps the longest stall with the CPU it took, and the soak reports it.
"""

from __future__ import annotations

import asyncio
import time

GRACE = 0.005  # lateness below this is the loop's ordinary jitter


class LoopWatch:
    def __init__(self, tick: float = 0.05) -> None:
        self.tick = tick
        self._stalled = 0.0
        self._expected: float | None = None  # when the current sleep should end (loop time)
        self.worst = (0.0, 0.0)  # (seconds late, seconds of the loop thread's CPU meanwhile)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def stalled(self) -> float:
        """Seconds the loop was late so far, a stall still going on included."""
        late = 0.0
        if self._expected is not None:
            late = max(0.0, asyncio.get_running_loop().time() - self._expected - GRACE)
        return self._stalled + late

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._expected = loop.time() + self.tick
            cpu0 = time.thread_time()
            await asyncio.sleep(self.tick)
            late = loop.time() - self._expected - GRACE
            self._expected = None
            if late > 0:
                self._stalled += late
                if late > self.worst[0]:
                    self.worst = (late, time.thread_time() - cpu0)
