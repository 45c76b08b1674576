"""Encoding of the `data` part by content_type (brpc's src/brpc/policy/baidu_rpc_protocol.cpp).

PB (0) is protobuf binary. JSON (1) is brpc's json2pb: proto field names as keys, 64-bit
integers as numbers, bytes as base64, unknown keys ignored when parsing. PROTO_JSON (2) is the
canonical protobuf JSON mapping. PROTO_TEXT (3) is the text format. Anything else cannot be
parsed (EREQUEST at a server, as brpc).
"""

from __future__ import annotations

import json

from google.protobuf import json_format, text_format
from google.protobuf.message import DecodeError, EncodeError

from ..errors import LocalProtocolError, RemoteProtocolError
from . import utf8

PB = 0
JSON = 1
PROTO_JSON = 2
PROTO_TEXT = 3
NAMES = {PB: "pb", JSON: "json", PROTO_JSON: "proto-json", PROTO_TEXT: "proto-text"}


def name(ctype: int) -> str:
    return NAMES.get(ctype, "unknown")


def serialize(message, ctype: int = PB):
    """Message -> bytes. Raises EncodeError for missing required fields, and for JSON, for a
    string field that is not UTF-8."""
    if ctype == PB:
        return message.SerializeToString()
    if ctype in (JSON, PROTO_JSON):
        bad = utf8.bad_field(message)
        if bad:  # protobuf's JSON writer would write the bytes' repr (b'...') as the string
            raise EncodeError(f"string field {bad} is not UTF-8: JSON cannot carry it")
    if ctype == JSON:
        d = json_format.MessageToDict(message, preserving_proto_field_name=True)
        _int64_as_numbers(d, message)
        return json.dumps(d, separators=(",", ":")).encode()
    if ctype == PROTO_JSON:
        return json_format.MessageToJson(message, indent=None).encode()
    if ctype == PROTO_TEXT:
        return text_format.MessageToString(message).encode()
    raise LocalProtocolError(f"content_type={ctype} is not supported (0 pb, 1 json, 2 proto-json, 3 proto-text)")


def parse(message_class, data, ctype: int = PB):
    """bytes -> message. Raises RemoteProtocolError(fatal=False) when `data` does not parse."""
    try:
        if ctype == PB:
            msg = message_class.FromString(data)
        elif ctype in (JSON, PROTO_JSON):
            msg = json_format.Parse(bytes(data), message_class(), ignore_unknown_fields=True)
        elif ctype == PROTO_TEXT:
            msg = text_format.Parse(bytes(data).decode("utf-8"), message_class())
        else:
            raise RemoteProtocolError(f"ContentType=unknown ({ctype})", fatal=False)
    except RemoteProtocolError:
        raise
    except (DecodeError, json_format.ParseError, text_format.ParseError, UnicodeDecodeError,
            RecursionError, ValueError) as e:
        raise RemoteProtocolError(f"{type(e).__name__}: {e}", fatal=False) from None
    if not msg.IsInitialized():
        missing = ", ".join(msg.FindInitializationErrors())
        raise RemoteProtocolError(f"missing required fields: {missing}", fatal=False)
    return msg


def _int64_as_numbers(d: dict, message) -> None:
    # The canonical mapping writes 64-bit integers as strings; json2pb writes numbers.
    for fd in message.DESCRIPTOR.fields:
        key = fd.name
        if key not in d:
            continue
        if fd.message_type is not None and not fd.message_type.GetOptions().map_entry:
            if fd.is_repeated:
                for sub_d, sub_m in zip(d[key], getattr(message, key)):
                    _int64_as_numbers(sub_d, sub_m)
            else:
                _int64_as_numbers(d[key], getattr(message, key))
        elif fd.cpp_type in (fd.CPPTYPE_INT64, fd.CPPTYPE_UINT64):
            d[key] = [int(v) for v in d[key]] if fd.is_repeated else int(d[key])
