"""Blocking calls for scripts, notebooks and threaded programs: `aiobrpc.sync.Channel` and `Stub`.

A sync Channel wraps an `aiobrpc.Channel` that lives on aiobrpc's background event loop: one
daemon thread per process, started by the first sync call and shared by every sync channel
(uvloop when installed). A call hands its coroutine to that loop and waits for the answer, so
any number of threads may call at once; each call costs a hop between threads, which an
`await` on the caller's own loop does not.

A waiting thread wakes every `_POLL_S` to notice that the background loop has died (the call
then raises RuntimeError instead of hanging) and to take an exception raised in it meanwhile
(Ctrl-C in the main thread): that exception cancels the call, which ends with ECANCELED as an
awaited call whose task is cancelled does, and propagates. When the loop stops (at interpreter
exit, or if it dies), the calls in flight end with that RuntimeError and the channels still
open are closed; a sync channel used after its loop died goes on with a new channel on a new
loop.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import threading
import weakref

from .client.channel import Channel as AsyncChannel
from .controller import Controller
from .options import ChannelOptions
from .stub import Stub as AsyncStub

__all__ = ["Channel", "Stub"]

_POLL_S = 0.1  # how often a waiting thread looks at the background loop and its own exceptions
_CANCEL_WAIT_S = 1.0  # how long an interrupted call waits for its cancellation to reach the controller
_CLOSE_AT_EXIT_S = 5.0
_IN_LOOP = ("aiobrpc.sync.{what} was called from a thread whose event loop is running: blocking "
            "there would stop that loop (and deadlock if it is the one serving the call). In async "
            "code use aiobrpc.Channel / aiobrpc.Stub and `await` the call instead.")
_LOOP_DIED = "aiobrpc's background event loop stopped before the call ended"
_EXITING = "the interpreter is exiting: aiobrpc's background event loop has stopped"


def _new_loop() -> asyncio.AbstractEventLoop:
    from . import event_loop_policy  # aiobrpc's default loop: uvloop's when installed
    return event_loop_policy().new_event_loop()


class _Submitted:
    """One coroutine function run on the background loop for a waiting thread. The coroutine
    is made on the loop's thread, so one whose loop stopped before it ran was never made."""

    __slots__ = ("future", "task", "_fn", "_args")

    def __init__(self, fn, args: tuple) -> None:
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.task: asyncio.Task | None = None
        self._fn = fn
        self._args = args

    def start(self) -> None:  # on the loop's thread
        fn, args = self._fn, self._args
        self._fn = self._args = None
        try:
            self.task = asyncio.ensure_future(fn(*args))
        except BaseException as e:
            self.future.set_exception(e)
            return
        self.task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        if task.cancelled():  # by cancel() (no one reads the result then) or by the loop stopping
            self.future.set_exception(RuntimeError(_LOOP_DIED))
            return
        exc = task.exception()
        if exc is None:
            self.future.set_result(task.result())
        else:
            self.future.set_exception(exc)
        self.task = None  # a failed task's traceback holds frames that hold the call

    def cancel(self) -> None:  # on the loop's thread, after start(): call_soon_threadsafe keeps their order
        if self.task is not None:
            self.task.cancel()


class _LoopThread:
    """The background event loop, running in its daemon thread, and the channels on it."""

    def __init__(self) -> None:
        self.loop = _new_loop()
        self.channels: set[AsyncChannel] = set()  # opened by sync channels and not closed yet
        self._stopped = False  # run_forever returned: what is submitted now never runs
        self.thread = threading.Thread(target=self._run, name="aiobrpc-sync-loop", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        loop = self.loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            self._stopped = True
            try:
                _cancel_all(loop)  # the calls in flight first: they end with RuntimeError(_LOOP_DIED)
                # Its channels are closed with it (their transports cannot outlive it); a
                # sync channel used again makes a new one on the next loop.
                loop.run_until_complete(_close_all(list(self.channels)))
                _cancel_all(loop)
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                asyncio.set_event_loop(None)
                loop.close()

    def is_alive(self) -> bool:
        return not self._stopped and self.thread.is_alive()

    def submit(self, fn, *args) -> _Submitted:
        """Run `fn(*args)`, a coroutine function, on the loop; `.future` gets its outcome."""
        sub = _Submitted(fn, args)
        try:
            self.loop.call_soon_threadsafe(self._start, sub)
        except RuntimeError:  # the loop is closed
            raise RuntimeError(_LOOP_DIED) from None
        return sub

    def _start(self, sub: _Submitted) -> None:
        if self._stopped:  # run by the loop's own shutdown, after its tasks were cancelled
            sub.future.set_exception(RuntimeError(_LOOP_DIED))
        else:
            sub.start()

    def wait(self, sub: _Submitted):
        """The outcome of `sub`, waited for in the calling thread; an exception raised in this
        thread meanwhile cancels it and propagates."""
        future = sub.future
        try:
            while True:
                try:
                    return future.result(_POLL_S)
                except concurrent.futures.TimeoutError:
                    if not self.is_alive():
                        raise RuntimeError(_LOOP_DIED) from None
        except BaseException:
            if not future.done() and self.is_alive():
                try:
                    self.loop.call_soon_threadsafe(sub.cancel)
                    concurrent.futures.wait([future], _CANCEL_WAIT_S)
                except RuntimeError:  # the loop closed meanwhile
                    pass
            raise

    def run(self, fn, *args):
        return self.wait(self.submit(fn, *args))

    def stop(self) -> None:
        """Stop the loop (which closes the channels left open) and wait for its thread."""
        try:
            self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:  # closed already
            return
        self.thread.join(_CLOSE_AT_EXIT_S)


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    tasks = asyncio.all_tasks(loop)
    for t in tasks:
        t.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))


async def _close_all(channels: list) -> None:
    await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)


_lock = threading.Lock()
_loop_thread: _LoopThread | None = None
_exiting = False


def _background() -> _LoopThread:
    """The background loop, started on first use (and again if it died)."""
    global _loop_thread
    runner = _loop_thread
    if runner is not None and runner.is_alive():
        return runner
    with _lock:
        if _exiting:
            raise RuntimeError(_EXITING)
        if _loop_thread is None:
            atexit.register(_stop_at_exit)
        elif _loop_thread.is_alive():
            return _loop_thread
        _loop_thread = _LoopThread()
        return _loop_thread


def _stop_at_exit() -> None:
    global _loop_thread, _exiting
    with _lock:
        _exiting = True
        runner, _loop_thread = _loop_thread, None
    if runner is not None:
        runner.stop()


def _refuse_in_running_loop(what: str) -> None:
    if asyncio._get_running_loop() is not None:
        raise RuntimeError(_IN_LOOP.format(what=what))


def _close_when_collected(channel: AsyncChannel) -> None:
    """A sync Channel was garbage-collected open: close its channel on the loop, not waiting."""
    runner = _loop_thread
    if runner is None or not runner.is_alive() or channel not in runner.channels:
        return
    runner.channels.discard(channel)
    try:
        runner.submit(channel.close)
    except RuntimeError:
        pass


class Channel:
    """A blocking client: `aiobrpc.Channel`'s calls, made from any thread, waited for there.

    Takes `aiobrpc.Channel`'s arguments: "host:port", or a naming-service URL with
    `load_balancer`. `call_method` blocks until the response (or raises `RpcError`, the
    controller filled as by an awaited call); `Stub(channel, service)` gives one blocking
    method per rpc. Safe to call from many threads at once. Called from a thread whose event
    loop is running, it raises RuntimeError: use `aiobrpc.Channel` with `await` there.
    `with Channel(...) as channel:` closes it at the end.

    >>> with aiobrpc.sync.Channel("127.0.0.1:8000") as channel:  # doctest: +SKIP
    ...     stub = aiobrpc.sync.Stub(channel, echo_pb2.DESCRIPTOR.services_by_name["EchoService"])
    ...     print(stub.Echo(echo_pb2.EchoRequest(message="hi")).message)
    hi

    Attributes:
        channel (aiobrpc.Channel): The channel it wraps, on the background loop; its `stats`
            and `status()` may be read from any thread.
    """

    def __init__(self, address: str, options: ChannelOptions | None = None, *,
                 load_balancer: str | None = None) -> None:
        self._load_balancer = load_balancer
        self._closed = False
        self._runner = _background()
        self._open(AsyncChannel(address, options, load_balancer=load_balancer))

    def _open(self, channel: AsyncChannel) -> None:
        self.channel = channel
        self._runner.channels.add(channel)
        self._finalizer = weakref.finalize(self, _close_when_collected, channel)
        self._finalizer.atexit = False  # the loop's own exit closes it

    @property
    def address(self) -> str:
        """The server ("host:port") or the naming-service URL."""
        return self.channel.address

    @property
    def options(self) -> ChannelOptions:
        return self.channel.options

    def call_method(self, service_name: str, method_name: str, request, response_class,
                    cntl: Controller | None = None):
        """Call `service_name`/`method_name` ("package.Service", "Method") with a protobuf
        `request` and return the `response_class` message; blocks until then.

        Raises RpcError on failure (also recorded in `cntl`), RuntimeError in a thread whose
        event loop is running, or when the background loop stopped before the call ended.
        An exception raised in the waiting thread (KeyboardInterrupt) cancels the call (ECANCELED)
        and propagates."""
        _refuse_in_running_loop("Channel.call_method()")
        runner = self._runner
        if not runner.is_alive():
            runner = self._reopen()
        return runner.run(self.channel.call_method, service_name, method_name, request, response_class, cntl)

    def _reopen(self) -> _LoopThread:
        """The background loop died and closed this channel's connections with it: a new
        aiobrpc.Channel on a new loop (a closed one stays closed)."""
        runner = _background()
        if runner is not self._runner:
            self._runner = runner
            if not self._closed:
                self._finalizer.detach()
                old = self.channel
                self._open(AsyncChannel(old.address, old.options, load_balancer=self._load_balancer))
        return runner

    def close(self) -> None:
        """Close the connections; calls in flight fail with EFAILEDSOCKET, later ones with
        EHOSTDOWN. From a thread whose event loop is running it does not wait for that."""
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        runner = self._runner
        runner.channels.discard(self.channel)
        if not runner.is_alive():  # its connections were closed with the loop
            return
        if asyncio._get_running_loop() is not None:
            runner.submit(self.channel.close)
            return
        runner.run(self.channel.close)

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<aiobrpc.sync.Channel {self.channel.address}{' closed' if self._closed else ''}>"


class Stub(AsyncStub):
    """The client side of `service` over a sync `Channel`: one blocking method per rpc.

    `stub.Method(request, cntl=None)` returns the response or raises RpcError; it is
    `channel.call_method(service.full_name, "Method", request, Response, cntl)`.

    >>> stub = aiobrpc.sync.Stub(channel, echo_pb2.DESCRIPTOR.services_by_name["EchoService"])  # doctest: +SKIP
    >>> stub.Echo(echo_pb2.EchoRequest(message="hi")).message  # doctest: +SKIP
    'hi'
    """

    def __init__(self, channel: Channel, service) -> None:
        if not isinstance(channel, Channel):
            raise TypeError(f"aiobrpc.sync.Stub takes an aiobrpc.sync.Channel, got {type(channel).__name__}; "
                            "over an aiobrpc.Channel use aiobrpc.Stub and await its methods")
        super().__init__(channel, service)
        for m in service.methods:
            if m.client_streaming or m.server_streaming:
                setattr(self, m.name, _streaming_refused(f"{service.full_name}.{m.name}"))


def _streaming_refused(name: str):
    def refused(*args, **kwargs):
        raise TypeError(f"{name} is a streaming rpc: aiobrpc.sync.Stub calls unary methods only; call it with "
                        'aiobrpc.Stub over an aiobrpc.Channel with ChannelOptions(protocol="grpc")')
    refused.__name__ = name.rpartition(".")[2]
    return refused
