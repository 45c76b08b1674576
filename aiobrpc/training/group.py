"""A group of N processes running ring collectives over aiobrpc calls.

Each rank runs a `Server` with the `aiobrpc.collective.Collective` service and calls its right
neighbour's: one `Segment` call per piece of tensor, the piece in the attachment (a view of the
tensor, never copied on send). At most `window` calls are in flight per collective. Collectives
run one at a time in the order they are called, which must be the same on every rank (as with
torch.distributed); each is numbered, and a segment that arrives before its collective has
started here waits for it.

Point-to-point messages (send, recv) and the collectives made of them (gather, scatter,
all_to_all) are p2p.py's and exchange.py's; they share the group's numbering, connections and
failure handling.

Failure: a call to a rank that fails at the transport level (refused, reset, timed out) names
that rank, breaks the group and tells every other rank (`Abort`), so their collectives fail at
once with the same error. A collective that has not completed shortly before its timeout asks
every rank for its state (`Status`) and fails at the timeout naming the ranks that did not
answer or had not started it. A broken group raises its error from every later collective.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import os
import secrets
import threading
import time
from typing import Any

import numpy as np

from ..client.channel import Channel
from ..controller import Controller
from ..errors import RpcError
from ..options import ChannelOptions, ServerOptions
from ..server.server import Server
from ..stub import Servicer, Stub
from ..tensor import DTYPE_NAMES, raw_array
from .._proto import collective_pb2 as pb
from . import ops
from . import p2p as p2p_mod
from .errors import CollectiveError, CollectiveTimeout
from .exchange import all_to_all, gather, scatter
from .lane_messages import LaneMessages, PeerBroke, PeerClosed
from .lanes import Deadline, LaneLost, Lanes
from .reduce import ReduceOp, reduce_op

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["Collective"]
_DTYPE_NAME = {code: name for name, code in DTYPE_NAMES.items()}
# Control calls (Abort, Status) are short; a rank that does not answer one within this is hung.
CONTROL_TIMEOUT_S = 2.0
CLOSE_DRAIN_S = 1.0
CLOSE_FLUSH_S = 10.0  # the longest a close waits for its peers to take what its sends wrote
AUTO_THREAD_BYTES = 4 << 20
NEVER = 1 << 62  # a thread_bytes no segment reaches
LANE_SLACK_S = 2.0  # the lanes' own deadline is this much after the diagnosis's timeout


class _Flight:
    """A collective in progress: its state machine, calls in flight, segments waiting to go."""

    __slots__ = ("op", "seq", "future", "inflight", "queue", "group", "threaded", "taking")

    def __init__(self, group: Group, op: ops.RingOp, seq: int, threaded: bool) -> None:
        self.group = group
        self.op = op
        self.seq = seq
        self.future: asyncio.Future = group._loop.create_future()  # type: ignore[union-attr]
        self.inflight = 0
        # Appended to by the reduce thread, emptied by the loop: a deque is safe for both.
        self.queue: collections.deque = collections.deque()
        # Its segments are taken (reduced, copied) on the group's reduce thread, one at a time
        # in arrival order, so the loop keeps reading and writing meanwhile.
        self.threaded = threaded
        # Segments on the reduce thread now: the op counts one as received before taking it,
        # so until it returns what it emits may still be missing from the queue.
        self.taking = 0

    def emit(self, step: int, segment: int, data: np.ndarray) -> None:
        self.queue.append((step, segment, data))
        if not self.threaded:
            self.group._pump(self)

    def describe(self) -> str:
        op = self.op
        return f"{op.name} #{self.seq} ({op.numel} {_DTYPE_NAME.get(op.code, '?')})"


class Group:
    """One rank of a group of `world_size` processes that run collectives together.

    Make one with `await Group.create(store, rank, world_size)` on each process (or use
    `GroupThread` from synchronous code); the ranks find each other through `store`
    (`FileStore`, or any torch store). Tensors are numpy arrays or torch CPU tensors,
    C-contiguous; collectives change them in place where torch's do.

    Args:
        rank: This process's rank, 0 <= rank < world_size.
        world_size: Processes in the group.
        timeout: Seconds a collective may take before it fails with CollectiveTimeout.
        segment_bytes: The most bytes one call carries; a tensor travels in pieces this size
            so that sending, receiving and reducing overlap. Large: each call costs a fixed
            amount of Python on the loop, which is what limits throughput here.
        window: Calls in flight to the right neighbour at once.
        thread_bytes: Collectives whose segments are at least this large take them (reduce,
            copy) on a thread of the group's, off the event loop; smaller ones on the loop,
            where handing over would cost more than it saves. None (the default): 4 MiB when
            this process has more cores than the group has ranks on this host, so the thread
            finds an idle core; otherwise every segment is taken on the loop, as the thread
            would only compete with the ranks for the cores (measured: docs/training.md).
        p2p_eager_bytes: Messages up to this size travel in one call and may be held by the
            receiver until their recv is posted; larger ones wait for it (p2p.py).
        p2p_buffer_bytes: The most bytes of such held messages per peer.
        p2p_max_messages: The most messages per peer held or waiting with no recv posted; a
            sender past them waits for the receiver's recvs (and fails at the timeout).
        lanes: Carry the collectives (ring ones, all_to_all, gather, scatter) and send/recv on
            lanes (lanes.py, lane_messages.py): two connections per pair of ranks read and
            written by blocking threads, opened when the group starts. False: through the
            group's calls (Segment, Send). The p2p_* options hold on either.

    >>> group = await Group.create(FileStore("/tmp/rdv"), rank, 4)  # doctest: +SKIP
    >>> await group.all_reduce(grads)            # summed over the 4 ranks, in place  # doctest: +SKIP
    >>> await group.close()  # doctest: +SKIP
    """

    def __init__(self, rank: int, world_size: int, *, timeout: float = 300.0,
                 segment_bytes: int = 8 << 20, window: int = 2, thread_bytes: int | None = None,
                 p2p_eager_bytes: int = p2p_mod.EAGER_BYTES, p2p_buffer_bytes: int = p2p_mod.BUFFER_BYTES,
                 p2p_max_messages: int = p2p_mod.MAX_MESSAGES, lanes: bool = True) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in 0..{world_size - 1}, got {rank!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        if not isinstance(segment_bytes, int) or segment_bytes < 8:
            raise ValueError(f"segment_bytes must be an int >= 8, got {segment_bytes!r}")
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int >= 1, got {window!r}")
        if thread_bytes is not None and (not isinstance(thread_bytes, int) or thread_bytes < 0):
            raise ValueError(f"thread_bytes must be None or an int >= 0, got {thread_bytes!r}")
        for name, value in (("p2p_eager_bytes", p2p_eager_bytes), ("p2p_buffer_bytes", p2p_buffer_bytes),
                            ("p2p_max_messages", p2p_max_messages)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if not isinstance(lanes, bool):
            raise ValueError(f"lanes must be True or False, got {lanes!r}")
        self._want_lanes = lanes and world_size > 1
        self._lanes: Lanes | None = None
        self._lane_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._p2p_options = {"eager_bytes": p2p_eager_bytes, "buffer_bytes": p2p_buffer_bytes,
                             "max_messages": p2p_max_messages}
        self.p2p: p2p_mod.P2P | None = None
        self.messages: LaneMessages | None = None  # send/recv on lanes
        self._tick: asyncio.TimerHandle | None = None
        self.rank = rank
        self.world_size = world_size
        self.timeout = float(timeout)
        self.segment_bytes = segment_bytes
        self.window = window
        self.thread_bytes = thread_bytes
        self._reducer: concurrent.futures.ThreadPoolExecutor | None = None
        self.id = ""
        self.addresses: list[str] = []
        self.ops_started = 0
        self.ops_finished = 0
        self._segments_placed = 0
        self._next_seq = 1
        self._tail: asyncio.Future | None = None
        self._current: _Flight | None = None
        # The exchange on lanes in flight: when its diagnosis is due, and a future done once it ran.
        self._diagnosis: tuple[float, asyncio.Future] | None = None
        self._waiters: dict[int, asyncio.Future] = {}
        self._broken: CollectiveError | None = None
        self._closed = False
        self._server: Server | None = None
        self._stubs: dict[int, Stub] = {}
        self._channels: list[Channel] = []
        self._background: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- setup ---------------------------------------------------------------------------------
    @classmethod
    async def create(cls, store: Any, rank: int, world_size: int, *, host: str = "127.0.0.1",
                     prefix: str = "aiobrpc", **options: Any) -> Group:
        """Start this rank's server on `host` (an ephemeral port), publish its address in
        `store` under `prefix` and wait for every other rank's. Blocking store calls run in
        the loop's default executor."""
        group = cls(rank, world_size, **options)
        await group._start(store, host, prefix)
        return group

    async def _start(self, store: Any, host: str, prefix: str) -> None:
        self._loop = loop = asyncio.get_running_loop()
        self.p2p = p2p_mod.P2P(self, **self._p2p_options)
        segment_max = self.segment_bytes * 2 + (1 << 16)  # float32 pieces of a half-precision tensor
        self._server = Server(ServerOptions(max_body_size=max(segment_max, 64 << 20)))
        self._server.add_service(_CollectiveServicer(self))
        await self._server.start(f"{host}:0")
        lanes = Lanes(self.rank, self.world_size, host) if self._want_lanes else None
        try:
            if self.rank == 0:
                self.id = secrets.token_hex(8)
                await loop.run_in_executor(None, store.set, f"{prefix}/group", self.id.encode())
            else:
                self.id = _text(await loop.run_in_executor(None, store.get, f"{prefix}/group"))
            if lanes is not None:
                await loop.run_in_executor(None, store.set, f"{prefix}/lane/{self.rank}", lanes.address.encode())
            await loop.run_in_executor(None, store.set, f"{prefix}/rank/{self.rank}", self._server.address.encode())
            for r in range(self.world_size):
                self.addresses.append(_text(await loop.run_in_executor(None, store.get, f"{prefix}/rank/{r}")))
            if self.thread_bytes is None:
                self.thread_bytes = auto_thread_bytes(self.addresses, self.rank)
            if lanes is not None:
                lane_addresses = [_text(await loop.run_in_executor(None, store.get, f"{prefix}/lane/{r}"))
                                  for r in range(self.world_size)]
                lanes.group_id = self.id
                # A thread of the group's own: opening blocks until every rank opens, and the
                # ranks of one process must not wait on each other for the default executor.
                self._lane_pool = concurrent.futures.ThreadPoolExecutor(1, f"aiobrpc-lanes-rank{self.rank}")
                await loop.run_in_executor(self._lane_pool, lanes.open, lane_addresses, self.timeout)
                self._lanes = lanes
                self.messages = LaneMessages(self.rank, self.world_size, lanes.mail, self.addresses,
                                             timeout=self.timeout, report=self._mail_report,
                                             **self._p2p_options)
                self.messages.start()
                self._tick = loop.call_later(_tick_time(self.timeout), self._mail_tick)
        except BaseException:
            if lanes is not None:
                lanes.abort(CollectiveError(f"rank {self.rank}'s group did not start"))
                if self._lane_pool is None:
                    lanes.close()
                else:  # the opening thread may still be in a call (a connect): close after it, off the loop
                    pool = self._lane_pool
                    threading.Thread(target=lambda: (pool.shutdown(wait=True), lanes.close()), daemon=True).start()
            await self._server.stop()
            await self._server.join(timeout=1)
            raise

    def _stub(self, rank: int) -> Stub:
        stub = self._stubs.get(rank)
        if stub is None:
            ch = Channel(self.addresses[rank], ChannelOptions(
                timeout_ms=int(self.timeout * 1000) + 1000, connect_timeout_ms=5000, max_retry=0,
                max_body_size=64 << 20, retry_throttle=None))
            self._channels.append(ch)
            stub = self._stubs[rank] = Stub(ch, SERVICE)
        return stub

    async def close(self) -> None:
        """Stop this rank's server and connections; a collective still running fails."""
        if self._closed:
            return
        self._closed = True
        healthy = self._broken is None
        if self.messages is not None:
            self.messages.goodbye()  # before the lanes close: the peers take it for no death
            if healthy:  # what the sends wrote reaches the peers that still read (see unsent)
                wait_s = min(self.timeout, CLOSE_FLUSH_S)
                end = self._loop.time() + wait_s
                while self.messages.unsent() and self._loop.time() < end:
                    await asyncio.sleep(0.002)
                left = self.messages.unsent()
                if left:
                    log.warning("aiobrpc group %s: rank %d closes with %d bytes or writes its peers did not take "
                                "within %.3g s; they are dropped", self.id, self.rank, left, wait_s)
        self._fail(CollectiveError(f"the group was closed on rank {self.rank}"), tell_peers=False)
        if self._background:  # an Abort still on its way to a peer is worth a short wait
            await asyncio.wait(list(self._background), timeout=CONTROL_TIMEOUT_S)
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        for ch in self._channels:
            await ch.close()
        if self._tick is not None:
            self._tick.cancel()
        if self._lanes is not None:  # _fail above shut the lanes down: their threads return at once
            self._close_lanes()  # here, not on an executor: at exit the loop's may be gone
        if self._reducer is not None:
            self._reducer.shutdown(wait=False)
        if self._server is not None:
            # Ranks close together after their last collective: waiting a moment for the left
            # neighbour to close its connection first spares it a "server lost" warning.
            end = self._loop.time() + (CLOSE_DRAIN_S if healthy else 0.0)
            while self._server.connections and self._loop.time() < end:
                await asyncio.sleep(0.01)
            await self._server.stop()
            await self._server.join(timeout=1 if healthy else 0.1)

    def _close_lanes(self) -> None:
        self._lane_pool.shutdown(wait=True)
        if self.messages is not None:
            self.messages.join()
        self._lanes.close()

    async def __aenter__(self) -> Group:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    @property
    def segments_placed(self) -> int:
        """Ring segments received by the kernel straight into the tensor (no copy)."""
        return self._segments_placed + (self._lanes.segments_placed if self._lanes is not None else 0)

    @property
    def broken(self) -> CollectiveError | None:
        """The error that broke the group, or None while it works."""
        return self._broken

    # -- collectives ---------------------------------------------------------------------------
    # Each returns an awaitable (a Task) and takes its number in the group when called, not
    # when awaited: the order of the calls is the order on the wire, whoever awaits when.
    def all_reduce(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM) -> asyncio.Future[None]:
        """Combine `tensor` over the ranks with `op` (SUM, AVG, MAX, MIN), in place on every
        rank. float16/bfloat16 are accumulated in float32 and rounded once."""
        code, raw = raw_array(tensor)
        return self._enqueue(ops.AllReduce(self.rank, self.world_size, code, raw, reduce_op(op),
                                           self._elems(raw, wide=True)))

    def reduce_scatter(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM) -> asyncio.Future[np.ndarray]:
        """Combine `tensor` over the ranks; the result is this rank's part: chunk `rank` of the
        flattened tensor cut into `world_size` chunks whose sizes differ by at most one element
        (numpy.array_split's), a numpy array in the tensor's wire dtype (bfloat16 as its uint16
        bits). `tensor` is not changed."""
        code, raw = raw_array(tensor)
        op_ = ops.ReduceScatter(self.rank, self.world_size, code, raw, reduce_op(op),
                                self._elems(raw, wide=True))
        return self._enqueue(op_, op_.result)

    def all_gather(self, tensor: Any, out: Any = None) -> asyncio.Future[Any]:
        """Every rank's `tensor` (same shape and dtype on all) in rank order; the result is
        `out` (C-contiguous, world_size times as many elements, same dtype) or a new numpy
        array of shape (world_size, *tensor.shape)."""
        code, raw = raw_array(tensor)
        if out is None:
            out = np.empty((self.world_size, *tensor.shape), raw.dtype)
        ocode, oraw = raw_array(out, what="all_gather output")
        if ocode != code:
            raise ValueError("all_gather output has another dtype than the tensor")
        return self._enqueue(ops.AllGather(self.rank, self.world_size, code, raw, oraw,
                                           self._elems(raw, wide=False)), lambda: out)

    def broadcast(self, tensor: Any, root: int = 0) -> asyncio.Future[None]:
        """`tensor` of rank `root` copied into `tensor` on every other rank."""
        if not isinstance(root, int) or not 0 <= root < self.world_size:
            raise ValueError(f"root must be a rank in 0..{self.world_size - 1}, got {root!r}")
        code, raw = raw_array(tensor)
        return self._enqueue(ops.Broadcast(self.rank, self.world_size, code, raw, root,
                                           self._elems(raw, wide=False)))

    def barrier(self) -> asyncio.Future[None]:
        """Done once every rank has called barrier."""
        return self._enqueue(ops.Barrier(self.rank, self.world_size, 1))

    # -- point-to-point and the collectives built on it ----------------------------------------
    def send(self, tensor: Any, dst: int, tag: int = 0) -> asyncio.Future[None]:
        """Send `tensor` (any dtype, C-contiguous) to rank `dst`; matched by the recv of `dst`
        from this rank with the same `tag`, in the order sent. On lanes, done once written to
        the lane (the tensor may be reused), as with gloo; on calls, once `dst` has it in place or
        holds it. Small messages are held by `dst` until their recv is posted; larger ones wait
        for it. A recv that does not fit fails, and this send if it still waits."""
        self._check_started()
        if self.messages is not None:
            self.p2p._check_peer(dst, "dst")
            return self._wrap(self.messages.send(tensor, int(dst), _tag(tag)))
        return self.p2p.send(tensor, dst, _tag(tag))

    def recv(self, tensor: Any, src: int | None = None, tag: int = 0) -> asyncio.Future[int]:
        """Receive into `tensor` the next message from rank `src` (None: from any rank) on
        `tag`; its dtype and element count must be the sender's. Gives the source rank."""
        self._check_started()
        if self.messages is not None:
            if src is not None:
                self.p2p._check_peer(src, "src")
                src = int(src)
            return self._wrap(self.messages.recv(tensor, src, _tag(tag)))
        return self.p2p.recv(tensor, src, _tag(tag))

    def _wrap(self, cf: concurrent.futures.Future) -> asyncio.Future:
        fut = asyncio.wrap_future(cf, loop=self._loop)
        fut.add_done_callback(_retrieved)  # as on calls: a send nobody waits for does not warn at exit
        return fut

    def gather(self, tensor: Any, outs: list | None, root: int = 0) -> asyncio.Future[None]:
        """Every rank's `tensor` into `outs[rank]` on `root` (`outs` is ignored elsewhere)."""
        self._check_root(root)
        if self.rank == root and (outs is None or len(outs) != self.world_size):
            raise ValueError(f"gather on its root needs a list of {self.world_size} output tensors")
        if self._lanes is None:
            return self._enqueue_exchange("gather", lambda seq: gather(self, seq, tensor, outs, root))
        mine = _part(tensor, "gather input")
        parts = None
        if self.rank == root:
            parts = [_part(t, "gather output") for t in outs]
            _check_fits(parts[root], mine, "gather output")
        return self._enqueue_exchange("gather", lambda seq: self._on_lanes(
            seq, "gather", self._lanes.gather, mine, parts, root))

    def scatter(self, out: Any, ins: list | None, root: int = 0) -> asyncio.Future[None]:
        """`ins[rank]` of `root` into `out` on every rank (`ins` is ignored off the root)."""
        self._check_root(root)
        if self.rank == root and (ins is None or len(ins) != self.world_size):
            raise ValueError(f"scatter on its root needs a list of {self.world_size} input tensors")
        if self._lanes is None:
            return self._enqueue_exchange("scatter", lambda seq: scatter(self, seq, out, ins, root))
        mine = _part(out, "scatter output")
        parts = None
        if self.rank == root:
            parts = [_part(t, "scatter input") for t in ins]
            _check_fits(mine, parts[root], "scatter output")
        return self._enqueue_exchange("scatter", lambda seq: self._on_lanes(
            seq, "scatter", self._lanes.scatter, mine, parts, root))

    def all_to_all(self, outs: list, ins: list) -> asyncio.Future[None]:
        """`ins[j]` of every rank i into `outs[i]` of rank j; sizes may differ per pair."""
        if len(outs) != self.world_size or len(ins) != self.world_size:
            raise ValueError(f"all_to_all needs {self.world_size} input and output tensors, got "
                             f"{len(ins)} and {len(outs)}")
        if self._lanes is None:
            return self._enqueue_exchange("all_to_all", lambda seq: all_to_all(self, seq, outs, ins))
        # The caller's mistakes raise here, before the exchange takes its number.
        parts_out = [_part(t, "all_to_all output") for t in outs]
        parts_in = [_part(t, "all_to_all input") for t in ins]
        _check_fits(parts_out[self.rank], parts_in[self.rank], "all_to_all output")
        return self._enqueue_exchange("all_to_all", lambda seq: self._on_lanes(
            seq, "all_to_all", self._lanes.all_to_all, parts_out, parts_in))

    async def _on_lanes(self, seq: int, name: str, fn, *args: Any) -> None:
        """Run exchange #seq's `fn(seq, *args, deadline)` on the lane thread. Shortly before the
        timeout every rank is asked where it is, and the exchange fails at the timeout naming
        the ranks that did not answer or had not started it (the lanes' own deadline, a little
        later, only ends it should that fail)."""
        what = f"{name} #{seq}"
        deadline = Deadline(time.monotonic() + self.timeout + LANE_SLACK_S, what)
        ended = [False]
        diagnosed = self._loop.create_future()
        diagnosis_at = self._loop.time() + max(0.0, self.timeout - _probe_time(self.timeout))
        timer = self._loop.call_at(diagnosis_at, lambda: self._spawn(
            self._diagnose_lanes(seq, what, ended, diagnosed)))
        self._diagnosis = (diagnosis_at, diagnosed)
        try:
            await self._loop.run_in_executor(self._lane_pool, fn, seq, *args, deadline)
        except LaneLost as e:
            self._fail(await self._why_lost(e))
            raise self._broken from None
        except CollectiveError as e:
            self._fail(e)
            raise self._broken from None
        except asyncio.CancelledError:
            self._fail(CollectiveError(f"{what} was cancelled on rank {self.rank}", (self.rank,)))
            raise
        except Exception as e:  # a defect, not a peer: still every rank must stop waiting
            self._fail(CollectiveError(f"{what} failed on rank {self.rank}: {e!r}", (self.rank,)))
            raise self._broken from e
        finally:
            ended[0] = True
            timer.cancel()
            if self._diagnosis is not None and self._diagnosis[1] is diagnosed:
                self._diagnosis = None

    async def _own_diagnosis_first(self) -> bool:
        """A peer gone without a word near the timeout may have timed out and exited (a timeout
        is not told: every rank finds it). Then this rank's own diagnosis of the exchange in
        flight, due or running, names the culprit, not the peer that merely left first: wait
        for it. True if the group broke meanwhile."""
        if self._diagnosis is not None:
            diagnosis_at, diagnosed = self._diagnosis
            wait = diagnosis_at - self._loop.time()
            if wait < _probe_time(self.timeout):  # due or running
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(diagnosed),
                                           max(0.0, wait) + _probe_time(self.timeout) + 1.0)
        return self._broken is not None

    def _reported(self, answer: Any, peer: int) -> CollectiveError:
        """The error a peer's Status answer reports, of the type it had there."""
        return _error(f"{answer.error} (reported to rank {self.rank} by rank {peer})", answer.ranks,
                      answer.timed_out)

    async def _why_lost(self, lost: LaneLost) -> CollectiveError:
        """A lane closed by its peer: the peer died, or its group broke and it shut its lanes
        (before its Abort, if any, reached this rank). Its Status tells which; no answer near
        the timeout leaves it to this rank's own diagnosis (`_own_diagnosis_first`)."""
        end = self._loop.time() + CONTROL_TIMEOUT_S
        while self._broken is None:  # an Abort or this rank's own diagnosis may come meanwhile
            answer = await self._status_of(lost.peer)
            if isinstance(answer, RpcError):  # no answer: dead, unless the timeout explains it
                if await self._own_diagnosis_first():
                    return self._broken
                return CollectiveError(str(lost), lost.ranks)
            if answer.error:
                return self._reported(answer, lost.peer)
            if self._loop.time() > end:
                return CollectiveError(f"{lost} (rank {lost.peer} still answers: it closed the lane "
                                       "and did not say why)", (lost.peer,))
            await asyncio.sleep(0.02)
        return self._broken

    async def _diagnose_lanes(self, seq: int, what: str, ended: list, diagnosed: asyncio.Future) -> None:
        try:
            blamed, notes = await self._blame(seq)
            if ended[0]:
                return
            if not notes:
                notes.append("every rank answers and has started it: a rank is too slow or stuck")
            self._fail(CollectiveTimeout(f"{what} timed out after {self.timeout:g} s on rank {self.rank}: "
                                         + "; ".join(notes), tuple(blamed)), tell_peers=False)
        finally:
            if not diagnosed.done():
                diagnosed.set_result(None)

    def _check_root(self, root: Any) -> None:
        if not isinstance(root, int) or not 0 <= root < self.world_size:
            raise ValueError(f"root must be a rank in 0..{self.world_size - 1}, got {root!r}")

    def _check_started(self) -> None:
        if self._loop is None:
            raise RuntimeError("the group is not started: make it with `await Group.create(...)`")

    def _enqueue_exchange(self, name: str, run) -> asyncio.Future:
        """A collective made of messages: numbered and run in turn like the ring collectives,
        its messages keyed by its number."""
        self._check_started()
        if self._broken is not None:
            raise self._broken
        seq = self._next_seq
        self._next_seq += 1
        prev, self._tail = self._tail, self._loop.create_future()
        return self._loop.create_task(self._run_exchange(name, seq, run, prev, self._tail))

    async def _run_exchange(self, name: str, seq: int, run, prev: asyncio.Future | None,
                            done: asyncio.Future) -> None:
        try:
            if prev is not None:
                await asyncio.shield(prev)
            if self._broken is not None:
                raise self._broken
            self.ops_started = seq
            waiter = self._waiters.pop(seq, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(CollectiveError(
                    f"collective #{seq} differs between ranks: rank {self.rank} runs {name}, a ring "
                    f"collective came; every rank must call the same collectives in the same order"))
            out = await run(seq)
            self.ops_finished = seq
            return out
        finally:
            self.p2p.forget_collective(seq)
            done.set_result(None)

    async def _status_of(self, rank: int) -> Any:
        """Rank `rank`'s StatusResponse, or the RpcError of asking."""
        cntl = Controller(timeout_ms=max(1, int(_probe_time(self.timeout) * 800)))
        try:
            return await self._stub(rank).Status(pb.StatusRequest(group=self.id), cntl)
        except RpcError as e:
            return e

    def _elems(self, raw: np.ndarray, wide: bool) -> int:
        return max(1, self.segment_bytes // (max(raw.itemsize, 4) if wide else raw.itemsize))

    def _enqueue(self, op: ops.RingOp, result: Any = None) -> asyncio.Future:
        if self._loop is None:
            raise RuntimeError("the group is not started: make it with `await Group.create(...)`")
        if self._broken is not None:
            raise self._broken
        if self._lanes is not None:
            async def on_lanes(seq: int) -> Any:
                await self._on_lanes(seq, op.name, self._lanes.ring, op)
                return result() if result is not None else None
            return self._enqueue_exchange(op.name, on_lanes)
        segment = min(op.layout.segment_elems, op.numel) * np.dtype(ops.wire_dtype(op.code)).itemsize
        flight = _Flight(self, op, self._next_seq, segment >= self.thread_bytes and op.world > 1)
        self._next_seq += 1
        op.emit = flight.emit
        prev, self._tail = self._tail, self._loop.create_future()
        return self._loop.create_task(self._run(flight, prev, self._tail, result))

    async def _run(self, flight: _Flight, prev: asyncio.Future | None, done: asyncio.Future,
                   result: Any) -> Any:
        seq = flight.seq
        timer = None
        try:
            if prev is not None:
                await asyncio.shield(prev)
            if self._broken is not None:
                raise self._broken
            self._current = flight
            self.ops_started = seq
            waiter = self._waiters.pop(seq, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(flight)
            timer = self._loop.call_later(max(0.0, self.timeout - _probe_time(self.timeout)),
                                          lambda: self._spawn(self._diagnose(flight)))
            flight.op.start()
            self._pump(flight)
            self._check_done(flight)
            await flight.future
            self.ops_finished = seq
            return result() if result is not None else None
        except asyncio.CancelledError:
            self._fail(CollectiveError(f"{flight.describe()} was cancelled on rank {self.rank}", (self.rank,)))
            raise
        finally:
            if timer is not None:
                timer.cancel()
            if self._current is flight:
                self._current = None
            done.set_result(None)

    # -- sending -------------------------------------------------------------------------------
    def _pump(self, flight: _Flight) -> None:
        if flight.future.done():
            return
        right = (self.rank + 1) % self.world_size
        stub = self._stub(right)
        op = flight.op
        remaining_ms = int(self.timeout * 1000) + 1000  # the collective's own timer fires first
        while flight.queue and flight.inflight < self.window:
            step, segment, data = flight.queue.popleft()
            req = pb.SegmentRequest(group=self.id, op=flight.seq, src=self.rank, kind=op.kind, dtype=op.code,
                                    numel=op.numel, step=step, segment=segment)
            cntl = Controller(request_attachment=data, timeout_ms=remaining_ms, max_retry=0)
            flight.inflight += 1
            task = self._loop.create_task(stub.Segment(req, cntl))
            task.add_done_callback(lambda t, f=flight: self._sent(f, t))

    def _sent(self, flight: _Flight, task: asyncio.Task) -> None:
        flight.inflight -= 1
        if flight.future.done() or task.cancelled():
            return
        right = (self.rank + 1) % self.world_size
        exc = task.exception()
        if exc is not None:
            why = exc.text if isinstance(exc, RpcError) else repr(exc)
            code = f"[E{exc.code}]" if isinstance(exc, RpcError) else ""
            self._fail(CollectiveError(f"{flight.describe()} failed on rank {self.rank}: rank {right} "
                                       f"({self.addresses[right]}) did not take a segment: {code}{why}",
                                       (right,)))
            return
        ack = task.result()
        if ack.error:
            self._fail(_error(ack.error, ack.ranks, ack.timed_out))
            return
        self._pump(flight)
        self._check_done(flight)

    def _check_done(self, flight: _Flight) -> None:
        if (flight.op.complete and not flight.inflight and not flight.taking and not flight.queue
                and not flight.future.done()):
            flight.future.set_result(None)

    # -- receiving -----------------------------------------------------------------------------
    async def _flight_for(self, seq: int) -> _Flight | CollectiveError:
        """The running collective number `seq`, waiting for it to start; or why not."""
        cur = self._current
        if cur is not None and cur.seq == seq:
            return cur
        if self._broken is not None:
            return self._broken
        if seq <= self.ops_started:
            return CollectiveError(f"rank {self.rank} has already finished collective #{seq}", (self.rank,))
        waiter = self._waiters.get(seq)
        if waiter is None:
            waiter = self._waiters[seq] = self._loop.create_future()
        try:
            flight = await asyncio.wait_for(asyncio.shield(waiter), self.timeout)
        except asyncio.TimeoutError:
            return CollectiveTimeout(f"rank {self.rank} did not start collective #{seq} within "
                                     f"{self.timeout:g} s", (self.rank,))
        if isinstance(flight, CollectiveError):
            return flight
        return flight if flight is not None else self._broken

    async def segment_received(self, req: pb.SegmentRequest, flight: _Flight, attachment: Any) -> pb.Ack:
        op = flight.op
        if (req.kind, req.dtype, req.numel) != (op.kind, op.code, op.numel):
            theirs = f"{ops.KIND_NAMES.get(req.kind, '?')} of {req.numel} {_DTYPE_NAME.get(req.dtype, '?')}"
            err = CollectiveError(f"collective #{flight.seq} differs between ranks: rank {req.src} runs "
                                  f"{theirs}, rank {self.rank} runs {flight.describe()}; every rank must "
                                  f"call the same collectives in the same order", (req.src, self.rank))
        else:
            try:
                if flight.threaded:
                    flight.taking += 1
                    try:
                        await self._loop.run_in_executor(self._reducer_pool(), op.receive, req.step,
                                                         req.segment, attachment)
                    finally:
                        flight.taking -= 1
                    self._pump(flight)
                else:
                    op.receive(req.step, req.segment, attachment)
                self._check_done(flight)
                return pb.Ack()
            except ValueError as e:
                err = CollectiveError(f"{flight.describe()}: rank {self.rank} cannot take a segment from "
                                      f"rank {req.src}: {e}", (req.src,))
        self._fail(err)
        return _refusal(err)

    def _reducer_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        # One thread: a collective's segments are taken one after another, never together.
        if self._reducer is None:
            self._reducer = concurrent.futures.ThreadPoolExecutor(1, f"aiobrpc-reduce-rank{self.rank}")
        return self._reducer

    # -- failure -------------------------------------------------------------------------------
    def _fail(self, err: CollectiveError, tell_peers: bool = True) -> None:
        """Break the group with `err` (the first error wins) and end what waits on it."""
        if self._broken is not None:
            return
        self._broken = err
        cur = self._current
        if cur is not None and not cur.future.done():
            cur.future.set_exception(err)
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_result(None)  # the handler waiting reads the error from the group
        self._waiters.clear()
        if self.p2p is not None:
            self.p2p.fail_all(err)
        if self.messages is not None:
            self.messages.goodbye(broke=err)  # before the lanes shut: the peers take it for no death
            self.messages.fail_all(err)
        if self._lanes is not None:
            self._lanes.abort(err)
        if tell_peers and self.addresses:
            seq = cur.seq if cur is not None else self.ops_started
            for r in range(self.world_size):
                if r != self.rank and r not in err.ranks:
                    req = pb.AbortRequest(group=self.id, src=self.rank, op=seq, ranks=err.ranks, reason=str(err),
                                          timed_out=isinstance(err, CollectiveTimeout))
                    self._spawn(self._tell(r, req))

    async def _tell(self, rank: int, req: pb.AbortRequest) -> None:
        with contextlib.suppress(RpcError):
            await self._stub(rank).Abort(req, Controller(timeout_ms=int(CONTROL_TIMEOUT_S * 1000)))

    def aborted_by(self, req: pb.AbortRequest) -> None:
        self._fail(_error(f"{req.reason} (reported to rank {self.rank} by rank {req.src})", req.ranks,
                          req.timed_out), tell_peers=False)

    async def _diagnose(self, flight: _Flight) -> None:
        """Shortly before the timeout: ask every rank where it is, then fail naming the culprits."""
        blamed, notes = await self._blame(flight.seq)
        if flight.future.done():
            return
        if not notes:
            left = (self.rank - 1) % self.world_size
            notes.append(f"every rank answers and has started it: rank {left} or a rank before it in "
                         f"the ring is too slow or stuck")
        op = flight.op
        self._fail(CollectiveTimeout(
            f"{flight.describe()} timed out after {self.timeout:g} s on rank {self.rank} "
            f"({op.received} of {op.expected} segments received): " + "; ".join(notes), tuple(blamed)),
            tell_peers=False)

    async def _blame(self, seq: int) -> tuple[list[int], list[str]]:
        """Ask every other rank where it is: the ranks that did not answer or have not started
        collective #seq, and a note on each."""
        probe = _probe_time(self.timeout)
        peers = [r for r in range(self.world_size) if r != self.rank]

        async def status(r: int):
            cntl = Controller(timeout_ms=max(1, int(probe * 800)))
            try:
                return await self._stub(r).Status(pb.StatusRequest(group=self.id), cntl)
            except RpcError as e:
                return e

        answers = await asyncio.gather(*(status(r) for r in peers))
        blamed, notes, excused = [], [], []
        for r, a in zip(peers, answers):
            if isinstance(a, RpcError):
                left = self.messages.left(r) if self.messages is not None else None
                if isinstance(left, PeerBroke):  # it gave up as this rank does, likely on the same culprit
                    excused.append(r)
                    notes.append(str(left))
                    continue
                blamed.append(r)
                notes.append(f"rank {r} ({self.addresses[r]}) did not answer: [E{a.code}]{a.text}")
            elif a.ops_started < seq:
                blamed.append(r)
                notes.append(f"rank {r} has not started it (it has started {a.ops_started} collectives)")
        return blamed or excused, notes

    # -- messages on lanes: a peer's report, and the timeouts ----------------------------------
    def _mail_report(self, err: CollectiveError, fatal: bool) -> None:
        """(A lane's thread.) A peer broke the message lane protocol (the group breaks), or its
        lane closed."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: the group is gone with it
            if fatal:
                self._loop.call_soon_threadsafe(self._fail, err)
            else:
                self._loop.call_soon_threadsafe(self._spawn, self._mail_lost(err))

    async def _mail_lost(self, err: CollectiveError) -> None:
        """A message lane closed: the peer died, or it closed its group or its group broke and
        it shut its lanes; a BYE, or else its Status, tells which. A peer that said BYE or
        answers (broken) fails what waits on it, with its reason, and the group goes on: a
        rank that closes after the last collective is no error. A peer that does not answer is
        dead: the group breaks naming it and every rank is told, as on calls (a rank that only
        waited on it would otherwise exit unheard, and its peers blame it)."""
        peer = err.ranks[0]
        end = self._loop.time() + CONTROL_TIMEOUT_S
        said_bye = isinstance(err, PeerClosed)
        if isinstance(err, PeerBroke) and err.reason is not None:  # it said why
            err = err.reason
        elif isinstance(err, PeerBroke):  # alive a moment more, maybe: its reason beats "it broke"
            answer = await self._status_of(peer)
            if not isinstance(answer, RpcError) and answer.error:
                err = self._reported(answer, peer)
        # A peer shuts a lane a moment before its group is marked broken: one that answers
        # without an error is asked again, for a little while. One that said BYE closed.
        while self._broken is None and not self._closed and not said_bye:
            answer = await self._status_of(peer)
            if isinstance(answer, RpcError):  # gone: dead, unless the timeout explains it
                if not await self._own_diagnosis_first():
                    self._fail(err)
                break
            if answer.error:
                err = self._reported(answer, peer)
                break
            if self._loop.time() > end:
                break
            await asyncio.sleep(0.02)
        self.messages.fail_peer(peer, err)

    def _mail_tick(self) -> None:
        if self._closed or self._broken is not None:
            return
        for r in self.messages.expire():
            self._spawn(self._mail_timed_out(r))
        self._tick = self._loop.call_later(_tick_time(self.timeout), self._mail_tick)

    async def _mail_timed_out(self, r: Any) -> None:
        """A recv not done within the timeout: a source that does not answer is dead (the group
        breaks, naming it); one that answers has not sent the message (only the recv fails)."""
        peers = [r.src] if r.src is not None else [p for p in range(self.world_size) if p != self.rank]
        answers = await asyncio.gather(*(self._status_of(p) for p in peers))
        dead = [p for p, a in zip(peers, answers) if isinstance(a, RpcError)]
        what = f"{r.describe()} timed out after {self.timeout:g} s on rank {self.rank}: "
        if dead:
            err = CollectiveTimeout(what + "; ".join(f"rank {p} ({self.addresses[p]}) did not answer" for p in dead),
                                    tuple(dead))
            self._fail(err)
        else:
            err = CollectiveTimeout(what + "no matching send arrived", tuple(peers) if r.src is not None else ())
        if not r.future.done():
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                r.future.set_exception(err)

    def _spawn(self, coro) -> None:
        task = self._loop.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def __repr__(self) -> str:
        state = "broken" if self._broken else "ok"
        return f"<Group rank {self.rank}/{self.world_size} {state} {self.ops_finished} collectives>"


class _CollectiveServicer(Servicer):
    SERVICE = SERVICE

    def __init__(self, group: Group) -> None:
        self.group = group

    def receive_attachment_into(self, method: str, req, attachment_size: int):
        """A segment that is only copied into the tensor (all-gather steps, broadcast) is
        received straight into its place."""
        g = self.group
        if method == "Send":
            return None if g.messages is not None else g.p2p.destination(req, attachment_size)
        flight = g._current
        if (method != "Segment" or flight is None or g._broken is not None or req.group != g.id
                or req.op != flight.seq):
            return None
        op = flight.op
        if (req.kind, req.dtype, req.numel) != (op.kind, op.code, op.numel):
            return None  # segment_received reports it
        dest = op.destination(req.step, req.segment, attachment_size)
        if dest is not None:
            g._segments_placed += 1
        return dest

    async def Segment(self, req: pb.SegmentRequest, cntl: Controller) -> pb.Ack:
        g = self.group
        if req.group != g.id:
            return pb.Ack(error=f"rank {g.rank} is in group {g.id}, not {req.group}: a stale or "
                                f"foreign rank sent to it")
        flight = await g._flight_for(req.op)
        if isinstance(flight, CollectiveError):
            return _refusal(flight)
        return await g.segment_received(req, flight, cntl.request_attachment)

    async def Send(self, req: pb.SendRequest, cntl: Controller) -> pb.Ack:
        g = self.group
        if g.messages is not None:
            return pb.Ack(error=f"rank {g.rank} takes messages on its message lanes, not in Send calls")
        return await g.p2p.received(req, cntl.request_attachment)

    async def Abort(self, req: pb.AbortRequest, cntl: Controller) -> pb.Ack:
        if req.group == self.group.id:
            self.group.aborted_by(req)
        return pb.Ack()

    async def Lane(self, req: pb.LaneRequest, cntl: Controller) -> pb.Ack:
        return pb.Ack(error="lanes are opened on a rank's lane port, not on its server")

    async def Status(self, req: pb.StatusRequest, cntl: Controller) -> pb.StatusResponse:
        g = self.group
        resp = pb.StatusResponse(rank=g.rank, ops_started=g.ops_started, ops_finished=g.ops_finished)
        err = g.broken
        if err is not None and req.group == g.id:
            resp.error = str(err)
            resp.ranks.extend(err.ranks)
            resp.timed_out = isinstance(err, CollectiveTimeout)
        return resp


def _part(tensor: Any, what: str) -> tuple[str, int, np.ndarray]:
    """(dtype name, numel, uint8 view) of a tensor a lane carries; the caller's mistakes raise."""
    dtype, numel, _, buf = p2p_mod.byte_view(tensor, what)
    return dtype, numel, buf


def _check_fits(dst: tuple, src: tuple, what: str) -> None:
    if dst[:2] != src[:2]:
        raise ValueError(f"{what}: {src[1]} {src[0]} cannot go into {dst[1]} {dst[0]}")


def _refusal(err: CollectiveError) -> pb.Ack:
    return pb.Ack(error=str(err), ranks=err.ranks, timed_out=isinstance(err, CollectiveTimeout))


def _error(text: str, ranks, timed_out: bool) -> CollectiveError:
    """An error another rank reported, of the type it had there: a rank that learns of a
    timeout from its neighbour raises CollectiveTimeout, as the neighbour does."""
    return (CollectiveTimeout if timed_out else CollectiveError)(text, tuple(ranks))


def auto_thread_bytes(addresses: list[str], rank: int, cores: int | None = None) -> int:
    """The default `thread_bytes`: segments of 4 MiB or more go to the reduce thread when
    this process has a core to spare beyond one per rank on its host (counted from the
    ranks' addresses); otherwise none do. Where the ranks fill the cores, the thread's
    hand-overs only add work: on 2 cores, 4 ranks ran all_reduce of 16 MiB 10-20 % faster
    with every segment on the loop."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    host = _host(addresses[rank])
    local = sum(1 for a in addresses if _host(a) == host)
    return AUTO_THREAD_BYTES if cores > local else NEVER


def _host(address: str) -> str:
    return address.rsplit(":", 1)[0]


def _probe_time(timeout: float) -> float:
    """Seconds before the timeout when a collective starts asking the ranks for their state."""
    return min(CONTROL_TIMEOUT_S, timeout / 4)


def _retrieved(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


def _tick_time(timeout: float) -> float:
    """How often the group looks for messages waiting past the timeout."""
    return min(0.5, timeout / 8)


def _tag(tag: Any) -> int:
    if not isinstance(tag, (int, np.integer)) or not -(1 << 63) <= tag < (1 << 63):
        raise ValueError(f"tag must be a 64-bit int, got {tag!r}")
    return int(tag)


def _text(value: Any) -> str:
    return bytes(value).decode() if not isinstance(value, str) else value
