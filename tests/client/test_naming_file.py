"""file://path: one entry per line, read again when the file changes; faults keep the last good
list, logged once each (docs/naming.md)."""

from __future__ import annotations

import asyncio
import logging
import os

import pytest

import aiobrpc
from aiobrpc import errors
from aiobrpc._proto import interop_pb2
from aiobrpc.client.naming import ServerNode, base, create_naming_service
from aiobrpc.client.naming.file import FileNamingService
from tests.helpers.etcd import ListFeed
from tests.helpers.interop_server import SERVICE, running_echo

Req = interop_pb2.EchoRequest
POLL_S = 0.02


def naming_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "aiobrpc.client.naming" and r.levelno == logging.WARNING]


def write(path, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


async def test_lines_comments_tags_and_duplicates(tmp_path):
    path = tmp_path / "servers"
    path.write_text("# the cluster\n\n  10.0.0.1:80  \n10.0.0.2:80 big tag  # rack 3\n"
                    "[::1]:81 0/2\n10.0.0.1:80\n")
    async with ListFeed(create_naming_service(f"file://{path}")) as lists:
        assert await lists.next() == [ServerNode("10.0.0.1", 80), ServerNode("10.0.0.2", 80, "big tag"),
                                          ServerNode("::1", 81, "0/2")]


async def test_follows_edits_and_keeps_the_last_good_list_through_faults(tmp_path, caplog):
    path = tmp_path / "servers"
    path.write_text("10.0.0.1:80\n10.0.0.2:80\n")
    async with ListFeed(FileNamingService(str(path), poll_s=POLL_S)) as lists:
        assert await lists.next() == [ServerNode("10.0.0.1", 80), ServerNode("10.0.0.2", 80)]

        write(path, "10.0.0.1:80\n10.0.0.2:80\n10.0.0.3:80\n")  # added
        assert await lists.next() == [ServerNode("10.0.0.1", 80), ServerNode("10.0.0.2", 80),
                                          ServerNode("10.0.0.3", 80)]
        write(path, "10.0.0.3:80\n")  # removed
        assert await lists.next() == [ServerNode("10.0.0.3", 80)]

        # Garbage beside good lines: skipped and logged, the good ones published.
        write(path, "10.0.0.3:80\nnot an address\n10.0.0.4:99999\n10.0.0.5:80\n")
        assert await lists.next() == [ServerNode("10.0.0.3", 80), ServerNode("10.0.0.5", 80)]
        [skipped] = naming_warnings(caplog)
        assert "skipped 2 lines" in skipped and "line 2" in skipped and "line 3" in skipped
        caplog.clear()

        # Nothing but garbage: a fault; the last list stays, logged once however many polls.
        write(path, "garbage\nmore garbage\n")
        await lists.none()
        [fault] = naming_warnings(caplog)
        assert "no line of" in fault and "keeping the last list (2 servers)" in fault
        caplog.clear()

        # Deleted: the same; recreated: followed again.
        path.unlink()
        await lists.none()
        [fault] = naming_warnings(caplog)
        assert "No such file" in fault and "keeping the last list (2 servers)" in fault
        write(path, "10.0.0.9:80 back\n")
        assert await lists.next() == [ServerNode("10.0.0.9", 80, "back")]

        # An empty file is an empty list, not a fault.
        write(path, "# nobody\n")
        assert await lists.next() == []


async def test_a_rewrite_of_the_same_size_in_place_is_seen(tmp_path):
    path = tmp_path / "servers"
    path.write_text("10.0.0.1:80\n")
    async with ListFeed(FileNamingService(str(path), poll_s=POLL_S)) as lists:
        assert await lists.next() == [ServerNode("10.0.0.1", 80)]
        with open(path, "r+") as f:  # same inode, same size
            f.write("10.0.0.2:80\n")
        assert await lists.next() == [ServerNode("10.0.0.2", 80)]


async def test_not_utf8_and_too_large_are_faults(tmp_path, monkeypatch, caplog):
    from aiobrpc.client.naming import file as file_module

    path = tmp_path / "servers"
    path.write_text("10.0.0.1:80\n")
    async with ListFeed(FileNamingService(str(path), poll_s=POLL_S)) as lists:
        assert await lists.next() == [ServerNode("10.0.0.1", 80)]
        path.write_bytes(b"10.0.0.2:80 \xff\n")
        await lists.none()
        assert any("not UTF-8" in w for w in naming_warnings(caplog))
        monkeypatch.setattr(file_module, "MAX_FILE_BYTES", 20)
        path.write_text("10.0.0.2:80\n" * 3)
        await lists.none()
        assert any("larger than 20 bytes" in w for w in naming_warnings(caplog))


async def test_the_list_is_capped(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(base, "MAX_SERVERS", 3)
    path = tmp_path / "servers"
    path.write_text("".join(f"10.0.0.{i}:80\n" for i in range(1, 6)))
    async with ListFeed(FileNamingService(str(path))) as lists:
        assert await lists.next() == [ServerNode(f"10.0.0.{i}", 80) for i in (1, 2, 3)]
    assert any("2 servers past the cap of 3" in w for w in naming_warnings(caplog))


async def test_a_file_missing_at_start_fails_calls_at_once_naming_it(tmp_path):
    channel = aiobrpc.Channel(f"file://{tmp_path}/absent", aiobrpc.ChannelOptions(timeout_ms=60_000),
                              load_balancer="rr")
    with pytest.raises(aiobrpc.RpcError) as ei:
        # At once: the naming fault releases the call, far before its 60 s deadline (10 s: a hang guard).
        await asyncio.wait_for(aiobrpc.Stub(channel, SERVICE).Echo(Req(message="x")), 10)
    assert ei.value.code == errors.ENODATA and "No such file" in ei.value.text
    await channel.close()


async def test_a_channel_follows_the_file(tmp_path):
    path = tmp_path / "servers"
    async with running_echo() as (a, _), running_echo() as (b, _):
        write(path, f"127.0.0.1:{a.port}\n")
        async with aiobrpc.Channel(f"file://{path}", aiobrpc.ChannelOptions(timeout_ms=2000),
                                   load_balancer="rr") as channel:
            stub = aiobrpc.Stub(channel, SERVICE)

            async def sides(n: int) -> set[str]:
                seen = set()
                for i in range(n):
                    cntl = aiobrpc.Controller()
                    await stub.Echo(Req(message=str(i)), cntl)
                    seen.add(cntl.remote_side)
                return seen

            assert await sides(3) == {f"127.0.0.1:{a.port}"}
            write(path, f"127.0.0.1:{b.port}\n")
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 3
            while f"127.0.0.1:{b.port}" not in channel.server_states() and loop.time() < deadline:
                await asyncio.sleep(0.02)
            assert await sides(4) == {f"127.0.0.1:{b.port}"}
