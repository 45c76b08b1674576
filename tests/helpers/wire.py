"""Independent wire builders for tests: they use protobuf and struct, never aiobrpc's codec,
and can produce any (also wrong) sizes and fields."""

from __future__ import annotations

import json
import pathlib
import struct

from aiobrpc._proto import brpc_meta_pb2

GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "data" / "golden"


def vi(n: int) -> bytes:
    """A protobuf varint (n taken modulo 2**64)."""
    n &= (1 << 64) - 1
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def field_varint(num: int, v: int) -> bytes:
    return vi(num << 3) + vi(v)


def field_ld(num: int, payload: bytes) -> bytes:
    return vi(num << 3 | 2) + vi(len(payload)) + payload


def rpc_meta(service: str | None = "example.EchoService", method: str | None = "Echo",
             correlation_id: int = 1, raw_extra: bytes = b"", **fields) -> bytes:
    """A serialized RpcMeta built with the generated protobuf class, plus raw bytes."""
    m = brpc_meta_pb2.RpcMeta()
    if service is not None or method is not None:
        m.request.service_name = service or ""
        m.request.method_name = method or ""
    m.correlation_id = correlation_id
    for k, v in fields.items():
        if k == "user_fields":
            m.user_fields.update(v)
        elif k in ("log_id", "timeout_ms", "request_id", "trace_id", "span_id", "parent_span_id"):
            setattr(m.request, k, v)
        elif k in ("error_code", "error_text"):
            setattr(m.response, k, v)
        else:
            setattr(m, k, v)
    return m.SerializeToString() + raw_extra


def frame(meta: bytes, payload: bytes = b"", *, magic: bytes = b"PRPC",
          body_size: int | None = None, meta_size: int | None = None) -> bytes:
    if body_size is None:
        body_size = len(meta) + len(payload)
    if meta_size is None:
        meta_size = len(meta)
    return magic + struct.pack(">II", body_size, meta_size) + meta + payload


def load_golden(name: str) -> dict:
    return json.loads((GOLDEN / f"{name}.json").read_text())


def golden_names() -> list[str]:
    names = sorted(p.stem for p in GOLDEN.glob("*.json"))
    if not names:  # a missing folder must fail collection, not shrink the suite to nothing
        raise FileNotFoundError(f"no golden captures in {GOLDEN}")
    return names
