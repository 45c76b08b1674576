"""A request's coroutine run inline, given a Task only if it suspends (Python < 3.12).

`asyncio.Task(coro)` costs a task object, its registration in asyncio's WeakSet of tasks, a
handle, and a loop iteration before the coroutine's first line runs. Most handlers return
without awaiting anything that is not ready, and need none of it: `run_inline` steps the
coroutine at once (`coro.send(None)`), in a copy of the current context as a task would, and
only when the coroutine yields (a future that is not done, or a bare `yield` as
`asyncio.sleep(0)` makes) does a Task take over from that point. The Task's first step hands
it the future the coroutine already yielded (`_Resumed`), so from there on the coroutine runs
exactly as in a task: cancellation, exceptions, wake-ups.

While the coroutine runs inline, `asyncio.current_task()` is its `InlineTask`: enough of a
task for `asyncio.timeout()`, `TaskGroup` and the coroutine's own `cancel()`, whose calls go to
the real task once there is one (a cancellation requested inline is handed to it, as a task
that cancels itself and then awaits sees it). What differs from a task: `current_task()` is
not an `asyncio.Task` before the first suspension and is another object after it, and a
coroutine that finishes inline is in no `asyncio.all_tasks()`.

From Python 3.12 the server uses eager tasks instead, asyncio's own form of the same idea.
"""

from __future__ import annotations

import asyncio
import collections.abc
import contextvars

_Task = asyncio.Task
_enter_task = asyncio.tasks._enter_task
_leave_task = asyncio.tasks._leave_task
_copy_context = contextvars.copy_context
_CancelledError = asyncio.CancelledError
_NOTHING = object()
_new = object.__new__


def run_inline(coro, loop) -> asyncio.Task | None:
    """Step `coro` now, as `loop`'s current task; None when it finished without suspending,
    else the Task that runs the rest of it. No task may be running on `loop`."""
    ctx = _copy_context()
    inline = _new(InlineTask)  # InlineTask(loop, coro) without an __init__ frame
    inline._loop = loop
    inline._coro = coro
    _enter_task(loop, inline)
    try:
        yielded = ctx.run(coro.send, None)
    except StopIteration:
        inline._state = _FINISHED
        return None
    except _CancelledError:  # the task would end cancelled; nobody awaits it
        inline._state = _FINISHED
        return None
    except (KeyboardInterrupt, SystemExit):
        inline._state = _FINISHED
        raise  # a task re-raises them into the loop too
    except BaseException as e:
        inline._state = _FINISHED
        # What asyncio logs of a task whose exception nobody retrieves.
        loop.call_exception_handler({"message": "Task exception was never retrieved", "exception": e})
        return None
    finally:
        _leave_task(loop, inline)
    task = _Task(_Resumed(coro, yielded), loop=loop, context=ctx)
    inline._promoted(task)
    return task


_RUNNING, _FINISHED = 0, 1


class InlineTask:
    """`asyncio.current_task()` while a coroutine runs inline; forwards to its Task once it has one."""

    # Class defaults: run_inline sets only what differs (no __init__ call per request).
    _task = None
    _state = _RUNNING
    _cancels = 0
    _must_cancel = False
    _cancel_msg = None

    def __init__(self, loop, coro) -> None:
        self._loop = loop
        self._coro = coro

    def _promoted(self, task: asyncio.Task) -> None:
        if self._must_cancel:  # the coroutine cancelled its own task, then awaited
            task.cancel(self._cancel_msg)
            while task.cancelling() < self._cancels:
                task.cancel(self._cancel_msg)
            if self._cancels == 0:  # cancel() then uncancel(): still cancelled, as in 3.11's tasks
                task.uncancel()
        self._task = task

    def cancel(self, msg=None) -> bool:
        if self._task is not None:
            return self._task.cancel(msg)
        if self._state == _FINISHED:
            return False
        self._cancels += 1
        self._must_cancel = True
        self._cancel_msg = msg
        return True

    def cancelling(self) -> int:
        return self._task.cancelling() if self._task is not None else self._cancels

    def uncancel(self) -> int:
        if self._task is not None:
            return self._task.uncancel()
        if self._cancels > 0:
            self._cancels -= 1
        return self._cancels

    def done(self) -> bool:
        return self._task.done() if self._task is not None else self._state == _FINISHED

    def cancelled(self) -> bool:
        return self._task.cancelled() if self._task is not None else False

    def get_loop(self):
        return self._loop

    def get_coro(self):
        return self._coro

    def get_name(self) -> str:
        return self._task.get_name() if self._task is not None else f"inline-{id(self):x}"

    def __getattr__(self, name: str):
        task = self._task
        if task is None:
            raise AttributeError(f"{name}: a request's task before its first suspension "
                                 f"(aiobrpc runs it inline) has no {name!r}")
        return getattr(task, name)

    def __repr__(self) -> str:
        if self._task is not None:
            return repr(self._task)
        return f"<InlineTask {'finished' if self._state == _FINISHED else 'running'} coro={self._coro!r}>"


class _Resumed(collections.abc.Coroutine):
    """What a Task runs to continue a coroutine that already yielded `first` inline: its first
    step gets `first`, as if the coroutine had yielded it in that step; then send and throw go
    to the coroutine."""

    __slots__ = ("_coro", "_first")

    def __init__(self, coro, first) -> None:
        self._coro = coro
        self._first = first

    def send(self, value):
        first = self._first
        if first is not _NOTHING:
            self._first = _NOTHING
            return first
        return self._coro.send(value)

    def throw(self, exc, *args):
        first = self._first
        if first is not _NOTHING:
            # The task was cancelled before its first step (Server.join, a timeout): as a task
            # does when cancelled while it waits, cancel the future the coroutine waits for;
            # the coroutine then sees the CancelledError from its await.
            self._first = _NOTHING
            if (isinstance(exc, _CancelledError) and getattr(first, "_asyncio_future_blocking", False)
                    and first.cancel(exc.args[0] if exc.args else None)):
                return first
        return self._coro.throw(exc, *args)

    def close(self) -> None:
        self._first = _NOTHING
        self._coro.close()

    def __await__(self):
        return self

    def __iter__(self):
        return self

    def __next__(self):
        return self.send(None)

    # What asyncio reads of a task's coroutine (repr, get_stack).
    @property
    def cr_frame(self):
        return self._coro.cr_frame

    @property
    def cr_code(self):
        return self._coro.cr_code

    @property
    def cr_await(self):
        return self._coro.cr_await

    @property
    def cr_running(self):
        return self._coro.cr_running
