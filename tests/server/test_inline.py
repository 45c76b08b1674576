"""run_inline: a coroutine stepped at once, given a Task only from its first suspension, behaves
as it would in a task (cancellation, contextvars, exceptions)."""

from __future__ import annotations

import asyncio
import contextvars
import sys

import pytest

from aiobrpc.server.inline import InlineTask, run_inline

# The server uses run_inline on 3.11 only (3.12+: eager tasks; 3.10's Task takes no context=).
pytestmark = pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="run_inline serves Python 3.11 only")

VAR = contextvars.ContextVar("VAR", default="unset")


async def inline(coro, then=None):
    """run_inline(coro) from a loop callback, as the server calls it (no task is running);
    `then()` runs in the same callback, right after."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def step():
        try:
            result = run_inline(coro, loop)
            if then is not None:
                then()
            done.set_result(result)
        except BaseException as e:
            done.set_exception(e)
    loop.call_soon(step, context=contextvars.copy_context())
    return await done


async def test_a_coroutine_that_does_not_suspend_finishes_inline():
    seen = []

    async def handler():
        seen.append((asyncio.current_task(), VAR.get()))
        VAR.set("inside")
        return 1

    VAR.set("outside")
    assert await inline(handler()) is None  # no task (the callback runs in a copy of this context)
    (task, value), = seen
    assert isinstance(task, InlineTask) and task.done() and value == "outside"
    assert VAR.get() == "outside"  # the coroutine ran in a copy of the context


async def test_a_coroutine_that_suspends_goes_on_in_a_task():
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    steps = []

    async def handler():
        VAR.set("mine")
        before = asyncio.current_task()
        steps.append("before")
        got = await fut
        steps.append(("after", got, VAR.get(), asyncio.current_task() is task, before.get_name() == task.get_name()))
        return got * 2

    task = await inline(handler())
    assert isinstance(task, asyncio.Task) and steps == ["before"] and VAR.get() == "unset"
    assert not fut.done()
    fut.set_result(21)
    assert await task == 42
    assert steps[1] == ("after", 21, "mine", True, True)


@pytest.mark.parametrize("where", ["before", "after"])
async def test_exceptions_are_the_coroutines(where):
    loop = asyncio.get_running_loop()
    errors = []
    loop.set_exception_handler(lambda loop, ctx: errors.append(ctx))

    async def handler():
        if where == "after":
            await asyncio.sleep(0)
        raise KeyError("boom")

    task = await inline(handler())
    if where == "before":  # as a task that nobody awaits: logged to the loop's handler
        assert task is None and isinstance(errors[0]["exception"], KeyError)
    else:
        with pytest.raises(KeyError):
            await task
    loop.set_exception_handler(None)


async def test_cancelling_the_task_before_its_first_step_cancels_what_the_coroutine_awaits():
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    seen = []

    async def handler():
        try:
            await fut
        except asyncio.CancelledError as e:
            seen.append(e.args)
            raise

    task = await inline(handler())
    task.cancel("stop")  # before the task ever ran (Server.join does this)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert fut.cancelled() and seen == [("stop",)]


async def test_a_cancel_requested_inline_reaches_the_first_await():
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    async def handler():
        assert asyncio.current_task().cancel()
        assert asyncio.current_task().cancelling() == 1
        await fut  # as in a task: the future is cancelled, the coroutine sees it

    task = await inline(handler())
    with pytest.raises(asyncio.CancelledError):
        await task
    assert fut.cancelled() and task.cancelling() == 1


async def test_asyncio_timeout_and_taskgroup_work_inline_and_across_the_suspension():

    async def handler():
        async with asyncio.timeout(5):
            pass  # entered and left inline
        try:
            async with asyncio.timeout(0.01):
                await asyncio.sleep(5)  # the timeout fires on the real task
        except TimeoutError:
            pass
        else:
            raise AssertionError("no timeout")
        async with asyncio.TaskGroup() as tg:
            child = tg.create_task(asyncio.sleep(0, "child"))
        return child.result()

    task = await inline(handler())
    assert await asyncio.wait_for(task, 2) == "child"


async def test_bare_yield_goes_through_the_loop():
    order = []

    async def handler():
        order.append("a")
        await asyncio.sleep(0)
        order.append("c")

    task = await inline(handler(), lambda: order.append("b"))
    await task
    assert order == ["a", "b", "c"]
