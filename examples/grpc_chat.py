"""gRPC on aiobrpc's port: grpcio and aiobrpc's own gRPC client call one servicer, and so does
a baidu_std client, on the same port.

Make the `_pb2` module first (only `--python_out`; no gRPC plugin):

    python -m grpc_tools.protoc -I examples/proto --python_out=examples/proto examples/proto/chat.proto
    PYTHONPATH=examples/proto python examples/grpc_chat.py

The servicer has one method of each kind gRPC has (chat.proto): `Say` is unary, `Subscribe`
an async generator (a stream of responses), `Upload` takes the stream of requests, `Talk` both.
A grpcio channel (the `grpc` package, as a gRPC user has it) calls Say and Subscribe; an
`aiobrpc.Channel` with `ChannelOptions(protocol="grpc")` calls all four through `aiobrpc.Stub`.
"""

from __future__ import annotations

import asyncio
import sys

try:
    import grpc  # grpcio, the gRPC client this example calls the server with
except ModuleNotFoundError:
    sys.exit("grpcio is not installed: pip install grpcio")

import aiobrpc

try:
    import chat_pb2  # generated from examples/proto/chat.proto
except ModuleNotFoundError:
    sys.exit("chat_pb2 not found: generate it with grpc_tools.protoc first (see this file's docstring)")

CHAT = chat_pb2.DESCRIPTOR.services_by_name["Chat"]


class Chat(aiobrpc.Servicer):
    SERVICE = CHAT

    async def Say(self, request, cntl):
        return chat_pb2.Line(text=f"you said {request.text!r}")

    async def Subscribe(self, request, cntl):  # rpc Subscribe(Topic) returns (stream Line)
        for i in range(request.count):
            yield chat_pb2.Line(text=f"{request.name} #{i + 1}")

    async def Upload(self, requests, cntl):  # rpc Upload(stream Line) returns (Summary)
        lines = [line.text async for line in requests]
        return chat_pb2.Summary(lines=len(lines), characters=sum(map(len, lines)))

    async def Talk(self, requests, cntl):  # rpc Talk(stream Line) returns (stream Line)
        async for line in requests:
            yield chat_pb2.Line(text=line.text.upper())


def grpcio_client(address: str) -> list[str]:
    """What a grpcio user writes (blocking API), without code generated for gRPC."""
    with grpc.insecure_channel(address) as channel:
        say = channel.unary_unary("/example.chat.Chat/Say", request_serializer=chat_pb2.Line.SerializeToString,
                                  response_deserializer=chat_pb2.Line.FromString)
        subscribe = channel.unary_stream("/example.chat.Chat/Subscribe",
                                         request_serializer=chat_pb2.Topic.SerializeToString,
                                         response_deserializer=chat_pb2.Line.FromString)
        out = [say(chat_pb2.Line(text="hello"), timeout=5).text]
        out += [line.text for line in subscribe(chat_pb2.Topic(name="news", count=2), timeout=5)]
        return out


async def aiobrpc_grpc_client(address: str) -> None:
    options = aiobrpc.ChannelOptions(protocol="grpc", timeout_ms=5000)
    async with aiobrpc.Channel(address, options) as channel:
        stub = aiobrpc.Stub(channel, CHAT)
        print("aiobrpc gRPC Say:", (await stub.Say(chat_pb2.Line(text="hi"))).text)
        async for line in stub.Subscribe(chat_pb2.Topic(name="sports", count=3)):
            print("aiobrpc gRPC Subscribe:", line.text)
        summary = await stub.Upload(chat_pb2.Line(text=t) for t in ("one", "two", "three"))
        print(f"aiobrpc gRPC Upload: {summary.lines} lines, {summary.characters} characters")

        async def lines():
            for text in ("ping", "pong"):
                yield chat_pb2.Line(text=text)
        async for line in stub.Talk(lines()):
            print("aiobrpc gRPC Talk:", line.text)


async def main() -> None:
    server = aiobrpc.Server()
    server.add_service(Chat())
    await server.start("127.0.0.1:0")
    address = f"127.0.0.1:{server.port}"
    try:
        for text in await asyncio.to_thread(grpcio_client, address):
            print("grpcio:", text)
        await aiobrpc_grpc_client(address)
        async with aiobrpc.Channel(address) as channel:  # baidu_std: unary calls
            reply = await aiobrpc.Stub(channel, CHAT).Say(chat_pb2.Line(text="hey"))
            print("baidu_std Say:", reply.text)
    finally:
        await server.stop()
        await server.join()


if __name__ == "__main__":
    asyncio.run(main())
