"""Harness: a training group's lanes (aiobrpc/training/lanes.py) from a hostile peer.

Each input is what a peer writes on one end of a socket pair, after which it closes its
writing side, played against one of three readers (the input's first byte chooses):
- the lane port's handshake (`Lanes._admit`, rank 1 of 2 waiting for rank 0's request);
- a lane's message (`Lanes.recv_message`, part 0 of exchange #5, a float32 or uint8 tensor of 0 to 70 elements
  the next bytes choose), received into a view with guard bytes on both sides;
- the opening rank's reading of the answer (`parse_header` and `parse_open_response`).

Checked: each ends (the deadline is 1 s) with a lane admitted, a tensor filled, or the
documented refusal (a LaneError or a CollectiveError naming rank 0, the connection closed);
nothing is written outside the tensor; an admitted lane came from a request that names this
group and ranks 0 -> 1; a filled tensor holds exactly the DATA frames' payload after the
descriptor.

    python -m fuzz.lanes fuzz/corpus/lanes -max_total_time=60
    python -m fuzz.lanes --seeds fuzz/corpus/lanes     # (re)write the seed corpus
"""

from __future__ import annotations

import socket
import threading
import time

from fuzz import _harness as H

with H.instrumented():
    import numpy as np

    from aiobrpc.training import lanes as L
    from aiobrpc.training.errors import CollectiveError

GROUP = "fuzzgroup"
GUARD = 16


def _feed(data: bytes) -> tuple[socket.socket, threading.Thread]:
    """The reading end of a socket pair whose other end writes `data`, then stops writing."""
    a, b = socket.socketpair()

    def write() -> None:  # a peer that then reads what it is answered until the reader closes
        try:
            b.sendall(data)
            b.shutdown(socket.SHUT_WR)
            b.settimeout(5)
            while b.recv(4096):
                pass
        except OSError:  # the reader closed first
            pass
        finally:
            b.close()

    t = threading.Thread(target=write, daemon=True)
    t.start()
    return a, t


def handshake(data: bytes) -> str:
    lanes = L.Lanes(1, 2, "127.0.0.1")
    lanes.group_id = GROUP
    sock, writer = _feed(data)
    expected = {(0, kind) for kind in L.KINDS}
    waiting = set(expected)
    try:
        lanes._admit(sock, ("fuzz", 0), waiting, ["127.0.0.1:1", "127.0.0.1:2"],
                     L.Deadline(time.monotonic() + 1.0, "fuzz"))
        admitted = lanes._lanes[0] is not None or lanes.mail[0] is not None
        if admitted:
            body_size, meta_size = L.parse_header(data[:L.HEADER], b"PRPC", L.HANDSHAKE_MAX)
            body = data[L.HEADER:L.HEADER + body_size]
            group, src, dst, sid, kind = L.parse_open_request(body[:meta_size], body[meta_size:])
            if (group, src, dst, sid) != (GROUP, 0, 1, 1) or waiting != expected - {(0, kind)}:
                raise H.Finding(f"admitted a lane from a request for {group!r} {src} -> {dst} stream {sid} "
                                f"kind {kind}")
            if (lanes._lanes[0] is not None, lanes.mail[0] is not None) != (kind == L.EXCHANGES, kind == L.MESSAGES):
                raise H.Finding(f"a lane of kind {kind} was kept as the other kind")
        elif waiting != expected:
            raise H.Finding("a refused connection was counted as rank 0's lane")
        return "admitted" if admitted else "refused"
    finally:
        lanes.close()
        sock.close()
        writer.join(5)


def message(data: bytes) -> str:
    if len(data) < 2:
        return "short"
    dtype = "float32" if data[0] & 1 else "uint8"
    numel = data[1] % 71
    arr = np.zeros(numel + 2 * GUARD, np.uint8 if dtype == "uint8" else np.float32)
    arr[:GUARD] = arr[-GUARD:] = 7
    target = arr[GUARD:GUARD + numel]
    buf = target.view(np.uint8)
    lanes = L.Lanes(0, 2, "127.0.0.1")
    sock, writer = _feed(data[2:])
    lane = L.Lane(1, "peer", sock, L.stream_id(0), L.stream_id(1))
    lanes._lanes[1] = lane
    try:
        try:
            lanes.recv_message(lane, 5, 0, (dtype, numel, buf), L.Deadline(time.monotonic() + 1.0, "fuzz #5"))
            outcome = "filled"
        except CollectiveError as e:
            if e.ranks not in ((1,), ()) or "rank 1" not in str(e):
                raise H.Finding(f"a refusal that does not name the peer: {e.ranks} {e}") from None
            outcome = "refused"
        if (arr[:GUARD] != 7).any() or (arr[-GUARD:] != 7).any():
            raise H.Finding("bytes written outside the tensor")
        if outcome == "filled" and bytes(buf) != _payload(data[2:]):
            raise H.Finding("the tensor does not hold the frames' payload")
        return outcome
    finally:
        lanes.close()
        sock.close()
        writer.join(5)


def _payload(raw: bytes) -> bytes:
    """The message's bytes as an independent reading of the frames gives them."""
    out, at, first = bytearray(), 0, True
    while True:
        body = int.from_bytes(raw[at + 4:at + 8], "big")
        meta = int.from_bytes(raw[at + 8:at + 12], "big")
        start = at + 12 + meta + (L.DESCRIPTOR if first else 0)
        out += raw[start:at + 12 + body]
        cont = L.check_data_meta(raw[at + 12:at + 12 + meta], 1, 2)
        at += 12 + body
        first = False
        if not cont:
            return bytes(out)


def answer(data: bytes) -> str:
    try:
        body_size, meta_size = L.parse_header(data[:L.HEADER], b"PRPC", L.HANDSHAKE_MAX)
        body = data[L.HEADER:L.HEADER + body_size]
        if len(body) != body_size:
            return "short"
        return f"stream {L.parse_open_response(body[:meta_size], body[meta_size:])}"
    except L.LaneError:
        return "refused"


def seeds() -> dict[str, bytes]:
    """Honest and near-honest inputs for each reader."""
    from aiobrpc.protocol import streaming

    req = L.open_request(GROUP, 0, 1)
    desc = L.pack_descriptor(5, 0, 3, 12, "float32")
    data = np.arange(3, dtype=np.float32).tobytes()
    whole = L.frame_head(2, 1, L.DESCRIPTOR + 12, False) + desc + data
    split = (L.frame_head(2, 1, L.DESCRIPTOR + 4, True) + desc + data[:4]
             + L.frame_head(2, 1, 8, False) + data[4:])
    return {
        "handshake_honest": b"\0" + req,
        "handshake_other_group": b"\0" + L.open_request("other", 0, 1),
        "handshake_wrong_rank": b"\0" + L.open_request(GROUP, 1, 1),
        "handshake_truncated": b"\0" + req[:20],
        "handshake_response_instead": b"\0" + L.open_response(0),
        "message_float32_whole": b"\1\1\3" + whole,
        "message_float32_continued": b"\1\1\3" + split,
        "message_wrong_size": b"\1\1\4" + whole,
        "message_uint8_empty": b"\1\0\0" + L.frame_head(2, 1, L.DESCRIPTOR, False)
        + L.pack_descriptor(5, 0, 0, 0, "uint8"),
        "message_close": b"\1\1\3" + streaming.close_frame(1, 2),
        "message_feedback": b"\1\1\3" + streaming.feedback_frame(1, 2, 100),
        "answer_accept": b"\2" + L.open_response(1),
        "answer_refuse": b"\2" + L.open_response(1, "not this group"),
    }


def _one(data: bytes) -> str:
    if not data:
        return "empty"
    mode = data[0] % 3
    return (handshake, message, answer)[mode](data[1:])


def one_input(data: bytes) -> str:
    return H.plain(_one, data)


if __name__ == "__main__":
    H.main(one_input, seeds)
