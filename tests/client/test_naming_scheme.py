"""A user's own scheme (the example of docs/naming.md) drives a Channel end to end; the
docstring examples of the naming modules hold."""

from __future__ import annotations

import asyncio
import doctest
import functools
import importlib
import os

import pytest

import aiobrpc
from aiobrpc._proto import interop_pb2
from aiobrpc.client.naming import PeriodicNamingService, parse_entry, register_naming_service
from tests.helpers.interop_server import SERVICE, running_echo

Req = interop_pb2.EchoRequest


class EnvNamingService(PeriodicNamingService):
    """env://NAME: the servers listed, comma-separated, in environment variable NAME."""

    def __init__(self, rest: str, refresh_s: float | None = None) -> None:
        super().__init__(f"env://{rest}", refresh_s)
        self.name = rest

    async def fetch(self):
        text = os.environ[self.name]  # KeyError: no list now (the last one is kept)
        return [parse_entry(entry) for entry in text.split(",") if entry.strip()], ""


register_naming_service("testenv", functools.partial(EnvNamingService, refresh_s=0.02))


async def test_a_user_scheme_drives_a_channel(monkeypatch):
    async with running_echo() as (a, _), running_echo() as (b, _):
        monkeypatch.setenv("AIOBRPC_TEST_SERVERS", f"127.0.0.1:{a.port}")
        async with aiobrpc.Channel("testenv://AIOBRPC_TEST_SERVERS", aiobrpc.ChannelOptions(timeout_ms=2000),
                                   load_balancer="rr") as channel:
            stub = aiobrpc.Stub(channel, SERVICE)

            async def sides(n: int) -> set[str]:
                seen = set()
                for _ in range(n):
                    cntl = aiobrpc.Controller()
                    await stub.Echo(Req(message="m"), cntl)
                    seen.add(cntl.remote_side)
                return seen

            async def servers_become(expected: list[str]) -> None:
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 3
                while list(channel.server_states()) != expected:
                    assert loop.time() < deadline, channel.server_states()
                    await asyncio.sleep(0.01)

            assert await sides(3) == {f"127.0.0.1:{a.port}"}
            monkeypatch.setenv("AIOBRPC_TEST_SERVERS", f"127.0.0.1:{a.port}, 127.0.0.1:{b.port}")
            await servers_become([f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"])
            assert await sides(4) == {f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"}
            monkeypatch.setenv("AIOBRPC_TEST_SERVERS", f"127.0.0.1:{b.port}")
            await servers_become([f"127.0.0.1:{b.port}"])
            monkeypatch.delenv("AIOBRPC_TEST_SERVERS")  # a fault: the last list stays
            await asyncio.sleep(0.1)
            assert await sides(3) == {f"127.0.0.1:{b.port}"}


@pytest.mark.parametrize("module", ["base", "dlist", "dns", "etcd_member", "etcd_target", "fault_log",
                                    "file", "list", "__init__"])
def test_docstring_examples_hold(module):
    name = "aiobrpc.client.naming" + ("" if module == "__init__" else f".{module}")
    failed, attempted = doctest.testmod(importlib.import_module(name))
    assert attempted and not failed
