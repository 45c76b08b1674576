"""Lanes: connections per pair of ranks, read and written by blocking threads. Each pair opens
two: one for the exchanges whose order every rank knows (the ring collectives: all_reduce,
reduce_scatter, all_gather, broadcast, barrier; all_to_all, gather and scatter), used here; and
one for point-to-point messages, whose protocol is lane_messages.py's (LaneRequest.kind 1).

Why: carried by calls on the group's event loop, an all_to_all at world 4 costs each rank
12 call ends (an announcement and a piece to each of 3 peers, the same from them) and their
socket events, about 2.5 ms of interpreter per exchange beyond what the bytes cost
(docs/training.md). On a lane the data goes from the tensor to the socket and from the socket
into the tensor with one small header per message, in threads that hold no GIL while the
kernel copies: what a bare `sendall` / `recv_into` exchange costs.

On the wire, brpc's own protocols (what brpc's StreamCreate does on a connection of its own):
1. The lower rank connects to the higher rank's lane port and sends a baidu_std request for
   `Collective.Lane`: a LaneRequest (group id, its rank, the rank it wants) with
   stream_settings offering its stream (id: its rank + 1; no feedback).
2. The higher rank answers with a baidu_std response whose stream_settings give its stream
   (id: its rank + 1) and an empty Ack; or refuses (wrong group, rank, a lane already open)
   with an error and closes the connection.
3. A message is then one or more STRM DATA frames, has_continuation on all but the last. The
   first frame's payload begins with a descriptor (DESCRIPTOR: the exchange's number, the
   elements, the bytes, the dtype's name); the rest is the tensor's bytes, which the kernel
   writes straight into the receiver's tensor.
Messages on a lane arrive in the order sent: an exchange's messages from rank i to rank j are
numbered (the descriptor's part: 0 for all_to_all; a ring's segments in (step, segment) order,
which is the order its sender emits them), and a descriptor that names another exchange,
part, dtype or size is refused.

Everything a peer sends is checked before it is used: a header, meta or descriptor that is
not what is expected, a frame longer than what is left of the message, a CLOSE or RST, or
nothing within the exchange's deadline, fails the exchange with a CollectiveError naming the
peer (logged), and the caller breaks the group: a lane whose framing is lost is not reused.
A lane that closes is a LaneLost: the group asks the peer (Status) whether it died or broke
its group and shut its lanes, and fails with the peer's own error in the second case.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import socket
import struct
import threading
import time
from typing import Any

import numpy as np

from .._fast.meta import RpcMeta, decode_meta, pack_head
from .._proto import collective_pb2 as pb
from ..errors import RemoteProtocolError
from ..protocol import streaming
from ..transport.tcp import RateLimitedLog
from .errors import CollectiveError, CollectiveTimeout

log = logging.getLogger(__name__)

SERVICE_NAME = "aiobrpc.collective.Collective"
METHOD = "Lane"
HEADER = 12
HANDSHAKE_MAX = 4096  # the most bytes of a handshake frame's body a lane port reads
MAX_FRAME_META = 64   # a DATA frame's StreamFrameMeta is at most 4 + 2 * 11 bytes
FRAME_BYTES = 1 << 30  # the most payload one DATA frame carries (body_size is 32 bits)
MAX_DTYPE_NAME = 64
_DESC = struct.Struct("<QIqQB")  # exchange number, part, elements, bytes, dtype name's length
DESCRIPTOR = _DESC.size + MAX_DTYPE_NAME  # 93 bytes, the name zero-padded
HANDSHAKE_TIMEOUT_S = 10.0
REFUSALS_LOGGED_PER_S = 20  # refused connections to a lane port logged each second; the rest counted
INLINE_BYTES = 64 << 10  # messages up to this size are written by the exchange's own thread


class LaneError(RemoteProtocolError):
    """What a peer sent on a lane is not what the protocol allows."""


class LaneLost(CollectiveError):
    """The lane to `peer` closed or failed mid-exchange: the peer died, or it shut its lanes
    because its group broke (the group asks it which)."""

    def __init__(self, message: str, peer: int) -> None:
        super().__init__(message, (peer,))
        self.peer = peer


# -- sans-IO: what goes on the wire and its checks (fuzz/lanes.py feeds these) ----------------

def stream_id(rank: int) -> int:
    return rank + 1


EXCHANGES, MESSAGES = 0, 1  # the kinds of lane: each pair of ranks opens one of each
KINDS = (EXCHANGES, MESSAGES)


def open_request(group: str, src: int, dst: int, kind: int = EXCHANGES) -> bytes:
    """The baidu_std request frame that opens the lane of `kind` from `src` to `dst`."""
    req = pb.LaneRequest(group=group, src=src, dst=dst)
    if kind:
        req.kind = kind
    body = req.SerializeToString()
    meta = RpcMeta()
    meta.has_request = True
    meta.service_name = SERVICE_NAME
    meta.method_name = METHOD
    meta.correlation_id = 1
    meta.stream_settings = streaming.encode_settings(stream_id(src), False, True)
    return pack_head(b"PRPC", meta, len(body)) + body


def open_response(dst: int, error: str = "") -> bytes:
    """The answer of `dst`'s lane port: its stream, or `error` (code EREQUEST) and no stream."""
    meta = RpcMeta()
    meta.has_response = True
    meta.correlation_id = 1
    if error:
        meta.error_code = 1003  # EREQUEST
        meta.error_text = error
        body = pb.Ack(error=error).SerializeToString()
    else:
        meta.stream_settings = streaming.encode_settings(stream_id(dst), False, True)
        body = b""
    return pack_head(b"PRPC", meta, len(body)) + body


def parse_header(head: bytes, magic: bytes, body_max: int) -> tuple[int, int]:
    """(body_size, meta_size) of a 12-byte header that must begin with `magic`."""
    if len(head) != HEADER:
        raise LaneError(f"a header of {len(head)} bytes, not {HEADER}")
    if head[:4] != magic:
        raise LaneError(f"a frame begins with {bytes(head[:4])!r}, not {magic!r}")
    body, meta = int.from_bytes(head[4:8], "big"), int.from_bytes(head[8:12], "big")
    if meta > body:
        raise LaneError(f"meta_size {meta} is larger than body_size {body}")
    if body > body_max:
        raise LaneError(f"a frame of {body} bytes, more than the {body_max} allowed here")
    return body, meta


def _decode(meta_bytes: bytes) -> RpcMeta:
    try:
        return decode_meta(meta_bytes)
    except RemoteProtocolError as e:
        raise LaneError(str(e)) from None


def _settings(raw: bytes) -> int:
    try:
        return streaming.decode_settings(raw).stream_id
    except RemoteProtocolError as e:
        raise LaneError(str(e)) from None


def parse_open_request(meta_bytes: bytes, body: bytes) -> tuple[str, int, int, int, int]:
    """(group, src, dst, src's stream id, kind) of a lane request's meta and body."""
    meta = _decode(meta_bytes)
    if not meta.has_request or (meta.service_name, meta.method_name) != (SERVICE_NAME, METHOD):
        raise LaneError(f"the lane port takes only {SERVICE_NAME}.{METHOD}, got "
                        f"{meta.service_name!r}.{meta.method_name!r}")
    if meta.stream_settings is None:
        raise LaneError("a lane request without stream_settings")
    sid = _settings(meta.stream_settings)
    if meta.attachment_size or meta.compress_type:
        raise LaneError("a lane request with an attachment or compression")
    try:
        req = pb.LaneRequest.FromString(body)
    except Exception as e:  # DecodeError, or a required field missing
        raise LaneError(f"an unparsable LaneRequest ({e})") from None
    if not req.IsInitialized():
        raise LaneError("a LaneRequest without its required fields")
    if req.kind not in KINDS:
        raise LaneError(f"a lane of kind {req.kind}, not one of {KINDS}")
    return req.group, req.src, req.dst, sid, req.kind


def parse_open_response(meta_bytes: bytes, body: bytes) -> int:
    """The accepting rank's stream id, or LaneError with its refusal."""
    meta = _decode(meta_bytes)
    if not meta.has_response or meta.correlation_id != 1:
        raise LaneError("the lane port answered with something else than the lane's response")
    if meta.error_code:
        raise LaneError(f"the lane was refused: [E{meta.error_code}]{meta.error_text}")
    if meta.stream_settings is None:
        raise LaneError("the lane's response has no stream_settings")
    return _settings(meta.stream_settings)


def check_data_meta(meta_bytes: bytes, mine: int, peer: int) -> bool:
    """A DATA frame's StreamFrameMeta addressed from `peer`'s stream to `mine`: its
    has_continuation. Anything else (CLOSE, RST, FEEDBACK, other streams) is a LaneError."""
    try:
        fm = streaming.decode_frame_meta(meta_bytes)
    except RemoteProtocolError as e:
        raise LaneError(str(e)) from None
    if fm.frame_type in (streaming.CLOSE, streaming.RST):
        raise LaneError(f"the peer closed its stream ({streaming.FRAME_TYPE_NAMES[fm.frame_type]})")
    if fm.frame_type != streaming.DATA:
        raise LaneError(f"a {streaming.FRAME_TYPE_NAMES.get(fm.frame_type, fm.frame_type)} frame, "
                        "where only DATA may come")
    if fm.stream_id != mine or fm.source_stream_id != peer:
        raise LaneError(f"a frame from stream {fm.source_stream_id} to {fm.stream_id}, not from "
                        f"{peer} to {mine}")
    return fm.has_continuation


def pack_descriptor(seq: int, part: int, numel: int, nbytes: int, dtype: str) -> bytes:
    name = dtype.encode()
    if len(name) > MAX_DTYPE_NAME:
        raise ValueError(f"dtype name {dtype!r} is longer than {MAX_DTYPE_NAME} bytes")
    return _DESC.pack(seq, part, numel, nbytes, len(name)) + name.ljust(MAX_DTYPE_NAME, b"\0")


def parse_descriptor(raw: bytes) -> tuple[int, int, int, int, str]:
    """(exchange number, part, elements, bytes, dtype name) of a message's DESCRIPTOR bytes.
    `part` numbers the messages of one exchange on one lane, from 0."""
    if len(raw) != DESCRIPTOR:
        raise LaneError(f"a descriptor of {len(raw)} bytes, not {DESCRIPTOR}")
    seq, part, numel, nbytes, n = _DESC.unpack_from(raw)
    return seq, part, numel, nbytes, dtype_name_at(raw, _DESC.size, n)


def dtype_name_at(raw: bytes, at: int, n: int) -> str:
    """The `n`-byte dtype name at `at` of a descriptor or note; LaneError if too long or not ASCII."""
    if n > MAX_DTYPE_NAME:
        raise LaneError(f"a dtype name of {n} bytes, more than {MAX_DTYPE_NAME}")
    try:
        return bytes(raw[at:at + n]).decode("ascii")
    except UnicodeDecodeError:
        raise LaneError("a dtype name that is not ASCII") from None


def frame_head(mine: int, peer: int, payload: int, continues: bool) -> bytes:
    """The header and meta of a DATA frame of `payload` bytes from stream `mine` to `peer`."""
    return _head(streaming.data_meta(peer, mine, continues), payload)


_HEADER = struct.Struct(">4sII")


def _head(meta: bytes, payload: int) -> bytes:
    n = len(meta)
    return _HEADER.pack(b"STRM", n + payload, n) + meta


# -- a lane ------------------------------------------------------------------------------------

class Lane:
    """One end of the lane to `peer`: its socket and both streams' ids."""

    __slots__ = ("peer", "address", "sock", "mine", "theirs", "out_meta", "in_meta")

    def __init__(self, peer: int, address: str, sock: socket.socket, mine: int, theirs: int) -> None:
        self.peer = peer
        self.address = address
        self.sock = sock
        self.mine = mine
        self.theirs = theirs
        # The metas of this lane's DATA frames, last and continued: what this end writes, and
        # what an honest peer writes (recognised without parsing; any other is parsed, checked)
        self.out_meta = (streaming.data_meta(theirs, mine, False), streaming.data_meta(theirs, mine, True))
        self.in_meta = {streaming.data_meta(mine, theirs, False): False, streaming.data_meta(mine, theirs, True): True}


class Deadline:
    __slots__ = ("at", "what")

    def __init__(self, at: float, what: str) -> None:
        self.at = at
        self.what = what

    def left(self) -> float:
        return self.at - time.monotonic()


class Lanes:
    """This rank's lanes to every other rank of a group, opened once (`open`), then used by one
    thread at a time for an exchange (`all_to_all`), a second thread sending while it receives.

    `abort()` (from any thread) shuts every lane down, so a thread blocked on one returns at once.
    """

    def __init__(self, rank: int, world_size: int, host: str) -> None:
        self.group_id = ""  # known once the group's rendezvous gives it, before `open`
        self.rank = rank
        self.world_size = world_size
        self._lanes: list[Lane | None] = [None] * world_size
        self.mail: list[Lane | None] = [None] * world_size  # the lanes of messages (lane_messages.py)
        # Strangers may connect to the lane port while it waits for the ranks: a flood of them logs
        # a bounded number of lines.
        self._refusal_log = RateLimitedLog(log, burst=REFUSALS_LOGGED_PER_S)
        self._listener: socket.socket | None = socket.create_server((host, 0))
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._sender: concurrent.futures.ThreadPoolExecutor | None = None
        self._queued = 0  # writes handed to the sending thread and not yet done
        # where reduced segments are received; kept across exchanges (the lane thread's only),
        # so an all_reduce does not map and fault in a fresh segment-sized buffer each time
        self._scratch: np.ndarray | None = None
        self._aborted: CollectiveError | None = None
        self._lock = threading.Lock()
        self.bytes_received = 0  # straight into the receiver's tensors
        self.segments_placed = 0  # ring segments received into their place in the tensor

    # -- opening -------------------------------------------------------------------------------
    def open(self, addresses: list[str], timeout: float) -> None:
        """Open the lane to every other rank (blocking): connect to the higher ranks' lane
        ports while accepting the lower ranks' on ours; then close our port."""
        deadline = Deadline(time.monotonic() + timeout, "opening the lanes")
        failure: list[BaseException] = []
        acceptor = None
        if self.rank > 0:
            acceptor = threading.Thread(target=self._accept_all, args=(addresses, deadline, failure),
                                        name=f"aiobrpc-lanes-accept-rank{self.rank}", daemon=True)
            acceptor.start()
        try:
            for peer in range(self.rank + 1, self.world_size):
                for kind in KINDS:
                    self._connect(peer, addresses[peer], deadline, kind)
        except BaseException:
            self.abort(CollectiveError(f"rank {self.rank} could not open its lanes"))
            raise
        finally:
            if acceptor is not None:
                acceptor.join()
            self._close_listener()
        if failure:
            self.abort(CollectiveError(f"rank {self.rank} could not open its lanes"))
            raise failure[0]
        self._sender = concurrent.futures.ThreadPoolExecutor(1, f"aiobrpc-lanes-send-rank{self.rank}")

    def _connect(self, peer: int, address: str, deadline: Deadline, kind: int = EXCHANGES) -> None:
        host, _, port = address.rpartition(":")
        try:
            sock = socket.create_connection((host, int(port)), timeout=max(0.001, deadline.left()))
        except OSError as e:
            raise _lost(peer, address, f"its lane port refused or did not answer ({e})", deadline) from None
        try:
            sock.settimeout(None)  # blocking: the deadlines are the kernel's (_arm)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _arm(sock, socket.SO_SNDTIMEO, deadline)
            sock.sendall(open_request(self.group_id, self.rank, peer, kind))
            body_size, meta_size = parse_header(_recv_exact(sock, HEADER, deadline, peer, address),
                                                b"PRPC", HANDSHAKE_MAX)
            body = _recv_exact(sock, body_size, deadline, peer, address)
            theirs = parse_open_response(body[:meta_size], body[meta_size:])
            if theirs != stream_id(peer):
                raise LaneError(f"rank {peer} answered with stream {theirs}, not {stream_id(peer)}")
        except LaneError as e:
            sock.close()
            log.warning("lane to rank %d (%s): %s", peer, address, e)
            raise CollectiveError(f"rank {self.rank} could not open its lane to rank {peer} "
                                  f"({address}): {e}", (peer,)) from None
        except OSError as e:  # reset, or no answer by the deadline (EAGAIN: the kernel's timeout)
            sock.close()
            timed_out = isinstance(e, (TimeoutError, BlockingIOError)) or deadline.left() <= 0
            raise (CollectiveTimeout if timed_out else CollectiveError)(
                f"rank {self.rank} could not open its lane to rank {peer} ({address}): "
                f"{'no answer in time' if timed_out else e}", (peer,)) from None
        except BaseException:
            sock.close()
            raise
        self._table(kind)[peer] = Lane(peer, address, sock, stream_id(self.rank), theirs)

    def _table(self, kind: int) -> list:
        return self.mail if kind == MESSAGES else self._lanes

    def _all(self) -> list[Lane]:
        return [lane for lane in self._lanes + self.mail if lane is not None]

    def _accept_all(self, addresses: list[str], deadline: Deadline, failure: list) -> None:
        waiting = {(r, kind) for r in range(self.rank) for kind in KINDS}
        try:
            while waiting:
                left = deadline.left()
                if left <= 0 or self._aborted is not None:
                    ranks = sorted({r for r, _ in waiting})
                    raise CollectiveTimeout(f"rank {self.rank}: ranks {ranks} did not open their lanes "
                                            f"within the group's timeout", tuple(ranks))
                self._listener.settimeout(min(left, 0.5))
                try:
                    sock, peer_addr = self._listener.accept()
                except TimeoutError:
                    continue
                self._admit(sock, peer_addr, waiting, addresses, deadline)
        except BaseException as e:
            failure.append(e)

    def _admit(self, sock: socket.socket, peer_addr: Any, waiting: set, addresses: list[str],
               deadline: Deadline) -> None:
        """Read one connection's lane request: keep it as the lane of the rank it names, or
        refuse it (logged) and close it; the port goes on waiting for the ranks' lanes."""
        who = f"{peer_addr[0]}:{peer_addr[1]}" if isinstance(peer_addr, tuple) else str(peer_addr)
        hand = Deadline(min(deadline.at, time.monotonic() + HANDSHAKE_TIMEOUT_S), "a lane's handshake")
        try:
            with contextlib.suppress(OSError):  # a socket that is not TCP (the fuzz harness's pair)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(None)  # blocking: the deadlines are the kernel's (_arm)
            _arm(sock, socket.SO_SNDTIMEO, hand)
            body_size, meta_size = parse_header(_recv_exact(sock, HEADER, hand, -1, who), b"PRPC",
                                                HANDSHAKE_MAX)
            body = _recv_exact(sock, body_size, hand, -1, who)
            group, src, dst, theirs, kind = parse_open_request(body[:meta_size], body[meta_size:])
            if group != self.group_id:
                raise LaneError(f"a lane request for group {group[:64]!r}, not this group")
            if dst != self.rank:
                raise LaneError(f"a lane request for rank {dst}, not {self.rank}")
            if (src, kind) not in waiting:
                raise LaneError(f"a lane request from rank {src} (kind {kind}), which is not a lower "
                                "rank still to open that lane")
            if theirs != stream_id(src):
                raise LaneError(f"rank {src} offered stream {theirs}, not {stream_id(src)}")
            sock.sendall(open_response(self.rank))
        except (LaneError, CollectiveError, OSError) as e:
            self._refusal_log(logging.WARNING, "lane port of rank %d: refused a connection from %s: %s",
                              self.rank, who, e)
            if isinstance(e, LaneError):
                try:
                    sock.sendmsg([open_response(self.rank, str(e)[:200])], [], socket.MSG_DONTWAIT)
                except OSError:
                    pass
            sock.close()
            return
        waiting.discard((src, kind))
        self._table(kind)[src] = Lane(src, addresses[src], sock, stream_id(self.rank), theirs)

    def _close_listener(self) -> None:
        with self._lock:
            if self._listener is not None:
                self._listener.close()
                self._listener = None

    # -- exchanging ----------------------------------------------------------------------------
    def all_to_all(self, seq: int, outs: list, ins: list, deadline: Deadline) -> None:
        """Exchange #seq (blocking): `ins[j]` to rank j and `outs[i]` from rank i, each a
        (dtype name, numel, uint8 view) triple; this rank's own part is copied here. Staggered:
        at step k this rank sends to rank + k while receiving from rank - k."""
        me, world = self.rank, self.world_size
        outs[me][2][:] = ins[me][2]
        for k in range(1, world):
            dst, src = (me + k) % world, (me - k) % world
            sending = self.submit_sends(self.lane(dst), seq, 0, [ins[dst]], deadline)
            try:
                self.recv_message(self.lane(src), seq, 0, outs[src], deadline)
            except BaseException as e:
                self.abort(e if isinstance(e, CollectiveError) else CollectiveError(repr(e)))
                if sending is not None:
                    concurrent.futures.wait([sending])
                raise
            if sending is not None:
                sending.result()

    def gather(self, seq: int, mine: tuple, outs: list | None, root: int, deadline: Deadline) -> None:
        """Exchange #seq (blocking): every rank's `mine` into `outs[rank]` on `root`."""
        me = self.rank
        if me != root:
            self.send_message(self.lane(root), seq, 0, mine, deadline)
            return
        outs[me][2][:] = mine[2]
        for r in range(self.world_size):
            if r != me:
                self.recv_message(self.lane(r), seq, 0, outs[r], deadline)

    def scatter(self, seq: int, out: tuple, ins: list | None, root: int, deadline: Deadline) -> None:
        """Exchange #seq (blocking): `ins[rank]` of `root` into every rank's `out`."""
        me = self.rank
        if me != root:
            self.recv_message(self.lane(root), seq, 0, out, deadline)
            return
        futures = []
        try:
            for r in range(self.world_size):
                if r != me:
                    sending = self.submit_sends(self.lane(r), seq, 0, [ins[r]], deadline)
                    if sending is not None:
                        futures.append(sending)
            out[2][:] = ins[me][2]
            for f in futures:
                f.result()
        except BaseException as e:
            self.abort(e if isinstance(e, CollectiveError) else CollectiveError(repr(e)))
            concurrent.futures.wait(futures)
            raise

    def ring(self, seq: int, op: Any, deadline: Deadline) -> None:
        """Run ring collective `op` (ops.RingOp, started here) as exchange #seq (blocking): what
        it emits goes to the right neighbour on the sending thread, in order; what the left
        neighbour sends arrives in the order it emitted it, (step, segment) ascending, each
        segment received into its place in the tensor when it is only copied there, else into
        a scratch buffer that the op reduces from."""
        n, me = self.world_size, self.rank
        right, left = self.lane((me + 1) % n), self.lane((me - 1) % n)
        emitted: list = []
        op.emit = lambda step, segment, data: emitted.append(
            (_dtype_name(data.dtype), data.size, data.reshape(-1).view(np.uint8)))
        futures: list = []
        sent = 0
        scratch = self._scratch
        try:
            op.start()
            step = segment = part = 0
            while True:
                if emitted:
                    sending = self.submit_sends(right, seq, sent, emitted[:], deadline)
                    if sending is not None:
                        futures.append(sending)
                    sent += len(emitted)
                    emitted.clear()
                if op.complete:
                    break
                try:
                    a, b, dtype = op._target(step, segment)
                except ValueError:  # past this step's last segment (or a step of none)
                    if segment == 0 and step > 2 * n:
                        raise CollectiveError(f"{deadline.what}: rank {me} expects no more segments "
                                              f"but has {op.received} of {op.expected}") from None
                    step, segment = step + 1, 0
                    continue
                dtype = np.dtype(dtype)
                dest = op.destination(step, segment, (b - a) * dtype.itemsize)
                if dest is not None:
                    self.segments_placed += 1
                else:
                    if scratch is None or scratch.dtype != dtype or scratch.size < b - a:
                        scratch = self._scratch = np.empty(b - a, dtype)
                    dest = scratch[:b - a]
                self.recv_message(left, seq, part, (_dtype_name(dtype), b - a, dest.view(np.uint8)), deadline)
                op.receive(step, segment, dest)
                part, segment = part + 1, segment + 1
            for f in futures:
                f.result()
        except BaseException as e:
            self.abort(e if isinstance(e, CollectiveError) else CollectiveError(repr(e)))
            concurrent.futures.wait(futures)
            if isinstance(e, ValueError):  # the op refused a segment its sender and we agreed on
                raise CollectiveError(f"{deadline.what} on rank {me}: {e}") from e
            raise
        finally:
            op.emit = _no_emit

    def lane(self, peer: int) -> Lane:
        if self._aborted is not None:
            raise self._aborted
        lane = self._lanes[peer]
        if lane is None:
            raise CollectiveError(f"rank {self.rank} has no lane to rank {peer}", (peer,))
        return lane

    def submit_sends(self, lane: Lane, seq: int, first_part: int, messages: list, deadline: Deadline):
        """Send `messages` ((dtype name, numel, uint8 view) triples) as parts first_part,
        first_part + 1, ... of exchange #seq, after what was submitted before. Called by the
        thread that runs the exchange: when the sending thread is idle, what the socket takes
        at once is written here (no hand-over: a small message goes whole); the rest goes to
        the sending thread, whose future is returned (None when nothing was left). Larger
        messages go to the sending thread whole: the kernel's copy of their bytes then runs
        beside this thread's receiving, not before it."""
        if self._aborted is not None:
            raise self._aborted
        bufs: list = []
        size = 0
        for i, message in enumerate(messages):
            _frames(bufs, lane, seq, first_part + i, message)
            size += len(message[2])
        with self._lock:
            idle = not self._queued
        if idle and size <= INLINE_BYTES:
            try:
                bufs = _write_now(lane.sock, bufs)
            except OSError as e:
                raise self._gone(lane, e, deadline) from None
            if not bufs:
                return None
        with self._lock:
            self._queued += 1
        return self._sender.submit(self._write, lane, bufs, deadline)

    def _write(self, lane: Lane, bufs: list, deadline: Deadline) -> None:
        try:
            for buf in bufs:
                _arm(lane.sock, socket.SO_SNDTIMEO, deadline)  # each send call waits at most what is left
                send_in_pieces(lane.sock, buf)
        except OSError as e:
            raise self._gone(lane, e, deadline) from None
        finally:
            with self._lock:
                self._queued -= 1

    def send_message(self, lane: Lane, seq: int, part: int, message: tuple, deadline: Deadline) -> None:
        """Send `message` as part `part` of exchange #seq and wait until it is written."""
        sending = self.submit_sends(lane, seq, part, [message], deadline)
        if sending is not None:
            sending.result()

    def recv_message(self, lane: Lane, seq: int, part: int, message: tuple, deadline: Deadline) -> None:
        """Receive part `part` of exchange #seq into `message`'s view; its dtype name and element
        count must be the sender's."""
        dtype, numel, buf = message
        view = memoryview(buf).cast("B") if len(buf) else memoryview(bytearray())
        want, got, first = len(view), 0, True
        sock, peer, addr = lane.sock, lane.peer, lane.address
        try:
            while True:
                body, meta_size = parse_header(_recv_exact(sock, HEADER, deadline, peer, addr), b"STRM",
                                               MAX_FRAME_META + DESCRIPTOR + FRAME_BYTES)
                extra = DESCRIPTOR if first else 0
                if meta_size > MAX_FRAME_META or body - meta_size < extra:
                    raise LaneError(f"a DATA frame of {body} bytes with a {meta_size}-byte meta")
                raw = _recv_exact(sock, meta_size + extra, deadline, peer, addr)
                continues = lane.in_meta.get(raw[:meta_size])
                if continues is None:
                    continues = check_data_meta(raw[:meta_size], lane.mine, lane.theirs)
                if first:
                    s, p, n, nbytes, name = parse_descriptor(raw[meta_size:])
                    if s != seq or p != part or name != dtype or n != numel or nbytes != want:
                        raise CollectiveError(
                            f"{deadline.what}: rank {peer} sent exchange #{s}'s part {p}, {n} {name} "
                            f"({nbytes} bytes), where rank {self.rank} receives part {part}, {numel} "
                            f"{dtype} ({want} bytes): every rank must call the same collectives "
                            "with matching sizes")  # no rank is dead or hung: every rank is told
                    first = False
                payload = body - meta_size - extra
                if payload > want - got:
                    raise LaneError(f"{payload} more bytes where {want - got} are left of the message")
                if continues and not payload:  # never sent: each frame that continues carries bytes
                    raise LaneError("an empty frame that says more follow")
                _recv_exact_into(sock, view[got:got + payload], deadline, peer, addr)
                got += payload
                if not continues:
                    break
            if got != want:
                raise LaneError(f"the message ended after {got} of its {want} bytes")
            self.bytes_received += got
        except LaneError as e:
            log.warning("lane from rank %d (%s) to rank %d: %s", peer, addr, self.rank, e)
            raise CollectiveError(f"{deadline.what}: rank {peer} ({addr}) broke the lane protocol: {e}",
                                  (peer,)) from None
        except OSError as e:
            raise self._gone(lane, e, deadline) from None

    def _gone(self, lane: Lane, e: OSError, deadline: Deadline) -> CollectiveError:
        if self._aborted is not None:
            return self._aborted
        if isinstance(e, (TimeoutError, BlockingIOError)) or deadline.left() <= 0:
            return CollectiveTimeout(f"{deadline.what} timed out on rank {self.rank} waiting for rank "
                                     f"{lane.peer} ({lane.address})", (lane.peer,))
        return LaneLost(f"{deadline.what} failed on rank {self.rank}: rank {lane.peer} ({lane.address}) "
                        f"closed its lane or is gone: {e}", lane.peer)

    # -- ending --------------------------------------------------------------------------------
    def abort(self, err: CollectiveError) -> None:
        """Fail what runs and every later exchange with `err`: every lane is shut down."""
        with self._lock:
            if self._aborted is None:
                self._aborted = err
        for lane in self._all():
            try:
                lane.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        """Abort, wait for the sending thread (shut down, its socket calls return at once), then
        close the sockets: never while a thread may still be in a call on one (its descriptor
        could be reused meanwhile). Whoever runs exchanges waits for them before calling this."""
        self.abort(CollectiveError(f"the group was closed on rank {self.rank}"))
        self._close_listener()
        if self._sender is not None:
            self._sender.shutdown(wait=True)
        for lane in self._all():
            lane.sock.close()


def _no_emit(step: int, segment: int, data: Any) -> None:
    raise RuntimeError("the ring collective emitted after its exchange ended")


_DTYPE_NAMES: dict = {}


def _dtype_name(dtype: np.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:  # numpy computes a dtype's name in Python each time; rings carry few dtypes
        name = dtype.name
        if len(_DTYPE_NAMES) < 64:
            _DTYPE_NAMES[dtype] = name
    return name


def _lost(peer: int, address: str, why: str, deadline: Deadline) -> CollectiveError:
    if deadline.left() <= 0:
        return CollectiveTimeout(f"{deadline.what}: rank {peer} ({address}): {why}", (peer,))
    return CollectiveError(f"{deadline.what}: rank {peer} ({address}): {why}", (peer,))


# Lane sockets are blocking, their deadlines the kernel's (SO_RCVTIMEO for the thread that
# reads, SO_SNDTIMEO for the one that writes: each sets its own), and a read waits for all its
# bytes in the kernel (MSG_WAITALL): a 4 MiB segment is one call, not a Python loop over what
# the socket buffer held. A read or write past its deadline fails with EAGAIN; abort() shuts
# the socket down, which ends a waiting read or write at once.
_TIMEVAL = struct.Struct("@ll")


def _arm(sock: socket.socket, option: int, deadline: Deadline) -> None:
    left = deadline.left()
    if left <= 0:
        raise TimeoutError(f"{deadline.what}: no time left")
    sock.setsockopt(socket.SOL_SOCKET, option, timeval(left))


def timeval(seconds: float) -> bytes:
    """A socket timeout option's value for `seconds` > 0 (never {0, 0}, which means none)."""
    sec = int(seconds)
    usec = int((seconds - sec) * 1e6)
    return _TIMEVAL.pack(sec, max(1, usec) if sec == 0 else usec)


def _recv_exact(sock: socket.socket, n: int, deadline: Deadline, peer: int, address: str) -> bytes:
    _arm(sock, socket.SO_RCVTIMEO, deadline)
    got = sock.recv(n, socket.MSG_WAITALL)
    if len(got) == n:
        return got
    if not got:
        raise ConnectionResetError("the peer closed the connection")
    rest = bytearray(n - len(got))  # the deadline passed or a signal came mid-read
    _recv_exact_into(sock, memoryview(rest), deadline, peer, address)
    return got + rest


def _recv_exact_into(sock: socket.socket, view: memoryview, deadline: Deadline, peer: int,
                     address: str) -> None:
    got, n = 0, len(view)
    while got < n:
        _arm(sock, socket.SO_RCVTIMEO, deadline)
        k = sock.recv_into(view[got:], 0, socket.MSG_WAITALL)
        if not k:
            raise ConnectionResetError("the peer closed the connection")
        got += k


def _frames(bufs: list, lane: Lane, seq: int, part: int, message: tuple) -> None:
    """Append to `bufs` what message `message` is on the wire: each DATA frame's header and
    meta (the first with the descriptor), then its slice of the tensor's bytes (a view)."""
    dtype, numel, buf = message
    data = memoryview(buf).cast("B") if len(buf) else memoryview(b"")
    frames(bufs, lane, pack_descriptor(seq, part, numel, len(data), dtype), data)


def frames(bufs: list, lane: Lane, lead: bytes, data: memoryview) -> None:
    """Append to `bufs` the DATA frames of a message: `lead` (its descriptor) then `data`,
    the first frame's header, meta and lead as one buffer, each slice of `data` a view."""
    total = len(data)
    first = min(total, FRAME_BYTES - len(lead))
    bufs.append(_head(lane.out_meta[first < total], len(lead) + first) + lead)
    if first:
        bufs.append(data[:first])
    at = first
    while at < total:
        n = min(FRAME_BYTES, total - at)
        bufs.append(_head(lane.out_meta[at + n < total], n))
        bufs.append(data[at:at + n])
        at += n


_IOV_MAX = 512
# A large buffer is written a piece at a time: while one send() copies, the socket is locked
# and the peer's ACKs wait in its backlog, so one 16 MiB send stalls on a full send buffer.
# Measured on loopback here: 16 MiB one way 2.8-3.1 GB/s as one sendall, 4.2-4.5 GB/s in
# 512 KiB pieces (2 MiB pieces 3.6-4.1), gloo writing 2 MiB at a time.
SEND_CHUNK = 512 << 10


def send_in_pieces(sock: socket.socket, buf: Any) -> None:
    """`sock.sendall(buf)` (a blocking socket) a piece at a time."""
    for piece in pieces(buf):
        sock.sendall(piece)


def pieces(buf: Any) -> Any:
    """`buf` as the pieces of at most SEND_CHUNK bytes to send one after the other."""
    view = memoryview(buf)
    n = view.nbytes
    if n <= SEND_CHUNK:
        return (view,)
    view = view.cast("B")
    return [view[at:at + SEND_CHUNK] for at in range(0, n, SEND_CHUNK)]


def _write_now(sock: socket.socket, bufs: list) -> list:
    """Write what the socket takes without waiting; what is left of `bufs`."""
    while bufs:
        try:
            sent = sock.sendmsg(bufs[:_IOV_MAX], [], socket.MSG_DONTWAIT)
        except BlockingIOError:
            break
        while sent:
            n = len(bufs[0])
            if sent >= n:
                sent -= n
                bufs.pop(0)
            else:
                bufs[0] = memoryview(bufs[0])[sent:]
                sent = 0
    return bufs
