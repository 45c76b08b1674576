"""channel.stats: one readable line with every counter."""

from __future__ import annotations

import aiobrpc


async def test_repr_lists_every_counter_on_one_line():
    async with aiobrpc.Channel("127.0.0.1:8000") as channel:
        stats = channel.stats
        stats.retries, stats.backup_requests = 2, 1
        text = repr(stats)
    assert text.startswith("ClientStats(") and text.endswith(")") and "\n" not in text
    assert "retries=2, backup_requests=1" in text
    assert text == f"ClientStats({', '.join(f'{k}={v}' for k, v in stats.as_dict().items())})"
