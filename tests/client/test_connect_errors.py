"""Connects that cannot succeed, said in words: a host that does not resolve (or is not a valid
name) fails the call at once with EHOSTUNREACH and is not retried; a peer that does not speak
baidu_std is named by its first bytes.

`.invalid` names never resolve (RFC 2606) and fail without asking a DNS server here
(getaddrinfo answers in about a millisecond); every call has no deadline of its own
(timeout_ms=-1), so a hang fails the test through wait_for.
"""

from __future__ import annotations

import asyncio
import re

import pytest

import aiobrpc
from aiobrpc import errors
from aiobrpc._proto import echo_pb2
from tests.helpers.waiting import wait_until

HOSTS = ["nonexistent.invalid", "127.0.0..1"]
WHY = {"nonexistent.invalid": "[A-Z][a-z]+ ", "127.0.0..1": "not a valid host name$"}  # the resolver's words, or ours


async def call(channel: aiobrpc.Channel) -> aiobrpc.Controller:
    cntl = aiobrpc.Controller(timeout_ms=-1)
    with pytest.raises(aiobrpc.RpcError) as info:
        await asyncio.wait_for(channel.call_method("example.EchoService", "Echo", echo_pb2.EchoRequest(message="hi"),
                                                   echo_pb2.EchoResponse, cntl), 5)
    assert (info.value.code, info.value.text) == (cntl.error_code, cntl.error_text)
    return cntl


@pytest.mark.parametrize("ctype", ["single", "pooled", "short"])
@pytest.mark.parametrize("host", HOSTS)
async def test_an_unresolvable_host_fails_at_once_in_words(host, ctype):
    async with aiobrpc.Channel(f"{host}:8000", aiobrpc.ChannelOptions(connection_type=ctype)) as channel:
        cntl = await call(channel)
        assert channel.server_states() == {f"{host}:8000": "down"}
    assert cntl.error_code == errors.EHOSTUNREACH
    assert re.match(f"Fail to connect {re.escape(host)}:8000: cannot resolve host '{re.escape(host)}': {WHY[host]}",
                    cntl.error_text), cntl.error_text
    assert "Unknown error" not in cntl.error_text
    assert [a.error_code for a in cntl.attempts] == [errors.EHOSTUNREACH]
    assert cntl.retried_count == 0


@pytest.mark.parametrize("host", HOSTS)
async def test_the_health_check_of_an_unresolvable_host_keeps_trying(host):
    async with aiobrpc.Channel(f"{host}:8000") as channel:
        await call(channel)
        loop = asyncio.get_running_loop()
        end = loop.time() + 5
        while channel.stats.health_checks < 2 and loop.time() < end:
            await asyncio.sleep(0.02)
        await wait_until(lambda: channel.stats.health_checks >= 2)
        assert channel.stats.health_checks >= 2
        assert channel.server_states() == {f"{host}:8000": "down"}


@pytest.mark.parametrize("host", HOSTS)
async def test_a_channel_connect_raises_the_same_error(host):
    async with aiobrpc.Channel(f"{host}:8000") as channel:
        with pytest.raises(aiobrpc.RpcError, match=f"cannot resolve host '{host}'") as info:
            await asyncio.wait_for(channel.connect(), 5)
    assert info.value.code == errors.EHOSTUNREACH


async def answering(reply: bytes):
    """A server that answers whatever comes with `reply`, then waits for the client to close."""
    async def answer(reader, writer):
        try:
            if await reader.read(1):
                writer.write(reply)
                writer.write_eof()
                await reader.read()
        except ConnectionError:
            pass
        finally:
            writer.close()
    return await asyncio.start_server(answer, "127.0.0.1", 0)


@pytest.mark.parametrize("reply, shown", [
    (b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
     'first bytes "HTTP/1.1 400 Bad Request\\r\\nConten"...'),
    (b"HTTP/1.0 400\r\n\r\n", 'first bytes "HTTP/1.0 400\\r\\n\\r\\n"'),
    (bytes([0x16, 0x03, 0x01, 0x00, 0x05, 0x01]), "first bytes 160301000501 (hex)"),
], ids=["http", "short", "binary"])
async def test_a_peer_that_is_not_brpc_is_named_by_its_first_bytes_once(reply, shown):
    server = await answering(reply)
    try:
        async with aiobrpc.Channel(f"127.0.0.1:{server.sockets[0].getsockname()[1]}") as channel:
            cntl = await call(channel)
    finally:
        server.close()
        await server.wait_closed()
    assert cntl.error_code == errors.EHOSTDOWN  # the retries find the server marked failed
    assert cntl.error_text.count("first bytes") == 1
    assert f"unknown protocol (not a brpc server?): {shown}" in cntl.error_text
