"""The parameter-server service: one shard of the keys, served over baidu_std.

Calls (proto/ps.proto, service `aiobrpc.ps.ParameterServer`): `Init` creates keys, `Push`
applies gradients (or gathers them for a sync step), `Pull` answers with weights once the
mode's clock allows (a pull that cannot be answered within `max_wait_s`, or the time its
caller has left, fails with ERPCTIMEDOUT naming the workers it waited for).

A push of AFTER_REPLY_BYTES or more is answered once checked and counted, and its optimizer
step taken after the reply is written: on the loop, one iteration later (a step of a few
milliseconds at most costs less there than the two thread switches of a hand-over), or, when
its bytes times the rule's `step_cost` reach BACKGROUND_BYTES (32 MiB of SGD, 330 KiB of
Adam), on one thread, while the loop receives the next call. Updates keep their order, and a
pull reads after every update answered before it.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import deque
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ... import tensor
from ...errors import EINTERNAL, ELOGOFF, EREQUEST, ERPCTIMEDOUT, RpcError
from ...stub import Servicer
from ..._proto import ps_pb2
from .optim import Optimizer
from .store import MAX_PULL_BYTES, KeyStore

__all__ = ["ParameterServer"]

SERVICE = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"]
# A push whose gradient bytes times its rule's step_cost reach this is answered once checked,
# and its optimizer step runs on a thread (the kernels let go of the GIL) while the loop
# receives the next call.
BACKGROUND_BYTES = 32 << 20
MAX_BACKGROUND = 2  # pushes applied or queued on the thread at once; one more waits for room
# A push of at least this many gradient bytes (and less than BACKGROUND_BYTES) is answered
# first; its step runs on the loop once the reply is out, before any later call's.
AFTER_REPLY_BYTES = 256 * 1024
# Such a step is taken this many bytes of gradient at a time, the loop reading between slices
# (16 MiB pushes of SGD here: 137-144 calls/s whole, 158-168 in 1 MiB slices, 158-171 in 512 KiB).
STEP_SLICE_BYTES = 1 << 20

log = logging.getLogger(__name__)


def _named(meta: tensor.TensorMeta, attachment: Any, what: str) -> dict[str, np.ndarray]:
    if not meta.tensors:
        return {}
    try:
        named = tensor.unpack_named(meta, attachment)
    except (ValueError, TypeError) as e:
        raise RpcError(EREQUEST, f"{what}: {e}") from None
    if len(named) != len(meta.tensors):
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
        max_bytes: Memory the keys may take (values, optimizer state, the sums and rows of a
            sync step, and 512 bytes plus the name of each key); an Init, or a sync push of
            rows, beyond it fails with EREQUEST.
        max_pull_bytes: The most bytes of rows one pull copies (1 GiB; keys pulled whole are
            lent, not copied); a pull asking more fails with EREQUEST. An 8-byte row id asks
            for a row of any size: without it a small request could make a huge reply.
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
                 max_bytes: int = 1 << 34, max_pull_bytes: int = MAX_PULL_BYTES,
                 initial: Mapping[str, Any] | None = None) -> None:
        if isinstance(max_wait_s, bool) or not isinstance(max_wait_s, (int, float)) or not max_wait_s > 0:
            raise ValueError(f"max_wait_s must be a number of seconds > 0, got {max_wait_s!r}")
        self.store = KeyStore(num_workers, mode=mode, staleness=staleness, optimizer=optimizer,
                              average=average, max_bytes=max_bytes, max_pull_bytes=max_pull_bytes)
        self.max_wait_s = float(max_wait_s)
        # Random, so that a restarted server (which lost its clocks) differs from its past self.
        self.generation = secrets.randbits(63) + 1
        self._stopping = False
        self._executor: ThreadPoolExecutor | None = None
        self._background: deque[asyncio.Future] = deque()  # in the order run (one thread)
        self._after_reply: deque = deque()  # steps to take on the loop, in order, before any later call's
        self._stepping = False  # _step_after_reply is scheduled
        self._failed: BaseException | None = None
        if initial:
            self.store.init({k: np.asarray(v) for k, v in initial.items()})

    def stop(self) -> None:
        """Fail the pulls waiting now (ELOGOFF) and those to come, so a server can stop at once."""
        self._stopping = True
        self.store.changed.set()

    def _stale(self, generation: int) -> bool:
        return generation != 0 and generation != self.generation

    async def Init(self, request, cntl):
        self._take_after_reply()
        if self._stale(request.generation):
            return ps_pb2.InitResponse(generation=self.generation)
        values = _named(request.values, cntl.request_attachment, "init values")
        created = self.store.init(values, request.step)
        return ps_pb2.InitResponse(generation=self.generation, created=created)

    async def Push(self, request, cntl):
        self._take_after_reply()
        if self._stale(request.generation):
            return ps_pb2.PushResponse(generation=self.generation)
        grads = _named(request.grads, cntl.request_attachment, "push gradients")
        ids = _named(request.row_ids, cntl.request_attachment, "push row ids")
        background = self._background
        nbytes = sum(g.nbytes for g in grads.values())
        if background or nbytes * self.store.optimizer.step_cost >= BACKGROUND_BYTES:
            while len(background) >= MAX_BACKGROUND:
                await asyncio.wait([background[0]])
            # Steps wait after a reply only while the thread is idle: taken here, before the
            # thread gets one, no two steps ever run at once.
            self._take_after_reply()
            # Behind an update still running, a small push goes to the thread too: in order.
            job = self.store.push(request.worker, request.step, grads, ids, later=True)
            if job is not None:
                self._run_in_background(job)
        elif nbytes >= AFTER_REPLY_BYTES:
            job = self.store.push(request.worker, request.step, grads, ids, later=True)
            if job is not None:
                self._after_reply.append(job)
                if not self._stepping:
                    # Two hops: the reply's write is queued for the end of this iteration.
                    self._stepping = True
                    loop = asyncio.get_running_loop()
                    loop.call_soon(loop.call_soon, self._step_after_reply)
        else:
            self.store.push(request.worker, request.step, grads, ids)
        return ps_pb2.PushResponse(generation=self.generation)

    def _step_after_reply(self) -> None:
        """Take a slice of the steps waiting after their replies, then let the loop read before
        the next one: the next push comes in while this one's step is taken (a sender can
        only put its socket's send buffer ahead of a reader that does not read)."""
        steps = self._after_reply
        try:
            if steps and steps[0].some(STEP_SLICE_BYTES):
                steps.popleft()
        except Exception as e:  # noqa: BLE001 (as on the thread: the key's state is unknown)
            steps.popleft()
            self._lost(e)
        if steps:
            asyncio.get_running_loop().call_soon(self._step_after_reply)
        else:
            self._stepping = False

    def _lost(self, e: BaseException) -> None:
        if self._failed is None:
            self._failed = e
            log.error("a push's update failed; pulls fail from now on", exc_info=e)

    def _take_after_reply(self) -> None:
        """Take the steps of the pushes answered before now (at the latest one iteration after
        their reply; at once when another call comes first)."""
        steps = self._after_reply
        while steps:
            job = steps.popleft()
            try:
                job()
            except Exception as e:  # noqa: BLE001 (as on the thread: the key's state is unknown)
                self._lost(e)

    def _run_in_background(self, fn, *args, update: bool = True) -> asyncio.Future:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="ps-update")
        fut = asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        self._background.append(fut)
        fut.add_done_callback(self._ran if update else self._background.remove)
        return fut

    def _ran(self, fut: asyncio.Future) -> None:
        self._background.remove(fut)
        if not fut.cancelled() and fut.exception() is not None and self._failed is None:
            self._failed = fut.exception()
            log.error("a push's update failed; pulls fail from now on", exc_info=self._failed)

    async def Pull(self, request, cntl):
        self._take_after_reply()
        if self._stale(request.generation):
            return ps_pb2.PullResponse(generation=self.generation)
        keys = list(request.keys)
        ids = _named(request.row_ids, cntl.request_attachment, "pull row ids")
        store = self.store
        store.check_pull(request.worker, request.step, keys, ids)
        await self._wait([*keys, *ids], request.step, cntl)
        self._take_after_reply()
        if self._background:
            # On the update thread, after the updates answered before: one thread, in order.
            values = await asyncio.shield(self._run_in_background(store.read, keys, ids, update=False))
        else:
            values = store.read(keys, ids)
        if self._failed is not None:
            raise RpcError(EINTERNAL, f"the parameter server lost an update ({self._failed!r}); "
                                      f"restart it from a checkpoint")
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
