"""The `loop_errors` fixture: a test fails on any exception that reaches the loop's exception
handler, also one reported by a task or handle destroyed while pending (gc runs before the
check). A conftest enables it for its folder with `from tests.helpers.loop_errors import
loop_errors`."""

from __future__ import annotations

import asyncio
import gc

import pytest_asyncio


@pytest_asyncio.fixture(autouse=True)
async def loop_errors():
    loop = asyncio.get_running_loop()
    errors: list = []
    loop.set_exception_handler(lambda lp, ctx: errors.append(ctx))
    yield errors
    await asyncio.sleep(0)
    gc.collect()  # a task destroyed while pending reports itself from __del__
    loop.set_exception_handler(None)
    assert not errors, f"exceptions reached the loop's handler: {errors}"
