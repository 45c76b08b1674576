"""pytest fixtures for code that uses aiobrpc (needs pytest-asyncio).

Enable them in a conftest.py: `pytest_plugins = ["aiobrpc.testing.pytest_plugin"]`.
"""

from __future__ import annotations

import pytest_asyncio

from . import ChannelFor


@pytest_asyncio.fixture
async def aiobrpc_channel_for():
    """Makes `ChannelFor`s, and closes those still open when the test ends.

    `async with aiobrpc_channel_for([MyServicer()]) as channel:` within the test, or
    `channel = await aiobrpc_channel_for([MyServicer()]).start()` to leave the closing to
    the fixture. It takes `ChannelFor`'s arguments (servicers, options, server_options=).
    """
    made: list[ChannelFor] = []

    def channel_for(*args, **kwargs) -> ChannelFor:
        made.append(ChannelFor(*args, **kwargs))
        return made[-1]

    yield channel_for
    for channel_for_ in made:
        await channel_for_.close()
