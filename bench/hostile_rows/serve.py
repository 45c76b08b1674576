"""The server under attack, in a process of its own (so that its RSS is its own):

    python bench/hostile_rows/serve.py '{"auth": "secret", "max_body_size": 2097152, ...}'

It serves GrpcTestService (the bench's own servicer, below) on 127.0.0.1:<any port>, and a
control socket on 127.0.0.1:<another port>, a plain asyncio server outside aiobrpc that answers
one JSON line per command line:

    stats      {"connections", "concurrency", "handlers_running", "handlers_started", ...}
    settle     gc.collect() and malloc_trim(0), then stats (RSS then counts live memory only)
    lag        the longest event loop stall (ms) since the last `lag`, and restart counting
    stop       Server.stop() + join(2), then the process exits

Its first line on stdout is `READY <port> <control port>`; its log goes to stderr.

The config (a JSON object): auth ("secret": accepts only b"secret"; "slow": the same after an
async 0.5 s), tls ({"cert", "ca"}: mutual TLS with verify_client="required"), loop ("uvloop" or
"asyncio"), and any ServerOptions field given as is (max_body_size, max_unwritten_bytes,
first_frame_timeout_sec, idle_timeout_sec, ...).

The servicer:
    Unary         sleeps `sleep_ms`; answers `text` and, when `count` > 0, `count` bytes of data
    ServerStream  `count` messages (-1: forever) of len(data) bytes, or 16 KiB when data is empty
    ClientStream  the texts joined
    Bidi          each text upper-cased
Each counts the handlers started, running and cancelled.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import json
import logging
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if os.environ.get("HOSTILE_SERVER_ROOT"):  # another checkout's aiobrpc (bench --server-root)
    sys.path.insert(0, os.environ["HOSTILE_SERVER_ROOT"])

import aiobrpc  # noqa: E402
from aiobrpc import Server, ServerOptions, Servicer  # noqa: E402
from aiobrpc._proto import grpc_test_pb2  # noqa: E402

Msg = grpc_test_pb2.GrpcMessage
SERVICE = grpc_test_pb2.DESCRIPTOR.services_by_name["GrpcTestService"]
SECRET = b"secret"


class Counted:
    def __init__(self) -> None:
        self.started = 0
        self.running = 0
        self.cancelled = 0

    def enter(self) -> None:
        self.started += 1
        self.running += 1

    def leave(self) -> None:
        self.running -= 1


class HostileTest(Servicer):
    SERVICE = SERVICE

    def __init__(self, counts: Counted) -> None:
        self.counts = counts

    async def Unary(self, request, cntl):
        c = self.counts
        c.enter()
        try:
            if request.sleep_ms:
                await asyncio.sleep(request.sleep_ms / 1000)
            if request.count > 0:
                return Msg(text=request.text, data=b"x" * request.count)
            return Msg(text=request.text)
        except asyncio.CancelledError:
            c.cancelled += 1
            raise
        finally:
            c.leave()

    async def ServerStream(self, request, cntl):
        c = self.counts
        c.enter()
        try:
            chunk = Msg(data=request.data or b"s" * 16384)
            i = 0
            while request.count < 0 or i < request.count:
                chunk.count = i
                yield chunk
                i += 1
        except (asyncio.CancelledError, GeneratorExit):
            c.cancelled += 1
            raise
        finally:
            c.leave()

    async def ClientStream(self, requests, cntl):
        c = self.counts
        c.enter()
        try:
            texts = [r.text async for r in requests]
            return Msg(text=",".join(texts), count=len(texts))
        except asyncio.CancelledError:
            c.cancelled += 1
            raise
        finally:
            c.leave()

    async def Bidi(self, requests, cntl):
        c = self.counts
        c.enter()
        try:
            while (r := await requests.read()) is not None:
                yield Msg(text=r.text.upper(), count=r.count)
        except (asyncio.CancelledError, GeneratorExit):
            c.cancelled += 1
            raise
        finally:
            c.leave()


class SecretAuth:
    """Accepts only b"secret"."""

    def __init__(self) -> None:
        self.asked = 0

    def verify_credential(self, credential, peer) -> bool:
        self.asked += 1
        return bytes(credential or b"") == SECRET


class SlowSecretAuth(SecretAuth):
    """Accepts only b"secret", after 0.5 s."""

    async def verify_credential(self, credential, peer) -> bool:
        self.asked += 1
        await asyncio.sleep(0.5)
        return bytes(credential or b"") == SECRET


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class LagMonitor:
    """The longest time the loop took to come back to a 10 ms sleep, less the 10 ms."""

    def __init__(self) -> None:
        self.max_lag = 0.0
        self.task: asyncio.Task | None = None

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(0.01)
            lag = loop.time() - t - 0.01
            if lag > self.max_lag:
                self.max_lag = lag

    def take(self) -> float:
        lag, self.max_lag = self.max_lag, 0.0
        return lag


def _deadlines(server: Server) -> int:
    """The grpc-timeout entries held by the server's HTTP/2 sessions (-1: not readable)."""
    n = 0
    try:
        for conn in list(server.connections):
            session = getattr(conn, "http", None)
            wheel = getattr(session, "deadlines", None)
            if wheel is not None:
                n += len(wheel)
    except Exception:  # noqa: BLE001 - a private attribute that may change
        return -1
    return n


def stats(server: Server, counts: Counted, auth, lag: LagMonitor, baseline_tasks: int) -> dict:
    with open("/proc/self/status") as f:
        rss = next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
    closed = getattr(getattr(server, "stats", None), "closed", {})
    return {
        "pid": os.getpid(),
        "rss_kib": rss,
        "connections": len(server.connections),
        "concurrency": server.concurrency,
        "handlers_running": counts.running,
        "handlers_started": counts.started,
        "handlers_cancelled": counts.cancelled,
        "tasks": len(asyncio.all_tasks()) - baseline_tasks - 1,  # less the control task asking
        "server_tasks": len(getattr(server, "_tasks", ()) or ()),
        "deadlines": _deadlines(server),
        "auth_asked": getattr(auth, "asked", 0),
        "max_lag_ms": round(lag.max_lag * 1000, 1),
        "closed": dict(closed) if isinstance(closed, dict) else {},
    }


async def main(cfg: dict) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    opts = {k: v for k, v in cfg.items() if k not in ("auth", "tls", "loop")}
    auth = None
    if cfg.get("auth") == "secret":
        auth = SecretAuth()
    elif cfg.get("auth") == "slow":
        auth = SlowSecretAuth()
    if auth is not None:
        opts["auth"] = auth
    if cfg.get("tls"):
        from aiobrpc.tls import ServerTlsOptions
        tls = cfg["tls"]
        opts["ssl"] = ServerTlsOptions(cert_file=tls["cert"], ca_file=tls["ca"], verify_client="required")
    counts = Counted()
    server = Server(ServerOptions(**opts))
    server.add_service(HostileTest(counts))
    await server.start("127.0.0.1:0")
    lag = LagMonitor()
    lag.task = asyncio.get_running_loop().create_task(lag.run())
    stopped = asyncio.get_running_loop().create_future()

    async def control(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := (await reader.readline()).strip():
                if line == b"stats":
                    out = stats(server, counts, auth, lag, baseline)
                elif line == b"settle":
                    gc.collect()
                    _malloc_trim()
                    out = stats(server, counts, auth, lag, baseline)
                elif line == b"lag":
                    out = {"max_lag_ms": round(lag.take() * 1000, 1)}
                elif line == b"stop":
                    t = time.monotonic()
                    await server.stop()
                    await server.join(2)
                    out = {"stopped_in_s": round(time.monotonic() - t, 3), "connections": len(server.connections),
                           "concurrency": server.concurrency, "handlers_running": counts.running}
                    writer.write(json.dumps(out).encode() + b"\n")
                    await writer.drain()
                    if not stopped.done():
                        stopped.set_result(None)
                    return
                else:
                    out = {"error": f"unknown command {line!r}"}
                writer.write(json.dumps(out).encode() + b"\n")
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    ctl = await asyncio.start_server(control, "127.0.0.1", 0)
    baseline = len(asyncio.all_tasks())
    print(f"READY {server.port} {ctl.sockets[0].getsockname()[1]} {Path(aiobrpc.__file__).parent}", flush=True)
    await stopped
    ctl.close()
    lag.task.cancel()


if __name__ == "__main__":
    config = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    if config.get("loop", "uvloop") == "uvloop":
        asyncio.set_event_loop_policy(aiobrpc.event_loop_policy())
    asyncio.run(main(config))
