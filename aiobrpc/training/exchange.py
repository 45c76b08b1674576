"""Collectives made of point-to-point messages: gather, scatter, all_to_all.

Each runs as collective number `seq` of its group; its messages carry that number (p2p.py's
`coll`), so they never match the user's sends or another collective's. A rank's own part is
copied locally.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from .p2p import byte_view

if TYPE_CHECKING:
    from .group import Group


def _copy(dst: Any, src: Any, what: str) -> None:
    dtype, numel, _, dbuf = byte_view(dst, what)
    sdtype, snumel, _, sbuf = byte_view(src, what)
    if (dtype, numel) != (sdtype, snumel):
        raise ValueError(f"{what}: {snumel} {sdtype} cannot go into {numel} {dtype}")
    dbuf[:] = sbuf


async def gather(group: Group, seq: int, tensor: Any, outs: list | None, root: int) -> None:
    p2p = group.p2p
    if group.rank != root:
        await p2p.send(tensor, root, 0, seq)
        return
    waits = [p2p.recv(outs[r], r, 0, seq) for r in range(group.world_size) if r != root]
    _copy(outs[root], tensor, "gather output")
    await asyncio.gather(*waits)


async def scatter(group: Group, seq: int, out: Any, ins: list | None, root: int) -> None:
    p2p = group.p2p
    if group.rank != root:
        await p2p.recv(out, root, 0, seq)
        return
    waits = [p2p.send(ins[r], r, 0, seq) for r in range(group.world_size) if r != root]
    _copy(out, ins[root], "scatter output")
    await asyncio.gather(*waits)


async def all_to_all(group: Group, seq: int, outs: list, ins: list) -> None:
    p2p, me, world = group.p2p, group.rank, group.world_size
    waits = []
    for k in range(1, world):  # staggered: rank r sends to r + k while receiving from r - k
        waits.append(p2p.recv(outs[(me - k) % world], (me - k) % world, 0, seq))
        waits.append(p2p.send(ins[(me + k) % world], (me + k) % world, 0, seq))
    _copy(outs[me], ins[me], "all_to_all output")
    await asyncio.gather(*waits)
