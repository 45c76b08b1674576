"""The servicers of examples/, tested as a user tests theirs: through `aiobrpc.testing.ChannelFor`,
in memory, with real serialization and real error codes."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import aiobrpc
from aiobrpc import errors
from aiobrpc._proto import echo_pb2
from aiobrpc.testing import ChannelFor

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"examples_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_loaded: dict = {}


@pytest.fixture
def kv_service(tmp_path_factory):
    """examples/kv_service.py and its kv_pb2, once per process (protobuf's default pool takes a
    .proto once)."""
    if "kv" not in _loaded:
        _loaded["kv"] = _load_kv(tmp_path_factory)
    return _loaded["kv"]


def _load_kv(tmp_path_factory):
    # Compiled as "examples/proto/kv.proto" rather than "kv.proto" (what examples/README.md
    # makes): aetcd, which the etcd tests of this process import, registers etcd's own
    # "kv.proto" in the same default pool.
    out = tmp_path_factory.mktemp("kv_pb2")
    protoc = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{EXAMPLES.parent}",
                             f"--python_out={out}", str(EXAMPLES / "proto" / "kv.proto")],
                            capture_output=True, text=True, timeout=60)
    assert protoc.returncode == 0, protoc.stderr
    out = out / "examples" / "proto"
    sys.path.insert(0, str(out))
    try:
        return load_example("kv_service")
    finally:
        sys.path.remove(str(out))


async def test_kv_put_then_get(kv_service):
    kv_pb2 = kv_service.kv_pb2
    async with ChannelFor([kv_service.KvService()]) as channel:
        stub = aiobrpc.Stub(channel, kv_service.KV)
        await stub.Put(kv_pb2.PutRequest(key="color", value=b"blue"))
        found = await stub.Get(kv_pb2.GetRequest(key="color"))
        missing = await stub.Get(kv_pb2.GetRequest(key="size"))
    assert (found.found, found.value) == (True, b"blue")
    assert (missing.found, missing.value) == (False, b"")


async def test_kv_put_with_an_empty_key_is_a_bad_request(kv_service):
    kv_pb2 = kv_service.kv_pb2
    async with ChannelFor([kv_service.KvService()], aiobrpc.ChannelOptions(max_retry=3)) as channel:
        cntl = aiobrpc.Controller()
        with pytest.raises(aiobrpc.RpcError) as e:
            await aiobrpc.Stub(channel, kv_service.KV).Put(kv_pb2.PutRequest(key="", value=b"x"), cntl)
    assert e.value.code == errors.EREQUEST and e.value.text.endswith("key must not be empty")
    assert cntl.retried_count == 0, "EREQUEST is not retried"


async def test_the_kv_demo_client_against_the_servicer_in_memory(kv_service, capsys):
    async with ChannelFor([kv_service.KvService()]) as channel:
        await kv_service.demo(channel)
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["Get color: found=True value=b'blue'",
                     f"Put with an empty key: code=1003 [E1003][{channel.address}][E1003]key must not be empty"]


async def test_echo_service_sends_the_attachment_back():
    echo_server = load_example("echo_server")
    async with ChannelFor([echo_server.EchoService()]) as channel:
        stub = aiobrpc.Stub(channel, echo_server.EchoService.SERVICE)
        cntl = aiobrpc.Controller()
        cntl.request_attachment = bytes(range(256)) * 4
        resp = await stub.Echo(echo_pb2.EchoRequest(message="hi"), cntl)
        assert resp.message == "hi" and bytes(cntl.response_attachment) == bytes(range(256)) * 4
        with pytest.raises(aiobrpc.RpcError) as e:
            await stub.Echo(echo_pb2.EchoRequest(message=""))
        assert e.value.code == errors.EREQUEST and "message must not be empty" in e.value.text
