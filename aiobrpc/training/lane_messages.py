"""Point-to-point messages (send, recv from a rank or from any) on lanes of their own.

Each pair of ranks opens a second lane (lanes.py, kind MESSAGES) beside the one of the
exchanges. Unlike an exchange, whose order every rank knows, a message may come at any time,
on any tag, before or after its recv: a reader thread per lane reads whatever comes, and
any thread sends (the torch backend's own, the event loop's), so a message costs no hand-over
to the loop at either end.

On the wire a message is a lane's STRM DATA frames (lanes.py) whose first payload begins with
a NOTE: its kind, tag, number on the tag, elements, bytes and dtype name. The kinds:
- EAGER (data follows): a message of at most `eager_bytes`, sent at once while the sender has
  credit. A recv already posted receives it in place; else the receiver holds it (one copy)
  until its recv comes. The receiver gives its credit (`buffer_bytes`) when the lane opens and
  gives it back (CREDIT) as held bytes are taken: what it holds for a peer never passes
  `buffer_bytes`, and a peer that sends past its credit breaks the lane.
- ANNOUNCE (no data): a message without credit or larger than `eager_bytes`; it waits for
  a GRANT.
- GRANT (no data; from the receiver): the recv for message (tag, number) is posted, with its
  dtype, elements and bytes. A recv from a given rank larger than `eager_bytes` grants at once,
  so a send that comes after it goes in one hop; any other recv grants what was announced when
  it matches it (a small message comes EAGER unless its sender is out of credit).
- DATA (data follows): a granted message, received straight into the recv's tensor.
- REFUSE (no data; from the receiver): the recv for message (tag, number) does not fit it (its
  dtype, elements and bytes are in the note): the sender's pending send fails.
- DECLINE (no data; from the sender): the GRANT of message (tag, number) does not fit what it
  sends (in the note): the granted recv fails.
- CREDIT (no data): `bytes` more of held messages, and `elements` more messages held or
  announced (slots), may come. The receiver gives `max_messages` slots with its credit and
  gives them back as its recvs take the messages; a sender out of slots keeps its sends
  (numbered) until some come back, then sends them in order: it waits, never breaks the lane.
- BYE: the sender leaves: it closes its group (elements 0, no data) or its group broke
  (elements 1; data, up to MAX_REASON bytes: whether it timed out, the ranks it blamed and its
  error's text, what its Status would answer). Its lane closing next is no death.

Messages from one rank on one tag match their recvs in the order sent (the number), as with
gloo. What a peer makes this rank keep is bounded: held bytes by the credit, held or announced
messages by the slots (`max_messages`), grants by `max_messages` per peer; a peer past them
breaks its lane.
A note that is not what the protocol allows (an unknown kind, DATA that was not granted, bytes
past the credit, a message numbered twice) breaks the group naming the peer, logged. A lane
that closes makes later sends and recvs with that peer fail at once; the group asks the peer's
Status: those waiting fail with the peer's own error (it closed its group, or its group broke)
and the group goes on, or, the peer not answering and not having said BYE (dead), the group
breaks naming it. A recv, or a send waiting
for its grant or a slot, that waits past the group's timeout fails (the group's tick: `expire`); a recv
from any rank whose ranks do not answer then breaks the group, naming them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import socket
import struct
import threading
import time
from typing import Any, Callable

import numpy as np

from .errors import CollectiveError, CollectiveTimeout
from .lanes import (FRAME_BYTES, HEADER, INLINE_BYTES, MAX_DTYPE_NAME, MAX_FRAME_META, Lane, LaneError,
                    check_data_meta, dtype_name_at, frames, parse_header, send_in_pieces, timeval, _write_now)
from .p2p import byte_view

try:  # the bytes a TCP socket's kernel holds unacknowledged (Linux: SIOCOUTQ)
    import fcntl
    import termios
    _OUTQ = termios.TIOCOUTQ
except (ImportError, AttributeError):
    fcntl = None
    _OUTQ = 0

log = logging.getLogger(__name__)

EAGER, ANNOUNCE, GRANT, DATA, REFUSE, CREDIT, DECLINE, BYE = 1, 2, 3, 4, 5, 6, 7, 8
KIND_NAMES = {EAGER: "EAGER", ANNOUNCE: "ANNOUNCE", GRANT: "GRANT", DATA: "DATA", REFUSE: "REFUSE",
              CREDIT: "CREDIT", DECLINE: "DECLINE", BYE: "BYE"}
_NOTE = struct.Struct("<BBqQqQ")  # kind, dtype name's length, tag, number, elements, bytes
NOTE = _NOTE.size + MAX_DTYPE_NAME  # 98 bytes, the name zero-padded
_DISCARD = 1 << 16  # the chunk that bytes nobody takes are read into, then dropped
_CREDIT_MAX = 1 << 62
MAX_REASON = 2048  # the most bytes of a BYE's reason (the text is cut to fit)
_REASON = struct.Struct("<BI")  # timed out, how many ranks (each a u32), then the text (UTF-8)
_EMPTY = memoryview(b"")
_LATER = object()  # (to _write) make the send's future only if the write cannot be done at once
_WRITTEN: concurrent.futures.Future = concurrent.futures.Future()  # every send written at once
_WRITTEN.set_result(None)


def pack_note(kind: int, tag: int, seq: int, numel: int = 0, nbytes: int = 0, dtype: str = "") -> bytes:
    name = dtype.encode()
    if len(name) > MAX_DTYPE_NAME:
        raise ValueError(f"dtype name {dtype!r} is longer than {MAX_DTYPE_NAME} bytes")
    return _NOTE.pack(kind, len(name), tag, seq, numel, nbytes) + name.ljust(MAX_DTYPE_NAME, b"\0")


def parse_note(raw: bytes) -> tuple[int, int, int, int, int, str]:
    """(kind, tag, number, elements, bytes, dtype name) of a NOTE; LaneError if malformed."""
    if len(raw) != NOTE:
        raise LaneError(f"a note of {len(raw)} bytes, not {NOTE}")
    kind, n, tag, seq, numel, nbytes = _NOTE.unpack_from(raw)
    if kind not in KIND_NAMES:
        raise LaneError(f"a note of unknown kind {kind}")
    name = dtype_name_at(raw, _NOTE.size, n)
    if kind not in (CREDIT, BYE) and seq < 1:
        raise LaneError(f"a {KIND_NAMES[kind]} note numbered {seq}")
    if numel < 0 or (kind == BYE and numel > 1):
        raise LaneError(f"a {KIND_NAMES[kind]} note of {numel} elements")
    return kind, tag, seq, numel, nbytes, name


def pack_reason(err: CollectiveError, world_size: int) -> bytes:
    """A broken group's error as a BYE's data (the ranks it names that are of the group)."""
    ranks = tuple(r for r in err.ranks if isinstance(r, int) and 0 <= r < world_size)
    head = _REASON.pack(isinstance(err, CollectiveTimeout), len(ranks)) + struct.pack(f"<{len(ranks)}I", *ranks)
    room = MAX_REASON - len(head)
    if room < 0:
        return _REASON.pack(isinstance(err, CollectiveTimeout), 0)  # too many ranks to name: no reason
    return head + str(err).encode()[:room].decode(errors="ignore").encode()


def parse_reason(data: bytes, world_size: int) -> tuple[bool, tuple[int, ...], str]:
    """(timed out, ranks, text) of a BYE's data; LaneError if malformed."""
    if len(data) < _REASON.size:
        raise LaneError(f"a BYE's reason of {len(data)} bytes")
    timed_out, n = _REASON.unpack_from(data)
    end = _REASON.size + 4 * n
    if timed_out > 1 or n > world_size or len(data) < end:
        raise LaneError(f"a BYE's reason naming {n} ranks in {len(data)} bytes")
    ranks = struct.unpack_from(f"<{n}I", data, _REASON.size)
    if any(r >= world_size for r in ranks):
        raise LaneError(f"a BYE's reason naming ranks {list(ranks)} of a world of {world_size}")
    try:
        text = data[end:].decode()
    except UnicodeDecodeError as e:
        raise LaneError(f"a BYE's reason that is not UTF-8 ({e})") from None
    return bool(timed_out), ranks, text


class PeerClosed(CollectiveError):
    """The peer said BYE: it closed its group, or its group broke (`PeerBroke`)."""


class PeerBroke(PeerClosed):
    """The peer said BYE as its group broke: it is alive a moment more. `reason`: its own error
    as it told it (or None), which later sends and recvs with it raise."""

    def __init__(self, message: str, ranks: tuple = (), reason: CollectiveError | None = None) -> None:
        super().__init__(message, ranks)
        self.reason = reason


class _Recv:
    """A posted recv: where the message goes and the future of the rank it came from."""

    __slots__ = ("src", "tag", "seq", "dtype", "numel", "buf", "future", "at", "granted", "abandoned")

    def __init__(self, src: int | None, tag: int, dtype: str, numel: int, buf: np.ndarray, at: float) -> None:
        self.src = src  # None: from any rank until matched
        self.tag = tag
        self.seq = 0
        self.dtype, self.numel, self.buf = dtype, numel, buf
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.at = at  # when it times out
        self.granted = False  # a GRANT went to its source: DATA may come
        self.abandoned = False  # timed out after its GRANT: what still comes for it is dropped

    def describe(self) -> str:
        src = "any rank" if self.src is None else f"rank {self.src}"
        return f"recv from {src} (tag {self.tag}) of {self.numel} {self.dtype}"

    def fits(self, dtype: str, numel: int, nbytes: int) -> str:
        if dtype != self.dtype or numel != self.numel or nbytes != self.buf.nbytes:
            return (f"it sent {numel} {dtype} ({nbytes} bytes), the recv takes {self.numel} {self.dtype} "
                    f"({self.buf.nbytes} bytes)")
        return ""


class _Send:
    """An announced send waiting for its GRANT."""

    __slots__ = ("dst", "tag", "seq", "dtype", "numel", "data", "future", "at")

    def __init__(self, dst: int, tag: int, seq: int, dtype: str, numel: int, data: memoryview,
                 future: concurrent.futures.Future, at: float) -> None:
        self.dst, self.tag, self.seq = dst, tag, seq
        self.dtype, self.numel, self.data = dtype, numel, data
        self.future = future
        self.at = at

    def describe(self) -> str:
        return f"send to rank {self.dst} (tag {self.tag}) of {self.numel} {self.dtype}"


class _Held:
    """A message that came (EAGER: its bytes held) or was announced before its recv."""

    __slots__ = ("seq", "dtype", "numel", "nbytes", "data")

    def __init__(self, seq: int, dtype: str, numel: int, nbytes: int, data: np.ndarray | None) -> None:
        self.seq, self.dtype, self.numel, self.nbytes, self.data = seq, dtype, numel, nbytes, data


class _Peer:
    """What this rank keeps about the message lane to one peer."""

    __slots__ = ("lane", "meta_size", "credit", "allowance", "held_bytes", "unmatched", "grants", "owed", "queued",
                 "lost", "bye", "reader", "filling", "slots", "slot_allowance", "owed_slots", "stalled")

    def __init__(self, lane: Lane) -> None:
        self.lane = lane
        sizes = {len(meta) for meta in lane.in_meta}
        if len(sizes) != 1:
            raise ValueError(f"the lane's DATA metas differ in size: {sizes}")
        self.meta_size = sizes.pop()  # an honest peer's, last frame or not
        self.credit = 0  # bytes of EAGER messages this rank may still send it (it gives them)
        self.allowance = 0  # bytes of EAGER messages it may still send this rank (this rank gave them)
        self.held_bytes = 0  # bytes of its EAGER messages held here, no recv having taken them
        self.unmatched = 0  # its messages held or announced here with no recv
        self.grants = 0  # its GRANTs kept here for sends this rank has not made yet
        self.owed = 0  # credit taken here and not yet given back
        self.queued = 0  # writes to it handed to the writing thread and not yet done
        self.lost: CollectiveError | None = None
        self.bye: PeerClosed | None = None  # what it said as it left, if it said BYE
        self.reader: threading.Thread | None = None
        self.filling: _Recv | None = None  # the recv its reader is reading into
        # Messages that may wait at the other end for a recv (EAGER and ANNOUNCE), counted as
        # the bytes are: `slots` this rank may still send it, `slot_allowance` it may still
        # send this rank, `owed_slots` taken by recvs here and not yet given back.
        self.slots = 0
        self.slot_allowance = 0
        self.owed_slots = 0
        self.stalled: dict[tuple[int, int], _Send] = {}  # (tag, number) -> its send waiting for a slot, in order


class LaneMessages:
    """The point-to-point layer of one rank on its message lanes (made by the group once they
    are open). `send` and `recv` may be called from any thread; they give concurrent futures.

    `report(err, fatal)` is called (from a reader thread) when a peer broke the protocol
    (fatal: the group breaks) or its lane closed."""

    def __init__(self, rank: int, world_size: int, lanes: list[Lane | None], addresses: list[str], *,
                 timeout: float, eager_bytes: int, buffer_bytes: int, max_messages: int,
                 report: Callable[[CollectiveError, bool], None]) -> None:
        self.rank = rank
        self.world_size = world_size
        self.addresses = addresses
        self.timeout = timeout
        self.eager_bytes = eager_bytes
        self.buffer_bytes = buffer_bytes
        self.max_messages = max_messages
        self._report = report
        self._peers: list[_Peer | None] = [None if lane is None else _Peer(lane) for lane in lanes]
        self._lock = threading.Lock()
        # Keyed by this rank's own tags (the sends and recvs its program makes): a peer's notes
        # add entries only to the tables counted against it (unmatched, grants).
        self._send_seq: dict[tuple[int, int], int] = {}  # (dst, tag) -> the last number sent
        self._next_match: dict[tuple[int, int], int] = {}  # (src, tag) -> the number the next recv takes
        self._recvs: dict[tuple[int, int, int], _Recv] = {}  # (src, tag, number): posted and granted
        self._any: dict[int, collections.deque] = {}  # tag -> recvs from any rank, oldest first
        # tag -> {(src, number): _Held}, in arrival order (a recv from any takes the first)
        self._unmatched: dict[int, dict[tuple[int, int], _Held]] = {}
        self._pending: dict[tuple[int, int, int], _Send] = {}  # (dst, tag, number): announced
        self._grants: dict[tuple[int, int, int], tuple[str, int, int]] = {}  # (src, tag, number)
        self._broken: CollectiveError | None = None
        self._said_bye = False
        self._writes: collections.deque = collections.deque()
        self._wake = threading.Condition(self._lock)
        self._writer: threading.Thread | None = None
        self.placed = 0  # messages received straight into their recv's tensor
        self.held = 0  # messages held until their recv came

    # -- starting and ending -------------------------------------------------------------------
    def start(self) -> None:
        """Start the reader and writing threads and give every peer its credit."""
        self._writer = threading.Thread(target=self._write_loop, name=f"aiobrpc-mail-send-rank{self.rank}",
                                        daemon=True)
        self._writer.start()
        for peer in self._peers:
            if peer is None:
                continue
            # no deadline on a lane's reads: messages come when they come (the handshake's is reset)
            peer.lane.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _TIMEVAL.pack(0, 0))
            peer.reader = threading.Thread(target=self._read_loop, args=(peer,), daemon=True,
                                           name=f"aiobrpc-mail-read-rank{self.rank}-from{peer.lane.peer}")
            peer.reader.start()
            with self._lock:
                peer.allowance = self.buffer_bytes
                peer.slot_allowance = self.max_messages
                self._note(peer, pack_note(CREDIT, 0, 0, self.max_messages, self.buffer_bytes))

    def fail_all(self, err: CollectiveError) -> None:
        """The group broke: every pending send and recv fails with `err`, held data is dropped,
        and later calls raise it. The lanes' sockets are the group's to shut."""
        with self._lock:
            if self._broken is None:
                self._broken = err
            futures = [r.future for r in self._recvs.values()]
            futures += [r.future for q in self._any.values() for r in q]
            futures += [s.future for s in self._pending.values()]
            futures += [s.future for p in self._peers if p is not None for s in p.stalled.values()]
            futures += [f for _, _, f in self._writes if f is not None]
            self._writes.clear()
            futures += [p.filling.future for p in self._peers if p is not None and p.filling is not None]
            self._recvs.clear()
            self._any.clear()
            self._unmatched.clear()
            self._pending.clear()
            self._grants.clear()
            for peer in self._peers:
                if peer is not None:
                    peer.held_bytes = peer.unmatched = peer.grants = 0
                    peer.stalled.clear()
            self._wake.notify_all()
        for f in futures:
            _settle(f, err)

    def fail_peer(self, rank: int, err: CollectiveError) -> None:
        """The lane to `rank` is lost: the recvs from it and the sends to it that wait fail
        with `err`; what it left here is dropped, but the messages a peer that closed its
        group (a BYE, no error) sent whole before it: later recvs still take them, as gloo's
        do (its sends were done). Recvs from any rank wait on (another rank may send), as do
        sends and recvs with other ranks."""
        keep = type(err) is PeerClosed
        with self._lock:
            peer = self._peers[rank]
            peer.lost = err  # later sends and recvs say why too
            futures = [r.future for k, r in self._recvs.items() if k[0] == rank and not r.abandoned]
            if peer.filling is not None:
                futures.append(peer.filling.future)
            for k in [k for k in self._recvs if k[0] == rank]:
                del self._recvs[k]
            futures += [self._pending.pop(k).future for k in [k for k in self._pending if k[0] == rank]]
            futures += [s.future for s in peer.stalled.values()]
            peer.stalled.clear()
            for k in [k for k in self._grants if k[0] == rank]:
                del self._grants[k]
            peer.held_bytes = peer.unmatched = peer.grants = 0
            for tag in list(self._unmatched):
                queue = self._unmatched[tag]
                for k in [k for k in queue if k[0] == rank]:
                    held = queue[k]
                    if keep and held.data is not None:
                        peer.held_bytes += held.nbytes
                        peer.unmatched += 1
                    else:
                        del queue[k]
                self._drop_if_empty(tag)
        for f in futures:
            _settle(f, err)

    def goodbye(self, broke: CollectiveError | None = None) -> None:
        """This rank closes its group, or its group broke with `broke`: tell every peer (BYE,
        once, with the error if any), so that its lanes closing next are not taken for its
        death, and what its peers still try with it fails with its reason. A rank whose group
        broke on a timeout exits at once, not telling (every rank finds a timeout itself):
        without the BYE its idle peers, finding it gone, would break their groups blaming it."""
        with self._lock:
            if self._said_bye or self._broken is not None:
                return
            self._said_bye = True
            reason = memoryview(pack_reason(broke, self.world_size)) if broke is not None else _EMPTY
            for peer in self._peers:
                if peer is not None and peer.lost is None:
                    self._note(peer, pack_note(BYE, 0, 0, int(broke is not None), len(reason)), reason)

    def unsent(self) -> int:
        """After `goodbye`: what this rank's lanes still hold to deliver to peers that can take
        it, writes the writing thread has not done and bytes a lane's kernel holds that its
        peer has not acknowledged (0 where the platform does not tell). The group waits for 0
        (bounded) before it closes the lanes: a socket closed with bytes unread in it resets
        the connection, and its kernel drops what it still held to send, messages whose sends
        had completed (once written to the kernel) among them."""
        with self._lock:
            if self._broken is not None:
                return 0
            live = [p for p in self._peers if p is not None and p.lost is None]
            queued = sum(p.queued for p in live)
        return queued + sum(_unacknowledged(p.lane.sock) for p in live)

    def join(self, timeout: float = 5.0) -> None:
        """Wait for the threads (after fail_all and the lanes' shutdown, they end at once)."""
        end = time.monotonic() + timeout
        for t in [self._writer] + [p.reader for p in self._peers if p is not None]:
            if t is not None and t is not threading.current_thread():
                t.join(max(0.0, end - time.monotonic()))

    # -- the caller's side ---------------------------------------------------------------------
    def send(self, tensor: Any, dst: int, tag: int) -> concurrent.futures.Future:
        """Send `tensor` to rank `dst` on `tag`: done once written to the lane (its memory may
        be reused), or failed if the recv does not fit it."""
        dtype, numel, _, buf = byte_view(tensor, "send tensor")
        data = memoryview(buf).cast("B") if buf.nbytes else memoryview(b"")
        settle: list = []
        with self._lock:
            peer = self._usable(dst)
            key = (dst, tag)
            seq = self._send_seq[key] = self._send_seq.get(key, 0) + 1
            grant = self._grants.pop((dst, tag, seq), None)
            if grant is not None:
                peer.grants -= 1
                future = concurrent.futures.Future()
                self._granted(peer, _Send(dst, tag, seq, dtype, numel, data, future, 0.0), grant, settle)
            elif peer.slots and not peer.stalled:
                future = self._offer(peer, _Send(dst, tag, seq, dtype, numel, data, _LATER, 0.0), settle)
            else:  # as many of its messages wait there for recvs as it allows: this one waits here
                future = concurrent.futures.Future()
                peer.stalled[(tag, seq)] = _Send(dst, tag, seq, dtype, numel, data, future,
                                                 time.monotonic() + self.timeout)
        _settle_all(settle)
        return future

    def _offer(self, peer: _Peer, s: _Send, settle: list) -> Any:
        """(Under the lock.) Send `s` on one of the peer's slots: EAGER while it has credit for
        the bytes, else ANNOUNCE (its DATA goes once granted). Returns its future (made here
        when `s.future` is _LATER)."""
        peer.slots -= 1
        if len(s.data) <= self.eager_bytes and peer.credit >= len(s.data):
            peer.credit -= len(s.data)
            bufs: list = []
            frames(bufs, peer.lane, pack_note(EAGER, s.tag, s.seq, s.numel, len(s.data), s.dtype), s.data)
            return self._write(peer, bufs, s.future, settle)
        if s.future is _LATER:
            s.future = concurrent.futures.Future()
        s.at = time.monotonic() + self.timeout
        self._pending[(s.dst, s.tag, s.seq)] = s
        self._note(peer, pack_note(ANNOUNCE, s.tag, s.seq, s.numel, len(s.data), s.dtype))
        return s.future

    def _unstall(self, peer: _Peer, settle: list) -> None:
        """(Under the lock.) Send what waits for a slot, in order, on the slots given back."""
        while peer.stalled and peer.slots:
            self._offer(peer, peer.stalled.pop(next(iter(peer.stalled))), settle)

    def recv(self, tensor: Any, src: int | None, tag: int) -> concurrent.futures.Future:
        """Receive into `tensor` the next message on `tag` from `src` (None: any rank); the
        future gives the source rank."""
        dtype, numel, _, buf = byte_view(tensor, "recv tensor")
        r = _Recv(src, tag, dtype, numel, buf, time.monotonic() + self.timeout)
        settle: list = []
        with self._lock:
            if src is not None:
                if self._broken is not None:
                    raise self._broken
                peer = self._peers[src]
                seq = self._next_match.get((src, tag), 1)
                queue = self._unmatched.get(tag)
                held = queue.get((src, seq)) if queue else None
                if peer.lost is not None and (held is None or held.data is None):
                    raise peer.lost  # but a peer that closed its group: what it sent before is still taken
                self._next_match[(src, tag)] = seq + 1
                r.seq = seq
                if held is not None:
                    del queue[(src, seq)]
                    self._drop_if_empty(tag)
                    self._bind(peer, r, held, settle)
                elif r.buf.nbytes > self.eager_bytes:
                    self._grant(peer, r)  # granted now, the send that comes later goes in one hop
                else:  # a message this small comes EAGER (or is announced, then granted)
                    self._recvs[(src, tag, seq)] = r
            else:
                self._usable(None)
                for (s, seq), held in self._unmatched.get(tag, {}).items():
                    if seq == self._next_match.get((s, tag), 1) and (held.data is not None
                                                                     or self._peers[s].lost is None):
                        del self._unmatched[tag][(s, seq)]
                        self._drop_if_empty(tag)
                        self._next_match[(s, tag)] = seq + 1
                        r.src, r.seq = s, seq
                        self._bind(self._peers[s], r, held, settle)
                        break
                else:
                    self._any.setdefault(tag, collections.deque()).append(r)
        _settle_all(settle)
        return r.future

    def _usable(self, rank: int | None) -> _Peer | None:
        if self._broken is not None:
            raise self._broken
        if rank is None:
            return None
        peer = self._peers[rank]
        if peer.lost is not None:
            raise peer.lost
        return peer

    def _grant(self, peer: _Peer, r: _Recv) -> None:
        """Post recv `r` (numbered) for its source and tell the source it may send."""
        self._recvs[(r.src, r.tag, r.seq)] = r
        r.granted = True
        self._note(peer, pack_note(GRANT, r.tag, r.seq, r.numel, r.buf.nbytes, r.dtype))

    def _bind(self, peer: _Peer, r: _Recv, held: _Held, settle: list) -> None:
        """Match recv `r` to a message that came or was announced before it."""
        peer.unmatched -= 1
        why = r.fits(held.dtype, held.numel, held.nbytes)
        if held.data is not None:
            peer.held_bytes -= held.nbytes
            self._give_back(peer, held.nbytes, 1)
            if why:
                self._refuse(peer, r, why, settle)
            else:
                r.buf[:] = held.data
                settle.append((r.future, r.src))
            return
        self._give_back(peer, 0, 1)
        if why:  # announced: the sender waits; it learns why
            self._refuse(peer, r, why, settle)
            return
        self._grant(peer, r)

    def _refuse(self, peer: _Peer, r: _Recv, why: str, settle: list) -> None:
        err = self._mismatch(r.describe(), r.src, why)
        self._note(peer, pack_note(REFUSE, r.tag, r.seq, r.numel, r.buf.nbytes, r.dtype))
        settle.append((r.future, err))

    def _mismatch(self, what: str, other: int, why: str) -> CollectiveError:
        msg = f"{what} on rank {self.rank} does not fit rank {other}'s: {why}"
        log.warning("aiobrpc message lanes: %s", msg)
        return CollectiveError(msg, (other, self.rank))

    def _granted(self, peer: _Peer, s: _Send, grant: tuple[str, int, int], settle: list) -> None:
        """Send `s` now that its recv is posted: its DATA, or its refusal if the recv does not
        fit it (both ends fail, each saying why)."""
        dtype, numel, nbytes = grant
        if (dtype, numel, nbytes) != (s.dtype, s.numel, len(s.data)):
            why = (f"the recv takes {numel} {dtype} ({nbytes} bytes), it sends {s.numel} {s.dtype} "
                   f"({len(s.data)} bytes)")
            settle.append((s.future, self._mismatch(s.describe(), s.dst, why)))
            self._note(peer, pack_note(DECLINE, s.tag, s.seq, s.numel, len(s.data), s.dtype))
            return
        bufs: list = []
        frames(bufs, peer.lane, pack_note(DATA, s.tag, s.seq, s.numel, len(s.data), s.dtype), s.data)
        self._write(peer, bufs, s.future, settle)

    def _give_back(self, peer: _Peer, nbytes: int, slots: int) -> None:
        """(Under the lock.) Bytes of credit and slots the peer's messages took here and no
        longer take: given back (CREDIT) an eighth at a time, or at once while the peer has
        none left (its next send waits for them)."""
        peer.owed += nbytes  # at most buffer_bytes: every EAGER byte was within the credit given
        peer.owed_slots += slots  # at most max_messages: every message was within the slots given
        if (peer.owed and peer.owed >= max(1, self.buffer_bytes // 8)) or \
                (peer.owed_slots and (peer.owed_slots >= max(1, self.max_messages // 8) or not peer.slot_allowance)):
            self._note(peer, pack_note(CREDIT, 0, 0, peer.owed_slots, peer.owed))
            peer.allowance += peer.owed
            peer.slot_allowance += peer.owed_slots
            peer.owed = peer.owed_slots = 0

    def _drop_if_empty(self, tag: int) -> None:
        if not self._unmatched.get(tag, True):
            del self._unmatched[tag]

    # -- timeouts (the group calls this on its loop, every tick) --------------------------------
    def expire(self, now: float | None = None) -> list[_Recv]:
        """Take out what waited past the timeout: the recvs, given back (the group diagnoses
        their source, then fails them; a granted one stays, abandoned, to drop what may still
        come for it), and the sends no recv was posted for (failed here)."""
        now = time.monotonic() if now is None else now
        recvs: list[_Recv] = []
        settle: list = []
        with self._lock:
            for r in self._recvs.values():
                if not r.abandoned and r.at <= now:
                    r.abandoned = True  # its tensor is the caller's again: nothing goes into it
                    recvs.append(r)
                    r.buf = None
            for src, r in [(p.lane.peer, p.filling) for p in self._peers if p is not None and p.filling]:
                if not r.abandoned and r.at <= now:  # its sender stopped mid-message: the lane is stuck
                    r.abandoned = True
                    recvs.append(r)
                    log.warning("aiobrpc message lane from rank %d to rank %d: a message stopped coming "
                                "for %g s; the lane is shut", src, self.rank, self.timeout)
                    with contextlib.suppress(OSError):
                        self._peers[src].lane.sock.shutdown(socket.SHUT_RDWR)
            for tag, q in list(self._any.items()):
                for r in [r for r in q if r.at <= now]:
                    q.remove(r)
                    recvs.append(r)
                if not q:
                    del self._any[tag]
            for key, s in list(self._pending.items()):
                if s.at <= now:
                    del self._pending[key]
                    settle.append((s.future, CollectiveTimeout(
                        f"{s.describe()} timed out after {self.timeout:g} s on rank {self.rank}: rank {s.dst} "
                        f"({self.addresses[s.dst]}) posted no recv for it", (s.dst,))))
            for peer in self._peers:
                for key in [k for k, s in peer.stalled.items() if s.at <= now] if peer is not None else ():
                    s = peer.stalled.pop(key)
                    settle.append((s.future, CollectiveTimeout(
                        f"{s.describe()} timed out after {self.timeout:g} s on rank {self.rank}: rank {s.dst} "
                        f"({self.addresses[s.dst]}) took none of the {self.max_messages} messages waiting there "
                        f"for its recvs (max_messages), so this one could not go", (s.dst,))))
        _settle_all(settle)
        return recvs

    # -- writing -------------------------------------------------------------------------------
    def _note(self, peer: _Peer, note: bytes, data: memoryview = _EMPTY) -> None:
        """(Under the lock.) Write a note (and a BYE's reason): one frame."""
        bufs: list = []
        frames(bufs, peer.lane, note, data)
        self._write(peer, bufs, None, None)

    def _write(self, peer: _Peer, bufs: list, future: Any, settle: list | None) -> Any:
        """(Under the lock.) Write `bufs` to the peer's lane after what was written before:
        here what the socket takes at once when nothing waits for the writing thread and it is
        small, the rest by the writing thread. `future` is done once all is written: when that
        is here, it goes to `settle`, settled by the caller once it lets go of the lock (a
        future's callbacks may call back in). A send passes `_LATER`: its future is made only
        where the write waits or fails, and returned; written here, it is `_WRITTEN`, done
        already (no future made, settled and waited on for each small message)."""
        if peer.lost is not None:
            if future is _LATER:
                future = concurrent.futures.Future()
            if future is not None:
                settle.append((future, peer.lost))
            return future
        if not peer.queued and sum(len(b) for b in bufs) <= INLINE_BYTES:
            try:
                bufs = _write_now(peer.lane.sock, bufs)
            except OSError:  # the writing thread meets it again and says what it means
                pass
            if not bufs:
                if future is _LATER:
                    return _WRITTEN
                if future is not None:
                    settle.append((future, None))
                return future
        if future is _LATER:
            future = concurrent.futures.Future()
        peer.queued += 1
        self._writes.append((peer, bufs, future))
        self._wake.notify()
        return future

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                while not self._writes and self._broken is None:
                    self._wake.wait()
                if not self._writes:
                    return
                peer, bufs, future = self._writes.popleft()
            error = None
            try:
                sock = peer.lane.sock
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval(self.timeout))
                for b in bufs:
                    send_in_pieces(sock, b)
            except OSError as e:
                error = e
            lost = False
            with self._lock:
                peer.queued -= 1
                if error is not None:
                    lost = self._lost_locked(peer, error)
            if future is not None:
                _settle(future, (peer.lost or self._broken) if error is not None else None)
            if lost:
                self._report(peer.lost, False)

    # -- reading (a thread per peer) -----------------------------------------------------------
    def _read_loop(self, peer: _Peer) -> None:
        lane = peer.lane
        try:
            while True:
                self._read_one(peer, lane)
        except LaneError as e:
            self._broke(peer, e)
        except OSError as e:
            with self._lock:
                lost = self._lost_locked(peer, e)
            if lost:
                self._report(peer.lost, False)
        except Exception as e:  # a defect: this lane cannot go on, and the group must know
            log.exception("aiobrpc message lane from rank %d: reader failed", lane.peer)
            self._broke(peer, LaneError(f"the reader failed: {e!r}"))

    def _read_one(self, peer: _Peer, lane: Lane) -> None:
        sock, m = lane.sock, peer.meta_size
        raw = _read(sock, HEADER + m + NOTE)  # one read: a first frame's meta is the lane's, its size known
        body, meta_size = parse_header(raw[:HEADER], b"STRM", MAX_FRAME_META + NOTE + FRAME_BYTES)
        if meta_size != m or body - meta_size < NOTE:
            raise LaneError(f"a frame of {body} bytes with a {meta_size}-byte meta, where this lane's first "
                            f"frames have a {m}-byte meta and a {NOTE}-byte note")
        continues = _continues(lane, raw[HEADER:HEADER + m])
        kind, tag, seq, numel, nbytes, dtype = parse_note(raw[HEADER + m:])
        first = body - meta_size - NOTE
        if kind not in (EAGER, DATA):
            data = b""
            if kind == BYE and numel:  # a broken group's: its reason, if any, is the frame's data
                if continues or first != nbytes or first > MAX_REASON:
                    raise LaneError(f"a BYE whose reason is {first} bytes in its frame and {nbytes} in its note "
                                    f"(at most {MAX_REASON}, in one frame)")
                data = _read(sock, first) if first else b""
            elif first or continues:
                raise LaneError(f"a {KIND_NAMES[kind]} note with data")
            settle: list = []
            with self._lock:
                self._control(peer, kind, tag, seq, numel, nbytes, dtype, settle, data)
            if settle and settle[-1][0] is None:  # BYE
                self._report(settle.pop()[1], False)
            _settle_all(settle)
            return
        settle = []
        with self._lock:
            into, r, held = self._arrival(peer, kind, tag, seq, numel, nbytes, dtype, settle)
        _settle_all(settle)
        try:
            _read_message(lane, into, nbytes, first, continues)
        except BaseException:
            if held is not None:  # never whole: not held after all
                with self._lock:
                    if self._broken is None and peer.lost is None:  # else counted out already
                        peer.held_bytes -= nbytes
                        peer.unmatched -= 1
            raise
        if r is not None:
            peer.filling = None
            _settle(r.future, r.src)
        elif held is not None:  # whole now: only now may a recv take it
            with self._lock:
                self._held_in(peer, tag, held, settle)
            _settle_all(settle)

    def _arrival(self, peer: _Peer, kind: int, tag: int, seq: int, numel: int, nbytes: int, dtype: str,
                 settle: list) -> tuple[Any, _Recv | None, _Held | None]:
        """(Under the lock.) Where an EAGER or DATA message's bytes go: a recv's tensor (and
        the recv, completed once they are in), a buffer to hold them in (and what is held,
        which a recv may take once it is whole), or None (read and dropped). Everything is
        checked before anything changes: a refusal leaves the tables as they were, so what
        waits is still there for the group's failure to settle."""
        src = peer.lane.peer
        key = (src, tag, seq)
        r = self._recvs.get(key)
        if kind == DATA:
            if r is None or not r.granted:
                raise LaneError(f"DATA for message #{seq} on tag {tag}, which this rank did not grant")
            if not r.abandoned and r.fits(dtype, numel, nbytes):
                raise LaneError(f"DATA of {numel} {dtype} ({nbytes} bytes) for a recv granted as "
                                f"{r.numel} {r.dtype} ({r.buf.nbytes} bytes)")
            del self._recvs[key]
            if r.abandoned:
                return None, None, None
            self.placed += 1
            peer.filling = r
            return r.buf, r, None
        # EAGER: sent on the credit and a slot this rank gave, which it gives back whatever
        # becomes of it
        if nbytes > peer.allowance:
            raise LaneError(f"an EAGER message of {nbytes} bytes past the credit given ({peer.allowance} "
                            f"bytes of it left)")
        if not peer.slot_allowance:
            raise LaneError(f"an EAGER message past the {self.max_messages} slots given (max_messages)")
        if r is None and seq == self._next_match.get((src, tag), 1) and self._any.get(tag):
            r = self._any[tag].popleft()
            if not self._any[tag]:
                del self._any[tag]
            r.src, r.seq = src, seq
            self._next_match[(src, tag)] = seq + 1
        elif r is not None:
            del self._recvs[key]
        if r is None:
            self._check_new(peer, tag, seq)
        peer.allowance -= nbytes
        peer.slot_allowance -= 1
        if r is not None:
            self._give_back(peer, nbytes, 1)
            if r.abandoned:
                return None, None, None
            why = r.fits(dtype, numel, nbytes)
            if why:
                self._refuse(peer, r, why, settle)
                return None, None, None
            self.placed += 1
            peer.filling = r
            return r.buf, r, None
        data = np.empty(nbytes, np.uint8)
        peer.held_bytes += nbytes
        peer.unmatched += 1  # counted now, matched once whole (_held_in)
        self.held += 1
        return data, None, _Held(seq, dtype, numel, nbytes, data)

    def _held_in(self, peer: _Peer, tag: int, held: _Held, settle: list) -> None:
        """(Under the lock.) An EAGER message held is whole: to a recv posted while it was
        read, or among the unmatched ones."""
        src = peer.lane.peer
        if self._broken is not None or peer.lost is not None:
            return
        r = self._recvs.pop((src, tag, held.seq), None)
        if r is None and held.seq == self._next_match.get((src, tag), 1) and self._any.get(tag):
            r = self._any[tag].popleft()
            if not self._any[tag]:
                del self._any[tag]
            r.src, r.seq = src, held.seq
            self._next_match[(src, tag)] = held.seq + 1
        if r is None:
            self._unmatched.setdefault(tag, {})[(src, held.seq)] = held
        elif r.abandoned:  # timed out meanwhile: dropped
            peer.unmatched -= 1
            peer.held_bytes -= held.nbytes
            self._give_back(peer, held.nbytes, 1)
        else:
            self._bind(peer, r, held, settle)

    def _check_new(self, peer: _Peer, tag: int, seq: int) -> None:
        src = peer.lane.peer
        if seq < self._next_match.get((src, tag), 1) or (src, seq) in self._unmatched.get(tag, ()):
            raise LaneError(f"message #{seq} on tag {tag} came twice")
        if peer.unmatched >= self.max_messages:
            raise LaneError(f"rank {self.rank} already holds {self.max_messages} messages from rank {src} "
                            "that no recv has taken (max_messages)")

    def _hold(self, peer: _Peer, tag: int, held: _Held) -> None:
        peer.unmatched += 1
        self._unmatched.setdefault(tag, {})[(peer.lane.peer, held.seq)] = held

    def _control(self, peer: _Peer, kind: int, tag: int, seq: int, numel: int, nbytes: int, dtype: str,
                 settle: list, data: bytes = b"") -> None:
        """(Under the lock.) A note without data (but a BYE's reason)."""
        src = peer.lane.peer
        if kind == CREDIT:
            peer.credit = min(_CREDIT_MAX, peer.credit + nbytes)
            peer.slots = min(_CREDIT_MAX, peer.slots + numel)
            self._unstall(peer, settle)
        elif kind == BYE:
            if numel:
                reason = None
                if data:
                    timed_out, ranks, text = parse_reason(data, self.world_size)
                    reason = (CollectiveTimeout if timed_out else CollectiveError)(
                        f"{text} (reported to rank {self.rank} by rank {src})", ranks)
                bye: PeerClosed = PeerBroke(f"rank {src} ({self.addresses[src]}) left: its group broke", (src,),
                                            reason)
            else:
                bye = PeerClosed(f"rank {src} ({self.addresses[src]}) closed its group", (src,))
            if peer.lost is None and self._broken is None:
                peer.bye = bye
                # Later sends and recvs with it raise its reason where it gave one.
                peer.lost = bye.reason if isinstance(bye, PeerBroke) and bye.reason is not None else bye
                settle.append((None, bye))  # reported by the caller, once the lock is let go
        elif kind == GRANT:
            s = self._pending.pop((src, tag, seq), None) or peer.stalled.pop((tag, seq), None)
            if s is not None:
                self._granted(peer, s, (dtype, numel, nbytes), settle)
            elif seq > self._send_seq.get((src, tag), 0):  # a recv posted before its send
                if (src, tag, seq) in self._grants:
                    raise LaneError(f"message #{seq} on tag {tag} was granted twice")
                if peer.grants >= self.max_messages:
                    raise LaneError(f"rank {src} granted more than {self.max_messages} messages that rank "
                                    f"{self.rank} has not sent (max_messages)")
                self._grants[(src, tag, seq)] = (dtype, numel, nbytes)
                peer.grants += 1
            # else: the message went (EAGER) before the grant came
        elif kind == REFUSE:
            s = self._pending.pop((src, tag, seq), None)
            why = f"the recv takes {numel} {dtype} ({nbytes} bytes)"
            if s is not None:
                why += f", it sends {s.numel} {s.dtype} ({len(s.data)} bytes)"
                settle.append((s.future, self._mismatch(s.describe(), src, why)))
            else:  # sent before its recv was posted: the sender's part is done
                log.warning("aiobrpc message lanes: rank %d refused rank %d's message #%d on tag %d, sent "
                            "already: %s", src, self.rank, seq, tag, why)
        elif kind == DECLINE:
            r = self._recvs.get((src, tag, seq))
            if r is None or not r.granted:
                raise LaneError(f"DECLINE of message #{seq} on tag {tag}, which this rank did not grant")
            del self._recvs[(src, tag, seq)]
            if not r.abandoned:
                settle.append((r.future, self._mismatch(r.describe(), src, f"it sends {numel} {dtype} ({nbytes} "
                                                        f"bytes), the recv takes {r.numel} {r.dtype} "
                                                        f"({r.buf.nbytes} bytes)")))
        else:  # ANNOUNCE, on a slot this rank gave
            if not peer.slot_allowance:
                raise LaneError(f"an ANNOUNCE past the {self.max_messages} slots given (max_messages)")
            peer.slot_allowance -= 1
            r = self._recvs.get((src, tag, seq))
            if r is not None:
                self._give_back(peer, 0, 1)  # no wait here: its recv is posted
                if not r.granted:  # a small recv posted before: granted now
                    if r.abandoned:  # it timed out: no recv takes the message, its send times out
                        del self._recvs[(src, tag, seq)]
                        return
                    why = r.fits(dtype, numel, nbytes)
                    if why:
                        del self._recvs[(src, tag, seq)]
                        self._refuse(peer, r, why, settle)
                    else:
                        self._grant(peer, r)
                return  # granted already, or abandoned: DATA comes (or is dropped)
            if seq == self._next_match.get((src, tag), 1) and self._any.get(tag):
                r = self._any[tag].popleft()
                if not self._any[tag]:
                    del self._any[tag]
                r.src, r.seq = src, seq
                self._next_match[(src, tag)] = seq + 1
                peer.unmatched += 1  # _bind counts it out
                self._bind(peer, r, _Held(seq, dtype, numel, nbytes, None), settle)
                return
            self._check_new(peer, tag, seq)
            self._hold(peer, tag, _Held(seq, dtype, numel, nbytes, None))

    # -- a peer lost or broken -----------------------------------------------------------------
    def _broke(self, peer: _Peer, e: LaneError) -> None:
        src = peer.lane.peer
        err = CollectiveError(f"rank {src} ({self.addresses[src]}) broke the message lane protocol: {e}",
                              (src,))
        log.warning("aiobrpc message lane from rank %d to rank %d: %s", src, self.rank, e)
        with self._lock:
            if self._broken is None and peer.lost is None:
                peer.lost = err
        self._report(err, True)  # first: the peer, seeing its lane shut, asks this rank why
        with contextlib.suppress(OSError):
            peer.lane.sock.shutdown(socket.SHUT_RDWR)

    def _lost_locked(self, peer: _Peer, e: OSError) -> bool:
        """(Under the lock.) The lane to `peer` closed or its writes stalled past the timeout:
        later sends and recvs with that peer fail at once. What waits on it fails once the
        group has asked the peer why (`fail_peer`): the caller reports it (True) once it lets go
        of the lock."""
        if peer.lost is not None or self._broken is not None:
            return False
        src = peer.lane.peer
        if isinstance(e, (TimeoutError, BlockingIOError)):
            why = f"did not read what was sent to it within {self.timeout:g} s"
        else:
            why = f"closed its message lane or is gone: {e}"
        # worded as on the exchange lanes: "... failed on rank R: rank P (address) ..."
        peer.lost = CollectiveError(f"messages failed on rank {self.rank}: rank {src} ({self.addresses[src]}) "
                                    f"{why}", (src,))
        return True

    # -- what tests and the group read ---------------------------------------------------------
    def left(self, rank: int) -> PeerClosed | None:
        """What `rank` said as it left (BYE), if it did."""
        with self._lock:
            return self._peers[rank].bye

    def held_bytes(self) -> list[int]:
        return [0 if p is None else p.held_bytes for p in self._peers]

    def stalled_count(self) -> int:
        """Sends waiting here for a slot, to every peer."""
        return sum(len(p.stalled) for p in self._peers if p is not None)

    def unmatched_count(self) -> list[int]:
        return [0 if p is None else p.unmatched for p in self._peers]

    def credit(self, rank: int) -> int:
        return self._peers[rank].credit


def _unacknowledged(sock: socket.socket) -> int:
    if fcntl is None:
        return 0
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), _OUTQ, b"\0\0\0\0"))[0]
    except (OSError, ValueError):  # closed, or not a socket the ioctl knows (a socketpair's)
        return 0


def _read(sock: socket.socket, n: int) -> bytes:
    got = sock.recv(n, socket.MSG_WAITALL)
    if len(got) == n:
        return got
    if not got:
        raise ConnectionResetError("the peer closed the connection")
    rest = bytearray(n - len(got))
    _read_into(sock, memoryview(rest))
    return got + rest


def _read_into(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], 0, socket.MSG_WAITALL)
        if not k:
            raise ConnectionResetError("the peer closed the connection")
        got += k


def _read_message(lane: Lane, into: Any, nbytes: int, first: int, continues: bool) -> None:
    """Read a message's `nbytes` bytes: `first` of them in the frame already begun, the rest in
    the frames that follow; into `into` (a uint8 array of nbytes) or, when None, dropped."""
    sock = lane.sock
    view = memoryview(into).cast("B") if into is not None and nbytes else None
    scratch = None if view is not None or not nbytes else memoryview(bytearray(min(nbytes, _DISCARD)))
    got, payload = 0, first
    while True:
        if payload > nbytes - got:
            raise LaneError(f"{payload} more bytes where {nbytes - got} are left of the message")
        if continues and not payload:
            raise LaneError("an empty frame that says more follow")
        if view is not None:
            _read_into(sock, view[got:got + payload])
        else:
            left = payload
            while left:
                k = min(left, len(scratch))
                _read_into(sock, scratch[:k])
                left -= k
        got += payload
        if not continues:
            break
        body, meta_size = parse_header(_read(sock, HEADER), b"STRM", MAX_FRAME_META + FRAME_BYTES)
        if meta_size > MAX_FRAME_META:
            raise LaneError(f"a DATA frame with a {meta_size}-byte meta")
        continues = _continues(lane, _read(sock, meta_size))
        payload = body - meta_size
    if got != nbytes:
        raise LaneError(f"the message ended after {got} of its {nbytes} bytes")


def _continues(lane: Lane, meta: bytes) -> bool:
    """A DATA frame's has_continuation; its meta must be the lane's (an honest peer's is
    recognised without parsing)."""
    continues = lane.in_meta.get(meta)
    if continues is None:
        continues = check_data_meta(meta, lane.mine, lane.theirs)
    return continues


_TIMEVAL = struct.Struct("@ll")


def _settle(future: concurrent.futures.Future, value: Any) -> None:
    if future.done():
        return
    try:
        if isinstance(value, BaseException):
            future.set_exception(value)
        else:
            future.set_result(value)
    except concurrent.futures.InvalidStateError:  # settled by another thread meanwhile
        pass


def _settle_all(settle: list) -> None:
    for future, value in settle:
        _settle(future, value)
