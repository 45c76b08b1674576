"""A JSON request for `aiobrpc call`, with errors that name the field, the type it expects and
the value given, where protobuf's json_format would only say that parsing failed."""

from __future__ import annotations

import base64
import binascii
import json
import math

from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from .cli_proto import ProtoError

_INT_RANGES = {
    **dict.fromkeys((FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SFIXED32),
                    (-2**31, 2**31 - 1)),
    **dict.fromkeys((FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32), (0, 2**32 - 1)),
    **dict.fromkeys((FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_SFIXED64),
                    (-2**63, 2**63 - 1)),
    **dict.fromkeys((FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64), (0, 2**64 - 1)),
}
_FLOAT_MAX = 3.4028234663852886e38


def parse_request(text: str, message) -> None:
    """Fill `message` from the JSON `text` (protobuf's JSON mapping).

    ProtoError names what is wrong: the line and column of invalid JSON, or the field, the
    type it expects and the value given (`field "a.b[2]": expected an integer, got "x"`).
    """
    try:
        value = json.loads(text, object_pairs_hook=_object)
    except json.JSONDecodeError as e:
        raise ProtoError(f"invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    try:
        json_format.Parse(text, message)
    except json_format.ParseError as e:
        why = explain_json(value, message.DESCRIPTOR) or " ".join(str(e).split())
        raise ProtoError(why) from None


def _object(pairs: list) -> dict:
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise ProtoError(f'duplicate key "{key}" in an object')
        obj[key] = value
    return obj


def explain_json(value, desc: Descriptor, path: str = "") -> str | None:
    """Why `value` is not a JSON `desc` message, or None when no reason is found here."""
    if desc.full_name.startswith("google.protobuf."):
        return None  # well-known types have JSON forms of their own: protobuf explains them
    if not isinstance(value, dict):
        return _expected(path, f"an object ({desc.full_name})", value)
    fields = {}
    for f in desc.fields:
        fields[f.name] = fields[f.json_name] = f
    for key, item in value.items():
        if key.startswith("["):
            continue  # an extension
        f = fields.get(key)
        if f is None:
            where = f'field "{path}": ' if path else ""
            known = ", ".join(f.name for f in desc.fields) or "none"
            return f'{where}{desc.full_name} has no field named "{key}" (fields: {known})'
        if item is not None:
            why = _explain_field(item, f, f"{path}.{key}" if path else key)
            if why:
                return why
    return None


def _explain_field(value, f: FieldDescriptor, path: str) -> str | None:
    entry = f.message_type
    if entry is not None and entry.GetOptions().map_entry:
        if not isinstance(value, dict):
            return _expected(path, "an object (a map)", value)
        key_field, value_field = entry.fields_by_name["key"], entry.fields_by_name["value"]
        for key, item in value.items():
            why = _explain_map_key(key, key_field, f"{path}[{key}]")
            if why is None and item is not None:
                why = _explain_value(item, value_field, f"{path}[{key}]")
            if why:
                return why
        return None
    if f.is_repeated:
        if not isinstance(value, list):
            return _expected(path, f"a list of {_plural(f)}", value)
        for i, item in enumerate(value):
            why = _explain_value(item, f, f"{path}[{i}]")
            if why:
                return why
        return None
    return _explain_value(value, f, path)


def _explain_map_key(key: str, f: FieldDescriptor, path: str) -> str | None:
    if f.type in _INT_RANGES:
        return _explain_value(key, f, path)
    if f.type == FieldDescriptor.TYPE_BOOL and key not in ("true", "false"):
        return _expected(path, 'a key "true" or "false"', key)
    return None


def _explain_value(value, f: FieldDescriptor, path: str) -> str | None:
    t = f.type
    if t == FieldDescriptor.TYPE_MESSAGE or t == FieldDescriptor.TYPE_GROUP:
        if value is None:
            return _expected(path, _kind(f), value)
        return explain_json(value, f.message_type, path)
    if t in _INT_RANGES:
        low, high = _INT_RANGES[t]
        number = _as_int(value)
        if number is None:
            return _expected(path, "an integer", value)
        if not low <= number <= high:
            return _expected(path, f"an integer in {low}..{high}", value)
        return None
    if t == FieldDescriptor.TYPE_DOUBLE or t == FieldDescriptor.TYPE_FLOAT:
        number = _as_float(value)
        if number is None:
            return _expected(path, "a number", value)
        if t == FieldDescriptor.TYPE_FLOAT and math.isfinite(number) and abs(number) > _FLOAT_MAX:
            return _expected(path, "a number in the range of a float", value)
        return None
    if t == FieldDescriptor.TYPE_BOOL:
        return None if isinstance(value, bool) else _expected(path, "true or false", value)
    if t == FieldDescriptor.TYPE_STRING:
        return None if isinstance(value, str) else _expected(path, "a string", value)
    if t == FieldDescriptor.TYPE_BYTES:
        return None if _is_base64(value) else _expected(path, "base64-encoded bytes", value)
    if t == FieldDescriptor.TYPE_ENUM:
        enum = f.enum_type
        if isinstance(value, str) and value in enum.values_by_name:
            return None
        if (isinstance(value, int) and not isinstance(value, bool)
                and (value in enum.values_by_number or not enum.is_closed)):
            return None
        return _expected(path, _kind(f), value)
    return None


def _kind(f: FieldDescriptor) -> str:
    """What one value of a message or enum field must be."""
    if f.type == FieldDescriptor.TYPE_ENUM:
        names = ", ".join(v.name for v in f.enum_type.values)
        return f"one of {names} ({f.enum_type.full_name})"
    return f"an object ({f.message_type.full_name})"


def _plural(f: FieldDescriptor) -> str:
    if f.type == FieldDescriptor.TYPE_ENUM:
        return f"{f.enum_type.full_name} values"
    if f.message_type is not None:
        return f"{f.message_type.full_name} objects"
    if f.type in _INT_RANGES:
        return "integers"
    return {FieldDescriptor.TYPE_BOOL: "booleans", FieldDescriptor.TYPE_STRING: "strings",
            FieldDescriptor.TYPE_BYTES: "base64 strings"}.get(f.type, "numbers")


def _as_int(value) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    if isinstance(value, str) and value.strip() == value:
        try:
            return int(value)
        except ValueError:
            return None
    return None


def _as_float(value) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value.strip() == value:
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _is_base64(value) -> bool:
    if not isinstance(value, str):
        return False
    text = value.replace("-", "+").replace("_", "/")
    try:
        base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


def _expected(path: str, what: str, value) -> str:
    shown = json.dumps(value, ensure_ascii=False)
    if len(shown) > 40:
        shown = shown[:37] + "..."
    return f'field "{path}": expected {what}, got {shown}' if path else f"expected {what}, got {shown}"
