"""CPU per gRPC call of the server's HTTP/2 session alone: no socket, no client process.

Run by hand from the repository root:

    python bench/grpc_server_profile.py             # microseconds per call
    python bench/grpc_server_profile.py --profile   # and cProfile's top functions, and each package's share

An `h2` client connection builds `--batch` unary calls (16 B, the headers grpcio sends) into one
buffer; one server `H2Session` (aiobrpc/server/grpc/session.py) reads it as one read would, runs
the handlers (GrpcTestService.Unary of tests/grpc) and writes its replies to a transport that
keeps them; the client reads the replies and gives the window back, and the next buffer starts
with the two WINDOW_UPDATEs (the stream's, the connection's) grpcio sends for each reply
(`--no-window-updates` leaves them out). Only the session's part is timed (process CPU time),
`--rounds` times.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pathlib
import pstats
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import h2.config  # noqa: E402
import h2.connection  # noqa: E402
import h2.events  # noqa: E402
from hyperframe.frame import WindowUpdateFrame  # noqa: E402

import aiobrpc  # noqa: E402
from aiobrpc import Server, ServerOptions  # noqa: E402
from aiobrpc._proto import grpc_test_pb2  # noqa: E402
from aiobrpc.server.grpc.session import H2Session  # noqa: E402
from tests.grpc.test_grpc_server import GrpcTest  # noqa: E402

HEADERS = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/aiobrpc.test.GrpcTestService/Unary"),
           (b":authority", b"127.0.0.1"), (b"te", b"trailers"), (b"content-type", b"application/grpc"),
           (b"user-agent", b"grpc-python/1.85.3 grpc-c/51.0.0 (linux; chttp2)"),
           (b"grpc-accept-encoding", b"identity, deflate, gzip"), (b"grpc-timeout", b"29999939u")]


class KeptTransport:
    def __init__(self) -> None:
        self.out: list[bytes] = []

    def write(self, data) -> None:
        self.out.append(data)

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return False


class FakeConnection:
    """What an H2Session uses of its ServerConnection."""

    def __init__(self, server, loop) -> None:
        self.server, self.loop = server, loop
        self.transport = KeptTransport()
        self.is_closed = self.eof = False
        self.peer, self.local = "127.0.0.1:1", "127.0.0.1:2"
        self.frames = self.inflight = 0
        self.max_unwritten_bytes = 1 << 30

    def writable(self, n: int = 0) -> bool:
        return True

    def request_done(self) -> None:
        self.inflight -= 1

    def close(self) -> None:
        pass


async def measure(batch: int, rounds: int, profile: bool, grpcio_updates: bool) -> None:
    server = Server(ServerOptions())
    server.add_service(GrpcTest())
    loop = asyncio.get_running_loop()
    conn = FakeConnection(server, loop)
    session = H2Session(conn)
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    client.initiate_connection()
    body = grpc_test_pb2.GrpcMessage(text="x" * 16).SerializeToString()
    message = b"\x00" + len(body).to_bytes(4, "big") + body
    session.data_received(client.data_to_send())
    client.receive_data(b"".join(conn.transport.out))
    conn.transport.out.clear()
    profiler = cProfile.Profile() if profile else None
    spent = 0.0
    pending_updates = b""
    for _ in range(rounds):
        for _ in range(batch):
            sid = client.get_next_available_stream_id()
            client.send_headers(sid, HEADERS)
            client.send_data(sid, message, end_stream=True)
        data = pending_updates + client.data_to_send()
        if profiler:
            profiler.enable()
        t = time.process_time()
        loop.call_soon(session.data_received, data)
        for _ in range(3):  # the read, the handlers, the flush
            await asyncio.sleep(0)
        spent += time.process_time() - t
        if profiler:
            profiler.disable()
        updates = []
        for ev in client.receive_data(b"".join(conn.transport.out)):
            if isinstance(ev, h2.events.DataReceived):
                client.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                if grpcio_updates:  # as grpcio does: the stream's window and the connection's, every reply
                    n = ev.flow_controlled_length
                    updates += [WindowUpdateFrame(ev.stream_id, window_increment=n).serialize(),
                                WindowUpdateFrame(0, window_increment=n).serialize()]
        conn.transport.out.clear()
        pending_updates = b"".join(updates)
    calls = batch * rounds
    if server.stats.requests != calls or server.stats.failed_requests:
        raise SystemExit(f"{server.stats.requests} requests, {server.stats.failed_requests} failed: expected {calls} ok")
    print(f"{spent / calls * 1e6:.1f} us of server CPU per call ({calls} calls, {batch} per read)")
    if profiler:
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime").print_stats(30)
        print("own time by package:")
        for package, share in _by_package(stats):
            print(f"  {share:5.1%}  {package}")


_PACKAGE = str(pathlib.Path(aiobrpc.__file__).parent)


def _by_package(stats: pstats.Stats) -> list[tuple[str, float]]:
    """Each package's share of the profiled own time: h2, hyperframe, aiobrpc's modules, asyncio's..."""
    spent: dict[str, float] = {}
    for (filename, _, _), (_, _, own, _, _) in stats.stats.items():
        path = pathlib.PurePath(filename).parts
        if "site-packages" in path:
            package = path[path.index("site-packages") + 1]
        elif filename.startswith(_PACKAGE):
            package = "aiobrpc" + filename[len(_PACKAGE):]
        elif filename.startswith("~") or filename.startswith("<"):
            package = "builtins"
        else:
            package = pathlib.PurePath(filename).stem  # the stdlib, the handler
        spent[package] = spent.get(package, 0.0) + own
    total = sum(spent.values()) or 1.0
    return sorted(((p, t / total) for p, t in spent.items()), key=lambda pt: -pt[1])[:12]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32, help="calls per read (default 32)")
    parser.add_argument("--rounds", type=int, default=100, help="reads (default 100)")
    parser.add_argument("--profile", action="store_true", help="print cProfile's top functions")
    parser.add_argument("--no-window-updates", action="store_true",
                        help="leave out the two WINDOW_UPDATEs grpcio sends for each reply")
    args = parser.parse_args()
    asyncio.run(measure(args.batch, args.rounds, args.profile, not args.no_window_updates))


if __name__ == "__main__":
    main()
