"""protoc-gen-aiobrpc (aiobrpc/protoc): the checked-in output is what it generates now, the
generated stubs and servicers work against a real server, and what the plugin cannot generate
is reported through protoc."""

from __future__ import annotations

import asyncio
import doctest
import inspect
import os
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import pytest

import aiobrpc
import aiobrpc.sync
from aiobrpc import errors
from aiobrpc._proto import echo_aiobrpc, echo_pb2, grpc_test_aiobrpc, grpc_test_pb2, interop_aiobrpc, interop_pb2
from aiobrpc.protoc import plugin
from google.protobuf import descriptor_pb2
from google.protobuf.compiler import plugin_pb2
from tests.tools import generated

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120


def test_checked_in_output_is_what_the_plugins_generate_now(tmp_path):
    fresh = generated.generate(tmp_path)
    checked_in = sorted(p for pattern in generated.PATTERNS for p in generated.OUT_DIR.glob(pattern))
    assert [p.name for p in fresh] == [p.name for p in checked_in]
    stale = [p.name for p in fresh if p.read_bytes() != (generated.OUT_DIR / p.name).read_bytes()]
    assert not stale, f"stale generated files {stale}: run python -m tests.tools.generated"
    assert {p.name for p in fresh} >= {"echo_aiobrpc.py", "echo_pb2.pyi", "ps_aiobrpc.py", "tensor_pb2.pyi"}


class Echo(echo_aiobrpc.EchoServiceServicer):
    async def Echo(self, request: echo_pb2.EchoRequest, cntl: aiobrpc.Controller) -> echo_pb2.EchoResponse:
        cntl.response_attachment = cntl.request_attachment
        return echo_pb2.EchoResponse(message=request.message.upper())


async def serve(*servicers: aiobrpc.Servicer) -> aiobrpc.Server:
    server = aiobrpc.Server()
    for servicer in servicers:
        server.add_service(servicer)
    await server.start("127.0.0.1:0")
    return server


async def stop(server: aiobrpc.Server) -> None:
    await server.stop()
    await server.join()


async def test_generated_stub_calls_a_generated_servicer():
    server = await serve(Echo())
    try:
        async with aiobrpc.Channel(server.address, aiobrpc.ChannelOptions(timeout_ms=5000)) as channel:
            stub = echo_aiobrpc.EchoServiceStub(channel)
            cntl = aiobrpc.Controller(request_attachment=b"abc")
            resp = await stub.Echo(echo_pb2.EchoRequest(message="hi"), cntl)
            assert type(resp) is echo_pb2.EchoResponse and resp.message == "HI"
            assert bytes(cntl.response_attachment) == b"abc"
            assert cntl.service_name == "example.EchoService" and cntl.method_name == "Echo"
            # The dynamic Stub calls the same server by the same names.
            dynamic = aiobrpc.Stub(channel, echo_aiobrpc.EchoServiceServicer.SERVICE)
            assert (await dynamic.Echo(echo_pb2.EchoRequest(message="yo"))).message == "YO"
    finally:
        await stop(server)


async def test_a_request_of_another_type_raises_type_error_before_sending():
    server = await serve(Echo())
    try:
        async with aiobrpc.Channel(server.address) as channel:
            stub = echo_aiobrpc.EchoServiceStub(channel)
            with pytest.raises(TypeError, match=r"^example\.EchoService\.Echo takes a request of type example\.EchoRequest, "
                                                r"got EchoResponse$"):
                await stub.Echo(echo_pb2.EchoResponse(message="x"))  # type: ignore[arg-type]
            with pytest.raises(TypeError, match="got EchoRequest"):  # same name, another package
                await stub.Echo(interop_pb2.EchoRequest(message="x"))  # type: ignore[arg-type]
    finally:
        await stop(server)


async def test_a_method_not_overridden_fails_as_brpc_does():
    # C++ brpc's generated service calls SetFailed("Method X() not implemented."): EINTERNAL.
    class OnlyEcho(interop_aiobrpc.EchoServiceServicer):
        async def Echo(self, request: interop_pb2.EchoRequest,
                       cntl: aiobrpc.Controller) -> interop_pb2.EchoResponse:
            return interop_pb2.EchoResponse(message=request.message)

    server = await serve(OnlyEcho())
    try:
        async with aiobrpc.Channel(server.address, aiobrpc.ChannelOptions(max_retry=0)) as channel:
            stub = interop_aiobrpc.EchoServiceStub(channel)
            assert (await stub.Echo(interop_pb2.EchoRequest(message="a"))).message == "a"
            with pytest.raises(aiobrpc.RpcError) as e:
                await stub.StartStream(interop_pb2.EchoRequest(message="a"))
            assert e.value.code == errors.EINTERNAL
            assert e.value.text.endswith("Method StartStream() not implemented.")
    finally:
        await stop(server)


class Streams(grpc_test_aiobrpc.GrpcTestServiceServicer):
    """The streaming rpcs of grpc_test.proto on the generated servicer; Bidi left as generated."""

    async def ServerStream(self, request: grpc_test_pb2.GrpcMessage,
                           cntl: aiobrpc.Controller) -> typing.AsyncIterator[grpc_test_pb2.GrpcMessage]:
        for i in range(request.count):
            yield grpc_test_pb2.GrpcMessage(text=request.text, count=i)

    async def ClientStream(self, requests: typing.AsyncIterator[grpc_test_pb2.GrpcMessage],
                           cntl: aiobrpc.Controller) -> grpc_test_pb2.GrpcMessage:
        return grpc_test_pb2.GrpcMessage(text=",".join([r.text async for r in requests]))


async def test_generated_stub_calls_streaming_rpcs_over_grpc():
    server = await serve(Streams())
    try:
        options = aiobrpc.ChannelOptions(protocol="grpc", timeout_ms=5000, max_retry=0)
        async with aiobrpc.Channel(server.address, options) as channel:
            stub = grpc_test_aiobrpc.GrpcTestServiceStub(channel)
            got = [m.count async for m in stub.ServerStream(grpc_test_pb2.GrpcMessage(text="s", count=3))]
            assert got == [0, 1, 2]
            reply = await stub.ClientStream(grpc_test_pb2.GrpcMessage(text=t) for t in "abc")
            assert reply.text == "a,b,c"
            # Bidi is not overridden: the generated method fails as brpc's do, from the first read
            with pytest.raises(aiobrpc.RpcError) as e:
                await stub.Bidi([grpc_test_pb2.GrpcMessage(text="x")]).read()
            assert e.value.code == errors.EINTERNAL and e.value.text.endswith("Method Bidi() not implemented.")
            with pytest.raises(TypeError, match="takes a request of type aiobrpc.test.GrpcMessage, got EchoRequest"):
                stub.ServerStream(echo_pb2.EchoRequest())  # type: ignore[arg-type]
        async with aiobrpc.Channel(server.address) as channel:  # baidu_std: refused before sending
            with pytest.raises(aiobrpc.RpcError) as e:
                grpc_test_aiobrpc.GrpcTestServiceStub(channel).ServerStream(grpc_test_pb2.GrpcMessage())
            assert e.value.code == errors.EREQUEST and "call it over gRPC" in e.value.text
    finally:
        await stop(server)


def test_servicer_methods_are_typed_and_async():
    hints = typing.get_type_hints(echo_aiobrpc.EchoServiceServicer.Echo)
    assert hints == {"request": echo_pb2.EchoRequest, "cntl": aiobrpc.Controller, "return": echo_pb2.EchoResponse}
    assert inspect.iscoroutinefunction(echo_aiobrpc.EchoServiceServicer.Echo)
    assert inspect.iscoroutinefunction(echo_aiobrpc.EchoServiceStub.Echo)
    assert not inspect.iscoroutinefunction(echo_aiobrpc.EchoServiceSyncStub.Echo)
    assert echo_aiobrpc.EchoServiceServicer.SERVICE is echo_pb2.DESCRIPTOR.services_by_name["EchoService"]


async def test_sync_stub_calls_a_real_server_from_a_thread():
    server = await serve(Echo())

    def call() -> tuple[echo_pb2.EchoResponse, bytes]:
        with aiobrpc.sync.Channel(server.address) as channel:
            stub = echo_aiobrpc.EchoServiceSyncStub(channel)
            cntl = aiobrpc.Controller(request_attachment=b"att")
            resp = stub.Echo(echo_pb2.EchoRequest(message="s"), cntl)
            with pytest.raises(TypeError, match="takes a request of type example.EchoRequest, got EchoResponse"):
                stub.Echo(echo_pb2.EchoResponse(message="x"))  # type: ignore[arg-type]
            return resp, bytes(cntl.response_attachment)

    try:
        assert await asyncio.to_thread(call) == (echo_pb2.EchoResponse(message="S"), b"att")
    finally:
        await stop(server)


async def test_sync_stub_refuses_an_async_channel():
    async with aiobrpc.Channel("127.0.0.1:1") as channel:
        with pytest.raises(TypeError, match="^EchoServiceSyncStub takes an aiobrpc.sync.Channel, got Channel: "
                                            "over an aiobrpc.Channel use EchoServiceStub$"):
            echo_aiobrpc.EchoServiceSyncStub(channel)  # type: ignore[arg-type]


def test_typed_example_runs(twin):
    env = dict(os.environ)
    env.pop("AIOBRPC_NO_EXTENSIONS", None)
    if twin == "python":
        env["AIOBRPC_NO_EXTENSIONS"] = "1"
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "typed_echo.py"), "--message", "hi"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["response: 'hi', attachment: 1024 bytes", "failed: code=1003"]


# --- The plugin on .proto files of its own: packages, imports, streaming, errors. ---

COMMON = """\
syntax = "proto3";
package shop.common;
message Money {
  message Currency { string code = 1; }
  int64 units = 1;
  optional Currency currency = 2;
}
"""

ORDERS = """\
syntax = "proto3";
package shop;
import "shop/common/money.proto";
import "google/protobuf/empty.proto";

message Order { string id = 1; shop.common.Money total = 2; }

// Takes orders.
// Second line with a "quote" and a \\backslash.
service Orders {
  // Places one order.
  rpc Place(Order) returns (shop.common.Money);
  rpc Watch(Order) returns (stream Order);
  rpc Nothing(google.protobuf.Empty) returns (shop.common.Money.Currency);
}
"""


def write_protos(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def request_for(root: Path, files: dict[str, str], generate: list[str], parameter: str = ""
                ) -> plugin_pb2.CodeGeneratorRequest:
    """The CodeGeneratorRequest protoc would send for `generate`."""
    write_protos(root, files)
    out = root / "set.pb"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{root}", "--include_imports",
                    "--include_source_info", f"--descriptor_set_out={out}", *generate],
                   check=True, cwd=root, timeout=TIMEOUT_S)
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    return plugin_pb2.CodeGeneratorRequest(file_to_generate=generate, proto_file=fds.file, parameter=parameter)


def only_file(response: plugin_pb2.CodeGeneratorResponse) -> tuple[str, str]:
    assert not response.error, response.error
    assert len(response.file) == 1
    return response.file[0].name, response.file[0].content


def test_docstring_examples():
    assert doctest.testmod(plugin).failed == 0


def test_module_name_is_the_pb2_module_of_protoc():
    assert plugin.module_name("echo.proto") == "echo_pb2"
    assert plugin.module_name("a/b-c.proto") == "a.b_c_pb2"


def test_imports_follow_the_python_package_of_each_proto(tmp_path):
    files = {"shop/common/money.proto": COMMON, "shop/orders.proto": ORDERS}
    name, content = only_file(plugin.generate(request_for(tmp_path, files, ["shop/orders.proto"])))
    assert name == "shop/orders_aiobrpc.py"
    assert ("from google.protobuf import empty_pb2\nfrom shop.common import money_pb2\n"
            "from shop import orders_pb2\n") in content  # sorted by module
    assert ") -> money_pb2.Money.Currency:" in content  # a nested message

    _, relative = only_file(plugin.generate(request_for(tmp_path, files, ["shop/orders.proto"],
                                                        "relative_imports")))
    assert "from google.protobuf import empty_pb2\nfrom .common import money_pb2\nfrom . import orders_pb2\n" in relative


def test_modules_of_the_same_name_get_protoc_aliases(tmp_path):
    files = {"a/money.proto": 'syntax = "proto3"; package a; message M {}',
             "b/money.proto": 'syntax = "proto3"; package b; message M {}',
             "svc.proto": 'syntax = "proto3"; import "a/money.proto"; import "b/money.proto";\n'
                          "service S { rpc F(a.M) returns (b.M); }"}
    _, content = only_file(plugin.generate(request_for(tmp_path, files, ["svc.proto"])))
    assert "from a import money_pb2 as a_dot_money__pb2\nfrom b import money_pb2 as b_dot_money__pb2\n" in content
    assert "import svc_pb2\n" in content
    assert "request: a_dot_money__pb2.M," in content and "-> b_dot_money__pb2.M:" in content


def test_a_proto_without_services_gets_no_module(tmp_path):
    response = plugin.generate(request_for(tmp_path, {"shop/common/money.proto": COMMON},
                                           ["shop/common/money.proto"]))
    assert not response.error and len(response.file) == 0


def test_streaming_rpcs_are_on_the_async_stub_and_servicer_only(tmp_path):
    files = {"shop/common/money.proto": COMMON, "shop/orders.proto": ORDERS}
    _, content = only_file(plugin.generate(request_for(tmp_path, files, ["shop/orders.proto"])))
    stub, sync, servicer = (content[content.index(f"class {c}"):] for c in
                            ("OrdersStub", "OrdersSyncStub", "OrdersServicer"))
    stub = stub[:stub.index("class OrdersSyncStub")]
    sync = sync[:sync.index("class OrdersServicer")]
    assert "    def Watch(self, request: orders_pb2.Order," in stub
    assert "-> aiobrpc.ResponseStream[orders_pb2.Order]:" in stub
    assert "aiobrpc.stub.call_streaming(" in stub
    assert "def Watch" not in sync
    assert sync.count("    # Watch: streaming, not here: OrdersStub calls it over gRPC") == 1
    assert "    async def Watch(self, request: orders_pb2.Order," in servicer
    assert "-> typing.AsyncIterator[orders_pb2.Order]:" in servicer


@pytest.mark.parametrize(("rpc", "error"), [
    ("rpc import(M) returns (M);", "rpc p.S.import is named 'import', a Python keyword"),
    ("rpc channel(M) returns (M);", "rpc p.S.channel would replace the attribute 'channel'"),
    ("rpc SERVICE(M) returns (M);", "rpc p.S.SERVICE would replace the attribute 'SERVICE'"),
    ("} service SSync {", "p.proto: services p.S and p.SSync both need a class SSyncStub"),
])
def test_names_python_cannot_take_are_errors(tmp_path, rpc, error):
    files = {"p.proto": f'syntax = "proto3"; package p; message M {{}} service S {{ {rpc} }}'}
    response = plugin.generate(request_for(tmp_path, files, ["p.proto"]))
    assert response.error.startswith(error) and len(response.file) == 0


def test_unknown_parameter_is_an_error():
    response = plugin.generate(plugin_pb2.CodeGeneratorRequest(parameter="relative_imports,fast"))
    assert response.error == "unknown parameter fast (known: relative_imports)"


def test_output_is_deterministic(tmp_path):
    files = {"shop/common/money.proto": COMMON, "shop/orders.proto": ORDERS}
    request = request_for(tmp_path, files, ["shop/orders.proto"])
    assert plugin.generate(request).SerializeToString() == plugin.generate(request).SerializeToString()


# --- `python -m aiobrpc.protoc`, as a user runs it. ---

def protoc(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aiobrpc.protoc", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=TIMEOUT_S)


def test_python_m_aiobrpc_protoc_end_to_end(tmp_path):
    write_protos(tmp_path, {"shop/common/money.proto": COMMON, "shop/orders.proto": ORDERS})
    out = tmp_path / "out"
    out.mkdir()
    done = protoc("-I.", f"--python_out={out}", f"--aiobrpc_out={out}", "shop/orders.proto",
                  "shop/common/money.proto", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*.py")) == [
        "shop/common/money_pb2.py", "shop/orders_aiobrpc.py", "shop/orders_pb2.py"]
    # The module imports and is typed with the message classes of both files.
    check = textwrap.dedent("""\
        import typing
        from shop import orders_aiobrpc, orders_pb2
        from shop.common import money_pb2
        hints = typing.get_type_hints(orders_aiobrpc.OrdersStub.Place)
        assert hints["request"] is orders_pb2.Order and hints["return"] is money_pb2.Money, hints
        assert typing.get_type_hints(orders_aiobrpc.OrdersServicer.Nothing)["return"] is money_pb2.Money.Currency
        assert orders_aiobrpc.OrdersServicer.SERVICE.full_name == "shop.Orders"
        import aiobrpc
        watch = typing.get_type_hints(orders_aiobrpc.OrdersStub.Watch)["return"]
        assert watch == aiobrpc.ResponseStream[orders_pb2.Order], watch
        assert not hasattr(orders_aiobrpc.OrdersSyncStub, "Watch")
        import inspect  # getdoc: 3.13 strips docstrings' indentation when compiling, earlier ones do not
        print(inspect.getdoc(orders_aiobrpc.OrdersStub))
        print(inspect.getdoc(orders_aiobrpc.OrdersStub.Place))
    """)
    run = subprocess.run([sys.executable, "-c", check], cwd=out, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        "Calls shop.Orders on an `aiobrpc.Channel`: `await stub.Method(request, cntl)`.", "",
        "Takes orders.", 'Second line with a "quote" and a \\backslash.', "Places one order."]


def test_plugin_errors_reach_protoc_and_its_exit_status(tmp_path):
    write_protos(tmp_path, {"e.proto": 'syntax = "proto3"; message M {} service S { rpc F(M) returns (M); }'})
    done = protoc("-I.", f"--aiobrpc_out=bogus:{tmp_path}", "e.proto", cwd=tmp_path)
    assert done.returncode == 1
    assert "unknown parameter bogus (known: relative_imports)" in done.stderr
    assert not (tmp_path / "e_aiobrpc.py").exists()
