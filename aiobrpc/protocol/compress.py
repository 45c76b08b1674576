"""Compression of the `data` part of a message, as brpc does it (brpc's src/brpc/policy/baidu_rpc_protocol.cpp).

snappy is the raw block format (cramjam), gzip and zlib are the RFC 1952 / RFC 1950
containers at zlib's default level (byte-identical to brpc's output). LZ4 (4) is declared by
brpc but has no handler there, so a C++ peer can neither send nor accept it: we refuse to
send it (LocalProtocolError) and answer a received one like brpc, with EREQUEST.

Decompression is capped: output beyond `max_size` is an error before it is allocated
(snappy: the declared length is checked first; gzip/zlib: inflate stops at max_size + 1).
"""

from __future__ import annotations

import mmap
import zlib

import cramjam

from ..errors import EREQUEST, LocalProtocolError, RemoteProtocolError

NONE = 0
SNAPPY = 1
GZIP = 2
ZLIB = 3
LZ4 = 4

NAMES = {NONE: "none", SNAPPY: "snappy", GZIP: "gzip", ZLIB: "zlib", LZ4: "lz4"}
SUPPORTED = (NONE, SNAPPY, GZIP, ZLIB)


def name(ctype: int) -> str:
    """brpc's name of a compress type, "unknown" for what it has no handler for."""
    return NAMES[ctype] if ctype in SUPPORTED else "unknown"


def compress(ctype: int, data):
    """Compress serialized message bytes. Returns a bytes-like object."""
    if ctype == NONE:
        return data
    if ctype == SNAPPY:
        return memoryview(cramjam.snappy.compress_raw(data))
    if ctype == GZIP:
        c = zlib.compressobj(-1, zlib.DEFLATED, 31)
        return c.compress(data) + c.flush()
    if ctype == ZLIB:
        return zlib.compress(data)
    raise LocalProtocolError(f"compress_type={ctype} is not supported (brpc handles 0-3; lz4=4 has no handler)")


def decompress(ctype: int, data, max_size: int, code: int = EREQUEST):
    """Inverse of compress(), refusing output larger than max_size bytes.

    Errors are RemoteProtocolError(fatal=False) with `code`: only this message is bad.
    """
    if ctype == NONE:
        if len(data) > max_size:
            raise _err(f"data of {len(data)} bytes exceeds max_decompressed_size={max_size}", code)
        return data
    if ctype == SNAPPY:
        try:
            n = cramjam.snappy.decompress_raw_len(data)
        except Exception as e:  # cramjam raises its own DecompressionError / ValueError
            raise _err(f"snappy data is corrupt: {e}", code) from None
        if n > max_size:
            raise _err(f"snappy data declares {n} bytes, exceeds max_decompressed_size={max_size}", code)
        out = bytearray(n)
        try:
            got = cramjam.snappy.decompress_raw_into(data, out)
        except Exception as e:
            raise _err(f"snappy data is corrupt: {e}", code) from None
        if got != n:
            raise _err(f"snappy data decompressed to {got} bytes, declared {n}", code)
        return out
    if ctype in (GZIP, ZLIB):
        return _inflate(ctype, data, max_size, code)
    raise _err(f"CompressType=unknown ({ctype})", code)


_INFLATE_CHUNK = 64 * 1024


def _inflate(ctype: int, data, max_size: int, code: int):
    # Inflate in bounded steps. What fits in one step is returned as it is; a larger output
    # goes into an anonymous map of max_size bytes, whose pages exist only where written: peak
    # memory is the output itself, whatever the allocator does (a growing bytearray is copied
    # when it cannot grow in place, holding twice its size for a moment), and never max_size
    # twice over, as one big decompress() call would hold.
    label = NAMES[ctype]
    if ctype == GZIP and len(data) >= 18:
        # The gzip trailer declares the size mod 2**32 and zlib verifies it at the end, so a
        # stream that declares more than max_size either is that large or fails: refuse it
        # before inflating anything.
        declared = int.from_bytes(data[len(data) - 4:], "little")
        if declared > max_size:
            raise _err(f"gzip data declares {declared} bytes, exceeds max_decompressed_size={max_size}", code)
    d = zlib.decompressobj(31 if ctype == GZIP else 15)
    out = None  # the map, from the second step on
    size = 0
    pending = data
    try:
        while True:
            chunk = d.decompress(pending, _INFLATE_CHUNK)
            size += len(chunk)
            if size > max_size:
                if out is not None:
                    out.close()  # now: a traceback would keep its pages
                raise _err(f"{label} data inflates beyond max_decompressed_size={max_size}", code)
            pending = d.unconsumed_tail
            done = d.eof or not (chunk or pending)
            if out is None:
                if done:
                    break  # it fit in one step: `chunk` is the output
                out = mmap.mmap(-1, max(max_size, 1))
            out.write(chunk)
            if done:
                break
    except zlib.error as e:
        raise _err(f"{label} data is corrupt: {e}", code) from None
    if not d.eof:
        raise _err(f"{label} data is truncated", code)
    if d.unused_data:
        raise _err(f"{len(d.unused_data)} bytes follow the end of the {label} stream", code)
    return chunk if out is None else memoryview(out)[:size]


def _err(message: str, code: int) -> RemoteProtocolError:
    return RemoteProtocolError(message, code=code, fatal=False)
