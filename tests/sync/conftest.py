"""Fixtures of the sync facade's tests: a real server in a thread of its own, and a check that
nothing reached the exception handler of aiobrpc's background loop."""

from __future__ import annotations

import asyncio
import threading

import pytest
import uvloop

import aiobrpc
from aiobrpc import sync
from tests.helpers.interop_server import InteropEcho

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


class ServerThread:
    """An InteropEcho server on 127.0.0.1 (an ephemeral port), run by an event loop in its own
    thread, as a server in another process would be."""

    def __init__(self, new_loop) -> None:
        self.loop = new_loop()
        self.server = aiobrpc.Server()
        self.server.add_service(InteropEcho())
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-server-loop")

    def run(self, coro, timeout: float = 10):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        self.run(self.server.start("127.0.0.1:0"))
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.run(self.server.join(timeout=0.5), timeout=15)  # a slow handler left running is cancelled
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


@pytest.fixture(params=sorted(LOOPS))
def server(request):
    """A ServerThread serving interop.EchoService, its loop asyncio or uvloop."""
    with ServerThread(LOOPS[request.param]) as srv:
        yield srv


@pytest.fixture(autouse=True)
def background_loop_errors():
    """A test fails on any exception that reached the background loop's exception handler."""
    errors: list = []
    loop = sync._background().loop
    loop.call_soon_threadsafe(loop.set_exception_handler, lambda lp, ctx: errors.append(ctx))
    yield errors
    assert not errors, f"exceptions reached the background loop's handler: {errors}"
