"""A Group on an event loop of its own in a background thread, for synchronous callers.

A training loop calls collectives and waits for them (`all_reduce`), or starts them and waits
later (`submit`, which returns a concurrent.futures.Future); the traffic runs on the thread's
loop meanwhile. Collectives are started in the order they are called from any thread.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import threading
from typing import Any, Callable, Coroutine

import numpy as np

from .group import Group
from .reduce import ReduceOp


def _default_loop() -> asyncio.AbstractEventLoop:
    from .. import event_loop_policy
    return event_loop_policy().new_event_loop()


class GroupThread:
    """`Group.create(store, rank, world_size, **options)` run on a loop in a daemon thread.

    `loop_factory` makes the loop (default: uvloop's when installed, else asyncio's). Close it
    with `close()` or a `with` block.

    >>> with GroupThread(FileStore("/tmp/rdv"), rank, 2) as group:  # doctest: +SKIP
    ...     group.all_reduce(grads)
    """

    def __init__(self, store: Any, rank: int, world_size: int, *,
                 loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None, **options: Any) -> None:
        self.loop = (loop_factory or _default_loop)()
        self._thread = threading.Thread(target=self._serve, name=f"aiobrpc-group-rank{rank}", daemon=True)
        self._thread.start()
        # A daemon thread still running a loop while the interpreter finalizes can crash it.
        atexit.register(self.close)
        try:
            self.group: Group = self.submit(Group.create, store, rank, world_size, **options).result()
        except BaseException:
            self._stop()
            raise

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        """Call `fn(*args)` on the group's loop, e.g. `submit(gt.group.all_reduce, t)`, and
        return a future of what the awaitable it returns gives. Calls run in the order they
        were submitted, so collectives are numbered in that order."""
        cf: concurrent.futures.Future = concurrent.futures.Future()

        def start() -> None:
            if not cf.set_running_or_notify_cancel():
                return
            try:
                aw = asyncio.ensure_future(fn(*args, **kwargs))
            except BaseException as e:
                cf.set_exception(e)
                return
            aw.add_done_callback(lambda f: _copy_result(f, cf))

        self.loop.call_soon_threadsafe(start)
        return cf

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world_size(self) -> int:
        return self.group.world_size

    def all_reduce(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM) -> None:
        """`Group.all_reduce`, waited for."""
        self.submit(self.group.all_reduce, tensor, op).result()

    def reduce_scatter(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM) -> np.ndarray:
        """`Group.reduce_scatter`, waited for."""
        return self.submit(self.group.reduce_scatter, tensor, op).result()

    def all_gather(self, tensor: Any, out: Any = None) -> Any:
        """`Group.all_gather`, waited for."""
        return self.submit(self.group.all_gather, tensor, out).result()

    def broadcast(self, tensor: Any, root: int = 0) -> None:
        """`Group.broadcast`, waited for."""
        self.submit(self.group.broadcast, tensor, root).result()

    def barrier(self) -> None:
        """`Group.barrier`, waited for."""
        self.submit(self.group.barrier).result()

    def send(self, tensor: Any, dst: int, tag: int = 0) -> None:
        """`Group.send`, waited for."""
        self.submit(self.group.send, tensor, dst, tag).result()

    def recv(self, tensor: Any, src: int | None = None, tag: int = 0) -> int:
        """`Group.recv`, waited for: the source rank."""
        return self.submit(self.group.recv, tensor, src, tag).result()

    def all_to_all(self, outs: list, ins: list) -> None:
        """`Group.all_to_all`, waited for."""
        self.submit(self.group.all_to_all, outs, ins).result()

    def close(self) -> None:
        """Close the group, stop the loop and join the thread."""
        atexit.unregister(self.close)
        if not self._thread.is_alive():
            return
        try:
            self.submit(self.group.close).result()
        finally:
            self._stop()

    def _stop(self) -> None:
        async def drain() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.loop.shutdown_asyncgens()
            await self.loop.shutdown_default_executor()
        try:
            self.submit(drain).result(timeout=10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
            self.loop.close()

    def __enter__(self) -> GroupThread:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _copy_result(f: asyncio.Future, cf: concurrent.futures.Future) -> None:
    if f.cancelled():
        cf.cancel()
    elif f.exception() is not None:
        cf.set_exception(f.exception())
    else:
        cf.set_result(f.result())
