"""What the soak's processes share: the services, the loop choice and /proc sampling."""

from __future__ import annotations

import asyncio
import collections
import ctypes
import gc
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from aiobrpc._proto import grpc_test_pb2, interop_pb2  # noqa: E402

ECHO = interop_pb2.DESCRIPTOR.services_by_name["EchoService"]
GRPC = grpc_test_pb2.DESCRIPTOR.services_by_name["GrpcTestService"]
Req = interop_pb2.EchoRequest
Resp = interop_pb2.EchoResponse
Msg = grpc_test_pb2.GrpcMessage
HTTP_PATH = "/" + ECHO.full_name + "/Echo"  # /interop.EchoService/Echo
STATS = "__stats__"  # Echo(message=STATS) answers the server's own figures as JSON

TCP_STATES = {"01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1",
              "05": "FIN_WAIT2", "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT",
              "09": "LAST_ACK", "0A": "LISTEN", "0B": "CLOSING"}


def run(main_coro_fn, loop: str):
    """Run `main_coro_fn()` on uvloop or asyncio's own loop."""
    if loop == "uvloop":
        import uvloop
        return uvloop.run(main_coro_fn())
    return asyncio.run(main_coro_fn())


def trim_heap() -> None:
    """Collect garbage and hand glibc's free heap pages back to the kernel (malloc_trim), so
    that RSS sampled next counts memory in use, not memory freed and kept by the allocator."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def rss_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def tcp_table() -> dict[int, tuple[int, int, str]]:
    """socket inode -> (local port, remote port, state) of this network namespace's TCP sockets."""
    table = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    inode = int(parts[9])
                    if inode:
                        table[inode] = (int(parts[1].rsplit(":", 1)[1], 16), int(parts[2].rsplit(":", 1)[1], 16),
                                        TCP_STATES.get(parts[3], parts[3]))
        except FileNotFoundError:
            pass
    return table


def sample(pid: int | str, table: dict | None = None) -> dict:
    """RSS, open fds, the non-TCP fds by kind, and the TCP sockets (local, remote, state) of `pid`."""
    table = tcp_table() if table is None else table
    other: collections.Counter = collections.Counter()
    tcp = []
    base = f"/proc/{pid}/fd"
    names = os.listdir(base)
    for fd in names:
        try:
            target = os.readlink(f"{base}/{fd}")
        except OSError:  # closed meanwhile (our own listing's fd among them)
            continue
        if target.startswith("socket:["):
            entry = table.get(int(target[8:-1]))
            if entry is not None:
                tcp.append(entry)
                continue
            other["socket"] += 1
        elif target.startswith("pipe:"):
            other["pipe"] += 1
        elif target.startswith("anon_inode:"):
            other[target] += 1
        else:
            other[target] += 1
    if pid == "self":  # os.listdir's own fd
        other = collections.Counter({k: v for k, v in other.items() if not k.startswith("/proc/")})
    return {"rss": rss_bytes(pid), "fds": sum(other.values()) + len(tcp), "other": dict(other),
            "tcp": sorted(tcp)}
