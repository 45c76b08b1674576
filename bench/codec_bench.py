"""baidu_std codec benchmark: echo-frame encode+decode rate, and copies of large attachments.

Run by hand from the repository root:

    python bench/codec_bench.py            # about a minute on a small VM
    python bench/codec_bench.py --quick    # a few seconds, rougher figures

Part 1 times one encode+decode cycle of a 16-byte echo request with the meta a C++ client
sends, for the compiled twin, the pure twin and a naive baseline (the generated protobuf class
and struct); the pure twin runs in a second process with AIOBRPC_NO_EXTENSIONS=1 (every module
as Python, the kernels of aiobrpc._fast included) where this one is compiled. Part 2 sends
1 MiB and 16 MiB numpy attachments twice through pack() and a Decoder fed like a kernel
(64 KiB reads into get_buffer) and reports what was copied in user space.
docs/codec_benchmark.md explains the columns. The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import struct
import sys
import timeit
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import pure  # noqa: E402  (bench/pure.py)
from aiobrpc import _fast  # noqa: E402
from aiobrpc._proto import brpc_meta_pb2  # noqa: E402
from aiobrpc.protocol import baidu_std  # noqa: E402

SERVICE = "example.EchoService"
METHOD = "Echo"
LOG_ID = 123456789
DATA16 = b"0123456789abcdef"
HEADER = 12
KERNEL_READ = 64 * 1024
LARGE_SIZES = (1 << 20, 16 << 20)


# --- encode + decode of one echo frame ------------------------------------------------------

def fast_meta(correlation_id: int):
    """The request meta as brpc's C++ client fills it, with this process's RpcMeta."""
    m = _fast.RpcMeta()
    m.has_request = True
    m.service_name = SERVICE
    m.method_name = METHOD
    m.log_id = LOG_ID
    m.correlation_id = correlation_id
    m.compress_type = 0
    m.content_type = 0
    m.checksum_type = 0
    m.checksum_value = b""
    return m


def aiobrpc_cycle():
    """encode (meta + pack) -> the kernel's gather and read -> next_event, on one connection."""
    RpcMeta = _fast.RpcMeta
    pack = baidu_std.pack
    decoder = baidu_std.Decoder(baidu_std.SERVER)
    ids = itertools.count(1)

    def cycle():
        m = RpcMeta()
        m.has_request = True
        m.service_name = SERVICE
        m.method_name = METHOD
        m.log_id = LOG_ID
        m.correlation_id = next(ids)
        m.compress_type = 0
        m.content_type = 0
        m.checksum_type = 0
        m.checksum_value = b""
        wire = b"".join(pack(m, DATA16))  # writev gathers the buffers
        n = len(wire)
        buf = decoder.get_buffer(-1)  # recv_into the protocol's buffer
        buf[:n] = wire
        del buf
        decoder.buffer_updated(n)
        return wire, decoder.next_event()

    return cycle


def naive_cycle():
    """The same with the generated protobuf class, struct, and slices of bytes."""
    RpcMeta = brpc_meta_pb2.RpcMeta
    pack_head, unpack_head = struct.Struct("!4sII").pack, struct.Struct("!4sII").unpack_from
    ids = itertools.count(1)

    def cycle():
        m = RpcMeta()
        req = m.request
        req.service_name = SERVICE
        req.method_name = METHOD
        req.log_id = LOG_ID
        m.correlation_id = next(ids)
        m.compress_type = 0
        m.content_type = 0
        m.checksum_type = 0
        m.checksum_value = b""
        meta = m.SerializeToString()
        wire = b"".join([pack_head(b"PRPC", len(meta) + len(DATA16), len(meta)) + meta, DATA16])
        magic, body_size, meta_size = unpack_head(wire)
        if magic != b"PRPC":
            raise ValueError(magic)
        got = RpcMeta.FromString(wire[HEADER:HEADER + meta_size])
        return wire, (got, wire[HEADER + meta_size:HEADER + body_size])

    return cycle


def check_echo(fast_cycle, naive) -> None:
    """Both paths put the same bytes on the wire and decode them to the same values."""
    wire_a, ev = fast_cycle()
    wire_b, (meta, data) = naive()
    assert wire_a == wire_b, (wire_a.hex(), wire_b.hex())
    assert bytes(ev.data) == data == DATA16 and len(ev.attachment) == 0
    assert (ev.meta.service_name, ev.meta.method_name, ev.meta.log_id, ev.meta.correlation_id) == (
        meta.request.service_name, meta.request.method_name, meta.request.log_id, meta.correlation_id)


def best_rate(cycle, number: int, repeat: int) -> float:
    """Cycles per second of the fastest of `repeat` runs (the others met a noisy neighbour)."""
    best = min(timeit.Timer(cycle).repeat(repeat=repeat, number=number))
    return number / best


# --- large attachments ------------------------------------------------------------------------

def deliver(decoder, bufs, read: int = KERNEL_READ) -> list:
    """A kernel between pack() and the Decoder: each read copies at most `read` bytes from the
    sender's buffers into the buffer get_buffer offers (that copy is the kernel's, not counted).
    Every complete event is taken after each read, as the protocol does."""
    segs = [memoryview(b) for b in bufs]
    events = []
    i = off = 0
    while i < len(segs):
        buf = decoder.get_buffer(-1)
        room = min(len(buf), read)
        n = 0
        while n < room and i < len(segs):
            seg = segs[i]
            k = min(room - n, len(seg) - off)
            buf[n:n + k] = seg[off:off + k]
            n += k
            off += k
            if off == len(seg):
                i, off = i + 1, 0
        del buf
        decoder.buffer_updated(n)
        while (ev := decoder.next_event()) is not None:
            events.append(ev)
    return events


def large_run(size: int) -> dict:
    """Two frames carrying the same `size`-byte attachment, back to back on one connection."""
    arr = np.arange(size, dtype=np.uint64).astype(np.uint8)
    decoder = baidu_std.Decoder(baidu_std.SERVER)
    rbuf = decoder.reader.rbuf
    out: dict = {"size": size}
    for n, cid in enumerate((1, 2), 1):
        bufs = baidu_std.pack(fast_meta(cid), DATA16, arr)
        assert bufs[-1].obj is arr, "pack copied the attachment"
        out["attachment_is_view"] = True
        frame_len = sum(memoryview(b).nbytes for b in bufs)
        before = rbuf.copied_bytes
        if n == 2:
            tracemalloc.start()
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
        [ev] = deliver(decoder, bufs)
        if n == 2:
            peak = tracemalloc.get_traced_memory()[1]
            traces = tracemalloc.take_snapshot().traces
            tracemalloc.stop()
            # allocations of attachment size still alive: the frame's own receive buffer only
            out["large_allocs"] = sum(1 for t in traces if t.size >= size)
            out["peak_extra"] = peak - base - frame_len
        copied = rbuf.copied_bytes - before
        # begin_large only ever moves the start of a frame; the attachment is its end.
        out[f"copied_frame{n}"] = copied
        out[f"attachment_copied_frame{n}"] = max(0, copied - (frame_len - size))
        att = ev.attachment
        assert ev.meta.correlation_id == cid and bytes(ev.data) == DATA16
        assert att.nbytes == size and np.array_equal(np.frombuffer(att, dtype=np.uint8), arr)
        # the frame's own buffer: room for the next header, and for ending the frame aligned
        assert type(att.obj) is bytearray and len(att.obj) == frame_len + HEADER + _fast.iobuf.LARGE_ALIGN
        del ev, att
    return out


# --- one build per process -------------------------------------------------------------------

def this_build(number: int, repeat: int) -> dict:
    """Echo rate and large runs of the build this process runs."""
    check_echo(aiobrpc_cycle(), naive_cycle())  # fresh ones: both count ids from 1
    rate = best_rate(aiobrpc_cycle(), number, repeat)
    return {"twin": _fast.IMPLEMENTATION, "rate": rate, "large": [large_run(size) for size in LARGE_SIZES]}


def pure_build(argv: list[str]) -> dict:
    """this_build() of a second process where every module is Python (its last line, JSON)."""
    out = json.loads(pure.rerun_output([*argv, "--only-this-build"]).splitlines()[-1])
    if out["twin"] != "python":
        raise SystemExit(f"AIOBRPC_NO_EXTENSIONS=1 gave kernels {out['twin']!r}, not the pure twin")
    return out


# --- report -----------------------------------------------------------------------------------

def machine() -> str:
    return (f"{platform.machine()} {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer cycles and repeats")
    parser.add_argument("--only-this-build", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    number, repeat = (2_000, 3) if args.quick else (50_000, 9)
    if args.only_this_build:
        print(json.dumps(this_build(number, repeat)))
        return 0
    result: dict = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine(),
                    "quick": args.quick, "number": number, "repeat": repeat, "echo": {}, "large": {}}
    builds = {}
    if _fast.IMPLEMENTATION == "cython":
        builds["cython"] = this_build(number, repeat)
    else:
        print(f"compiled twin not built (python setup.py build_ext --inplace), or AIOBRPC_NO_EXTENSIONS "
              f"is set (kernels: {_fast.IMPLEMENTATION}): skipping (a)")
    if pure.needs_own_process():
        builds["python"] = pure_build(sys.argv[1:] if argv is None else argv)
    else:
        builds["python"] = this_build(number, repeat)
    rates = {twin: b["rate"] for twin, b in builds.items()}
    rates["naive"] = best_rate(naive_cycle(), number, repeat)
    result["large"] = {twin: b["large"] for twin, b in builds.items()}

    result["echo"] = {k: round(v) for k, v in rates.items()}
    ratios = {}
    if "cython" in rates:
        ratios["cython/naive"] = rates["cython"] / rates["naive"]
    ratios["python/naive"] = rates["python"] / rates["naive"]
    if "cython" in rates:
        ratios["cython/python"] = rates["cython"] / rates["python"]
    result["ratios"] = {k: round(v, 2) for k, v in ratios.items()}

    print(f"baidu_std codec benchmark  {result['date']}  {result['machine']}")
    print(f"\necho: encode+decode of a 16-byte request, best of {repeat} x {number} cycles")
    print(f"  {'path':<28}{'cycles/s':>12}{'us/cycle':>10}")
    names = {"cython": "(a) compiled twin", "python": "(b) pure twin", "naive": "(c) protobuf + struct"}
    for key in ("cython", "python", "naive"):
        if key in rates:
            print(f"  {names[key]:<28}{rates[key]:>12,.0f}{1e6 / rates[key]:>10.2f}")
        else:
            print(f"  {names[key]:<28}{'not built':>12}")
    print("  " + "   ".join(f"{k.replace('cython', '(a)').replace('python', '(b)').replace('naive', '(c)')}"
                            f" = {v:.2f}" for k, v in ratios.items()))

    print(f"\nlarge attachments: pack + Decoder fed by {KERNEL_READ // 1024} KiB reads, two frames in a row")
    cols = ("twin", "attachment", "view", "moved 1st", "att 1st", "moved 2nd", "att 2nd",
            "big allocs", "peak extra")
    print("  " + "".join(f"{c:>11}" for c in cols))
    for twin, runs in result["large"].items():
        for r in runs:
            row = (twin, f"{r['size'] >> 20} MiB", "yes" if r["attachment_is_view"] else "NO",
                   r["copied_frame1"], r["attachment_copied_frame1"], r["copied_frame2"],
                   r["attachment_copied_frame2"], r["large_allocs"], r["peak_extra"])
            print("  " + "".join(f"{c:>11}" for c in row))
    print()
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
