"""A rank that learns of a failure from another rank raises the same type of error: a timeout
found on one rank is a CollectiveTimeout on every rank, whichever way the news reached it.

Two ranks in one loop, so which rank fails first is chosen, not raced (the process tests in
test_collectives.py race them)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from aiobrpc.training import CollectiveError, CollectiveTimeout, FileStore, Group


async def _pair(tmp_path) -> list[Group]:
    store = FileStore(str(tmp_path), timeout=10)
    return list(await asyncio.gather(*(Group.create(store, r, 2, timeout=5) for r in range(2))))


async def _close(groups: list[Group]) -> None:
    await asyncio.gather(*(g.close() for g in groups))


@pytest.mark.parametrize("error_type", [CollectiveTimeout, CollectiveError])
async def test_a_segment_refused_by_a_broken_rank_raises_its_error_type(error_type, tmp_path):
    groups = await _pair(tmp_path)
    try:
        groups[1]._fail(error_type("rank 1 found rank 7 hung", (7,)), tell_peers=False)
        with pytest.raises(CollectiveError) as info:
            await groups[0].all_reduce(np.ones(1000, np.float32))
        assert type(info.value) is error_type
        assert info.value.ranks == (7,) and "rank 7 hung" in str(info.value)
    finally:
        await _close(groups)


@pytest.mark.parametrize("error_type", [CollectiveTimeout, CollectiveError])
async def test_an_abort_from_another_rank_raises_its_error_type(error_type, tmp_path):
    groups = await _pair(tmp_path)
    try:
        groups[1]._fail(error_type("rank 1 found rank 7 hung", (7,)))  # tells rank 0
        for _ in range(100):
            if groups[0].broken is not None:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(CollectiveError) as info:
            await groups[0].all_reduce(np.ones(10, np.float32))
        assert type(info.value) is error_type
        assert "reported to rank 0 by rank 1" in str(info.value) and info.value.ranks == (7,)
    finally:
        await _close(groups)
