"""What an etcd key under an `etcd://` prefix means: one server.

The key is `<prefix><name>`, any name (EtcdRegistration uses the server's `ip:port`). Its
value is either

* text, one entry as in list:// and file://: `ip:port[ tag]`, e.g. `10.0.0.5:8000 0/2`; or
* a JSON object: `{"address": "ip:port", "tag": "0/2"}` or `{"address": "ip:port", "weight": 3}`.
  `weight` (a positive integer) is written as the tag, which is where weighted balancers
  (wrr, wr) read it; a partition channel reads `i/n` from the tag. Giving both is an error,
  as they would compete for the one tag. Other members of the object are ignored.

A value that is neither, or longer than `MAX_VALUE_BYTES`, is malformed: the naming service
skips the key and logs it.

>>> parse_member(b"10.0.0.5:8000 0/2")
ServerNode(host='10.0.0.5', port=8000, tag='0/2')
>>> parse_member(b'{"address": "[::1]:8000", "weight": 3}')
ServerNode(host='::1', port=8000, tag='3')
>>> format_member("10.0.0.5:8000", tag="0/2")
b'{"address": "10.0.0.5:8000", "tag": "0/2"}'
"""

from __future__ import annotations

import json

from .base import ServerNode, parse_entry

MAX_VALUE_BYTES = 4096


def parse_member(value: bytes) -> ServerNode:
    """The server a value names; ValueError saying why when it is malformed."""
    if len(value) > MAX_VALUE_BYTES:
        raise ValueError(f"value longer than {MAX_VALUE_BYTES} bytes")
    try:
        text = value.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ValueError("value is not UTF-8 text") from None
    if not text.startswith("{"):
        if "#" in text:  # a comment in a value would hide what follows it
            raise ValueError(f"'#' in {text!r}")
        return parse_entry(text)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"bad JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError("JSON value is not an object")
    address, tag, weight = obj.get("address"), obj.get("tag"), obj.get("weight")
    if not isinstance(address, str):
        raise ValueError('JSON value needs "address": "ip:port"')
    if tag is not None and not isinstance(tag, str):
        raise ValueError('"tag" must be a string')
    if weight is not None:
        if tag is not None:
            raise ValueError('give "tag" or "weight", not both: both would be the tag')
        if isinstance(weight, bool) or not isinstance(weight, int) or weight <= 0:
            raise ValueError(f'"weight" must be a positive integer, got {weight!r}')
        tag = str(weight)
    node = parse_entry(address)
    if node.tag:
        raise ValueError(f'"address" must be ip:port alone, got {address!r}')
    return ServerNode(node.host, node.port, (tag or "").strip())


def format_member(address: str, *, tag: str = "", weight: int | None = None) -> bytes:
    """The JSON value naming the server at `address` ("ip:port") with `tag` or `weight`;
    ValueError for a value parse_member would refuse."""
    obj: dict[str, object] = {"address": address}
    if tag:
        obj["tag"] = tag
    if weight is not None:
        obj["weight"] = weight
    value = json.dumps(obj).encode()
    parse_member(value)
    return value
