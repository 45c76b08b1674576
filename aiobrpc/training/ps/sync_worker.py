"""The parameter-server worker for a plain (not asyncio) training loop.

`SyncPsWorker` runs a `PsWorker` on an event loop of its own, in a background thread, and
waits for each call there. Every call ends: each has the worker's deadline, and the wait here
gives up a little after it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from .worker import PsWorker

__all__ = ["SyncPsWorker"]

_SLACK_S = 5.0  # beyond the call's own deadline: the loop thread is stuck if we get there


class SyncPsWorker:
    """`PsWorker` with blocking methods, for a plain loop (use it as a context manager).

    >>> with SyncPsWorker(["127.0.0.1:8000"], worker=0) as ps:  # doctest: +SKIP
    ...     ps.init({"w": w})
    ...     for step in range(100):
    ...         w = ps.pull()["w"]
    ...         ps.push({"w": gradient(w)})
    """

    def __init__(self, servers: Sequence[str], worker: int = 0, *, timeout_s: float = 30.0,
                 **options: Any) -> None:
        """`options`: the other keyword arguments of `PsWorker` (max_retry, on_restart, ...);
        `on_restart` is called in the loop thread."""
        from ... import event_loop_policy
        self._timeout_s = 30.0  # until PsWorker has checked timeout_s
        self._loop = event_loop_policy().new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="aiobrpc-ps-worker", daemon=True)
        self._thread.start()
        try:
            self._worker: PsWorker = self._run(self._make(servers, worker, timeout_s, options))
            self._timeout_s = timeout_s
        except BaseException:
            self._stop_loop()
            raise

    @staticmethod
    async def _make(servers, worker, timeout_s, options) -> PsWorker:
        return PsWorker(servers, worker, timeout_s=timeout_s, **options)

    def _run(self, coro) -> Any:
        if self._loop.is_closed():
            coro.close()
            raise RuntimeError("this SyncPsWorker is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(self._timeout_s + _SLACK_S)
        except concurrent.futures.TimeoutError:  # not the builtin TimeoutError before 3.11
            future.cancel()
            raise TimeoutError(f"the parameter-server call did not end within {self._timeout_s + _SLACK_S:.0f} s "
                               f"(its deadline is {self._timeout_s} s)") from None

    @property
    def step(self) -> int:
        """The step the next pull and push are for."""
        return self._worker.step

    @property
    def worker(self) -> PsWorker:
        """The `PsWorker` behind this one (its loop runs in another thread: do not await it here)."""
        return self._worker

    def init(self, params: Mapping[str, Any], *, step: int | None = None) -> list[str]:
        """`PsWorker.init`."""
        return self._run(self._worker.init(params, step=step))

    def push(self, grads: Mapping[str, Any], *, rows: Mapping[str, Any] | None = None) -> None:
        """`PsWorker.push`."""
        return self._run(self._worker.push(grads, rows=rows))

    def pull(self, keys: Sequence[str] | None = None, *, rows: Mapping[str, Any] | None = None,
             out: Mapping[str, Any] | None = None, torch: bool = False) -> dict[str, Any]:
        """`PsWorker.pull`."""
        return self._run(self._worker.pull(keys, rows=rows, out=out, torch=torch))

    def resume(self, params: Mapping[str, Any] | None = None) -> list[str]:
        """`PsWorker.resume`."""
        return self._run(self._worker.resume(params))

    def close(self) -> None:
        """Close the channels and stop the loop thread."""
        if self._loop.is_closed():
            return
        try:
            self._run(self._worker.close())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(_SLACK_S)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> SyncPsWorker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
