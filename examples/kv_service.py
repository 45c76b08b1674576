"""A service from a `.proto`, called by the names a C++ brpc client sends.

Make the `_pb2` module first (aiobrpc needs only `--python_out`, no gRPC plugin):

    python -m grpc_tools.protoc -I examples/proto --python_out=examples/proto examples/proto/kv.proto
    PYTHONPATH=examples/proto python examples/kv_service.py           # a demo that calls itself
    PYTHONPATH=examples/proto python examples/kv_service.py --serve --port 8000

A request names its method by the service's full name, `package.Service`, and the method's
name: here "example.kv.KvService" and "Put" or "Get", which is what a C++ brpc client built from
the same kv.proto sends:

    example::kv::KvService_Stub stub(&channel);
    stub.Put(&cntl, &request, &response, nullptr);

With `--serve` this program serves until Ctrl-C or SIGTERM, for such a client.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import aiobrpc

try:
    import kv_pb2  # generated from examples/proto/kv.proto
except ModuleNotFoundError:
    sys.exit("kv_pb2 not found: generate it with grpc_tools.protoc first (see this file's docstring)")

KV = kv_pb2.DESCRIPTOR.services_by_name["KvService"]


class KvService(aiobrpc.Servicer):
    SERVICE = KV

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    async def Put(self, request, cntl):
        if not request.key:
            # Bad input is EREQUEST (1003), as in brpc: the caller does not retry it.
            raise aiobrpc.RpcError(aiobrpc.errors.EREQUEST, "key must not be empty")
        self.values[request.key] = request.value
        return kv_pb2.PutResponse()

    async def Get(self, request, cntl):
        value = self.values.get(request.key)
        return kv_pb2.GetResponse(found=value is not None, value=value or b"")


async def demo(channel: aiobrpc.Channel) -> None:
    # call_method takes the names as they go on the wire; aiobrpc.Stub(channel, KV) does the same.
    await channel.call_method("example.kv.KvService", "Put",
                              kv_pb2.PutRequest(key="color", value=b"blue"), kv_pb2.PutResponse)
    resp = await channel.call_method("example.kv.KvService", "Get",
                                     kv_pb2.GetRequest(key="color"), kv_pb2.GetResponse)
    print(f"Get color: found={resp.found} value={resp.value!r}")
    try:
        await aiobrpc.Stub(channel, KV).Put(kv_pb2.PutRequest(key="", value=b"x"))
    except aiobrpc.RpcError as e:
        print(f"Put with an empty key: code={e.code} {e}")


async def main(port: int, serve: bool) -> None:
    server = aiobrpc.Server()
    server.add_service(KvService())
    await server.start(f"127.0.0.1:{port}")
    print(f"listening on {server.address}")
    for method in KV.methods:
        print(f"serving {KV.full_name}/{method.name}")  # e.g. example.kv.KvService/Put
    if serve:
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
    else:
        async with aiobrpc.Channel(server.address) as channel:
            await demo(channel)
    await server.stop()
    await server.join()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0, help="0: any free port")
    parser.add_argument("--serve", action="store_true", help="serve until Ctrl-C instead of the demo")
    args = parser.parse_args()
    asyncio.run(main(args.port, args.serve))
