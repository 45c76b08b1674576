"""Point-to-point messages between the ranks of a `Group`: send, recv from a rank or from any.

A message is matched on (src, coll, tag, seq): `coll` is 0 for the user's sends and the
sequence number of a collective built on messages (all_to_all, gather, scatter) otherwise;
`seq` numbers src's messages to this rank on (coll, tag) from 1, so messages between two
ranks on one tag are received in the order they were sent (as with gloo).

Two ways on the wire (`Send` calls of the Collective service):
- EAGER, for a message of at most `eager_bytes`: the whole message in one call. A recv already
  posted receives it in place; otherwise it is held (copied once) until its recv is posted,
  within `buffer_bytes` per peer. Past that the call is answered `busy` and nothing is held:
  the sender falls back to the other way.
- HEADER then DATA: the sender announces the message (no data); the receiver answers once the
  recv is posted (or fails it at the timeout); the sender then sends the message in pieces of
  `segment_bytes`, each received by the kernel straight into the recv's tensor.

Unmatched messages (held or announced) are at most `max_messages` per peer. Past that an
EAGER call is answered `busy` (the sender announces it instead) and an announcement waits,
outside the tables, for a recv to take one (or for its own recv), within the timeout: an
honest sender ahead of its receiver's recvs waits, as gloo's does. A sender keeps at most
`max_messages` calls in flight to each rank, so an honest one never has more waiting there;
a peer that does is refused, logged and the group broken. A message that does not fit its recv
(dtype, element count, bytes), a piece of no announced message, or a stale one fails the recv
and the sender's call with an error naming both ranks and is logged.

Tensors are numpy arrays or torch CPU tensors of any dtype (complex, bfloat16, bool, ...),
C-contiguous; they travel as their bytes.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import sys
from typing import TYPE_CHECKING, Any

import numpy as np

from ..controller import Controller
from ..errors import RpcError
from .._proto import collective_pb2 as pb
from .errors import CollectiveError, CollectiveTimeout

if TYPE_CHECKING:
    from .group import Group

log = logging.getLogger(__name__)

EAGER, HEADER, DATA = 1, 2, 3
EAGER_BYTES = 256 << 10
BUFFER_BYTES = 64 << 20
MAX_MESSAGES = 1024
MAX_DTYPE_NAME = 64  # "float8_e4m3fnuz" and the like; a peer's longer name is refused, never held


def byte_view(tensor: Any, what: str = "tensor") -> tuple[str, int, tuple[int, ...], np.ndarray]:
    """(dtype name, numel, shape, 1-D uint8 numpy view of its memory) of a C-contiguous
    numpy array or torch CPU tensor."""
    if isinstance(tensor, np.ndarray):
        if not tensor.flags.c_contiguous:
            raise ValueError(f"{what} is not C-contiguous (strides {tensor.strides})")
        name = _DTYPE_NAMES.get(tensor.dtype) or _dtype_name(tensor.dtype)
        return name, tensor.size, tensor.shape, tensor.reshape(-1).view(np.uint8)
    torch = _torch()
    if torch is None or not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a numpy array or a torch CPU tensor, got {type(tensor).__name__}")
    if not tensor.is_cpu:  # (a bool; tensor.device makes an object each time)
        raise ValueError(f"{what} is on {tensor.device}; only CPU tensors can be sent")
    if not tensor.is_contiguous():
        raise ValueError(f"{what} is not contiguous (strides {tuple(tensor.stride())})")
    name = _TORCH_NAMES.get(tensor.dtype)
    if name is None:
        name = str(tensor.dtype).replace("torch.", "")
        if len(_TORCH_NAMES) < _MAX_DTYPE_NAMES:
            _TORCH_NAMES[tensor.dtype] = name
    if name in _NUMPY_TOO:  # numpy's own views: a few microseconds less than torch's
        array = (tensor.detach() if tensor.requires_grad else tensor).numpy()
        return name, array.size, array.shape, (array if array.ndim == 1 else array.reshape(-1)).view(np.uint8)
    flat = tensor.detach().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
    return name, tensor.numel(), tuple(tensor.shape), raw.numpy()


_TORCH_NAMES: dict = {}
# torch dtypes whose tensors numpy views as the same dtype (its name the same as torch's)
_NUMPY_TOO = frozenset({"float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "bool",
                        "complex64", "complex128"})


# numpy computes a dtype's name in Python on every read (a few hundred bytecodes): the names
# of the dtypes seen are kept, at most _MAX_DTYPE_NAMES (structured dtypes are endless).
_DTYPE_NAMES: dict[np.dtype, str] = {}
_MAX_DTYPE_NAMES = 256


def _dtype_name(dtype: np.dtype) -> str:
    name = dtype.name
    if len(_DTYPE_NAMES) < _MAX_DTYPE_NAMES:
        _DTYPE_NAMES[dtype] = name
    return name


def _torch():
    return sys.modules.get("torch")


class _Recv:
    """A posted receive: where the message goes and the future of the rank it came from."""

    __slots__ = ("src", "key", "dtype", "numel", "shape", "buf", "future", "received", "timer")

    def __init__(self, p2p: P2P, src: int | None, key: tuple[int, int], tensor: Any) -> None:
        self.src = src  # None: from any rank until matched
        self.key = key
        self.dtype, self.numel, self.shape, self.buf = byte_view(tensor, "recv tensor")
        self.future: asyncio.Future = p2p.loop.create_future()
        self.received = 0
        self.timer: asyncio.TimerHandle | None = None

    def describe(self) -> str:
        src = "any rank" if self.src is None else f"rank {self.src}"
        coll, tag = self.key
        what = f"recv from {src} (tag {tag})" if coll == 0 else f"collective #{coll}'s recv from {src}"
        return f"{what} of {self.numel} {self.dtype}"


class _Incoming:
    """A message that arrived (held data) or was announced (a HEADER waiting) before its recv."""

    __slots__ = ("src", "key", "seq", "dtype", "numel", "nbytes", "data", "ready")

    def __init__(self, req: pb.SendRequest, data: np.ndarray | None, ready: asyncio.Future | None) -> None:
        self.src, self.key, self.seq = req.src, (req.coll, req.tag), req.seq
        self.dtype, self.numel, self.nbytes = req.dtype, req.numel, req.nbytes
        self.data = data
        self.ready = ready


class P2P:
    """The point-to-point layer of one rank of `group` (made by the group, on its loop)."""

    def __init__(self, group: Group, *, eager_bytes: int = EAGER_BYTES, buffer_bytes: int = BUFFER_BYTES,
                 max_messages: int = MAX_MESSAGES) -> None:
        self.group = group
        self.loop = group._loop
        self.eager_bytes = eager_bytes
        self.buffer_bytes = buffer_bytes
        self.max_messages = max_messages
        # Keyed by the tags this rank's own program uses (and by running collectives, dropped
        # when they end): a peer's messages never add keys here.
        self._send_seq: dict[tuple[int, int, int], int] = collections.defaultdict(int)  # (dst, coll, tag)
        self._next_match: dict[tuple[int, int, int], int] = {}  # (src, coll, tag) -> seq the next recv takes
        self._recvs: dict[tuple[int, int, int, int], _Recv] = {}  # (src, coll, tag, seq), matched
        self._any: dict[tuple[int, int], collections.deque] = {}  # (coll, tag) -> anysource recvs
        # (coll, tag) -> {(src, seq): _Incoming}, in arrival order (recv from any takes the first)
        self._unmatched: dict[tuple[int, int], dict[tuple[int, int], _Incoming]] = {}
        self.held_bytes = [0] * group.world_size      # per peer: bytes of held EAGER messages
        self.unmatched_count = [0] * group.world_size  # per peer: held or announced messages
        self._sends: set[asyncio.Future] = set()
        # per peer: its announcements past max_messages, waiting for room: (coll, tag, seq) -> future
        self._parked: list[dict[tuple[int, int, int], asyncio.Future]] = [{} for _ in range(group.world_size)]
        # per destination: at most max_messages sends in flight, so never more waiting there
        self._window = [asyncio.Semaphore(max_messages) for _ in range(group.world_size)]
        self.placed = 0  # messages or pieces the kernel received straight into a recv's tensor

    # -- the caller's side ----------------------------------------------------------------------
    def send(self, tensor: Any, dst: int, tag: int = 0, coll: int = 0) -> asyncio.Future:
        """Send `tensor` to rank `dst`; done once the receiver holds it or has it in place."""
        self._check_peer(dst, "dst")
        dtype, numel, _, buf = byte_view(tensor, "send tensor")
        self._check_usable()
        key = (dst, coll, tag)
        self._send_seq[key] += 1
        done = self.loop.create_future()
        self._sends.add(done)
        done.add_done_callback(self._sends.discard)
        task = self.loop.create_task(self._send(done, buf, dtype, numel, dst, tag, coll, self._send_seq[key]))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return done

    def recv(self, tensor: Any, src: int | None, tag: int = 0, coll: int = 0) -> asyncio.Future:
        """Receive into `tensor` from rank `src` (None: any rank); the future gives the source."""
        if src is not None:
            self._check_peer(src, "src")
        self._check_usable()
        key = (coll, tag)
        r = _Recv(self, src, key, tensor)
        self._arm_timer(r)
        queue = self._unmatched.get(key, {})
        if src is not None:
            seq = self._next_match.get((src, coll, tag), 1)
            self._next_match[(src, coll, tag)] = seq + 1
            inc = queue.pop((src, seq), None)
            self._drop_if_empty(key)
            if inc is None:
                self._recvs[(src, coll, tag, seq)] = r
                _set(self._parked[src].get((coll, tag, seq)), None)  # its announcement waits for room: it has a recv
            else:
                self._bind(r, inc)
            return r.future
        for (s, seq), inc in queue.items():
            if seq == self._next_match.get((s, coll, tag), 1):
                del queue[(s, seq)]
                self._drop_if_empty(key)
                self._next_match[(s, coll, tag)] = seq + 1
                r.src = s
                self._bind(r, inc)
                return r.future
        self._any.setdefault(key, collections.deque()).append(r)
        for s, parked in enumerate(self._parked):
            if parked:
                _set(parked.get((coll, tag, self._next_match.get((s, coll, tag), 1))), None)
        return r.future

    def _made_room(self, src: int) -> None:
        """A message of `src` left the tables: the first of its announcements waiting for room
        tries again."""
        parked = self._parked[src]
        for fut in parked.values():
            if not fut.done():
                fut.set_result(None)
                return

    def _drop_if_empty(self, key: tuple[int, int]) -> None:
        if not self._unmatched.get(key, True):
            del self._unmatched[key]

    def forget_collective(self, coll: int) -> None:
        """Collective `coll` ended: drop its counters (its messages were all matched)."""
        for table in (self._send_seq, self._next_match):
            for k in [k for k in table if k[1] == coll]:
                del table[k]
        for k in [k for k in self._unmatched if k[0] == coll]:
            for inc in self._unmatched.pop(k).values():
                self.unmatched_count[inc.src] -= 1
                self._made_room(inc.src)
                if inc.data is not None:
                    self.held_bytes[inc.src] -= inc.nbytes
                if inc.ready is not None:
                    _set(inc.ready, CollectiveError(f"collective #{coll} ended on rank {self.group.rank} "
                                                    f"without taking this message", (inc.src,)))
        for k in [k for k in self._any if k[0] == coll]:
            del self._any[k]

    def _check_peer(self, rank: Any, name: str) -> None:
        g = self.group
        if not isinstance(rank, (int, np.integer)) or not 0 <= rank < g.world_size or rank == g.rank:
            raise ValueError(f"{name} must be another rank of the group (0..{g.world_size - 1}, not "
                             f"{g.rank}), got {rank!r}")

    def _check_usable(self) -> None:
        if self.group._broken is not None:
            raise self.group._broken
        if self.group._closed:
            raise CollectiveError(f"the group was closed on rank {self.group.rank}")

    def _arm_timer(self, r: _Recv) -> None:
        g = self.group
        r.timer = self.loop.call_later(g.timeout, lambda: g._spawn(self._timed_out(r)))
        r.future.add_done_callback(lambda _f: r.timer.cancel())

    async def _timed_out(self, r: _Recv) -> None:
        """A recv not done within the timeout: a source that does not answer is dead (the group
        breaks, naming it); one that answers has not sent the message (only the recv fails)."""
        g = self.group
        peers = [r.src] if r.src is not None else [p for p in range(g.world_size) if p != g.rank]
        answers = await asyncio.gather(*(g._status_of(p) for p in peers))
        if r.future.done():
            return
        dead = [p for p, a in zip(peers, answers) if isinstance(a, RpcError)]
        if dead:
            err = CollectiveTimeout(f"{r.describe()} timed out after {g.timeout:g} s on rank {g.rank}: "
                                    + "; ".join(f"rank {p} ({g.addresses[p]}) did not answer" for p in dead),
                                    tuple(dead))
            g._fail(err)
        else:
            err = CollectiveTimeout(f"{r.describe()} timed out after {g.timeout:g} s on rank {g.rank}: "
                                    f"no matching send arrived ({r.received} bytes received)",
                                    tuple(peers) if r.src is not None else ())
        self._forget(r)
        if not r.future.done():
            r.future.set_exception(err)

    def _forget(self, r: _Recv) -> None:
        for k, v in list(self._recvs.items()):
            if v is r:
                del self._recvs[k]
        q = self._any.get(r.key)
        if q is not None and r in q:
            q.remove(r)

    # -- sending --------------------------------------------------------------------------------
    async def _send(self, done: asyncio.Future, buf: np.ndarray, dtype: str, numel: int, dst: int,
                    tag: int, coll: int, seq: int) -> None:
        async with self._window[dst]:
            await self._send_now(done, buf, dtype, numel, dst, tag, coll, seq)

    async def _send_now(self, done: asyncio.Future, buf: np.ndarray, dtype: str, numel: int, dst: int,
                        tag: int, coll: int, seq: int) -> None:
        g = self.group
        if done.done():  # the group broke or closed while this send waited for the window
            return
        req = pb.SendRequest(group=g.id, src=g.rank, coll=coll, tag=tag, seq=seq, dtype=dtype, numel=numel,
                             nbytes=buf.nbytes, phase=EAGER)
        try:
            if buf.nbytes <= self.eager_bytes:
                ack = await self._call(dst, req, buf)
                if not ack.busy:
                    _set(done, None)
                    return
            req.phase = HEADER
            await self._call(dst, req, None)
            req.phase = DATA
            pieces = [(a, min(a + g.segment_bytes, buf.nbytes)) for a in range(0, buf.nbytes, g.segment_bytes)]
            for i in range(0, len(pieces), g.window):
                calls = [self._call(dst, _piece(req, a), buf[a:b]) for a, b in pieces[i:i + g.window]]
                # One call (a message in one piece: segment_bytes is 8 MiB) needs no task and no gather.
                await (calls[0] if len(calls) == 1 else asyncio.gather(*calls))
            _set(done, None)
        except CollectiveError as e:
            _set(done, e)
        except asyncio.CancelledError:
            _set(done, CollectiveError(f"send to rank {dst} was cancelled on rank {g.rank}", (g.rank,)))
            raise
        except Exception as e:  # noqa: BLE001 - the caller's future carries it
            _set(done, CollectiveError(f"send to rank {dst} failed on rank {g.rank}: {e!r}", (dst,)))

    async def _call(self, dst: int, req: pb.SendRequest, data: np.ndarray | None) -> pb.Ack:
        g = self.group
        # The group's channels carry its timeout and max_retry=0: a controller only for data.
        cntl = Controller(request_attachment=data) if data is not None and data.nbytes else None
        try:
            ack = await g._stub(dst).Send(req, cntl)
        except RpcError as e:
            err = CollectiveError(f"send of {req.numel} {req.dtype} (tag {req.tag}) failed on rank {g.rank}: "
                                  f"rank {dst} ({g.addresses[dst]}) did not take it: [E{e.code}]{e.text}", (dst,))
            g._fail(err)
            raise err from None
        if ack.error:
            raise (CollectiveTimeout if ack.timed_out else CollectiveError)(ack.error, tuple(ack.ranks))
        return ack

    # -- receiving (the Send handler) -----------------------------------------------------------
    def destination(self, req: pb.SendRequest, size: int) -> np.ndarray | None:
        """Where a large attachment is received: straight into a matched recv's tensor."""
        if req.group != self.group.id or self.group._broken is not None:
            return None
        if req.phase == EAGER:
            r = self._recvs.get((req.src, req.coll, req.tag, req.seq))
            if r is None and self._any.get((req.coll, req.tag)):
                return None  # matched in the handler, then copied
            offset = 0
        elif req.phase == DATA:
            r = self._recvs.get((req.src, req.coll, req.tag, req.seq))
            offset = req.offset
        else:
            return None
        if r is None or self._mismatch(r, req) or not 0 <= offset <= r.buf.nbytes - size:
            return None
        return r.buf[offset:offset + size]

    async def received(self, req: pb.SendRequest, attachment: Any) -> pb.Ack:
        g = self.group
        if g._broken is not None:
            return _refusal(g._broken)
        why = self._malformed(req, attachment)
        if why:
            return self._refuse(req, why, (req.src,), fatal=False)
        if req.phase == DATA:
            r = self._recvs.get((req.src, req.coll, req.tag, req.seq))
            if r is None or r.src != req.src:
                return self._refuse(req, "a DATA piece of a message that was not announced or is complete",
                                    (req.src,), fatal=True)
            return self._take(r, req, attachment, req.offset)
        deadline = self.loop.time() + g.timeout
        while True:
            ack = await self._arrived(req, attachment, deadline)
            if ack is not None:
                return ack
            # Past max_messages: an announcement waits for room, or for its recv.
            parked, pkey = self._parked[req.src], (req.coll, req.tag, req.seq)
            if pkey in parked:
                return self._refuse(req, f"message #{req.seq} on tag {req.tag} arrived twice", (req.src,),
                                    fatal=True)
            if len(parked) >= self.max_messages:
                return self._refuse(req, f"rank {req.src} has more than {self.max_messages} messages waiting for "
                                         f"room beside the {self.max_messages} rank {g.rank} holds that no recv "
                                         f"has taken (max_messages)", (req.src,), fatal=True)
            room = parked[pkey] = self.loop.create_future()
            try:
                await asyncio.wait_for(room, max(0.0, deadline - self.loop.time()))
            except asyncio.TimeoutError:
                return self._no_recv(req, f"; it holds {self.max_messages} messages of rank {req.src} that no "
                                          f"recv has taken (max_messages)")
            except CollectiveError as e:  # the group broke or closed
                return _refusal(e if e.ranks else CollectiveError(str(e), (g.rank,)))
            finally:
                del parked[pkey]

    def _no_recv(self, req: pb.SendRequest, more: str = "") -> pb.Ack:
        g = self.group
        return pb.Ack(error=f"rank {g.rank} posted no recv for rank {req.src}'s send of {req.numel} "
                            f"{req.dtype} (tag {req.tag}) within {g.timeout:g} s{more}", ranks=[g.rank],
                      timed_out=True)

    async def _arrived(self, req: pb.SendRequest, attachment: Any, deadline: float) -> pb.Ack | None:
        """An EAGER or HEADER call: matched to its recv, held, or waiting for its recv; None
        where it is an announcement past max_messages, which must wait for room."""
        g = self.group
        if g._broken is not None:
            return _refusal(g._broken)
        key = (req.coll, req.tag)
        mkey = (req.src, req.coll, req.tag, req.seq)
        next_seq = self._next_match.get((req.src, req.coll, req.tag), 1)
        if req.seq < next_seq and mkey not in self._recvs:
            return self._refuse(req, f"message #{req.seq} on tag {req.tag} was already received", (req.src,),
                                fatal=True)
        r = self._recvs.get(mkey)
        if r is None and req.seq == next_seq and self._any.get(key):
            r = self._any[key].popleft()
            r.src = req.src
            self._next_match[(req.src, req.coll, req.tag)] = req.seq + 1
            self._recvs[mkey] = r
        if r is not None:
            why = self._mismatch(r, req)
            if why:
                return self._fail_recv(r, req, why)
            if req.phase == EAGER or req.nbytes == 0:
                return self._take(r, req, attachment, 0)
            return pb.Ack()  # HEADER: the recv is posted, the pieces may come
        # No recv yet: hold or wait, within the caps.
        queue = self._unmatched.get(key, {})
        if (req.src, req.seq) in queue:
            return self._refuse(req, f"message #{req.seq} on tag {req.tag} arrived twice", (req.src,), fatal=True)
        if req.phase == EAGER:
            if (self.held_bytes[req.src] + req.nbytes > self.buffer_bytes
                    or self.unmatched_count[req.src] >= self.max_messages):
                return pb.Ack(busy=True)  # nothing held: the sender announces it instead
            data = np.empty(req.nbytes, np.uint8)
            if req.nbytes:
                data[:] = np.frombuffer(attachment, np.uint8)
            self.held_bytes[req.src] += req.nbytes
            self.unmatched_count[req.src] += 1
            self._unmatched.setdefault(key, queue)[(req.src, req.seq)] = _Incoming(req, data, None)
            return pb.Ack()
        if self.unmatched_count[req.src] >= self.max_messages:
            return None
        ready = self.loop.create_future()
        inc = self._unmatched.setdefault(key, queue)[(req.src, req.seq)] = _Incoming(req, None, ready)
        self.unmatched_count[req.src] += 1
        try:
            r = await asyncio.wait_for(asyncio.shield(ready), max(0.0, deadline - self.loop.time()))
        except asyncio.TimeoutError:
            if queue.get((req.src, req.seq)) is inc:
                del queue[(req.src, req.seq)]
                self._drop_if_empty(key)
                self.unmatched_count[req.src] -= 1
                self._made_room(req.src)
            return self._no_recv(req)
        except CollectiveError as e:  # _set gave `ready` the error: the group broke, or a mismatch
            # An error naming no rank (this group was closed): to the sender, this rank is gone.
            return _refusal(e if e.ranks else CollectiveError(str(e), (g.rank,)))
        why = self._mismatch(r, req)
        return self._fail_recv(r, req, why) if why else pb.Ack()

    def _bind(self, r: _Recv, inc: _Incoming) -> None:
        """Match a posted recv to a message that came first."""
        self.unmatched_count[inc.src] -= 1
        self._made_room(inc.src)
        if inc.data is not None:
            self.held_bytes[inc.src] -= inc.nbytes
        why = self._mismatch(r, inc)
        if why:
            err = self._mismatch_error(r, inc.src, why)
            if inc.ready is not None:
                _set(inc.ready, err)
            _set(r.future, err)
            return
        if inc.data is not None:
            r.buf[:] = inc.data
            _set(r.future, inc.src)
            return
        if r.buf.nbytes:
            self._recvs[(inc.src, inc.key[0], inc.key[1], inc.seq)] = r
        else:
            _set(r.future, inc.src)
        _set(inc.ready, r)

    def _take(self, r: _Recv, req: pb.SendRequest, attachment: Any, offset: int) -> pb.Ack:
        size = memoryview(attachment).nbytes if attachment is not None else 0
        if not 0 <= offset <= r.buf.nbytes - size or r.received + size > r.buf.nbytes:
            return self._fail_recv(r, req, f"a piece of {size} bytes at {offset} overruns the {r.buf.nbytes} "
                                           f"bytes of the message")
        if size:
            incoming = np.frombuffer(attachment, np.uint8)
            dest = r.buf[offset:offset + size]
            if incoming.ctypes.data == dest.ctypes.data:
                self.placed += 1
            else:
                dest[:] = incoming
        r.received += size
        if r.received == r.buf.nbytes:
            self._recvs.pop((req.src, req.coll, req.tag, req.seq), None)
            _set(r.future, req.src)
        return pb.Ack()

    def _malformed(self, req: pb.SendRequest, attachment: Any) -> str:
        g = self.group
        size = memoryview(attachment).nbytes if attachment is not None else 0
        if req.group != g.id:
            return f"rank {g.rank} is in group {g.id}, not {req.group}: a stale or foreign rank sent to it"
        if not 0 <= req.src < g.world_size or req.src == g.rank:
            return f"src {req.src} is not another rank of a group of {g.world_size}"
        if len(req.dtype) > MAX_DTYPE_NAME:
            return f"a dtype name of {len(req.dtype)} characters"
        if req.phase not in (EAGER, HEADER, DATA) or req.nbytes < 0 or req.numel < 0 or req.seq < 1:
            return f"a malformed message (phase {req.phase}, {req.nbytes} bytes, seq {req.seq})"
        if req.phase == EAGER and size != req.nbytes:
            return f"a message of {req.nbytes} bytes came with {size}"
        if req.phase == HEADER and size:
            return "an announcement came with data"
        if req.coll and req.coll <= g.ops_finished:
            return f"a message for collective #{req.coll}, which rank {g.rank} has finished"
        return ""

    def _mismatch(self, r: _Recv, msg: Any) -> str:
        if msg.dtype != r.dtype or msg.numel != r.numel or msg.nbytes != r.buf.nbytes:
            return (f"it sent {msg.numel} {msg.dtype} ({msg.nbytes} bytes), the recv takes {r.numel} {r.dtype} "
                    f"({r.buf.nbytes} bytes)")
        return ""

    def _mismatch_error(self, r: _Recv, src: int, why: str) -> CollectiveError:
        g = self.group
        msg = f"{r.describe()} on rank {g.rank} does not fit rank {src}'s send: {why}"
        log.warning("aiobrpc group %s: %s", g.id, msg)
        return CollectiveError(msg, (src, g.rank))

    def _fail_recv(self, r: _Recv, req: pb.SendRequest, why: str) -> pb.Ack:
        err = self._mismatch_error(r, req.src, why)
        self._forget(r)
        _set(r.future, err)
        return _refusal(err)

    def _refuse(self, req: pb.SendRequest, why: str, ranks: tuple, fatal: bool) -> pb.Ack:
        g = self.group
        err = CollectiveError(f"rank {g.rank} refused a message from rank {req.src}: {why}", ranks)
        log.warning("aiobrpc group %s: %s", g.id, err)
        if fatal:
            g._fail(err)
        return _refusal(err)

    # -- failure --------------------------------------------------------------------------------
    def fail_all(self, err: CollectiveError) -> None:
        """The group broke: every pending send and recv fails with `err`; held data is dropped."""
        for r in list(self._recvs.values()):
            _set(r.future, err)
        for q in self._any.values():
            for r in q:
                _set(r.future, err)
        for queue in self._unmatched.values():
            for inc in queue.values():
                if inc.ready is not None:
                    _set(inc.ready, err)
        for done in list(self._sends):
            _set(done, err)
        for parked in self._parked:
            for room in parked.values():
                _set(room, err)
        self._recvs.clear()
        self._any.clear()
        self._unmatched.clear()
        self.held_bytes = [0] * len(self.held_bytes)
        self.unmatched_count = [0] * len(self.unmatched_count)


def _piece(req: pb.SendRequest, offset: int) -> pb.SendRequest:
    """The DATA request of the piece at `offset`: `req` itself for the first (offset 0, as `req`
    has it), a copy for the others, which are in flight beside it."""
    if offset == 0:
        return req
    piece = pb.SendRequest()
    piece.CopyFrom(req)
    piece.offset = offset
    return piece


def _set(fut: asyncio.Future | None, value: Any) -> None:
    if fut is None or fut.done():
        return
    if isinstance(value, BaseException):
        fut.set_exception(value)
        fut.exception()  # retrieved here: a send nobody waits for must not warn at exit
    else:
        fut.set_result(value)


def _refusal(err: CollectiveError) -> pb.Ack:
    return pb.Ack(error=str(err), ranks=err.ranks, timed_out=isinstance(err, CollectiveTimeout))
