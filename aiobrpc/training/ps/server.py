"""The parameter-server service: one shard of the keys, served over baidu_std.

Calls (proto/ps.proto, service `aiobrpc.ps.ParameterServer`): `Init` creates keys, `Push`
applies gradients (or gathers them for a sync step), `Pull` answers with weights once the
mode's clock allows (a pull that cannot be answered within `max_wait_s`, or the time its
caller has left, fails with ERPCTIMEDOUT naming the workers it waited for).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Mapping
from typing import Any

import numpy as np

from ... import tensor
from ...errors import ELOGOFF, EREQUEST, ERPCTIMEDOUT, RpcError
from ...stub import Servicer
from ..._proto import ps_pb2
from .optim import Optimizer
from .store import KeyStore

__all__ = ["ParameterServer"]

SERVICE = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"]


def _named(meta: tensor.TensorMeta, attachment: Any, what: str) -> dict[str, np.ndarray]:
    try:
        views = tensor.unpack(meta, attachment)
    except (ValueError, TypeError) as e:
        raise RpcError(EREQUEST, f"{what}: {e}") from None
    named = {info.name: v for info, v in zip(meta.tensors, views)}
    if len(named) != len(views):
        names = [info.name for info in meta.tensors]
        twice = next(n for n in names if names.count(n) > 1)
        raise RpcError(EREQUEST, f"{what}: key {twice!r} is given twice")
    return named


class ParameterServer(Servicer):
    """One shard of a parameter server: add it to an `aiobrpc.Server`.

    Args:
        num_workers: Workers pushing to it, numbered 0 .. num_workers - 1.
        mode: "sync" (a pull at step t waits for every worker's push of step t - 1, and a
            step's pushes are combined into one update), "async" (pushes apply on arrival,
            pulls never wait) or "bounded" (pushes apply on arrival; a pull at step t waits
            until every worker has pushed step t - 1 - staleness).
        staleness: Steps a worker may run ahead of the slowest, in "bounded" mode.
        optimizer: `Sum()`, `SGD(lr)` (the default, lr=0.01) or `Adam(...)`.
        average: In sync mode, apply the mean of the workers' pushes (else their sum).
        max_wait_s: The longest a pull waits for other workers.
        max_bytes: Memory the keys may take (values, optimizer state, sync sums); an Init
            beyond it fails with EREQUEST.
        initial: Keys to hold from the start (e.g. loaded from a checkpoint), name -> array.

    >>> import aiobrpc, numpy as np
    >>> from aiobrpc.training.ps import ParameterServer, PsWorker, SGD
    >>> async def main():
    ...     async with aiobrpc.Server() as server:
    ...         server.add_service(ParameterServer(num_workers=1, mode="sync", optimizer=SGD(lr=0.5)))
    ...         await server.start("127.0.0.1:0")
    ...         async with PsWorker([server.address], worker=0) as w:
    ...             await w.init({"w": np.zeros(2, np.float32)})
    ...             await w.push({"w": np.array([1, -1], np.float32)})
    ...             return (await w.pull())["w"].tolist()
    >>> asyncio.run(main())
    [-0.5, 0.5]
    """

    SERVICE = SERVICE

    def __init__(self, num_workers: int, *, mode: str = "async", staleness: int = 0,
                 optimizer: Optimizer | None = None, average: bool = True, max_wait_s: float = 30.0,
                 max_bytes: int = 1 << 34, initial: Mapping[str, Any] | None = None) -> None:
        if isinstance(max_wait_s, bool) or not isinstance(max_wait_s, (int, float)) or not max_wait_s > 0:
            raise ValueError(f"max_wait_s must be a number of seconds > 0, got {max_wait_s!r}")
        self.store = KeyStore(num_workers, mode=mode, staleness=staleness, optimizer=optimizer,
                              average=average, max_bytes=max_bytes)
        self.max_wait_s = float(max_wait_s)
        # Random, so that a restarted server (which lost its clocks) differs from its past self.
        self.generation = secrets.randbits(63) + 1
        self._stopping = False
        if initial:
            self.store.init({k: np.asarray(v) for k, v in initial.items()})

    def stop(self) -> None:
        """Fail the pulls waiting now (ELOGOFF) and those to come, so a server can stop at once."""
        self._stopping = True
        self.store.changed.set()

    def _stale(self, generation: int) -> bool:
        return generation != 0 and generation != self.generation

    async def Init(self, request, cntl):
        if self._stale(request.generation):
            return ps_pb2.InitResponse(generation=self.generation)
        values = _named(request.values, cntl.request_attachment, "init values")
        created = self.store.init(values, request.step)
        return ps_pb2.InitResponse(generation=self.generation, created=created)

    async def Push(self, request, cntl):
        if self._stale(request.generation):
            return ps_pb2.PushResponse(generation=self.generation)
        grads = _named(request.grads, cntl.request_attachment, "push gradients")
        ids = _named(request.row_ids, cntl.request_attachment, "push row ids")
        self.store.push(request.worker, request.step, grads, ids)
        return ps_pb2.PushResponse(generation=self.generation)

    async def Pull(self, request, cntl):
        if self._stale(request.generation):
            return ps_pb2.PullResponse(generation=self.generation)
        keys = list(request.keys)
        ids = _named(request.row_ids, cntl.request_attachment, "pull row ids")
        store = self.store
        store.check_pull(request.worker, request.step, keys, ids)
        await self._wait([*keys, *ids], request.step, cntl)
        values = store.read(keys, ids)
        meta = tensor.set_response_tensors(cntl, values)
        for info, name in zip(meta.tensors, [*keys, *ids]):
            info.name = name  # a key may be pulled whole and by rows: a list, named after
        return ps_pb2.PullResponse(generation=self.generation, values=meta)

    async def _wait(self, keys: list[str], step: int, cntl) -> None:
        store = self.store
        if store.ready(keys, step) and not self._stopping:
            return
        wait_s = self.max_wait_s
        if cntl.timeout_ms is not None and cntl.timeout_ms > 0:
            # End before the caller does, so that it reads who it waited for.
            wait_s = min(wait_s, cntl.timeout_ms * 0.9 / 1000)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            store.changed.clear()
            if self._stopping:
                raise RpcError(ELOGOFF, "the parameter server is stopping")
            if store.ready(keys, step):
                return
            left = deadline - loop.time()
            if left <= 0:
                late = store.stragglers(keys, step)
                raise RpcError(ERPCTIMEDOUT, f"pull at step {step} waited {wait_s:.3g} s for worker(s) "
                                             f"{late} to push ({store.mode} mode"
                                             + (f", staleness {store.staleness})" if store.mode == "bounded" else ")"))
            try:
                await asyncio.wait_for(store.changed.wait(), left)
            except asyncio.TimeoutError:
                pass
