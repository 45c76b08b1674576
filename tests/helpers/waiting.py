"""Waiting for what the loop does a few turns later, on a machine of any speed."""

from __future__ import annotations

import asyncio


async def wait_until(predicate, timeout: float = 10.0) -> None:
    """Return once `predicate()` holds, or after `timeout` s (a hang guard only): the test's
    own assert after it then names what did not happen.

    A fixed sleep before an assert is a bet on the machine's speed: beside a CPU-heavy process
    the other side's reply, close or count may come a few loop turns after the sleep ends.
    A sleep that gives something the time to happen wrongly (a negative check) stays a sleep.
    """
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate() and loop.time() < end:
        await asyncio.sleep(0.005)
