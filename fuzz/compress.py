"""Harness: request and response decompression (protocol/compress.py: snappy, gzip, zlib) with the
max_decompressed_size cap, and the gRPC message codec's decompression (protocol/grpc.py), and the
HTTP body inflation of server/http_rpc.py.

Input: byte 0 the compress type (0-3, or anything), byte 1 the cap (a power of two, 2^(b % 21)),
then the data (compressed by the harness first when bit 7 of byte 0 is set, so that valid
streams are common; the fuzzer then mutates the rest).

Expected: the output (at most the cap) or RemoteProtocolError (non-fatal); anything else is a
finding, as is an output over the cap or an output that differs from zlib/gzip/cramjam's own.

    python -m fuzz.compress fuzz/corpus/compress -max_total_time=60
"""

from __future__ import annotations

import gzip
import zlib

from fuzz import _harness as H

with H.instrumented():
    import cramjam
    from aiobrpc.errors import RemoteProtocolError, RpcError
    from aiobrpc.protocol import compress
    from aiobrpc.server import http_rpc


def _reference(ctype: int, data: bytes):
    try:
        if ctype == 1:
            return bytes(cramjam.snappy.decompress_raw(data))
        if ctype == 2:
            d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif ctype == 3:
            d = zlib.decompressobj()
        else:
            return None
        out = d.decompress(data, 1 << 24)
        if d.unconsumed_tail or not d.eof or d.unused_data:
            return None
        return out
    except Exception:  # noqa: BLE001 - the reference refuses too
        return None


def one_input(data: bytes) -> str:
    return H.plain(_one, data)


def _one(data: bytes) -> str:
    if len(data) < 2:
        return "short"
    ctype = data[0] & 0x7F
    ctype = ctype if ctype < 8 else data[0]
    cap = 1 << (data[1] % 21)
    body = data[2:]
    if data[0] & 0x80:
        if ctype == 1:
            body = bytes(cramjam.snappy.compress_raw(body))
        elif ctype == 2:
            body = gzip.compress(body, mtime=0)
        elif ctype == 3:
            body = zlib.compress(body)
    try:
        out = bytes(compress.decompress(ctype, body, cap))
    except RemoteProtocolError as e:
        if e.fatal:
            raise H.Finding(f"decompress raised a fatal RemoteProtocolError: {e}") from e
        result = "refused"
    else:
        if len(out) > cap:
            raise H.Finding(f"{len(out)} bytes out of decompress, over the cap of {cap}")
        if ctype:
            ref = _reference(ctype, body)
            if ref is not None and ref != out:
                raise H.Finding(f"decompress gave {len(out)} bytes, the reference {len(ref)}")
        result = f"ok {len(out)} {H.short(out)}"
    # the HTTP side: Content-Encoding gzip / deflate / other
    enc = ("gzip", "deflate", "identity", None, "br")[data[1] % 5]
    try:
        http_out = http_rpc._inflated(body, enc, cap)
        http = f"{len(http_out)}"
        if enc == "gzip" and len(http_out) > cap:
            raise H.Finding(f"{len(http_out)} bytes out of _inflated, over the cap of {cap}")
    except RpcError as e:
        http = f"E{e.code}"
    return f"{result} http={http}"


if __name__ == "__main__":
    H.fuzz_main(one_input)
