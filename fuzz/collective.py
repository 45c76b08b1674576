"""Harness: a training group's point-to-point messages (aiobrpc/training/p2p.py, the `Send` calls
of the Collective service), from a hostile rank.

Each input makes a fresh group of two ranks in this loop (an in-memory store, their own
servers on 127.0.0.1, a timeout of 0.05 s, point-to-point on calls: `lanes=False`, since
messages on lanes never reach p2p.py and have harnesses of their own), then plays the recipe
against rank 1:
recvs posted by rank 1's program (from rank 0 or from any, a tag, a dtype, a size), honest
sends of rank 0, and `Send` calls made by hand with every field from the fuzzer (group id right
or wrong, src, coll, tag, seq, dtype name, numel, nbytes, phase, offset) and an attachment whose
size may lie. Through rank 1's real server: the attachment is placed by `destination()` and
the call handled by `received()`.

Checked: every call, send and recv ends within the group's timeout (plus slack); rank 1 never
holds more than its caps (`p2p_buffer_bytes`, `p2p_max_messages`), and what it says it holds is
what its tables hold; a recv that ends with a source got exactly the bytes of a message sent to
it; no traceback logged; nothing left running once the group is closed.

    python -m fuzz.collective fuzz/corpus/collective -max_total_time=60
"""

from __future__ import annotations

import asyncio
import threading

from fuzz import _harness as H

with H.instrumented():
    import numpy as np

    from aiobrpc.controller import Controller
    from aiobrpc.errors import RpcError
    from aiobrpc._proto import collective_pb2 as pb
    from aiobrpc.training import CollectiveError, Group

# Real sockets and timers: which of two racing messages a rank takes first, so the outcome of
# an input, may differ between runs; tests/fuzz/test_twins_differential.py leaves it out.
DIFFERENTIAL = False
TIMEOUT = 0.05  # short: an input waits for its unmatched recvs and sends to time out
CAP_BYTES, CAP_MESSAGES, EAGER = 4096, 8, 1024  # small caps, so the fuzzer reaches them
DTYPES = ("uint8", "float32", "int64", "bfloat16", "x" * 65, "", "float32\x00")  # the first 3: arrays
SETTLE = TIMEOUT * 4 + 3.0
_n = 0


class _MemoryStore:
    """The group's rendezvous in this process: a get is answered as soon as its key is set
    (a FileStore polls, and its waits were most of an input's time)."""

    def __init__(self) -> None:
        self._values: dict[str, bytes] = {}
        self._set = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self._set:
            self._values[key] = bytes(value)
            self._set.notify_all()

    def get(self, key: str) -> bytes:
        with self._set:
            if not self._set.wait_for(lambda: key in self._values, timeout=5):
                raise TimeoutError(f"store key {key!r} was not set within 5 s")
            return self._values[key]


def _array(dtype: str, numel: int, fill: int) -> np.ndarray:
    return np.full(numel, fill, np.dtype(dtype))


async def drive(data: bytes) -> str:
    global _n
    _n += 1
    p = H._Provider(data)
    before = asyncio.all_tasks()  # the harness's own (run's wait_for)
    store = _MemoryStore()
    prefix = f"in{_n}"
    g0, g1 = await asyncio.gather(*(Group.create(store, r, 2, prefix=prefix, timeout=TIMEOUT,
                                                 p2p_eager_bytes=EAGER, p2p_buffer_bytes=CAP_BYTES,
                                                 p2p_max_messages=CAP_MESSAGES, lanes=False)
                                    for r in range(2)))
    stub = g0._stub(1)  # rank 0's channel to rank 1: the hostile calls go the way real ones do
    pending: list = []
    recvs: list = []
    fills: dict[int, set] = {}  # tag -> the fill values of rank 0's honest sends on it
    hostile = False
    out: list[str] = []
    try:
        for _ in range(p.int_in(1, 12)):
            kind = p.byte() % 4
            if kind == 0:  # rank 1's program posts a recv
                dtype = DTYPES[p.byte() % 3]
                buf = _array(dtype, p.int_in(0, 64) * (1 + 40 * (p.byte() % 8 == 0)), 0)
                src = None if p.byte() % 4 == 0 else 0
                try:
                    tag = p.int_in(0, 3)
                    fut = g1.recv(buf, src, tag=tag)
                except (CollectiveError, ValueError) as e:
                    out.append(f"recv refused {type(e).__name__}")
                    continue
                recvs.append((fut, buf, tag))
            elif kind == 1:  # an honest send of rank 0
                dtype = DTYPES[p.byte() % 3]
                fill = p.int_in(1, 250)
                arr = _array(dtype, p.int_in(0, 64) * (1 + 40 * (p.byte() % 8 == 0)), fill)
                tag = p.int_in(0, 3)
                fills.setdefault(tag, set()).add(fill)
                try:
                    pending.append(("send", g0.send(arr, 1, tag=tag)))
                except CollectiveError as e:
                    out.append(f"send refused {type(e).__name__}")
            else:  # a Send call made by hand
                hostile = True
                req = pb.SendRequest(
                    group=g1.id if p.byte() % 8 else "not-the-group", src=p.pick((0, 0, 0, 1, 2, -1)),
                    coll=p.pick((0, 0, 0, 1, 5, 1 << 63)), tag=p.int_in(0, 3) if p.byte() % 8 else -(1 << 63),
                    seq=p.pick((1, 1, 2, 3, 0, 1 << 40)), dtype=DTYPES[p.byte() % len(DTYPES)],
                    numel=p.pick((0, 1, 4, 64, -1, 1 << 40)), nbytes=p.pick((0, 4, 16, 256, 5000, -1, 1 << 40)),
                    phase=p.pick((1, 1, 2, 3, 0, 9)))
                if p.byte() % 4 == 0:
                    req.offset = p.pick((0, 4, 16, 1 << 40))
                attachment = p.blob(300) if p.byte() % 8 else bytes(p.int_in(0, 6000))
                cntl = Controller(timeout_ms=int(SETTLE * 1000), max_retry=0)
                if attachment:
                    cntl.request_attachment = attachment
                pending.append(("call", asyncio.ensure_future(stub.Send(req, cntl))))
            _check_caps(g1)
            if p.byte() % 2:
                await asyncio.sleep(0)
        # Every send, call and recv ends within the timeout (the recvs' timers, the HEADER waits).
        results = await asyncio.wait_for(asyncio.gather(*(f for _, f in pending), *(f for f, _, _ in recvs),
                                                        return_exceptions=True), SETTLE)
    except asyncio.TimeoutError:
        raise H.Finding(f"hang: sends, calls or recvs not ended {SETTLE} s after the input") from None
    except H.Finding:
        raise
    finally:
        _check_caps(g1)
        await asyncio.gather(g0.close(), g1.close())
    for (what, _), r in zip(pending, results):
        if isinstance(r, BaseException) and not isinstance(r, (CollectiveError, RpcError)):
            raise H.Finding(f"a {what} ended with an undocumented {r!r}")
        out.append(f"{what} {'ok' if not isinstance(r, BaseException) else type(r).__name__}")
    for (fut, buf, tag), r in zip(recvs, results[len(pending):]):
        if isinstance(r, BaseException):
            if not isinstance(r, CollectiveError):
                raise H.Finding(f"a recv ended with an undocumented {r!r}")
            out.append(f"recv {type(r).__name__}")
            continue
        if not hostile and buf.size:  # only rank 0's honest sends: one of them, whole
            got = set(np.unique(buf).tolist())
            if len(got) != 1 or not got <= fills.get(tag, set()):
                raise H.Finding(f"a recv on tag {tag} got {sorted(got)[:5]}, not one of the messages sent "
                                f"on it (fills {sorted(fills.get(tag, ()))})")
        out.append(f"recv from {r}")
    leftover = [t for t in asyncio.all_tasks() - before if t is not asyncio.current_task() and not t.done()]
    if leftover:
        await asyncio.sleep(0.05)
        leftover = [t for t in leftover if not t.done()]
        if leftover:
            raise H.Finding(f"leak: {len(leftover)} tasks still running after the group closed: {leftover[:2]}")
    return "; ".join(out)


def _check_caps(g: Group) -> None:
    p2p = g.p2p
    if p2p is None:
        return
    held = [0] * g.world_size
    count = [0] * g.world_size
    for queue in p2p._unmatched.values():
        for inc in queue.values():
            count[inc.src] += 1
            if inc.data is not None:
                held[inc.src] += inc.data.nbytes
    for peer in range(g.world_size):
        if p2p.held_bytes[peer] > CAP_BYTES or p2p.unmatched_count[peer] > CAP_MESSAGES:
            raise H.Finding(f"past a cap: rank {g.rank} holds {p2p.held_bytes[peer]} bytes in "
                            f"{p2p.unmatched_count[peer]} messages of rank {peer}")
        if held[peer] != p2p.held_bytes[peer] or count[peer] != p2p.unmatched_count[peer]:
            raise H.Finding(f"the counts lie: rank {g.rank} counts {p2p.held_bytes[peer]} bytes in "
                            f"{p2p.unmatched_count[peer]} messages of rank {peer}, its tables hold "
                            f"{held[peer]} in {count[peer]}")


def one_input(data: bytes) -> str:
    return H.run(drive, data)


if __name__ == "__main__":
    H.fuzz_main(one_input)
