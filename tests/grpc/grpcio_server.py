"""A grpcio (`grpc.aio`) server of interop.EchoService, for testing aiobrpc's gRPC client.

It runs in its own thread on its own plain asyncio loop (grpc.aio and uvloop in one loop are
unreliable), on 127.0.0.1 and an ephemeral port. What a request asks (interop.proto's fields,
read the gRPC way):

* `sleep_ms`: wait this long first (a cancelled wait is recorded in `cancelled`);
* `fail_code`: end with this gRPC status and `fail_text`;
* responses are compressed as the server's `compression` says (grpc.aio's per-call
  `set_compression` does not compress);
* `message` and `payload` come back as `message` and `payload_size`/`payload_crc32`;
  `server_timeout_ms` is the time the call had left when it arrived (-1: no deadline);
  `calls_served` counts the calls of this server.

Every request's `x-*` metadata comes back in the initial metadata and, prefixed `t-`, in the
trailing metadata.
"""

from __future__ import annotations

import asyncio
import threading
import zlib

import grpc

from aiobrpc._proto import interop_pb2

SERVICE = "interop.EchoService"
MAX_MESSAGE = 16 * 1024 * 1024


class GrpcioServer:
    """`start()` listens and returns the port; `stop()` ends it (in-flight calls are cancelled).

    `delay_first_ms`: the first call of this server waits that much longer (a backup request's
    original)."""

    def __init__(self, delay_first_ms: int = 0, compression=None) -> None:
        self.port = 0
        self.calls = 0
        self.cancelled: list[str] = []  # message of each call cancelled while it waited
        self.seen_metadata: list[dict] = []
        self.delay_first_ms = delay_first_ms
        self.compression = compression  # e.g. grpc.Compression.Gzip: every response compressed
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server = None
        self._thread: threading.Thread | None = None
        self._cancel_seen = threading.Event()

    def start(self) -> int:
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="grpcio-server", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the grpc.aio server did not start")
        return self.port

    def _run(self, ready: threading.Event) -> None:
        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        loop.run_until_complete(self._start())
        ready.set()
        loop.run_forever()
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()

    async def _start(self) -> None:
        server = self._server = grpc.aio.server(compression=self.compression, options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE),
            ("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.so_reuseport", 0),
        ])
        handler = grpc.unary_unary_rpc_method_handler(
            self._echo, request_deserializer=interop_pb2.EchoRequest.FromString,
            response_serializer=interop_pb2.EchoResponse.SerializeToString)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Echo": handler}),))
        self.port = server.add_insecure_port("127.0.0.1:0")
        await server.start()

    async def _echo(self, request, context):
        self.calls += 1
        served = self.calls
        metadata = {k: v for k, v in context.invocation_metadata() if k.startswith("x-")}
        self.seen_metadata.append(metadata)
        remaining = context.time_remaining()
        sleep_ms = request.sleep_ms + (self.delay_first_ms if served == 1 else 0)
        if sleep_ms:
            try:
                await asyncio.sleep(sleep_ms / 1000)
            except asyncio.CancelledError:
                self.cancelled.append(request.message)
                self._cancel_seen.set()
                raise
        if metadata:
            await context.send_initial_metadata(tuple(metadata.items()))
            context.set_trailing_metadata(tuple((f"t-{k}", v) for k, v in metadata.items()))
        if request.fail_code:
            await context.abort(grpc.StatusCode[_STATUS_NAMES[request.fail_code]], request.fail_text)
        return interop_pb2.EchoResponse(
            message=request.message,
            server_timeout_ms=-1 if remaining is None else int(remaining * 1000),
            calls_served=served,
            payload_size=len(request.payload),
            payload_crc32=zlib.crc32(request.payload),
        )

    def wait_cancelled(self, timeout: float) -> bool:
        """Block until a call was seen cancelled (call from a thread, or via to_thread)."""
        return self._cancel_seen.wait(timeout)

    def stop(self, grace: float | None = None) -> None:
        if self._loop is None:
            return
        future = asyncio.run_coroutine_threadsafe(self._server.stop(grace), self._loop)
        future.result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop = None


_STATUS_NAMES = {s.value[0]: s.name for s in grpc.StatusCode}
