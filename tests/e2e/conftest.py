"""End-to-end fixtures: a test fails on any exception that reaches the loop's exception handler."""

from __future__ import annotations

import pytest_asyncio

import aiobrpc
from tests.helpers.interop_server import running_echo
from tests.helpers.loop_errors import loop_errors  # noqa: F401  (autouse fixture)


@pytest_asyncio.fixture
async def interop():
    """(server, servicer) of the interop EchoService on an ephemeral port."""
    async with running_echo(aiobrpc.ServerOptions(server_tag="127.0.0.1:9110")) as pair:
        yield pair
