"""Harness: the sans-IO baidu_std codec: the meta codec and the frame reader of `_fast`
(meta.py and framing.py, compiled and run as Python), the compiled and the pure kernel side by
side in one process (a differential in itself: they must agree on every input), plus the
decoder's events.

Input: a control byte (bit 0: the bytes are a meta, else a byte stream; bits 1-3: the read size
for the stream), then the bytes.

Expected: RemoteProtocolError from a decoder (any other exception is a finding); both kernels
give the same fields, or both refuse; a decoded meta re-encodes and decodes to the same fields.

    python -m fuzz.codec fuzz/corpus/codec -max_total_time=60
"""

from __future__ import annotations

from fuzz import _harness as H

with H.instrumented():
    from aiobrpc import _compiled as _builds
    from aiobrpc import _fast
    from aiobrpc._fast import framing, meta
    from aiobrpc.errors import RemoteProtocolError
    from aiobrpc.protocol.baidu_std import SERVER, Decoder

    # The kernels' Python builds; where they are the ones imported, there is no second one to
    # compare (not built, or AIOBRPC_NO_EXTENSIONS set).
    _compiled = {"meta": meta, "framing": framing} if _fast.IMPLEMENTATION == "cython" else None
    meta_py = _builds.load_source("aiobrpc._fast.meta") if _compiled is not None else meta
    framing_py = _builds.load_source("aiobrpc._fast.framing") if _compiled is not None else framing

FIELDS = ("has_request", "has_response", "service_name", "method_name", "log_id", "trace_id", "span_id",
          "parent_span_id", "request_id", "timeout_ms", "error_code", "error_text", "compress_type",
          "correlation_id", "attachment_size", "authentication_data", "stream_settings", "user_fields",
          "content_type", "checksum_type", "checksum_value", "checksum_with_attachment")


def _fields(m) -> tuple:
    out = []
    for f in FIELDS:
        v = getattr(m, f, None)
        if isinstance(v, (bytes, bytearray, memoryview)):
            v = bytes(v)
        elif isinstance(v, list):
            v = tuple(tuple(x) if isinstance(x, (list, tuple)) else x for x in v)
        out.append(v)
    return tuple(out)


def _decode(mod, data: bytes):
    try:
        return _fields(mod.decode_meta(data))
    except RemoteProtocolError as e:
        return f"refused: {str(e)[:40]}" if False else "refused"


def meta(data: bytes) -> str:
    got = _decode(meta_py, data)
    if _compiled is not None:
        other = _decode(_compiled["meta"], data)
        if other != got:
            raise H.Finding(f"meta kernels disagree: python {got!r} cython {other!r}")
    if got == "refused":
        return "meta refused"
    m = meta_py.decode_meta(data)
    try:
        again = meta_py.encode_meta(m)
    except Exception as e:  # a decoded meta must encode
        raise H.Finding(f"a decoded meta does not encode: {e!r}") from e
    if _fields(meta_py.decode_meta(again)) != got:
        raise H.Finding("a decoded meta does not round-trip")
    return f"meta {H.short(repr(got).encode())}"


def _frames(mod, data: bytes, step: int) -> list:
    reader = mod.FrameReader(1 << 20)
    out = []
    try:
        pos = 0
        while pos < len(data):
            n = len(data) - pos if step <= 0 else min(step, len(data) - pos)
            reader.feed(data[pos:pos + n])
            pos += n
            while True:
                f = reader.next_frame()
                if f is None:
                    break
                kind, m, payload = f
                out.append((kind, bytes(m), bytes(payload)))
        out.append(("pending", reader.pending_bytes()))
    except RemoteProtocolError:
        out.append("refused")
    return out


def stream(data: bytes, step: int) -> str:
    got = _frames(framing_py, data, step)
    if _compiled is not None:
        other = _frames(framing, data, step)
        if other != got:
            raise H.Finding(f"frame reader kernels disagree: python {got!r:.200} cython {other!r:.200}")
    dec = Decoder(SERVER, 1 << 20)
    events = []
    try:
        dec.feed(data)
        while True:
            ev = dec.next_event()
            if ev is None:
                break
            events.append(type(ev).__name__)
    except RemoteProtocolError:
        events.append("refused")
    return f"frames={len(got)} {H.short(repr(got).encode())} events={','.join(events)}"


def one_input(data: bytes) -> str:
    return H.plain(_one, data)


def _one(data: bytes) -> str:
    if not data:
        return "empty"
    c = data[0]
    if c & 1:
        return meta(data[1:])
    return stream(data[1:], H.CHUNKS[(c >> 1) & 7])


if __name__ == "__main__":
    H.fuzz_main(one_input)
