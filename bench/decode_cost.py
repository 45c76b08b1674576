"""Cost of decoding small requests that carry an attachment: Decoder.next_event alone.

A read of 32 echo requests (16-byte message, `--attachment` bytes of attachment) is handed to
a server-side Decoder `--rounds` times and every event is taken and dropped, as a connection
does. It prints the time per event; on a shared VM that moves with the neighbours, so for a
change of a few hundred instructions count them instead, with callgrind, and subtract a short
run from a long one (what is left is the decoding alone, start-up and imports cancel out):

    for n in 10 110; do PYTHONHASHSEED=0 valgrind --tool=callgrind \\
        --callgrind-out-file=/dev/null python bench/decode_cost.py --rounds $n; done
    # instructions per event = (Collected[110] - Collected[10]) / (100 * 32)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pure  # noqa: E402  (bench/pure.py)
from aiobrpc import _fast  # noqa: E402
from aiobrpc.protocol import baidu_std  # noqa: E402

BATCH = 32


def read_of_requests(attachment: int) -> bytes:
    out = bytearray()
    for i in range(BATCH):
        meta = _fast.RpcMeta()
        meta.has_request = True
        meta.service_name = "example.EchoService"
        meta.method_name = "Echo"
        meta.correlation_id = i + 1
        # EchoRequest(message="x" * 16) serialized
        for buf in baidu_std.pack(meta, b"\n\x10" + b"x" * 16, b"a" * attachment or None):
            out += buf
    return bytes(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--twin", default="cython" if _fast.IMPLEMENTATION == "cython" else "python",
                   choices=["cython", "python"], help="default: this process's build")
    p.add_argument("--attachment", type=int, default=16, help="bytes of attachment per request")
    p.add_argument("--rounds", type=int, default=2000, help="reads of 32 requests")
    args = p.parse_args(argv)
    if args.twin == "python" and pure.needs_own_process():
        raise SystemExit(pure.rerun(sys.argv[1:] if argv is None else argv))
    if args.twin == "cython" and _fast.IMPLEMENTATION != "cython":
        raise SystemExit(f"--twin cython: the kernels of aiobrpc._fast are {_fast.IMPLEMENTATION!r} in this "
                         "process, not compiled (python setup.py build_ext --inplace, "
                         "AIOBRPC_NO_EXTENSIONS unset)")
    chunk = read_of_requests(args.attachment)
    decoder = baidu_std.Decoder(baidu_std.SERVER)
    elapsed = 0.0
    for _ in range(args.rounds):
        buf = decoder.get_buffer(-1)
        buf[:len(chunk)] = chunk
        del buf
        decoder.buffer_updated(len(chunk))
        next_event = decoder.next_event
        start = time.perf_counter()
        for _ in range(BATCH):
            next_event()  # each event dropped at once, as a connection drops it after the call
        elapsed += time.perf_counter() - start
        assert next_event() is None
    print(f"{args.twin} att={args.attachment}B {elapsed / (args.rounds * BATCH) * 1e9:.0f} ns/event")


if __name__ == "__main__":
    main()
