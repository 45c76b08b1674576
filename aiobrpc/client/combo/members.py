"""What a combo channel asks of its sub-channels: a `call_method` coroutine, and optionally
`check_health()` / `server_states()` (health) and `close()`.

Any aiobrpc channel qualifies (Channel and every combo channel, so combos nest).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

log = logging.getLogger(__name__)

#: The most sub-channels one ParallelChannel or SelectiveChannel holds, and the most
#: partitions of a PartitionChannel: each call of a fan-out channel holds one task and one
#: controller per sub-channel, so this bounds a call's memory.
MAX_SUB_CHANNELS = 1024


async def call_sub_channel(channel: Any, service_name: str, method_name: str, request, response_class, cntl):
    """`channel.call_method(...)`, awaited inside the sub-call's task: a call_method that
    raises at once fails that sub-call like any other failure."""
    return await channel.call_method(service_name, method_name, request, response_class, cntl)


def check_sub_channel(owner: Any, channel: Any, count: int) -> None:
    """TypeError / ValueError when `channel` cannot be added to `owner`, which has `count`
    sub-channels already."""
    if not callable(getattr(channel, "call_method", None)):
        raise TypeError(f"a sub-channel needs a call_method(service_name, method_name, request, "
                        f"response_class, cntl) coroutine method, got {type(channel).__name__}")
    if count >= MAX_SUB_CHANNELS:
        raise ValueError(f"{type(owner).__name__} holds at most {MAX_SUB_CHANNELS} sub-channels")
    if reaches(channel, owner):
        raise ValueError(f"adding {channel!r} to {owner!r} would make a cycle: a call would never end")


def reaches(channel: Any, target: Any) -> bool:
    """Whether `target` is `channel` or one of the combo channels nested in it."""
    seen: set[int] = set()
    todo = [channel]
    while todo:
        ch = todo.pop()
        if ch is target:
            return True
        if id(ch) in seen:
            continue
        seen.add(id(ch))
        subs = getattr(ch, "sub_channels", None)
        if callable(subs):
            todo.extend(subs())
    return False


def is_healthy(channel: Any) -> bool:
    """Whether `channel` can serve a call now: its own `check_health()`, else (a Channel)
    whether one of its servers is up, else True."""
    check = getattr(channel, "check_health", None)
    if callable(check):
        try:
            return bool(check())
        except Exception as e:  # a foreign channel's fault: it stays unhealthy
            log.warning("check_health of %r raised %r", channel, e)
            return False
    states = getattr(channel, "server_states", None)
    if callable(states):
        return any(state == "up" for state in states().values())
    return True


async def close_all(channels: Iterable[Any]) -> None:
    """Close each distinct channel once (those without `close()` are left); a close that
    raises is logged, the others still close."""
    seen: set[int] = set()
    for ch in channels:
        if id(ch) in seen:
            continue
        seen.add(id(ch))
        close = getattr(ch, "close", None)
        if not callable(close):
            continue
        try:
            result = close()
            if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
                await result
        except Exception as e:
            log.error("closing sub-channel %r raised %r", ch, e, exc_info=e)
