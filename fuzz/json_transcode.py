"""Harness: JSON <-> protobuf transcoding of the HTTP side (server/http_rpc.py parse_body for
JSON, proto, proto-text bodies, and the reply side: write_body / to_brpc_json), and the command
line's JSON reading (cli_json.py) where it takes a peer's or a user's text.

Input: byte 0 picks the message type and the content type, the rest is the body.

Expected: a message, or RpcError(EREQUEST); a parsed message writes back (write_body) in every
content type, and the JSON it writes parses back to the same message. Anything else is a finding.

    python -m fuzz.json_transcode fuzz/corpus/json_transcode -max_total_time=60
"""

from __future__ import annotations

from fuzz import _harness as H

with H.instrumented():
    from aiobrpc._proto import grpc_test_pb2, interop_pb2
    from aiobrpc.errors import RpcError
    from aiobrpc.server import http_rpc

TYPES = ("application/json", "application/proto", "application/proto-text", None, "application/x-protobuf",
         "text/plain", "application/json; charset=utf-8", "application/proto-json")


def _classes():
    out = [interop_pb2.EchoRequest, interop_pb2.EchoResponse]
    for mod in (grpc_test_pb2,):
        for name in sorted(mod.DESCRIPTOR.message_types_by_name):
            out.append(getattr(mod, name))
    return tuple(out)


CLASSES = _classes()


def one_input(data: bytes) -> str:
    return H.plain(_one, data)


def _one(data: bytes) -> str:
    if not data:
        return "empty"
    cls = CLASSES[data[0] % len(CLASSES)]
    ctype = TYPES[(data[0] >> 4) % len(TYPES)]
    body = data[1:]
    try:
        msg = http_rpc.parse_body(cls, body, ctype)
    except RpcError as e:
        if e.code != 1003:
            raise H.Finding(f"parse_body failed with code {e.code}, not EREQUEST: {e}") from e
        return f"{cls.__name__} refused"
    except RecursionError as e:
        raise H.Finding(f"parse_body raised RecursionError (B5): {e}") from e
    outs = []
    known = type(msg)()
    known.CopyFrom(msg)
    known.DiscardUnknownFields()  # JSON has no place for unknown fields: compared without them
    for out_type in ("application/json", "application/proto", "application/proto-text"):
        if out_type == "application/proto" and not msg.IsInitialized():
            outs.append("uninitialized")  # a handler's reply like this is ERESPONSE, by design
            continue
        try:
            written = http_rpc.write_body(msg, out_type)
        except Exception as e:
            raise H.Finding(f"write_body({cls.__name__}, {out_type}) of a parsed message raised {e!r}") from e
        outs.append(H.short(written))
        if out_type == "application/json":
            try:
                back = http_rpc.parse_body(cls, written, out_type)
            except RpcError as e:
                raise H.Finding(f"the JSON write_body wrote does not parse back: {e}; {written[:200]!r}") from e
            if back != known:
                raise H.Finding(f"JSON round trip changed the message: {msg} -> {back}")
    return f"{cls.__name__} ok {' '.join(outs)}"


if __name__ == "__main__":
    H.fuzz_main(one_input)
