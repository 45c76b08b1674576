"""Which string field of a parsed message holds bytes that are not UTF-8.

protobuf checks the UTF-8 of `string` fields when it parses proto3, not proto2 (C++ only logs
it in debug builds); Python's protobuf (upb) then gives such a field back as `bytes`. A handler
would get `bytes` where its type says `str`, and fail (or store them) far from the cause. The
server refuses such a request as EREQUEST naming the field, on every protocol; the JSON writer
refuses such a message (docs/protocol_notes.md).

`checker(cls)` is made once per message type: None where the type cannot hold such a field
(no string field in a proto2 file is reachable from it), else a function of a message giving
the dotted path of the first bad field, or "" when there is none.
"""

from __future__ import annotations

from collections.abc import Callable

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.descriptor_pb2 import FeatureSet

_STRING, _MESSAGE, _GROUP = FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_MESSAGE, FieldDescriptor.TYPE_GROUP
_VERIFY = FeatureSet.VERIFY

Check = Callable[[object], str]
_CHECKS: dict[Descriptor, Check | None] = {}  # one entry per message type of the program: bounded


def checker(message_class) -> Check | None:
    """The check of `message_class`'s messages, or None where none is needed."""
    return _for(message_class.DESCRIPTOR, set())


_BY_CLASS: dict[type, Check | None] = {}
_MAX_CLASSES = 4096  # message classes are few and live as long as the program; past this, not cached


def class_checker(message_class) -> Check | None:
    """`checker(message_class)`, looked up by the class (one dict lookup on the call path)."""
    try:
        return _BY_CLASS[message_class]
    except KeyError:
        check = checker(message_class)
        if len(_BY_CLASS) < _MAX_CLASSES:
            _BY_CLASS[message_class] = check
        return check


def bad_field(message) -> str:
    """The dotted path of `message`'s first string field that is not UTF-8, or ""."""
    check = _for(message.DESCRIPTOR, set())
    return check(message) if check is not None else ""


def _unchecked(field: FieldDescriptor) -> bool:
    """A string field whose UTF-8 protobuf's parser leaves unchecked (proto2's, or an edition's
    `utf8_validation = NONE`)."""
    if field.type != _STRING:
        return False
    features = getattr(field, "_GetFeatures", None)  # protobuf >= 4.26; no public spelling of it
    if features is not None:
        return features().utf8_validation != _VERIFY
    syntax = getattr(field.file, "syntax", "proto2")
    return syntax != "proto3"


def _for(desc: Descriptor, visiting: set) -> Check | None:
    if desc in _CHECKS:
        return _CHECKS[desc]
    if not _reaches_unchecked(desc):
        _CHECKS[desc] = None
        return None
    if desc in visiting:  # a recursive type: the check of the type being built, looked up late
        return lambda m: _CHECKS[desc](m)
    visiting.add(desc)
    steps = [step for step in (_field_step(f, visiting) for f in desc.fields) if step is not None]
    visiting.discard(desc)
    check = steps[0] if len(steps) == 1 else _all(steps)
    _CHECKS[desc] = check
    return check


def _reaches_unchecked(desc: Descriptor) -> bool:
    """Whether a message of type `desc` can hold an unchecked string field, at any depth."""
    seen, todo = {desc}, [desc]
    while todo:
        for field in todo.pop().fields:
            if _unchecked(field):
                return True
            sub = field.message_type
            if sub is not None and sub not in seen:
                seen.add(sub)
                todo.append(sub)
    return False


def _all(steps: list[Check]) -> Check:
    def check(message) -> str:
        for step in steps:
            bad = step(message)
            if bad:
                return bad
        return ""
    return check


def _field_step(field: FieldDescriptor, visiting: set) -> Check | None:
    name = field.name
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        key_bad = _unchecked(key)
        value_check = _for(value.message_type, visiting) if value.type in (_MESSAGE, _GROUP) else None
        value_bad = _unchecked(value)
        if not (key_bad or value_check or value_bad):
            return None

        def map_step(message) -> str:
            for k, v in getattr(message, name).items():
                if key_bad and type(k) is bytes:
                    return f"{name}[{k!r}]"
                if value_bad and type(v) is bytes or value_check is not None and value_check(v):
                    return f"{name}[{k!r}]" + (f".{value_check(v)}" if value_check is not None else "")
            return ""
        return map_step
    if field.type in (_MESSAGE, _GROUP):
        sub = _for(field.message_type, visiting)
        if sub is None:
            return None
        if field.is_repeated:
            def repeated_message_step(message) -> str:
                for i, v in enumerate(getattr(message, name)):
                    bad = sub(v)
                    if bad:
                        return f"{name}[{i}].{bad}"
                return ""
            return repeated_message_step

        def message_step(message) -> str:
            if not message.HasField(name):
                return ""
            bad = sub(getattr(message, name))
            return f"{name}.{bad}" if bad else ""
        return message_step
    if not _unchecked(field):
        return None
    if field.is_repeated:
        def repeated_string_step(message) -> str:
            for i, v in enumerate(getattr(message, name)):
                if type(v) is bytes:
                    return f"{name}[{i}]"
            return ""
        return repeated_string_step

    def string_step(message) -> str:
        return name if type(getattr(message, name)) is bytes else ""
    return string_step
