"""A parameter server over baidu_std: key-sharded servers, push and pull of tensors.

Keys (parameter names) live on server `crc32c(utf8(key)) % len(servers)` (sharding.py); a
worker pushes gradients, the server sums them or takes an SGD or Adam step (optim.py), and
workers pull the weights, in sync, async or bounded-staleness mode (store.py). Tensors travel
as the call's attachment (aiobrpc.tensor); the service is proto/ps.proto, so a C++ brpc worker
can take part.

- `ParameterServer`: the servicer of one shard, for an `aiobrpc.Server`.
- `PsWorker`: the worker API for an asyncio loop; `SyncPsWorker` for a plain loop.
- `python -m aiobrpc.training.ps --port 0 --workers 2 --mode sync`: a server process.
"""

from __future__ import annotations

from .optim import SGD, Adam, Optimizer, Sum
from .server import ParameterServer
from .sharding import key_hash, shard_of
from .store import MODES
from .sync_worker import SyncPsWorker
from .worker import PsWorker, ServerRestarted

__all__ = ["MODES", "SGD", "Adam", "Optimizer", "ParameterServer", "PsWorker", "ServerRestarted", "Sum",
           "SyncPsWorker", "key_hash", "shard_of"]
