"""Time the operations of aiobrpc._fast's kernels, one line each: ns per operation, best of N.

    python bench/kernels.py                 # the tree this file is in
    python bench/kernels.py --tree ../old   # another checkout (its extensions built in place)

Run two trees in one shell loop, alternating, to compare a kernel before and after a change
(this machine drifts between runs; the best of many repeats is the stable figure), or count
instructions with callgrind, which a busy machine does not bend:

    for n in 1000 3000; do valgrind --tool=callgrind --callgrind-out-file=/dev/null \
        $PYTHON bench/kernels.py --case meta_decode --calls $n 2>&1 | grep Collected; done What is
timed is what one call of the call path does with each kernel: the receive buffer's read and
take of small frames, a large frame's own buffer, the send chain's append and cut, the frame
header and meta codec; and the parameter server's SGD step over a 16 MiB key. The last line
printed is JSON. `AIOBRPC_NO_EXTENSIONS=1 python bench/kernels.py` times the Python builds.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import timeit


def cases(fast) -> dict:
    """name -> a zero-argument function doing the operation once."""
    meta = fast.RpcMeta()
    meta.has_request = True
    meta.service_name = "example.EchoService"
    meta.method_name = "Echo"
    meta.correlation_id = 12345
    meta.log_id = 7
    meta_bytes = fast.encode_meta(meta)
    payload = b"\x0a\x10" + b"x" * 16
    frame = fast.pack_header(b"PRPC", len(meta_bytes) + len(payload), len(meta_bytes)) + meta_bytes + payload
    batch = frame * 64

    reader = fast.FrameReader()

    def read_small_frames():
        # One kernel read of 64 small frames, then each taken: per call of the call path,
        # one get_buffer/buffer_updated is shared by the frames that arrived together.
        buf = reader.get_buffer(-1)
        n = len(batch)
        buf[:n] = batch
        reader.buffer_updated(n)
        nf = reader.next_frame
        while nf() is not None:
            pass

    big = fast.pack_header(b"PRPC", 1 << 20, 0) + bytes(1 << 20)
    big_reader = fast.FrameReader()

    def read_large_frame():
        # A 1 MiB frame: header into the block, its own buffer for the rest, taken whole.
        r = big_reader
        buf = r.get_buffer(-1)
        buf[:12] = big[:12]
        r.buffer_updated(12)
        assert r.next_frame() is None
        buf = r.get_buffer(-1)
        n = len(big) - 12
        buf[:n] = memoryview(big)[12:]
        r.buffer_updated(n)
        kind, m, p = r.next_frame()
        del m, p

    chunks = [b"a" * 16, bytearray(64), memoryview(b"c" * 100)]

    def iobuf_append_cut():
        b = fast.IOBuf()
        for c in chunks:
            b.append(c)
        b.cut(50)
        b.cut_all()

    view_of = fast.byte_view
    arr = bytearray(4096)

    def byte_view():
        view_of(arr)

    split = fast.split_payload

    feed_reader = fast.FrameReader()

    def split_payload():
        feed_reader.feed(frame)
        _, _, p = feed_reader.next_frame()
        split(p, 4)

    encode, decode = fast.encode_meta, fast.decode_meta

    def meta_encode():
        encode(meta)

    def meta_decode():
        decode(meta_bytes)

    head = fast.pack_head

    def meta_pack_head():
        head(b"PRPC", meta, 18)

    pack = fast.pack_header

    def header_pack():
        pack(b"PRPC", 100, 20)

    out = {"read_small_frames/64": read_small_frames, "read_large_frame_1MiB": read_large_frame,
           "iobuf_append_cut": iobuf_append_cut, "byte_view": byte_view,
           "feed_next_split": split_payload, "meta_encode": meta_encode,
           "meta_decode": meta_decode, "meta_pack_head": meta_pack_head,
           "pack_header": header_pack}
    try:
        import numpy as np
    except ImportError:  # the parameter server's step needs numpy (the bench extra has it)
        return out
    sgd = importlib.import_module(fast.__name__ + ".sgd")
    value, grad = np.zeros(4 << 20, np.float32), np.ones(4 << 20, np.float32)

    def sgd_step_16MiB():
        # The parameter server's SGD step over a 16 MiB float32 key (value -= lr * grad).
        sgd.sub_scaled(value, grad, 1e-6)

    out["sgd_step_16MiB_float32"] = sgd_step_16MiB
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--budget", type=float, default=0.2, help="seconds per repeat of one case")
    ap.add_argument("--case", help="run this case --calls times, untimed (for callgrind: the "
                                   "difference of two runs over the difference of their calls)")
    ap.add_argument("--calls", type=int, default=1000)
    args = ap.parse_args()
    sys.path.insert(0, os.path.abspath(args.tree))
    from aiobrpc import _fast
    if args.case:
        fn = cases(_fast)[args.case]
        for _ in range(args.calls):
            fn()
        return 0
    out = {"tree": args.tree, "implementation": _fast.IMPLEMENTATION}
    for name, fn in cases(_fast).items():
        fn()
        number = max(1, int(args.budget / max(timeit.timeit(fn, number=3) / 3, 1e-9)))
        best = min(timeit.repeat(fn, number=number, repeat=args.repeat)) / number
        out[name] = round(best * 1e9, 1)
        print(f"{name:24s} {best * 1e9:10.1f} ns")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
