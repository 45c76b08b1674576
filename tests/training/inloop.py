"""Groups whose ranks all run on the test's own event loop (a FileStore in tmp_path)."""

from __future__ import annotations

import asyncio

from aiobrpc.training import FileStore, Group


async def make_groups(tmp_path, world=2, timeout=5.0, **options) -> list[Group]:
    store = FileStore(str(tmp_path), timeout=10)
    return list(await asyncio.gather(*(Group.create(store, r, world, timeout=timeout, **options)
                                       for r in range(world))))


async def close_groups(groups) -> None:
    await asyncio.gather(*(g.close() for g in groups))
