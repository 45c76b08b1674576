"""Harness: a training group's message lanes (aiobrpc/training/lane_messages.py) from a hostile peer.

Each input plays rank 1 against rank 0's `LaneMessages` (a world of 2, eager_bytes 64,
buffer_bytes 256, max_messages 4, timeout 1 s) over a socket pair. Its first six bytes say what
rank 0 posts, and when (a point where the reader waits: what follows does not depend on the
threads' timing):
- byte 0, options: bit 0 a recv from rank 1 on tag 0 of byte 1's size (float32, % 41 elements, or
  uint8 with bit 6, % 161: larger than eager_bytes, it is granted at once, so DATA may come);
  bit 1 a recv from any rank of byte 2's size (float32, % 41 elements; tag 1 with bit 3, else
  tag 0); bit 2 a send to rank 1 on tag 0 of byte 3's size (float32, % 41 elements), EAGER
  where rank 1's credit covers it (bit 4: rank 1 gave its 256 bytes before), else announced;
  bit 5 the recvs and the send time out (`expire`) once posted; bit 7 they are posted once
  the reader has handled the first N bytes rank 1 writes (bytes 4-5, little-endian) and waits
  for more, or ended (messages held, announced or granted before their recv or send; a recv
  posted mid-message), else before the reader starts;
- the rest: what rank 1 writes, after which it shuts its writing side and reads what rank 0
  writes until rank 0 closes.

Checked: the reader ends (EOF or a refusal) within 5 s, having reported; every report is a
CollectiveError naming rank 1 alone, none of a reader that failed (a traceback logged is a
finding too); what rank 1 made rank 0 keep is within the caps (held bytes <= buffer_bytes, held
or announced messages and stored grants <= max_messages) and those counts match the tables;
nothing is written outside a recv's tensor, nor into one that timed out; a recv that completed
holds exactly the payload of the EAGER or DATA message that matched it (an independent reading
of the frames), of its dtype and size; rank 0 writes only well-formed frames, its EAGER or DATA
the send's bytes; `fail_peer` leaves nothing of rank 1 in the tables (but, where it closed
its group with a BYE, the messages it sent whole before, which a recv from it then takes) and
settles what waited on it, `fail_all` the rest, and every thread ends once the lanes are shut.

    python -m fuzz.lane_messages fuzz/corpus/lane_messages -max_total_time=60
    python -m fuzz.lane_messages --seeds fuzz/corpus/lane_messages     # (re)write the seed corpus
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import socket
import struct
import threading
import time

from fuzz import _harness as H

with H.instrumented():
    import numpy as np

    from aiobrpc.training import lane_messages as M
    from aiobrpc.training import lanes as L
    from aiobrpc.training.errors import CollectiveError, CollectiveTimeout

EAGER_BYTES, BUFFER_BYTES, MAX_MESSAGES, TIMEOUT = 64, 256, 4, 1.0
READER_SECONDS = 5.0  # after rank 1 stopped writing, the reader must have ended within this
GUARD = 16  # elements on each side of a recv's tensor, SENTINEL: nothing may write there
SENTINEL = 7
PREFIX = 6
# the note, read here independently of lane_messages.parse_note
_NOTE = struct.Struct("<BBqQqQ")  # kind, dtype name's length, tag, number, elements, bytes
NOTE = _NOTE.size + L.MAX_DTYPE_NAME
KINDS = {1: "EAGER", 2: "ANNOUNCE", 3: "GRANT", 4: "DATA", 5: "REFUSE", 6: "CREDIT", 7: "DECLINE"}
EAGER, ANNOUNCE, GRANT, DATA, REFUSE, CREDIT, DECLINE = range(1, 8)


def _feed(first: bytes, rest: bytes) -> tuple[socket.socket, socket.socket, threading.Thread, threading.Event,
                                              bytearray]:
    """Rank 0's end of a socket pair whose other end (rank 1) writes `first`, then, once told
    (the event), `rest`, shuts its writing side, and reads what rank 0 writes (into the
    bytearray) until rank 0 closes."""
    a, b = socket.socketpair()
    go = threading.Event()
    got = bytearray()

    def peer() -> None:
        try:
            with contextlib.suppress(OSError):  # rank 0 refused the lane (shut it) before the end
                b.sendall(first)
                go.wait(READER_SECONDS * 3)
                b.sendall(rest)
            with contextlib.suppress(OSError):
                b.shutdown(socket.SHUT_WR)
            b.settimeout(READER_SECONDS * 3)
            with contextlib.suppress(OSError):
                while chunk := b.recv(65536):
                    got.extend(chunk)
        finally:
            b.close()

    return a, b, threading.Thread(target=peer, daemon=True), go, got


class _Watched:
    """Rank 0's socket as its reader uses it: `asks` is set once the reader asks for bytes past
    the first `mark` rank 1 writes (it handled all before them, and waits for the rest)."""

    def __init__(self, sock: socket.socket, mark: int) -> None:
        self._sock, self._mark, self._read = sock, mark, 0
        self.asks = threading.Event()

    def _want(self, n: int) -> None:
        if self._read + n > self._mark:
            self.asks.set()

    def recv(self, n: int, flags: int = 0) -> bytes:
        self._want(n)
        got = self._sock.recv(n, flags)
        self._read += len(got)
        return got

    def recv_into(self, buf, nbytes: int = 0, flags: int = 0) -> int:
        self._want(nbytes or len(buf))
        k = self._sock.recv_into(buf, nbytes, flags)
        self._read += k
        return k

    def __getattr__(self, name: str):
        return getattr(self._sock, name)


class _Posted:
    """A recv or the send rank 0 posted, and what the check needs of it."""

    def __init__(self, name: str, future: concurrent.futures.Future, tag: int, seq: int,
                 arr: np.ndarray | None = None, target: np.ndarray | None = None) -> None:
        self.name, self.future, self.tag, self.seq = name, future, tag, seq
        self.arr, self.target = arr, target
        self.expired = self.raised = False

    def state(self) -> str:
        f = self.future
        if self.raised:
            return "raised"
        if not f.done():
            return "waiting"
        if f.exception() is not None:
            e = f.exception()
            return "timeout" if isinstance(e, CollectiveTimeout) else "failed"
        return "ok" if f.result() is None else f"from {f.result()}"


def _tensor(dtype, numel: int) -> tuple[np.ndarray, np.ndarray]:
    arr = np.zeros(numel + 2 * GUARD, dtype)
    arr[:GUARD] = arr[-GUARD:] = SENTINEL
    return arr, arr[GUARD:GUARD + numel]


def _post(m: M.LaneMessages, opts: int, n_recv: int, n_any: int, n_send: int) -> tuple[list[_Posted], bytes]:
    """The recvs and the send the options ask for (a call that raises: a lane already lost),
    then, with bit 5, what timed out taken out and failed as the group does."""
    posted: list[_Posted] = []
    send_bytes = b""

    def call(p: _Posted, fn, *args) -> None:
        try:
            p.future = fn(*args)
        except CollectiveError as e:
            p.raised = True
            p.future.set_exception(e)
        posted.append(p)

    if opts & 1:
        dtype, numel = (np.uint8, n_recv % 161) if opts & 64 else (np.float32, n_recv % 41)
        arr, target = _tensor(dtype, numel)
        call(_Posted("recv", concurrent.futures.Future(), 0, 1, arr, target), m.recv, target, 1, 0)
    if opts & 2:
        tag = 1 if opts & 8 else 0
        arr, target = _tensor(np.float32, n_any % 41)
        took = opts & 1 and tag == 0 and not posted[0].raised
        seq = 2 if took else 1  # the recv from rank 1 took #1 on tag 0
        call(_Posted("any", concurrent.futures.Future(), tag, seq, arr, target), m.recv, target, None, tag)
    if opts & 4:
        if opts & 16:
            with m._lock:
                m._peers[1].credit = max(m._peers[1].credit, BUFFER_BYTES)  # as rank 1's first CREDIT gives it
        tensor = np.arange(1, n_send % 41 + 1, dtype=np.float32)
        send_bytes = tensor.tobytes()
        call(_Posted("send", concurrent.futures.Future(), 0, 1), m.send, tensor, 1, 0)
    if opts & 32:
        timed_out = m.expire(time.monotonic() + 10 * TIMEOUT)
        for r in timed_out:  # the group fails them (after asking their source why)
            r.future.set_exception(CollectiveTimeout("fuzz: the recv timed out", (1,)))
        for p in posted:
            p.expired = any(r.future is p.future for r in timed_out)
    return posted, send_bytes


def _one(data: bytes) -> str:
    if len(data) < PREFIX:
        return "short"
    opts, n_recv, n_any, n_send = data[:4]
    late = bool(opts & 128)
    raw = data[PREFIX:]
    mark = min(int.from_bytes(data[4:6], "little"), len(raw)) if late else 0
    sock, peer_sock, peer_thread, go, out = _feed(raw[:mark], raw[mark:])
    watched = _Watched(sock, mark)
    lane = L.Lane(1, "peer1", watched, L.stream_id(0), L.stream_id(1))
    reports: list = []
    m = M.LaneMessages(0, 2, [None, lane], ["rank0", "peer1"], timeout=TIMEOUT, eager_bytes=EAGER_BYTES,
                       buffer_bytes=BUFFER_BYTES, max_messages=MAX_MESSAGES,
                       report=lambda e, fatal: reports.append((e, fatal)))
    posted: list[_Posted] = []
    send_bytes = b""
    started = done = False

    def finish() -> None:  # what the group does when it closes: idempotent, also after a finding
        nonlocal done
        if done:
            return
        done = True
        go.set()
        m.fail_all(CollectiveError("fuzz over"))
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        m.join(READER_SECONDS)
        sock.close()
        if started:
            peer_thread.join(READER_SECONDS)
        else:
            peer_sock.close()

    try:
        if not late:
            posted, send_bytes = _post(m, opts, n_recv, n_any, n_send)
        m.start()
        peer_thread.start()
        started = True
        if late:  # posted once the reader handled the first `mark` bytes and waits for more (or ended)
            reader = m._peers[1].reader
            end = time.monotonic() + READER_SECONDS
            while not watched.asks.wait(0.002) and reader.is_alive() and time.monotonic() < end:
                pass
            if not watched.asks.is_set() and reader.is_alive():
                raise H.Finding(f"reader hangs: it neither ended nor asked for more than the first {mark} bytes")
            posted, send_bytes = _post(m, opts, n_recv, n_any, n_send)
        go.set()
        outcome = _check(m, posted, reports, send_bytes)
        finish()
        for t in [m._writer, m._peers[1].reader]:
            if t is not None and t.is_alive():
                raise H.Finding(f"{t.name} still runs after fail_all and the lane's shutdown")
        _check_reports(reports)
        for p in posted:
            if not p.future.done():
                raise H.Finding(f"the {p.name} still waits after fail_all (rank 1's reports: "
                                f"{'; '.join(str(e) for e, _ in reports)})")
            if p.arr is not None:
                _check_tensor(p, raw)
        return outcome + "; wrote " + _written(bytes(out), send_bytes)
    finally:
        finish()


def _check(m: M.LaneMessages, posted: list[_Posted], reports: list, send_bytes: bytes) -> str:
    peer = m._peers[1]
    peer.reader.join(READER_SECONDS)
    if peer.reader.is_alive():
        raise H.Finding(f"reader hangs: still running {READER_SECONDS:g} s after rank 1 stopped writing")
    if not reports:
        raise H.Finding("the reader ended without reporting the lane")
    _check_reports(reports)
    with m._lock:
        held = [h for q in m._unmatched.values() for (src, _), h in q.items() if src == 1]
        held_bytes = sum(h.nbytes for h in held if h.data is not None)
        if any(h.data is not None and h.data.nbytes != h.nbytes for h in held):
            raise H.Finding("a held message's buffer is not its size")
        grants = sum(1 for k in m._grants if k[0] == 1)
        counts = (m.held_bytes()[1], m.unmatched_count()[1], peer.grants)
    if counts[0] > BUFFER_BYTES or counts[1] > MAX_MESSAGES or counts[2] > MAX_MESSAGES:
        raise H.Finding(f"past the caps: {counts[0]} bytes held, {counts[1]} messages held or announced, "
                        f"{counts[2]} grants kept from rank 1")
    if counts != (held_bytes, len(held), grants):
        raise H.Finding(f"the counts {counts} do not match the tables {(held_bytes, len(held), grants)}")
    for p in posted:
        if p.name == "send" and not p.future.done() and (1, 0, 1) not in m._pending and (0, 1) not in peer.stalled:
            with contextlib.suppress(Exception):
                p.future.result(READER_SECONDS)  # granted: being written by the writing thread
    states = " ".join(f"{p.name} {p.state()}" for p in posted)
    end = "refused" if any(fatal for _, fatal in reports) else "closed"
    # the group learns the lane is lost: what waits on rank 1 fails, nothing of it is kept but,
    # where rank 1 closed its group (a BYE, no error), the messages it sent whole before
    bye = m.left(1)
    closed = type(bye) is M.PeerClosed
    m.fail_peer(1, bye if closed else CollectiveError("fuzz: rank 1 is lost", (1,)))
    with m._lock:
        kept = [h for q in m._unmatched.values() for (src, _), h in q.items() if src == 1]
        left = ([k for q in m._unmatched.values() for k, h in q.items()
                 if k[0] == 1 and not (closed and h.data is not None)]
                + [k for k in m._grants if k[0] == 1] + [k for k in m._pending if k[0] == 1]
                + [k for k in m._recvs if k[0] == 1])
        counts = (m.held_bytes()[1], m.unmatched_count()[1], peer.grants)
    if left or counts != (sum(h.nbytes for h in kept), len(kept), 0):
        raise H.Finding(f"fail_peer left rank 1's entries {left[:4]} or counts {counts} for {len(kept)} kept")
    if closed:  # a recv from rank 1 takes what it sent whole before it left
        for tag, q in list(m._unmatched.items()):
            h = q.get((1, m._next_match.get((1, tag), 1)))
            if h is None or h.data is None:
                continue
            try:
                dt = np.dtype(h.dtype)
            except TypeError:  # bfloat16: numpy has none
                continue
            if dt.itemsize * h.numel != h.nbytes:
                continue
            want, arr = bytes(h.data), np.zeros(h.numel, dt)
            try:
                got = m.recv(arr, 1, tag).result(READER_SECONDS)
            except (CollectiveError, concurrent.futures.TimeoutError) as e:
                raise H.Finding(f"a recv after rank 1 closed failed on a message it sent whole before: {e!r}")
            if got != 1 or arr.tobytes() != want:
                raise H.Finding("a recv after rank 1 closed did not get the message it sent whole before")
            break
    for p in posted:
        if p.name != "any" and not p.future.done():
            raise H.Finding(f"the {p.name} still waits after fail_peer (rank 1's reports: "
                            f"{'; '.join(str(e) for e, _ in reports)})")
    return f"{end}; {states or 'nothing posted'}; kept {counts[0]}/{counts[1]}/{counts[2]}"


def _check_reports(reports: list) -> None:
    for e, _ in list(reports):
        if not isinstance(e, CollectiveError) or e.ranks != (1,) or "rank 1" not in str(e):
            raise H.Finding(f"a report that does not name rank 1 alone: {type(e).__name__} "
                            f"{getattr(e, 'ranks', None)} {e}")
        if "the reader failed" in str(e):
            raise H.Finding(f"the reader failed: {e}")


def _check_tensor(p: _Posted, raw: bytes) -> None:
    if (p.arr[:GUARD] != SENTINEL).any() or (p.arr[-GUARD:] != SENTINEL).any():
        raise H.Finding(f"bytes written outside the {p.name}'s tensor")
    got = p.target.view(np.uint8).tobytes()
    if p.expired:
        if any(got):
            raise H.Finding(f"bytes written into the {p.name}'s tensor after it timed out")
        if p.future.exception() is None:
            raise H.Finding(f"the {p.name} completed after it timed out")
        return
    if p.future.exception() is not None:
        return  # failed: what it holds is the caller's to ignore
    if p.future.result() != 1:
        raise H.Finding(f"the {p.name} completed from rank {p.future.result()}, not 1")
    msg = next((x for x in _messages(raw) if (x[1], x[2]) == (p.tag, p.seq)), None)
    if msg is None:
        raise H.Finding(f"the {p.name} completed with no message #{p.seq} on tag {p.tag} in rank 1's bytes")
    kind, _, _, numel, nbytes, dtype, payload, whole = msg
    if (dtype, numel, nbytes) != (p.target.dtype.name, p.target.size, p.target.nbytes) or not whole:
        raise H.Finding(f"the {p.name} of {p.target.size} {p.target.dtype.name} completed from a "
                        f"{'whole' if whole else 'cut'} {KINDS[kind]} of {numel} {dtype} ({nbytes} bytes)")
    if got != payload:
        raise H.Finding(f"the {p.name}'s tensor does not hold the payload of {KINDS[kind]} #{p.seq}")


def _messages(raw: bytes) -> list[tuple]:
    """(kind, tag, number, elements, bytes, dtype, payload, whole) of rank 1's EAGER and DATA
    messages, in order, as an independent reading of its frames gives them; it stops where
    they stop being well-formed."""
    out: list[tuple] = []
    at = 0

    def frame() -> tuple[bytes, bytes, bool, bool] | None:
        """(meta, payload, has_continuation, whole) of the frame at `at` (a cut one: what there is)."""
        nonlocal at
        if at + 12 > len(raw) or raw[at:at + 4] != b"STRM":
            return None
        body, meta = struct.unpack(">II", raw[at + 4:at + 12])
        if meta > body or at + 12 + meta > len(raw) or meta > L.MAX_FRAME_META:
            return None
        try:
            cont = L.check_data_meta(raw[at + 12:at + 12 + meta], 1, 2)
        except L.LaneError:
            return None
        f = raw[at + 12:at + 12 + meta], raw[at + 12 + meta:at + 12 + body], cont, at + 12 + body <= len(raw)
        at += 12 + body
        return f

    while True:
        f = frame()
        if f is None or len(f[1]) < NOTE:
            return out
        _, body, cont, whole = f
        kind, n, tag, seq, numel, nbytes = _NOTE.unpack_from(body)
        dtype = body[_NOTE.size:_NOTE.size + min(n, L.MAX_DTYPE_NAME)].decode("ascii", "replace")
        payload = bytearray(body[NOTE:])
        while cont and whole:
            f = frame()
            if f is None:
                whole = False
                break
            payload += f[1]
            cont, whole = f[2], f[3]
        if kind in (EAGER, DATA):
            out.append((kind, tag, seq, numel, nbytes, dtype, bytes(payload), whole and len(payload) == nbytes))
        if not whole:
            return out


def _written(raw: bytes, send_bytes: bytes) -> str:
    """Rank 0's notes to rank 1, in order (repeats counted): each frame well-formed, addressed
    from its stream to rank 1's, an EAGER's or DATA's payload the send's bytes."""
    kinds: list[str] = []
    at = 0
    while at < len(raw):
        if len(raw) - at < 12:
            kinds.append("cut")  # a write cut by the lane's shutdown
            break
        if raw[at:at + 4] != b"STRM":
            raise H.Finding(f"rank 0 wrote a frame that begins with {raw[at:at + 4]!r}")
        body, meta = struct.unpack(">II", raw[at + 4:at + 12])
        if at + 12 + body > len(raw):
            kinds.append("cut")
            break
        cont = _rank0_meta(raw[at + 12:at + 12 + meta], meta, body)
        note = raw[at + 12 + meta:at + 12 + meta + NOTE]
        if len(note) != NOTE or note[0] not in KINDS:
            raise H.Finding(f"rank 0 wrote a frame of {body} bytes without a note")
        kind, nbytes = note[0], _NOTE.unpack_from(note)[5]
        payload = bytearray(raw[at + 12 + meta + NOTE:at + 12 + body])
        at += 12 + body
        while cont and at + 12 <= len(raw):
            body, meta = struct.unpack(">II", raw[at + 4:at + 12])
            if raw[at:at + 4] != b"STRM" or at + 12 + body > len(raw):
                raise H.Finding("rank 0 wrote a continued frame that is not one")
            cont = _rank0_meta(raw[at + 12:at + 12 + meta], meta, body)
            payload += raw[at + 12 + meta:at + 12 + body]
            at += 12 + body
        if kind in (EAGER, DATA) and (bytes(payload) != send_bytes or nbytes != len(send_bytes)):
            raise H.Finding(f"rank 0's {KINDS[kind]} does not carry the send's bytes")
        if kind not in (EAGER, DATA) and payload:
            raise H.Finding(f"rank 0 wrote a {KINDS[kind]} with data")
        name = KINDS[kind]
        if kinds and kinds[-1].split("x")[0] == name:
            n = int(kinds[-1].split("x")[1]) if "x" in kinds[-1] else 1
            kinds[-1] = f"{name}x{n + 1}"
        else:
            kinds.append(name)
    return ",".join(kinds) or "nothing"


def _rank0_meta(meta_bytes: bytes, meta: int, body: int) -> bool:
    if meta > body:
        raise H.Finding(f"rank 0 wrote a frame whose meta ({meta} bytes) passes its body ({body})")
    try:
        return L.check_data_meta(meta_bytes, 2, 1)
    except L.LaneError as e:
        raise H.Finding(f"rank 0 wrote a frame rank 1's lane refuses: {e}") from None


# -- seeds ---------------------------------------------------------------------------------------
def _note(kind: int, tag: int = 0, seq: int = 1, numel: int = 0, nbytes: int = 0, dtype: str = "") -> bytes:
    name = dtype.encode()
    return _NOTE.pack(kind, len(name), tag, seq, numel, nbytes) + name.ljust(L.MAX_DTYPE_NAME, b"\0")


def _msg(kind: int, tag: int = 0, seq: int = 1, numel: int = 0, nbytes: int = 0, dtype: str = "",
         data: bytes = b"", split: int | None = None) -> bytes:
    """Rank 1's frames of a note (and its data): one frame, or two cut at `split`."""
    note = _note(kind, tag, seq, numel, nbytes, dtype)
    if split is None:
        return L.frame_head(2, 1, NOTE + len(data), False) + note + data
    return (L.frame_head(2, 1, NOTE + split, True) + note + data[:split]
            + L.frame_head(2, 1, len(data) - split, False) + data[split:])


_REASON_1 = bytes([1, 1, 0, 0, 0, 1, 0, 0, 0]) + b"all_reduce #2 timed out on rank 1: rank 1 did not answer"


def _f32(n: int, start: int = 0) -> bytes:
    return np.arange(start, start + n, dtype=np.float32).tobytes()


def seeds() -> dict[str, bytes]:
    """Honest and near-honest inputs: prefix (options, recv size, any size, send size), then rank 1's frames."""
    from aiobrpc.protocol import streaming

    def p(opts: int, n_recv: int = 0, n_any: int = 0, n_send: int = 0, mark: int = 0) -> bytes:
        return bytes((opts, n_recv, n_any, n_send)) + mark.to_bytes(2, "little")

    eager4 = _msg(EAGER, 0, 1, 4, 16, "float32", _f32(4))
    data30 = _f32(30, 5)
    return {
        "credit": p(0) + _msg(CREDIT, nbytes=1000),
        "eager_into_recv": p(1, 4) + eager4,
        "eager_into_recv_continued": p(1, 4) + _msg(EAGER, 0, 1, 4, 16, "float32", _f32(4), split=6),
        "eager_into_recv_wrong_size": p(1, 4) + _msg(EAGER, 0, 1, 5, 20, "float32", _f32(5)),
        "eager_into_uint8_recv": p(1 | 64, 7) + _msg(EAGER, 0, 1, 7, 7, "uint8", b"abcdefg"),
        "eager_held": p(0) + eager4,
        "eager_held_twice": p(0) + eager4 + eager4,
        "eager_held_past_max_messages": p(0) + b"".join(_msg(EAGER, t, 1, 4, 16, "float32", _f32(4))
                                                        for t in range(5)),
        "eager_past_the_credit": p(0) + b"".join(_msg(EAGER, t, 1, 40, 160, "float32", _f32(40))
                                                 for t in range(2)),
        "eager_into_any": p(2, 0, 4) + eager4,
        "eager_into_any_and_recv": p(3, 4, 4) + _msg(EAGER, 0, 2, 4, 16, "float32", _f32(4, 9)) + eager4,
        "eager_into_any_other_tag": p(2 | 8, 0, 4) + _msg(EAGER, 1, 1, 4, 16, "float32", _f32(4)),
        "announce_any": p(2, 0, 30) + _msg(ANNOUNCE, 0, 1, 30, 120, "float32"),
        "announce_any_then_data": p(2, 0, 30) + _msg(ANNOUNCE, 0, 1, 30, 120, "float32")
        + _msg(DATA, 0, 1, 30, 120, "float32", data30),
        "announce_any_wrong_size": p(2, 0, 30) + _msg(ANNOUNCE, 0, 1, 31, 124, "float32"),
        "announce_held": p(0) + _msg(ANNOUNCE, 0, 1, 30, 120, "float32"),
        "announce_small_recv": p(1, 4) + _msg(ANNOUNCE, 0, 1, 4, 16, "float32")
        + _msg(DATA, 0, 1, 4, 16, "float32", _f32(4)),
        "data_granted": p(1, 30) + _msg(DATA, 0, 1, 30, 120, "float32", data30),
        "data_granted_continued": p(1, 30) + _msg(DATA, 0, 1, 30, 120, "float32", data30, split=50),
        "data_granted_cut": p(1, 30) + _msg(DATA, 0, 1, 30, 120, "float32", data30)[:-10],
        # posted once the reader handled the first bytes (bit 7; bytes 4-5: how many)
        "late_recv_takes_held_eager": p(1 | 128, 4, mark=len(eager4)) + eager4,
        "late_recv_takes_held_eager_wrong_size": p(1 | 128, 4, mark=138) + _msg(EAGER, 0, 1, 5, 20, "float32", _f32(5)),
        "late_any_takes_held_eager": p(2 | 128, 0, 4, mark=2 * len(eager4))
        + _msg(EAGER, 0, 2, 4, 16, "float32", _f32(4, 3)) + eager4,
        "late_recv_and_any_take_held_eagers": p(3 | 128, 4, 4, mark=2 * len(eager4))
        + _msg(EAGER, 0, 2, 4, 16, "float32", _f32(4, 3)) + eager4,
        "late_recv_takes_held_announce": p(1 | 128, 30, mark=len(_msg(ANNOUNCE)))
        + _msg(ANNOUNCE, 0, 1, 30, 120, "float32") + _msg(DATA, 0, 1, 30, 120, "float32", data30),
        "late_any_takes_held_announce_wrong_size": p(2 | 128, 0, 30, mark=len(_msg(ANNOUNCE)))
        + _msg(ANNOUNCE, 0, 1, 31, 124, "float32"),
        "late_send_takes_kept_grant": p(4 | 128, 0, 0, 30, mark=len(_msg(GRANT)))
        + _msg(GRANT, 0, 1, 30, 120, "float32"),
        "late_send_takes_kept_grant_wrong_size": p(4 | 128, 0, 0, 30, mark=len(_msg(GRANT)))
        + _msg(GRANT, 0, 1, 29, 116, "float32"),
        "late_send_on_credit": p(4 | 128, 0, 0, 4, mark=len(_msg(CREDIT))) + _msg(CREDIT, nbytes=256),
        "late_any_mid_note": p(2 | 128, 0, 4, mark=60) + eager4,
        "late_recv_mid_message": p(2 | 128, 0, 4, mark=len(eager4) + 30)
        + _msg(EAGER, 0, 1, 4, 16, "float32", _f32(4), split=6) + _msg(EAGER, 0, 2, 4, 16, "float32", _f32(4)),
        "late_while_the_reader_waits_then_a_refusal": p(1 | 2 | 4 | 128, 4, 4, 4, mark=100) + b"PRPC" + eager4[4:],
        "late_after_a_refusal": p(1 | 2 | 4 | 128, 4, 4, 4, mark=len(eager4)) + b"PRPC" + eager4[4:],
        "late_any_takes_held_eager_after_a_refusal": p(1 | 2 | 128, 4, 4, mark=len(eager4) + 118)
        + eager4 + b"PRPC" + bytes(114),
        "late_after_the_end": p(1 | 2 | 4 | 32 | 128, 30, 4, 30, mark=1000) + eager4,
        # defects found (lane_messages.py): a recv posted while a held EAGER message is still being
        # read, or after its read failed (the lane broken mid-message), takes it at once, its bytes
        # not all in; a DATA that does not fit its granted recv
        # leaves that recv waiting for ever (taken out of the table before the check raises);
        # credit owed past 2**64-1 (a placed EAGER of 16 bytes, then one that claims 2**64-1
        # bytes) breaks the CREDIT note's packing: the reader fails
        "regress_recv_takes_held_eager_mid_read": p(2 | 128, 0, 4, mark=NOTE + 26)
        + _msg(EAGER, 0, 1, 4, 16, "float32", bytes.fromhex("0000c03f0000204100009a4200001643"), split=6),
        "regress_any_takes_held_eager_cut_by_a_refusal": p(2 | 128, 0, 4, mark=NOTE + 26 + 12)
        + _msg(EAGER, 0, 1, 4, 16, "float32", bytes.fromhex("0000c03f0000204100009a4200001643"), split=6)[:NOTE + 26]
        + b"PRPC" + bytes(8),
        "regress_data_unfit_for_its_grant": p(1, 30) + _msg(DATA, 0, 1, 31, 124, "float32", _f32(31)),
        "regress_credit_owed_overflow": p(3 | 8, 4, 4) + eager4 + _msg(EAGER, 1, 1, 4, (1 << 64) - 1, "float32"),
        "data_not_granted": p(0) + _msg(DATA, 0, 1, 2, 8, "float32", _f32(2)),
        "data_after_timeout": p(1 | 32, 30) + _msg(DATA, 0, 1, 30, 120, "float32", data30),
        "eager_after_timeout": p(1 | 2 | 32, 4, 4) + eager4 + _msg(EAGER, 0, 2, 4, 16, "float32", _f32(4)),
        "grant_for_the_send": p(4, 0, 0, 30) + _msg(GRANT, 0, 1, 30, 120, "float32"),
        "grant_for_the_send_wrong_size": p(4, 0, 0, 30) + _msg(GRANT, 0, 1, 31, 124, "float32"),
        "grant_kept": p(0) + _msg(GRANT, 0, 1, 30, 120, "float32"),
        "grant_twice": p(0) + _msg(GRANT, 0, 1, 30, 120, "float32") * 2,
        "grants_past_max_messages": p(0) + b"".join(_msg(GRANT, t, 1, 1, 4, "float32") for t in range(5)),
        "send_eager_on_credit": p(4 | 16, 0, 0, 4) + _msg(CREDIT, nbytes=16),
        "send_after_timeout": p(4 | 32, 0, 0, 30) + _msg(GRANT, 0, 1, 30, 120, "float32"),
        # BYE (kind 8): a closed group; a broken one, without and with its reason (timed out,
        # ranks, text); a reason naming a rank past the world
        "bye_closed_with_a_recv_waiting": p(1, 4) + _msg(8, 0, 0),
        "bye_closed_after_held_messages": p(0) + eager4 + _msg(EAGER, 1, 1, 4, 16, "float32", _f32(4, 3))
        + _msg(ANNOUNCE, 2, 1, 30, 120, "float32") + _msg(8, 0, 0),
        "bye_broke_without_a_reason": p(1 | 4, 4, 0, 4) + _msg(8, 0, 0, 1),
        "bye_broke_with_its_reason": p(1 | 2 | 4, 4, 4, 4) + _msg(8, 0, 0, 1, len(_REASON_1), "", _REASON_1),
        "bye_broke_reason_past_the_world": p(1, 4) + _msg(8, 0, 0, 1, 9, "", bytes([0, 1, 0, 0, 0, 5, 0, 0, 0])),
        "refuse_the_send": p(4, 0, 0, 30) + _msg(REFUSE, 0, 1, 31, 124, "float32"),
        "refuse_sent_already": p(0) + _msg(REFUSE, 0, 1, 31, 124, "float32"),
        "decline_granted": p(1, 30) + _msg(DECLINE, 0, 1, 31, 124, "float32"),
        "decline_nothing_granted": p(0) + _msg(DECLINE, 0, 1, 31, 124, "float32"),
        "note_with_data": p(0) + _msg(GRANT, 0, 1, 1, 4, "float32", b"xxxx"),
        "note_unknown_kind": p(0) + _msg(9, 0, 1),
        "note_numbered_0": p(0) + _msg(ANNOUNCE, 0, 0, 1, 4, "float32"),
        "wrong_meta_other_stream": p(1, 4) + L.frame_head(3, 1, NOTE + 16, False) + eager4[-NOTE - 16:],
        "wrong_meta_size": p(1, 4) + L._head(streaming.data_meta(1, 200, False), NOTE + 16) + eager4[-NOTE - 16:],
        "bad_magic": p(1, 4) + b"PRPC" + eager4[4:],
        "close_frame": p(1, 4) + streaming.close_frame(1, 2),
        "close_frame_then_more": p(1, 4) + streaming.close_frame(1, 2) + eager4,
        "empty_frame_that_continues": p(1, 30) + L.frame_head(2, 1, NOTE, True) + _note(DATA, 0, 1, 30, 120, "float32")
        + L.frame_head(2, 1, 0, True) + L.frame_head(2, 1, 120, False) + data30,
    }


def one_input(data: bytes) -> str:
    return H.plain(_one, data)


if __name__ == "__main__":
    H.main(one_input, seeds)
