"""The README's client example and examples/typed_echo.py pass `mypy --strict` with the
generated stubs (aiobrpc/_proto/echo_aiobrpc.py, echo_pb2.pyi), and so do the generated
modules; a probe checked in the same run asserts the types the stubs give, so a stub left
untyped (or typed Any) fails here. Programs using the dynamic `aiobrpc.Stub` (examples/
echo_client.py, docs/sync.md's example) pass too: its methods are untyped callables.

One mypy run for all of it (mypy is slow to start), in one of the two processes only
(tests/conftest.py: _ONCE_DIRS): types do not depend on the twin.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300

# `# type: ignore[...]` lines must be needed: --strict warns about unused ones.
PROBE = '''\
import typing

from typing_extensions import assert_type

import aiobrpc
import aiobrpc.sync
from aiobrpc._proto import echo_aiobrpc, echo_pb2, grpc_test_aiobrpc, grpc_test_pb2


def sync_probe(channel: aiobrpc.sync.Channel) -> None:
    stub = echo_aiobrpc.EchoServiceSyncStub(channel)
    assert_type(stub.Echo(echo_pb2.EchoRequest(message="a")), echo_pb2.EchoResponse)
    echo_aiobrpc.EchoServiceSyncStub(aiobrpc.Channel("127.0.0.1:1"))  # type: ignore[arg-type]


async def probe(channel: aiobrpc.Channel) -> None:
    stub = echo_aiobrpc.EchoServiceStub(channel)
    assert_type(await stub.Echo(echo_pb2.EchoRequest(message="a")), echo_pb2.EchoResponse)
    assert_type(await stub.Echo(echo_pb2.EchoRequest(message="a"), aiobrpc.Controller()), echo_pb2.EchoResponse)
    await stub.Echo(echo_pb2.EchoResponse(message="a"))  # type: ignore[arg-type]
    await stub.Echo(echo_pb2.EchoRequest(message="a"), cntl=7)  # type: ignore[arg-type]


def combo_probe(parallel: aiobrpc.ParallelChannel, selective: aiobrpc.SelectiveChannel) -> None:
    echo_aiobrpc.EchoServiceStub(parallel)  # any aiobrpc.RpcChannel
    echo_aiobrpc.EchoServiceStub(selective)
    echo_aiobrpc.EchoServiceStub(object())  # type: ignore[arg-type]


async def streaming_probe(channel: aiobrpc.Channel) -> None:
    stub = grpc_test_aiobrpc.GrpcTestServiceStub(channel)
    one = grpc_test_pb2.GrpcMessage()
    stream = stub.ServerStream(one)
    assert_type(stream, aiobrpc.ResponseStream[grpc_test_pb2.GrpcMessage])
    assert_type(await stream.read(), grpc_test_pb2.GrpcMessage | None)
    async for message in stub.Bidi([one]):
        assert_type(message, grpc_test_pb2.GrpcMessage)
    assert_type(await stub.ClientStream([one]), grpc_test_pb2.GrpcMessage)
    stub.ServerStream(echo_pb2.EchoRequest())  # type: ignore[arg-type]
    await stub.ClientStream(one)  # type: ignore[arg-type]


class Streams(grpc_test_aiobrpc.GrpcTestServiceServicer):
    async def ServerStream(self, request: grpc_test_pb2.GrpcMessage,
                           cntl: aiobrpc.Controller) -> typing.AsyncIterator[grpc_test_pb2.GrpcMessage]:
        yield request

    async def ClientStream(self, requests: typing.AsyncIterator[grpc_test_pb2.GrpcMessage],
                           cntl: aiobrpc.Controller) -> grpc_test_pb2.GrpcMessage:
        return [r async for r in requests][-1]


async def dynamic_stub_probe(channel: aiobrpc.Channel) -> None:
    stub = aiobrpc.Stub(channel, echo_pb2.DESCRIPTOR.services_by_name["EchoService"])
    assert_type(stub.Echo, typing.Callable[..., typing.Any])
    assert_type(await stub.Echo(echo_pb2.EchoRequest(message="a")), typing.Any)


def dynamic_sync_stub_probe(channel: aiobrpc.sync.Channel) -> None:
    stub = aiobrpc.sync.Stub(channel, echo_pb2.DESCRIPTOR.services_by_name["EchoService"])
    assert_type(stub.Echo(echo_pb2.EchoRequest(message="a")).message, typing.Any)


class WrongRequest(echo_aiobrpc.EchoServiceServicer):
    async def Echo(self, request: echo_pb2.EchoResponse, cntl: aiobrpc.Controller) -> echo_pb2.EchoResponse:  # type: ignore[override]
        return request


class WrongResponse(echo_aiobrpc.EchoServiceServicer):
    async def Echo(self, request: echo_pb2.EchoRequest, cntl: aiobrpc.Controller) -> echo_pb2.EchoRequest:  # type: ignore[override]
        return request
'''


def readme_client_example() -> str:
    readme = (ROOT / "README.md").read_text()
    match = re.search(r"^## Client\n.*?^```python\n(.*?)^```", readme, re.S | re.M)
    assert match, "README.md has a ```python block under '## Client'"
    return match.group(1)


def sync_doc_example() -> str:
    match = re.search(r"^```python\n(.*?)^```", (ROOT / "docs" / "sync.md").read_text(), re.S | re.M)
    assert match, "docs/sync.md opens with a ```python example"
    return match.group(1)


def test_readme_client_and_typed_example_pass_mypy_strict(tmp_path):
    (tmp_path / "readme_client.py").write_text(readme_client_example())
    (tmp_path / "echo_client.py").write_text((ROOT / "examples" / "echo_client.py").read_text())
    (tmp_path / "sync_doc.py").write_text(sync_doc_example())
    assert "aiobrpc.sync.Stub(channel, ECHO)" in (tmp_path / "sync_doc.py").read_text()
    assert "echo_aiobrpc.EchoServiceStub(channel)" in (tmp_path / "readme_client.py").read_text()
    (tmp_path / "typed_echo.py").write_text((ROOT / "examples" / "typed_echo.py").read_text())
    (tmp_path / "stub_types_probe.py").write_text(PROBE)
    # The generated modules themselves too: as targets, mypy reports their errors.
    generated = [f"aiobrpc._proto.{p.stem}" for p in sorted((ROOT / "aiobrpc" / "_proto").glob("*_aiobrpc.py"))]
    assert "aiobrpc._proto.echo_aiobrpc" in generated
    modules = ["readme_client", "typed_echo", "echo_client", "sync_doc", "stub_types_probe", *generated]
    # Run outside the repository (mypy finds the files above in its working directory), so
    # aiobrpc is found as installed (`pip install -e .`), as a user's is.
    done = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path / "mypy_cache"),
                           *(a for m in modules for a in ("-m", m))],
                          cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith(f"Success: no issues found in {len(modules)} source files"), done.stdout
