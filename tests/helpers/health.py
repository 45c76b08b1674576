"""Waiting for a channel's servers to be revived by their health check (brpc's docs/en/client.md)."""

from __future__ import annotations

import asyncio


async def wait_up(channel, timeout: float = 3.0) -> float:
    """Wait until every server of `channel` is up again; returns the seconds waited."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while any(state != "up" for state in channel.server_states().values()):
        if loop.time() - start > timeout:
            raise AssertionError(f"servers not revived within {timeout}s: {channel.server_states()}")
        await asyncio.sleep(0.01)
    return loop.time() - start
