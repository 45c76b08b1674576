"""TLS on the server's ordinary port and in channels: detection, baidu_std and HTTP inside,
certificates made per run with trustme, mutual TLS, and the I6-I10 rows of
docs/hostile_inputs.md (no plaintext fallback, handshake timeouts, force_ssl)."""

from __future__ import annotations

import asyncio
import http.client
import logging
import os
import socket
import ssl

import pytest
import trustme

import aiobrpc
from aiobrpc import errors
from aiobrpc._proto import interop_pb2
from aiobrpc.protocol import baidu_std
from aiobrpc.server import connection
from aiobrpc.tls import ClientTlsOptions, ServerTlsOptions
from tests.helpers.interop_server import SERVICE, InteropEcho
from tests.helpers.peers import raw_exchange
from tests.helpers.unread import flood_without_reading
from tests.helpers.waiting import wait_until
from tests.helpers.wire import frame, rpc_meta

MIB = 1 << 20
Req, Resp = interop_pb2.EchoRequest, interop_pb2.EchoResponse
SVC = "interop.EchoService"


@pytest.fixture(autouse=True)
def logs_not_rate_limited():
    """The server logs a cause at most once a second: each test here reads its own line."""
    connection._detect_log._next = 0.0


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """Files of two CAs: `ca` signs the server's and a client's certificates, `other` a
    client certificate the server does not trust and a server certificate no client trusts."""
    d = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    files = {}

    def put(name, blob):
        files[name] = str(d / f"{name}.pem")
        blob.write_to_path(files[name])
    put("ca", ca.cert_pem)
    put("other_ca", other.cert_pem)
    put("server", ca.issue_cert("127.0.0.1", "localhost").private_key_and_cert_chain_pem)
    put("wrong_name", ca.issue_cert("elsewhere.example").private_key_and_cert_chain_pem)
    put("untrusted_server", other.issue_cert("127.0.0.1").private_key_and_cert_chain_pem)
    put("client", ca.issue_cert("client@example").private_key_and_cert_chain_pem)
    put("stranger", other.issue_cert("stranger@example").private_key_and_cert_chain_pem)
    return files


async def start(pki, cert="server", **opts):
    tls = opts.pop("tls", None) or ServerTlsOptions(cert_file=pki[cert])
    servicer = InteropEcho()
    srv = aiobrpc.Server(aiobrpc.ServerOptions(ssl=tls, **opts))
    srv.add_service(servicer)
    await srv.start("127.0.0.1:0")
    return srv, servicer


async def stop(srv):
    await srv.stop()
    await srv.join(timeout=2)
    assert not srv.connections


async def echo(srv, tls, message="hi", **opts):
    opts.setdefault("timeout_ms", 3000)
    opts.setdefault("max_retry", 0)
    ch = aiobrpc.Channel(srv.address, aiobrpc.ChannelOptions(ssl=tls, **opts))
    try:
        return await aiobrpc.Stub(ch, SERVICE).Echo(Req(message=message))
    finally:
        await ch.close()


def trusting(pki, **kw) -> ClientTlsOptions:
    return ClientTlsOptions(ca_file=pki["ca"], **kw)


@pytest.mark.parametrize("ctype", ["single", "pooled", "short"])
async def test_tls_and_plaintext_share_the_port(pki, ctype):
    srv, servicer = await start(pki)
    assert (await echo(srv, trusting(pki), "secret", connection_type=ctype)).message == "secret"
    assert (await echo(srv, None, "plain", connection_type=ctype)).message == "plain"
    assert servicer.calls_served == 2
    await stop(srv)


async def test_many_calls_and_a_large_attachment_over_tls(pki):
    srv, _ = await start(pki)
    ch = aiobrpc.Channel(srv.address, aiobrpc.ChannelOptions(ssl=trusting(pki), timeout_ms=10000))
    stub = aiobrpc.Stub(ch, SERVICE)
    got = await asyncio.gather(*[stub.Echo(Req(message=str(i))) for i in range(1000)])
    assert [r.message for r in got] == [str(i) for i in range(1000)]
    att = os.urandom(5 * MIB + 7)
    cntl = aiobrpc.Controller()
    cntl.request_attachment = att
    await stub.Echo(Req(message="big", echo_attachment=True), cntl=cntl)
    assert bytes(cntl.response_attachment) == att
    (conn,) = srv.connections
    assert conn.tls is not None and conn.protocol == "baidu_std"
    assert conn.transport.get_extra_info("cipher") is not None
    await ch.close()
    await stop(srv)


async def test_https_reaches_methods_and_builtin_pages(pki):
    srv, _ = await start(pki)
    ctx = ssl.create_default_context(cafile=pki["ca"])

    def get(path, body=None):
        c = http.client.HTTPSConnection("127.0.0.1", srv.port, context=ctx, timeout=5)
        try:
            c.request("POST" if body else "GET", path, body=body,
                      headers={"Content-Type": "application/json"} if body else {})
            r = c.getresponse()
            return r.status, r.read()
        finally:
            c.close()
    assert await asyncio.to_thread(get, "/health") == (200, b"OK")
    status, body = await asyncio.to_thread(get, f"/{SVC}/Echo", b'{"message": "json over tls"}')
    assert status == 200 and b'"json over tls"' in body
    status, body = await asyncio.to_thread(get, "/connections")
    assert status == 200 and b"ssl" in body
    await stop(srv)


# --- I6: a server the client does not trust: ESSL, never plaintext -------------------------

@pytest.mark.parametrize("cert, tls", [
    ("untrusted_server", lambda pki: trusting(pki)),  # signed by a CA the client does not trust
    ("wrong_name", lambda pki: trusting(pki)),  # trusted CA, another host's name
    ("server", lambda pki: True),  # the system's CAs do not include the test CA
])
async def test_i6_an_untrusted_server_fails_with_essl_and_no_plaintext(pki, cert, tls):
    srv, servicer = await start(pki, cert=cert)
    with pytest.raises(aiobrpc.RpcError) as info:
        await echo(srv, tls(pki))
    assert info.value.code == errors.ESSL and "TLS handshake failed" in info.value.text
    assert "certificate verify failed" in info.value.text
    assert servicer.calls_served == 0 and srv.stats.connections_accepted >= 1
    await stop(srv)


async def test_a_name_the_certificate_carries_can_be_asked_for(pki):
    srv, _ = await start(pki, cert="wrong_name")
    got = await echo(srv, trusting(pki, server_hostname="elsewhere.example"))
    assert got.message == "hi"
    await stop(srv)


# --- I7: a TLS client meets a plaintext server, or one that never answers ------------------

def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_i7_a_tls_client_to_a_plaintext_server_fails_fast(pki, caplog):
    srv = aiobrpc.Server()
    srv.add_service(InteropEcho())
    await srv.start("127.0.0.1:0")
    caplog.set_level(logging.WARNING)
    with pytest.raises(aiobrpc.RpcError) as info:
        await echo(srv, trusting(pki))
    assert info.value.code == errors.ESSL
    assert "has no certificate for" in caplog.text  # the server named what it closed
    await stop(srv)


async def test_i7_a_silent_server_fails_within_the_handshake_timeout(pki):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # the kernel completes TCP handshakes; nobody ever answers ClientHello
    port = listener.getsockname()[1]
    fds = open_fds()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    ch = aiobrpc.Channel(f"127.0.0.1:{port}", aiobrpc.ChannelOptions(
        ssl=trusting(pki), ssl_handshake_timeout_ms=300, timeout_ms=5000, max_retry=0))
    with pytest.raises(aiobrpc.RpcError) as info:
        await aiobrpc.Stub(ch, SERVICE).Echo(Req(message="x"))
    took = loop.time() - t0
    await ch.close()
    listener.close()
    # ESSL "no handshake within": the handshake's timer ended it, not the call's (timeout_ms=5000).
    assert info.value.code == errors.ESSL and "no handshake within" in info.value.text
    assert took >= 0.25  # not before ssl_handshake_timeout_ms=300
    for _ in range(1000):  # the client's socket is closed (10 s at most)
        if open_fds() <= fds:
            break
        await asyncio.sleep(0.01)
    await wait_until(lambda: open_fds() <= fds)
    assert open_fds() <= fds


# --- I8: a stalled handshake at the server --------------------------------------------------

async def test_i8_a_stalled_client_hello_is_closed_at_the_handshake_timeout(pki, caplog):
    srv, _ = await start(pki, ssl_handshake_timeout_sec=0.3)
    caplog.set_level(logging.WARNING)
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
    writer.write(bytes([0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xFC, 0x03]))  # 10 bytes of a hello
    t0 = loop.time()
    assert await asyncio.wait_for(reader.read(), 10) == b""  # 10 s only guards against a hang
    assert loop.time() - t0 >= 0.25  # not before ssl_handshake_timeout_sec=0.3; the log says which timer
    writer.close()
    assert "TLS handshake failed: no handshake within 0.3 s" in caplog.text
    assert srv.stats.closed.get("tls_handshake") == 1
    await stop(srv)


# --- I9: force_ssl ---------------------------------------------------------------------------

async def test_i9_force_ssl_closes_plaintext(pki, caplog):
    srv, servicer = await start(pki, force_ssl=True)
    caplog.set_level(logging.WARNING)
    got, closed = await raw_exchange(srv.port, frame(rpc_meta(service=SVC, correlation_id=1),
                                                      Req(message="x").SerializeToString()))
    assert got == b"" and closed
    got, closed = await raw_exchange(srv.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert got == b"" and closed
    assert "does not start with a TLS handshake" in caplog.text
    assert servicer.calls_served == 0
    assert (await echo(srv, trusting(pki))).message == "hi"
    await stop(srv)


def test_force_ssl_needs_a_certificate_and_bad_settings_are_named(pki, tmp_path):
    with pytest.raises(ValueError, match="force_ssl=True needs ssl"):
        aiobrpc.ServerOptions(force_ssl=True)
    with pytest.raises(TypeError, match="ssl must be None, a ServerTlsOptions"):
        aiobrpc.ServerOptions(ssl="cert.pem")
    with pytest.raises(TypeError, match="ssl must be None, True, a ClientTlsOptions"):
        aiobrpc.ChannelOptions(ssl="ca.pem")
    with pytest.raises(ValueError, match="verify_client='required' needs ca_file"):
        ServerTlsOptions(cert_file=pki["server"], verify_client="required")
    with pytest.raises(ValueError, match="verify_client must be one of"):
        ServerTlsOptions(cert_file=pki["server"], verify_client="yes")
    with pytest.raises(ValueError, match="ssl_handshake_timeout_ms"):
        aiobrpc.ChannelOptions(ssl_handshake_timeout_ms=0)
    with pytest.raises(FileNotFoundError):  # a server whose certificate is missing fails when made
        aiobrpc.Server(aiobrpc.ServerOptions(ssl=ServerTlsOptions(cert_file=str(tmp_path / "none.pem"))))


# --- I10: mutual TLS ---------------------------------------------------------------------------

async def test_i10_mutual_tls(pki, caplog):
    tls = ServerTlsOptions(cert_file=pki["server"], ca_file=pki["ca"], verify_client="required")
    srv, servicer = await start(pki, tls=tls)
    caplog.set_level(logging.WARNING)
    got = await echo(srv, trusting(pki, cert_file=pki["client"]))
    assert got.message == "hi"
    for client_cert in (None, pki["stranger"]):  # none, or one from a CA the server does not trust
        with pytest.raises(aiobrpc.RpcError) as info:
            await echo(srv, trusting(pki, cert_file=client_cert))
        # TLS 1.3 ends the client's handshake before the server judged its certificate: the
        # server's alert then ends the connection, and the call, with ESSL all the same
        assert info.value.code == errors.ESSL, info.value
        assert "ALERT" in info.value.text
    assert servicer.calls_served == 1
    assert srv.stats.closed.get("tls_handshake") == 2
    assert "TLS handshake failed: PEER_DID_NOT_RETURN_A_CERTIFICATE" in caplog.text
    await stop(srv)


H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # + empty SETTINGS


async def test_mutual_tls_refuses_plaintext_on_every_protocol_by_default(pki, caplog):
    """Issue 29 R2: a server that requires client certificates cannot be reached by not using
    TLS: plaintext baidu_std, HTTP and HTTP/2 (gRPC) are closed unread (stricter than brpc)."""
    tls = ServerTlsOptions(cert_file=pki["server"], ca_file=pki["ca"], verify_client="required")
    srv, servicer = await start(pki, tls=tls)
    assert srv.force_ssl
    caplog.set_level(logging.WARNING)
    for first in (frame(rpc_meta(service=SVC, correlation_id=1), Req(message="x").SerializeToString()),
                  b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", H2_PREFACE):
        got, closed = await raw_exchange(srv.port, first)
        assert got == b"" and closed, first
    assert "does not start with a TLS handshake and the server requires TLS (client certificates are " \
           "required)" in caplog.text
    assert servicer.calls_served == 0 and srv.stats.closed.get("not_tls") == 3
    assert (await echo(srv, trusting(pki, cert_file=pki["client"]))).message == "hi"
    await stop(srv)


async def test_plaintext_beside_mutual_tls_only_when_asked(pki):
    tls = ServerTlsOptions(cert_file=pki["server"], ca_file=pki["ca"], verify_client="required")
    srv, servicer = await start(pki, tls=tls, force_ssl=False)
    assert (await echo(srv, None, "plain")).message == "plain"
    await stop(srv)
    srv, _ = await start(pki, tls=ServerTlsOptions(cert_file=pki["server"], ca_file=pki["ca"],
                                                     verify_client="optional"))
    assert not srv.force_ssl and (await echo(srv, None, "plain")).message == "plain"
    await stop(srv)
    with pytest.raises(TypeError, match="force_ssl must be None, True or False"):
        aiobrpc.ServerOptions(force_ssl="yes")


async def test_a_clients_close_notify_closes_the_connection(pki):
    """A TLS client that ends cleanly (close_notify, then waits for the server's) is closed
    by the server, not left open until an idle timeout."""
    srv, _ = await start(pki)
    assert (await echo(srv, trusting(pki))).message == "hi"  # a TLS connection the server served

    def unwrap() -> None:
        raw = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        tls = ssl.create_default_context(cafile=pki["ca"]).wrap_socket(raw, server_hostname="localhost")
        tls.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        got = b""
        while not got.endswith(b"\r\n\r\nOK"):
            chunk = tls.recv(4096)
            assert chunk, got
            got += chunk
        assert got.startswith(b"HTTP/1.1 200")
        tls.unwrap().close()  # sends close_notify and waits for the server's

    await asyncio.to_thread(unwrap)
    loop = asyncio.get_running_loop()
    end = loop.time() + 5
    while srv.connections and loop.time() < end:
        await asyncio.sleep(0.01)
    await wait_until(lambda: not srv.connections)
    assert not srv.connections
    await stop(srv)


async def test_the_peer_certificate_is_on_the_connection(pki):
    tls = ServerTlsOptions(cert_file=pki["server"], ca_file=pki["ca"], verify_client="required")
    srv, _ = await start(pki, tls=tls)
    ch = aiobrpc.Channel(srv.address, aiobrpc.ChannelOptions(ssl=trusting(pki, cert_file=pki["client"])))
    await aiobrpc.Stub(ch, SERVICE).Echo(Req(message="x"))
    (conn,) = srv.connections
    subject = dict(x[0] for x in conn.transport.get_extra_info("peercert")["subject"])
    assert subject.get("commonName", "") == "client@example" or "client@example" in str(
        conn.transport.get_extra_info("peercert"))
    await ch.close()
    await stop(srv)


# --- inside TLS: detection again, garbage, and the write cap ---------------------------------

@pytest.mark.parametrize("inner", [b"\x16\x03\x01\x00\x05hello", b"NOT A PROTOCOL\r\n\r\n"])
async def test_what_no_parser_takes_inside_tls_closes(pki, inner):
    srv, _ = await start(pki)
    ctx = ssl.create_default_context(cafile=pki["ca"])
    reader, writer = await asyncio.open_connection("127.0.0.1", srv.port, ssl=ctx)
    writer.write(inner)
    assert await asyncio.wait_for(reader.read(), 3) == b""
    writer.close()
    assert (await echo(srv, trusting(pki))).message == "hi"  # the others are served
    await stop(srv)


async def test_unread_replies_over_tls_stay_within_max_unwritten_bytes(pki):
    srv, servicer = await start(pki, max_unwritten_bytes=4 * MIB)
    ctx = ssl.create_default_context(cafile=pki["ca"])
    reader, writer = await asyncio.open_connection("127.0.0.1", srv.port, ssl=ctx)
    await flood_without_reading(srv, servicer, reader, writer, 4 * MIB)
    await stop(srv)
