"""aiobrpc.sync: blocking calls from any thread, made on one background event loop."""

from __future__ import annotations

import asyncio
import ctypes
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import aiobrpc
from aiobrpc import errors, sync
from aiobrpc._proto import interop_pb2
from tests.helpers.interop_server import SERVICE
from tests.helpers.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
THREADS, CALLS = 8, 200


def echo(message: str, **fields) -> interop_pb2.EchoRequest:
    return interop_pb2.EchoRequest(message=message, **fields)


def background_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "aiobrpc-sync-loop"]


def test_calls_from_many_threads_at_once(server):
    failures: list = []
    start = threading.Barrier(THREADS)
    with sync.Channel(server.server.address) as channel:
        stub = sync.Stub(channel, SERVICE)

        def caller(n: int) -> None:
            start.wait()
            try:
                for i in range(CALLS):
                    cntl = aiobrpc.Controller()
                    cntl.request_attachment = f"{n}:{i}".encode()
                    resp = stub.Echo(echo(f"thread {n} call {i}"), cntl)
                    if resp.message != f"thread {n} call {i}" or bytes(cntl.response_attachment) != f"{n}:{i}".encode():
                        failures.append((n, i, resp.message, bytes(cntl.response_attachment)))
            except BaseException as e:  # noqa: BLE001 - reported by the assertion below
                failures.append((n, repr(e)))

        threads = [threading.Thread(target=caller, args=(n,)) for n in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
    assert failures == []
    assert len(background_threads()) == 1


def test_call_method_blocks_and_fills_the_controller(server):
    with sync.Channel(server.server.address) as channel:
        cntl = aiobrpc.Controller(log_id=7)
        cntl.request_user_fields = {"who": "sync"}
        resp = channel.call_method("interop.EchoService", "Echo", echo("hi", response_attachment_size=3),
                                   interop_pb2.EchoResponse, cntl)
    assert resp.message == "hi" and resp.log_id == 7 and list(resp.user_fields) == ["who=sync"]
    assert not cntl.failed and cntl.remote_side == server.server.address
    assert bytes(cntl.response_attachment) == bytes([0, 1, 2])
    assert cntl.response_user_fields == {"who": "sync"} and cntl.latency_us > 0


def test_errors_raise_rpc_error_with_their_codes(server):
    with sync.Channel(server.server.address) as channel:
        stub = sync.Stub(channel, SERVICE)
        cntl = aiobrpc.Controller()
        with pytest.raises(aiobrpc.RpcError) as e:
            stub.Echo(echo("x", fail_code=errors.EREQUEST, fail_text="no such key"), cntl)
        assert e.value.code == errors.EREQUEST and "no such key" in e.value.text
        assert cntl.error_code == errors.EREQUEST and cntl.failed
        with pytest.raises(aiobrpc.RpcError) as e:
            channel.call_method("interop.NoSuchService", "Echo", echo("x"), interop_pb2.EchoResponse)
        assert e.value.code == errors.ENOMETHOD
        with pytest.raises(TypeError, match="takes a request of type interop.EchoRequest"):
            stub.Echo(interop_pb2.EchoResponse(message="wrong type"))
        with pytest.raises(TypeError, match="interop.EchoService.Echo takes a protobuf message, got dict"):
            channel.call_method("interop.EchoService", "Echo", {"message": "x"}, interop_pb2.EchoResponse)


def test_a_call_past_its_deadline_raises_erpctimedout(server):
    with sync.Channel(server.server.address, aiobrpc.ChannelOptions(timeout_ms=100)) as channel:
        stub = sync.Stub(channel, SERVICE)
        started = time.monotonic()
        with pytest.raises(aiobrpc.RpcError) as e:
            stub.Echo(echo("slow", sleep_ms=3000))
        # The answer comes after 3 s: ERPCTIMEDOUT is the deadline's, and it was not early.
        assert e.value.code == errors.ERPCTIMEDOUT
        assert time.monotonic() - started >= 0.09
        cntl = aiobrpc.Controller(timeout_ms=10_000)  # the controller's wins: an answer after 150 ms is in time
        assert stub.Echo(echo("fast enough", sleep_ms=150), cntl).message == "fast enough"


async def test_called_inside_a_running_loop_it_says_to_await_instead(server):
    channel = sync.Channel(server.server.address)
    try:
        with pytest.raises(RuntimeError, match=r"event loop is running.*use aiobrpc.Channel / aiobrpc.Stub and `await`"):
            sync.Stub(channel, SERVICE).Echo(echo("x"))
    finally:
        channel.close()  # from a running loop: handed to the background loop, not waited for
    await asyncio.sleep(0.05)
    await wait_until(lambda: channel.channel._closed)
    assert channel.channel._closed


def test_called_on_the_background_loop_it_refuses_instead_of_deadlocking(server):
    with sync.Channel(server.server.address) as channel:
        async def call_from_the_loop():
            return channel.call_method("interop.EchoService", "Echo", echo("x"), interop_pb2.EchoResponse)

        future = asyncio.run_coroutine_threadsafe(call_from_the_loop(), sync._background().loop)
        with pytest.raises(RuntimeError, match="event loop is running"):
            future.result(5)


class Interrupted(Exception):
    pass


def test_an_exception_in_the_waiting_thread_cancels_the_call(server):
    outcome: dict = {}
    with sync.Channel(server.server.address) as channel:
        cntl = aiobrpc.Controller(timeout_ms=30_000)

        def caller() -> None:
            try:
                sync.Stub(channel, SERVICE).Echo(echo("slow", sleep_ms=10_000), cntl)
            except BaseException as e:  # noqa: BLE001 - the test looks at it
                outcome["error"] = e
                outcome["code"] = cntl.error_code

        t = threading.Thread(target=caller)
        t.start()
        end = time.monotonic() + 10
        while server.server.concurrency == 0:  # until the request is in the server's handler
            assert time.monotonic() < end, "the request never reached the server's handler"
            time.sleep(0.01)
        assert ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(t.ident), ctypes.py_object(Interrupted)) == 1
        t.join(5)  # the handler answers only after 10 s: a thread still waiting did not cancel
        assert not t.is_alive()
        assert isinstance(outcome["error"], Interrupted)
        assert outcome["code"] == errors.ECANCELED, "the call ended, cancelled, before the exception propagated"
        assert channel.channel.stats.cancelled == 1
        assert sync.Stub(channel, SERVICE).Echo(echo("after")).message == "after"


def test_ctrl_c_during_a_call_cancels_it_and_raises_keyboard_interrupt(server):
    script = textwrap.dedent(f"""
        import os, signal, threading, time
        import aiobrpc
        from aiobrpc import sync
        from aiobrpc._proto import interop_pb2

        # Python leaves SIGINT ignored when it started so (a job run with `&` by a shell)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        channel = sync.Channel({server.server.address!r})
        cntl = aiobrpc.Controller(timeout_ms=30000)
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        started = time.monotonic()
        try:
            channel.call_method("interop.EchoService", "Echo", interop_pb2.EchoRequest(message="x", sleep_ms=10000),
                                interop_pb2.EchoResponse, cntl)
        except KeyboardInterrupt:
            print("KeyboardInterrupt", cntl.error_code, time.monotonic() - started < 3)
        # left open: closed at interpreter exit
    """)
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONWARNINGS="error"))
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"KeyboardInterrupt {errors.ECANCELED} True\n"
    assert r.stderr == ""


def test_the_background_loop_is_stopped_at_exit_closing_what_is_open(server):
    script = textwrap.dedent(f"""
        import threading
        from aiobrpc import sync
        from aiobrpc._proto import interop_pb2

        channels = [sync.Channel({server.server.address!r}) for _ in range(2)]
        for c in channels:
            print(c.call_method("interop.EchoService", "Echo", interop_pb2.EchoRequest(message="hi"),
                                interop_pb2.EchoResponse).message)
        print(sum(t.name == "aiobrpc-sync-loop" for t in threading.enumerate()))
    """)
    r = subprocess.run([sys.executable, "-X", "dev", "-c", script], cwd=ROOT, capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, PYTHONWARNINGS="error"))
    assert r.returncode == 0, r.stderr
    assert r.stdout == "hi\nhi\n1\n"
    assert r.stderr == "", "no unclosed transport, no pending task, no warning"


def test_close_ends_calls_in_flight_and_refuses_later_ones(server):
    channel = sync.Channel(server.server.address)
    stub = sync.Stub(channel, SERVICE)
    outcome: dict = {}

    def caller() -> None:
        try:
            stub.Echo(echo("slow", sleep_ms=10_000), aiobrpc.Controller(timeout_ms=30_000))
        except aiobrpc.RpcError as e:
            outcome["code"] = e.code

    t = threading.Thread(target=caller)
    t.start()
    time.sleep(0.3)
    channel.close()
    t.join(5)
    assert outcome == {"code": errors.EFAILEDSOCKET}
    with pytest.raises(aiobrpc.RpcError) as e:
        stub.Echo(echo("x"))
    assert e.value.code == errors.EHOSTDOWN
    channel.close()  # again: nothing happens
    assert "closed" in repr(channel)


def test_channels_share_one_background_thread(server):
    with sync.Channel(server.server.address) as a, sync.Channel(server.server.address) as b:
        assert sync.Stub(a, SERVICE).Echo(echo("a")).message == "a"
        assert sync.Stub(b, SERVICE).Echo(echo("b")).message == "b"
        assert a.channel._loop is b.channel._loop is sync._background().loop
    assert len(background_threads()) == 1


def test_a_dead_background_loop_ends_the_waiting_call_and_a_new_one_starts(server):
    channel = sync.Channel(server.server.address)
    stub = sync.Stub(channel, SERVICE)
    assert stub.Echo(echo("before")).message == "before"
    old = sync._background()
    outcome: dict = {}

    def caller() -> None:
        try:
            stub.Echo(echo("slow", sleep_ms=10_000), aiobrpc.Controller(timeout_ms=30_000))
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            outcome["error"] = e

    t = threading.Thread(target=caller)
    t.start()
    time.sleep(0.3)
    old.loop.call_soon_threadsafe(old.loop.stop)  # as if it had died
    t.join(5)
    assert not t.is_alive()
    assert isinstance(outcome["error"], RuntimeError) and "background event loop stopped" in str(outcome["error"])
    old.thread.join(5)
    assert stub.Echo(echo("after")).message == "after", "the channel goes on on a new loop"
    assert sync._background() is not old and len(background_threads()) == 1
    channel.close()


def test_the_sync_stub_takes_only_a_sync_channel():
    with pytest.raises(TypeError, match="aiobrpc.sync.Stub takes an aiobrpc.sync.Channel"):
        sync.Stub(aiobrpc.Channel("127.0.0.1:8000"), SERVICE)


def test_a_server_that_is_not_there_fails_fast():
    with sync.Channel("127.0.0.1:1", aiobrpc.ChannelOptions(max_retry=0)) as channel:
        with pytest.raises(aiobrpc.RpcError) as e:
            sync.Stub(channel, SERVICE).Echo(echo("x"))
    assert e.value.code == errors.ECONNREFUSED
