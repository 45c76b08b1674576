"""Distributed training over aiobrpc, built on the public API like any user of the library:
ring collectives among N processes (here) and `ps`, a parameter server.

`Group` (asyncio) and `GroupThread` (synchronous callers; its loop runs in a background thread)
run all_reduce (SUM, AVG, MAX, MIN, PRODUCT, BAND, BOR, BXOR), reduce_scatter, all_gather,
broadcast, barrier, point-to-point send/recv, gather, scatter and all_to_all on numpy arrays
and torch CPU tensors; the ranks meet through a store (`FileStore`, or any torch
store). `aiobrpc.training.torch_backend` registers these as the torch.distributed backend
"aiobrpc".

>>> from aiobrpc.training import ReduceOp
>>> ReduceOp("avg")
<ReduceOp.AVG: 'avg'>
"""

from __future__ import annotations

from .errors import CollectiveError, CollectiveTimeout
from .group import Group
from .reduce import ReduceOp
from .store import FileStore, Store
from .thread import GroupThread

__all__ = ["CollectiveError", "CollectiveTimeout", "FileStore", "Group", "GroupThread", "ReduceOp", "Store"]
