"""FaultProxy: a TCP proxy on 127.0.0.1 that injects the faults of docs/hostile_inputs.md rows D7, E1-E6.

Each accepted connection is joined to a fresh connection to `target`. Every direction ("up" is
client to server, "down" is server to client) is a reader task that queues chunks and a sender
task that forwards them, so `delay` is latency added to every chunk, not a pause between reads.
The faults are plain attributes read each time a chunk moves, so changing one applies to the
connections already open as well as to new ones:

- `delay`: seconds added to every chunk before it is forwarded.
- `dribble`: forward at most this many bytes per write, `dribble_interval` seconds apart.
- `cut_after`: once this many bytes went `cut_direction` on one connection, cut both sides of
  it with `cut_mode` ("reset": SO_LINGER(1, 0) then close, the peers see ECONNRESET; "close":
  the bytes forwarded so far, then FIN). The cut happens when data moves that way, so
  `cut_after=0, cut_direction="down"` lets the request through and cuts as the reply starts.
- `blackhole`: read and discard everything, forward nothing, never close. A connection
  accepted in a blackhole has no upstream and stays a blackhole.

`await refuse()` closes the listening socket (connects get ECONNREFUSED), `await accept_again()`
listens on the same port again, `cut_all(mode)` cuts every open connection now. `close()` ends
every connection and task it made, and raises any unexpected error one of them hit.

>>> async with FaultProxy(("127.0.0.1", server.port), delay=0.05) as proxy:  # doctest: +SKIP
...     channel = aiobrpc.Channel(proxy.address)
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct

log = logging.getLogger(__name__)

CUT_MODES = ("reset", "close")
DIRECTIONS = ("up", "down")
_CHUNK = 65536
_QUEUE_CHUNKS = 64  # chunks a direction may hold before it stops reading (backpressure)


def _abort(writer: asyncio.StreamWriter, reset: bool) -> None:
    if reset:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            try:
                # Linger 0: close() sends RST instead of FIN, the peer reads ECONNRESET.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass  # already closed by the peer
    writer.transport.abort()


class _Link:
    """One proxied connection: the client's streams and, unless blackholed, the upstream's."""

    def __init__(self, proxy: FaultProxy, client_r: asyncio.StreamReader,
                 client_w: asyncio.StreamWriter) -> None:
        self.proxy = proxy
        self.client_r = client_r
        self.client_w = client_w
        self.up_w: asyncio.StreamWriter | None = None
        self.sent = {"up": 0, "down": 0}
        self.eof = {"up": False, "down": False}
        self.is_cut = False
        self.finished = False  # closed on both sides with FIN, nothing left to abort
        self.cut_event = asyncio.Event()
        self.tasks: list[asyncio.Task] = []

    async def run(self) -> None:
        proxy = self.proxy
        if proxy.blackhole:
            await self._discard(self.client_r)
            await self.cut_event.wait()
            return
        try:
            up_r, self.up_w = await asyncio.open_connection(*proxy.target)
        except OSError as e:
            log.debug("fault proxy: upstream %s unreachable: %s", proxy.target, e)
            self.finished = True
            self.client_w.close()
            return
        if self.is_cut:  # cut while connecting
            _abort(self.up_w, reset=False)
            return
        loop = asyncio.get_running_loop()
        for direction, src, dst in (("up", self.client_r, self.up_w), ("down", up_r, self.client_w)):
            queue: asyncio.Queue = asyncio.Queue(_QUEUE_CHUNKS)
            self.tasks.append(loop.create_task(self._read(direction, src, queue)))
            self.tasks.append(loop.create_task(self._send(direction, dst, queue)))
        try:
            await asyncio.wait(self.tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for t in self.tasks:
                t.cancel()
            await asyncio.wait(self.tasks)
        for t in self.tasks:
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()

    async def _discard(self, src: asyncio.StreamReader) -> None:
        try:
            while data := await src.read(_CHUNK):
                self.proxy.bytes_discarded += len(data)
        except OSError:
            pass

    async def _read(self, direction: str, src: asyncio.StreamReader, queue: asyncio.Queue) -> None:
        proxy = self.proxy
        loop = asyncio.get_running_loop()
        try:
            while data := await src.read(_CHUNK):
                if proxy.blackhole:
                    proxy.bytes_discarded += len(data)
                else:
                    await queue.put((loop.time(), data))
        except OSError:
            self.cut("reset")  # pass a reset on to the other side
            return
        if not proxy.blackhole:  # a blackhole swallows the FIN too
            await queue.put((loop.time(), None))

    async def _send(self, direction: str, dst: asyncio.StreamWriter, queue: asyncio.Queue) -> None:
        proxy = self.proxy
        loop = asyncio.get_running_loop()
        try:
            while True:
                arrived, data = await queue.get()
                wait = arrived + proxy.delay - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if data is None:
                    self._forward_eof(direction, dst)
                    return
                if not await self._forward(direction, dst, data):
                    return
        except OSError:
            self.cut("reset")

    async def _forward(self, direction: str, dst: asyncio.StreamWriter, data: bytes) -> bool:
        """Write `data` with the faults applied; False once the link is cut."""
        proxy = self.proxy
        view = memoryview(data)
        while view:
            if proxy.blackhole:
                proxy.bytes_discarded += len(view)
                return True
            n = len(view)
            if proxy.dribble:
                n = min(n, proxy.dribble)
            cutting = proxy.cut_after is not None and proxy.cut_direction == direction
            if cutting:
                left = proxy.cut_after - self.sent[direction]
                if left <= 0:
                    self.cut(proxy.cut_mode)
                    return False
                n = min(n, left)
            dst.write(view[:n])
            view = view[n:]
            self.sent[direction] += n
            if direction == "up":
                proxy.bytes_up += n
            else:
                proxy.bytes_down += n
            if cutting and self.sent[direction] >= proxy.cut_after:
                self.cut(proxy.cut_mode)
                return False
            await dst.drain()
            if view and proxy.dribble:
                await asyncio.sleep(proxy.dribble_interval)
        return True

    def _forward_eof(self, direction: str, dst: asyncio.StreamWriter) -> None:
        self.eof[direction] = True
        if all(self.eof.values()):
            self.finished = True
            self.client_w.close()
            self.up_w.close()
        elif dst.can_write_eof():
            dst.write_eof()  # half-close, as the peer did

    def cut(self, mode: str) -> None:
        """End both sides now: "reset" (RST), "close" (FIN after what was forwarded) or
        "abort" (FIN, dropping what is still buffered here)."""
        if self.is_cut and mode != "abort":
            return
        self.is_cut = True
        self.cut_event.set()
        for w in (self.client_w, self.up_w):
            if w is None:
                continue
            if mode == "close":
                w.close()
            else:
                _abort(w, reset=mode == "reset")
        me = asyncio.current_task()
        for t in self.tasks:
            if t is not me:
                t.cancel()


class FaultProxy:
    """A fault-injecting TCP proxy from 127.0.0.1:`port` to `target` (see the module doc)."""

    def __init__(self, target: tuple[str, int], *, port: int = 0, delay: float = 0.0,
                 dribble: int | None = None, dribble_interval: float = 0.001,
                 cut_after: int | None = None, cut_direction: str = "up", cut_mode: str = "reset",
                 blackhole: bool = False) -> None:
        self.target = target
        self.port = port
        self.delay = delay
        self.dribble = dribble
        self.dribble_interval = dribble_interval
        self.cut_after = cut_after
        self.cut_direction = cut_direction
        self.cut_mode = cut_mode
        self.blackhole = blackhole
        self.connections_accepted = 0
        self.bytes_up = 0
        self.bytes_down = 0
        self.bytes_discarded = 0
        self._links: set[_Link] = set()
        self._tasks: set[asyncio.Task] = set()
        self._errors: list[BaseException] = []
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task | None = None
        self._closed = False

    def __setattr__(self, name, value) -> None:
        # Faults are checked when set, not when the first chunk moves.
        if name == "cut_direction" and value not in DIRECTIONS:
            raise ValueError(f"cut_direction must be one of {DIRECTIONS}, got {value!r}")
        if name == "cut_mode" and value not in CUT_MODES:
            raise ValueError(f"cut_mode must be one of {CUT_MODES}, got {value!r}")
        if name in ("dribble", "cut_after") and value is not None and (
                not isinstance(value, int) or value < (1 if name == "dribble" else 0)):
            raise ValueError(f"{name} must be None or an int >= {1 if name == 'dribble' else 0}, got {value!r}")
        if name in ("delay", "dribble_interval") and not value >= 0:
            raise ValueError(f"{name} must be >= 0, got {value!r}")
        super().__setattr__(name, value)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def active_connections(self) -> int:
        return len(self._links)

    @property
    def refusing(self) -> bool:
        return self._listener is None

    async def start(self) -> FaultProxy:
        if self._closed:
            raise RuntimeError("FaultProxy is closed")
        await self.accept_again()
        return self

    async def __aenter__(self) -> FaultProxy:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def accept_again(self) -> None:
        """Listen (again) on `port`; the first start picks an ephemeral port."""
        if self._listener is not None:
            return
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            # Rebinding the port of the accepted connections still open needs SO_REUSEADDR.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", self.port))
            sock.listen(128)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
        self._listener = sock
        self._accept_task = self._spawn(self._accept(sock))

    async def refuse(self) -> None:
        """Close the listening socket: new connects get ECONNREFUSED; open ones go on."""
        task, self._accept_task = self._accept_task, None
        if task is not None:
            # The loop must stop watching the socket before it is closed.
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        sock, self._listener = self._listener, None
        if sock is not None:
            sock.close()

    def cut_all(self, mode: str = "reset") -> None:
        """Cut every open connection now, with "reset" or "close"."""
        if mode not in CUT_MODES:
            raise ValueError(f"mode must be one of {CUT_MODES}, got {mode!r}")
        for link in list(self._links):
            link.cut(mode)

    async def close(self) -> None:
        """Close the listener and every connection; wait for every task; raise their errors."""
        if self._closed:
            return
        self._closed = True
        await self.refuse()
        for link in list(self._links):
            link.cut("abort")
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0)  # asyncio closes an aborted transport's socket one turn later
        if self._errors:
            errors, self._errors = self._errors, []
            raise RuntimeError(f"FaultProxy tasks failed: {errors!r}") from errors[0]

    # -- internals -------------------------------------------------------------------------
    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._errors.append(task.exception())

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as e:  # EMFILE and the like: wait, then accept again
                log.debug("fault proxy: accept failed: %s", e)
                await asyncio.sleep(0.05)
                continue
            self.connections_accepted += 1
            self._spawn(self._serve(sock))

    async def _serve(self, sock: socket.socket) -> None:
        try:
            reader, writer = await asyncio.open_connection(sock=sock)
        except OSError:
            sock.close()
            return
        link = _Link(self, reader, writer)
        self._links.add(link)
        try:
            await link.run()
        finally:
            if not (link.is_cut or link.finished):
                link.cut("abort")  # the run was cancelled
            try:
                for w in (link.client_w, link.up_w):
                    if w is not None:
                        # Waits for a FIN to follow what is still buffered (close() aborts that),
                        # and retrieves a reset's exception, which the streams would otherwise
                        # report as "Future exception was never retrieved" from gc.
                        try:
                            await w.wait_closed()
                        except OSError:
                            pass
            finally:
                self._links.discard(link)
